"""One pass over a leaf's state that both validates it and plans its reset.

Nothing is mutated while planning, so a reset that finds any error changes nothing.
Tensors to zero are collected per leaf and key: the supported optimizers create each
key's history like its parameter, and a leaf's parameters share a device and dtype, so
each list takes ``torch._foreach_zero_``'s multi-tensor path (a mixed list is still
zeroed correctly, tensor by tensor). Execution allocates no tensors.
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


def step_number(value: object) -> float | None:
    """A step counter's value (the largest, for a tensor of several), or None if it is none."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return float(value.item())
        return float(value.max()) if value.numel() else None
    return float(value) if isinstance(value, (int, float)) else None


@define
class StatePlan:
    """What a reset does to one leaf's ``state``: the result of the per-tensor pass."""

    lists: list[list[torch.Tensor]] = field(factory=list)
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


@define
class ResetPlan:
    """Everything a reset will do, gathered before anything is done."""

    zero: list[list[torch.Tensor]] = field(factory=list)
    drop: list[tuple[StateEntry, str]] = field(factory=list)
    number_steps: list[StateEntry] = field(factory=list)
    scales: list[torch.Tensor] = field(factory=list)
    leaves: int = 0
    shared_leaves: int = 0
    tensors_zeroed: int = 0
    bytes_reset: int = 0
    steps: int = 0
    tensors_kept: int = 0
    bytes_kept: int = 0
    kept_keys: set[str] = field(factory=set)

    def add_state(self, part: StatePlan) -> None:
        self.zero.extend(part.lists)
        self.number_steps.extend(part.number_steps)
        self.drop.extend(part.drop)
        self.scales.extend(part.scales)
        self.tensors_zeroed += part.zeroed
        self.steps += part.steps
        self.tensors_kept += part.kept
        self.bytes_reset += part.bytes_reset
        self.bytes_kept += part.bytes_kept
        self.kept_keys |= part.kept_keys

    def execute(self) -> ResetReport:
        with torch.no_grad():
            zero_lists(self.zero, total_bytes=self.bytes_reset)
            for scale in self.scales:
                scale.fill_(1.0)
        for entry, key in self.drop:
            del entry[key]
        for entry in self.number_steps:
            entry["step"] = 0
        return ResetReport(
            leaves=self.leaves,
            tensors_zeroed=self.tensors_zeroed,
            tensors_dropped=len(self.drop),
            bytes_reset=self.bytes_reset,
            steps=self.steps,
            tensors_kept=self.tensors_kept,
            bytes_kept=self.bytes_kept,
            kept_keys=tuple(sorted(self.kept_keys)),
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
        self.cls = type(node.optimizer).__qualname__

    def problem(self, kind: ProblemKind, message: str, key: str | None = None) -> None:
        self.problems.append(Problem(kind, self.node.path, self.cls, message, key))

    def inspect(self) -> None:
        optimizer = self.node.optimizer
        state = optimizer.state
        chosen = self.selection.tensors
        in_groups: list[torch.Tensor] = []
        group_steps: list[torch.Tensor] = []
        for index, group in enumerate(optimizer.param_groups):
            params = group["params"]
            in_groups.extend(params)
            step = group.get("step")
            if self.schema.step is StepLocation.PER_GROUP and step is not None and self.selection.resets("step"):
                self.plan_group_step(index, group, params, step, group_steps)
            if step_number(step) and not any(p in state for p in params):
                self.problem(ProblemKind.EMPTY_STATE, f"a group says step {step} but none of its parameters has state")
        self.plan.leaves += 1
        # Reusing a plan pays off for large states; a small one is planned faster than checked.
        whole = chosen is None and self.selection.keys is None and len(state) >= plan_cache.MIN_ENTRIES
        part = plan_cache.lookup(optimizer, self.schema, in_groups) if whole else None
        if part is None:
            problems_before = len(self.problems)
            part = self.inspect_state(optimizer, state.items(), set(map(id, in_groups)), chosen)
            if whole and part.reusable and len(self.problems) == problems_before:
                plan_cache.store(optimizer, self.schema, in_groups, part)
        self.plan.add_state(part)
        if group_steps:
            self.plan.zero.append(group_steps)

    def plan_group_step(
        self, index: int, group: StateEntry, params: list[torch.Tensor], step: object, tensors: list[torch.Tensor]
    ) -> None:
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
        if isinstance(step, torch.Tensor):
            tensors.append(step)
        else:
            self.plan.number_steps.append(group)
        self.plan.steps += 1

    def inspect_state(
        self,
        optimizer: torch.optim.Optimizer,
        entries: Iterable[tuple[torch.Tensor, StateEntry]],
        grouped: set[int],
        chosen: frozenset[int] | None,
    ) -> StatePlan:
        """The hot loop of a reset: one dictionary look-up per state key, counters kept in
        locals, tensors appended to one list per key."""
        part = StatePlan()
        actions = self.actions
        scale_of = self.schema.scale_of
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
                        tensors = lists[key] = []
                    tensors.append(value)
                    zeroed += 1
                    bytes_reset += value.nbytes
                    if scale_of is not None:
                        self.plan_scale(scale_of, optimizer, param, key, part.scales)
                elif action is KeyAction.STEP:
                    steps += 1
                    if isinstance(value, torch.Tensor):
                        tensors = lists.get(key)
                        if tensors is None:
                            tensors = lists[key] = []
                        tensors.append(value)
                    else:
                        part.number_steps.append(entry)
                elif action is KeyAction.KEEP:
                    part.kept_keys.add(key)
                    if isinstance(value, torch.Tensor):
                        kept += 1
                        bytes_kept += value.nbytes
                elif action is KeyAction.DROP and isinstance(value, torch.Tensor):
                    part.drop.append((entry, key))
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
        part.lists = list(lists.values())
        part.zeroed, part.steps, part.kept = zeroed, steps, kept
        part.bytes_reset, part.bytes_kept = bytes_reset, bytes_kept
        return part

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
