"""One pass over a leaf's state that both validates it and plans its reset.

Nothing is mutated while planning, so a reset that finds any error changes nothing.
Tensors to zero are listed by state key and by the device and dtype of their leaf's
parameters: the supported optimizers create history like its parameter, so each list
takes ``torch._foreach_zero_``'s multi-tensor path (a mixed list would still be zeroed
correctly, tensor by tensor), and thousands of one-parameter leaves share a few lists.
Execution allocates no tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping

import torch
from attrs import define, field

from opttree import _plan_cache as plan_cache
from opttree._errors import OptTreeError
from opttree._nodes import LeafNode
from opttree._problems import Problem, ProblemKind
from opttree._report import ResetReport
from opttree._schema import KeyAction, ScaleLookup, StateSchema, StepLocation
from opttree._selection import EVERYTHING, Selection
from opttree._zeroing import zero_lists

StateEntry = MutableMapping[str, object]
ListKey = tuple[str, torch.dtype | None, torch.device | None]
"""A zero list: the state key, and the dtype and device of the leaf's parameters."""


def step_number(value: object) -> float | None:
    """A step counter's value (the largest, for a tensor of several), or None if it is none."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return float(value.item())
        return float(value.max()) if value.numel() else None
    return float(value) if isinstance(value, (int, float)) else None


@define
class StatePlan:
    """What a reset does to some state: one leaf's, or, merged, a whole tree's."""

    lists: dict[ListKey, list[torch.Tensor]] = field(factory=dict)
    number_steps: list[StateEntry] = field(factory=list)
    drop: list[tuple[StateEntry, str]] = field(factory=list)
    scales: list[torch.Tensor] = field(factory=list)
    zeroed: int = 0
    steps: int = 0
    kept: int = 0
    bytes_reset: int = 0
    bytes_kept: int = 0
    kept_keys: set[str] = field(factory=set)

    @property
    def reusable(self) -> bool:
        """Whether the same state will still be there after this reset: nothing dropped,
        and no scales, which TE may rebuild."""
        return not self.drop and not self.scales

    def zero_list(self, key: ListKey) -> list[torch.Tensor]:
        found = self.lists.get(key)
        if found is None:
            found = self.lists[key] = []
        return found

    def merge(self, other: StatePlan) -> None:
        for key, tensors in other.lists.items():
            self.zero_list(key).extend(tensors)
        self.number_steps.extend(other.number_steps)
        self.drop.extend(other.drop)
        self.scales.extend(other.scales)
        self.zeroed += other.zeroed
        self.steps += other.steps
        self.kept += other.kept
        self.bytes_reset += other.bytes_reset
        self.bytes_kept += other.bytes_kept
        self.kept_keys |= other.kept_keys


@define
class ResetPlan:
    """Everything a reset will do, gathered before anything is done."""

    state: StatePlan = field(factory=StatePlan)
    leaves: int = 0
    shared_leaves: int = 0

    def execute(self) -> ResetReport:
        state = self.state
        with torch.no_grad():
            zero_lists(list(state.lists.values()), total_bytes=state.bytes_reset)
            for scale in state.scales:
                scale.fill_(1.0)
        for entry, key in state.drop:
            del entry[key]
        for entry in state.number_steps:
            entry["step"] = 0
        return ResetReport(
            leaves=self.leaves,
            tensors_zeroed=state.zeroed,
            tensors_dropped=len(state.drop),
            bytes_reset=state.bytes_reset,
            steps=state.steps,
            tensors_kept=state.kept,
            bytes_kept=state.bytes_kept,
            kept_keys=tuple(sorted(state.kept_keys)),
            shared_leaves=self.shared_leaves,
        )


class LeafInspector:
    """Plans one leaf against its schema and records every problem it finds."""

    def __init__(
        self,
        node: LeafNode,
        schema: StateSchema,
        plan: ResetPlan,
        problems: list[Problem],
        selection: Selection = EVERYTHING,
    ) -> None:
        self.node = node
        self.schema = schema
        self.plan = plan
        self.problems = problems
        self.selection = selection
        self.actions = schema.actions if selection.keys is None else schema.actions_for(selection.keys)

    def problem(self, kind: ProblemKind, message: str, key: str | None = None) -> None:
        cls = type(self.node.optimizer).__qualname__
        self.problems.append(Problem(kind, self.node.path, cls, message, key))

    def inspect(self) -> None:
        optimizer = self.node.optimizer
        state = optimizer.state
        plan = self.plan
        in_groups: list[torch.Tensor] = []
        for index, group in enumerate(optimizer.param_groups):
            params = group["params"]
            in_groups.extend(params)
            step = group.get("step")
            if step is None:
                continue
            if self.schema.step is StepLocation.PER_GROUP and self.selection.resets("step"):
                self.plan_group_step(index, group, params, step)
            if step_number(step) and not any(p in state for p in params):
                self.problem(ProblemKind.EMPTY_STATE, f"a group says step {step} but none of its parameters has state")
        plan.leaves += 1
        if not state:
            return
        chosen = self.selection.tensors
        # Reusing a plan pays off for large states; a small one is planned faster than checked.
        whole = chosen is None and self.selection.keys is None and len(state) >= plan_cache.MIN_ENTRIES
        if not whole:
            self.inspect_state(optimizer, state.items(), set(map(id, in_groups)), chosen, plan.state)
            return
        part = plan_cache.lookup(optimizer, self.schema, in_groups)
        if part is None:
            problems_before = len(self.problems)
            part = StatePlan()
            self.inspect_state(optimizer, state.items(), set(map(id, in_groups)), None, part)
            if part.reusable and len(self.problems) == problems_before:
                plan_cache.store(optimizer, self.schema, in_groups, part)
        plan.state.merge(part)

    def placement(self) -> tuple[torch.dtype | None, torch.device | None]:
        for group in self.node.optimizer.param_groups:
            for param in group["params"]:
                return param.dtype, param.device
        return None, None

    def plan_group_step(self, index: int, group: StateEntry, params: list[torch.Tensor], step: object) -> None:
        """A per-group step is shared by the group: a partial reset must take all of it."""
        chosen = self.selection.tensors
        if chosen is not None:
            taken = sum(id(p) in chosen for p in params)
            if taken == 0:
                return
            if taken < len(params):
                self.problem(
                    ProblemKind.PARTIAL_GROUP,
                    f"param group {index} counts one step for its {len(params)} parameters and "
                    f"{taken} are selected: select the whole group, or leave 'step' out of keys",
                    "step",
                )
                return
        state = self.plan.state
        if isinstance(step, torch.Tensor):
            state.zero_list(("group step", step.dtype, step.device)).append(step)
        else:
            state.number_steps.append(group)
        state.steps += 1

    def inspect_state(
        self,
        optimizer: torch.optim.Optimizer,
        entries: Iterable[tuple[torch.Tensor, StateEntry]],
        grouped: set[int],
        chosen: frozenset[int] | None,
        into: StatePlan,
    ) -> None:
        """The hot loop of a reset: one dictionary look-up per state key, counters kept in
        locals, tensors appended to one list per key."""
        actions = self.actions
        scale_of = self.schema.scale_of
        dtype, device = self.placement()
        lists: dict[str, list[torch.Tensor]] = {}
        zeroed = steps = kept = 0
        bytes_reset = bytes_kept = 0
        for param, entry in entries:
            if id(param) not in grouped:
                self.problem(ProblemKind.ORPHAN_STATE, "holds state for a tensor that is in no param group")
            if chosen is not None and id(param) not in chosen:
                continue
            for key, value in entry.items():
                action = actions.get(key)
                if action is KeyAction.ZERO and isinstance(value, torch.Tensor):
                    tensors = lists.get(key)
                    if tensors is None:
                        tensors = lists[key] = into.zero_list((key, dtype, device))
                    tensors.append(value)
                    zeroed += 1
                    bytes_reset += value.nbytes
                    if scale_of is not None:
                        self.plan_scale(scale_of, optimizer, param, key, into.scales)
                elif action is KeyAction.STEP:
                    steps += 1
                    if isinstance(value, torch.Tensor):
                        tensors = lists.get(key)
                        if tensors is None:
                            tensors = lists[key] = into.zero_list((key, dtype, device))
                        tensors.append(value)
                    else:
                        into.number_steps.append(entry)
                elif action is KeyAction.KEEP:
                    into.kept_keys.add(key)
                    if isinstance(value, torch.Tensor):
                        kept += 1
                        bytes_kept += value.nbytes
                elif action is KeyAction.DROP and isinstance(value, torch.Tensor):
                    into.drop.append((entry, key))
                    bytes_reset += value.nbytes
                elif action is None:
                    known = ", ".join(sorted(actions)) or "no keys"
                    self.problem(ProblemKind.UNSUPPORTED_STATE, f"not in the schema ({known})", key)
                else:
                    self.problem(
                        ProblemKind.UNSUPPORTED_STATE,
                        f"history is a {type(value).__qualname__}, expected a tensor",
                        key,
                    )
        into.zeroed += zeroed
        into.steps += steps
        into.kept += kept
        into.bytes_reset += bytes_reset
        into.bytes_kept += bytes_kept

    def plan_scale(
        self,
        scale_of: ScaleLookup,
        optimizer: torch.optim.Optimizer,
        param: torch.Tensor,
        key: str,
        scales: list[torch.Tensor],
    ) -> None:
        try:
            scale = scale_of(optimizer, param, key)
        except OptTreeError as error:
            self.problem(ProblemKind.UNSUPPORTED_STATE, str(error), key)
            return
        if scale is not None:
            scales.append(scale)
