"""One pass over a leaf's state that both validates it and plans its reset.

Nothing is mutated while planning, so a reset that finds any error changes nothing.
Execution then zeroes every planned tensor with one ``torch._foreach_zero_`` per
(device, dtype) and allocates no tensors.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import cast

import torch
from attrs import define, field
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from opttree._errors import OptTreeError
from opttree._nodes import LeafNode
from opttree._problems import Problem, ProblemKind
from opttree._report import ResetReport
from opttree._schema import KeyAction, ScaleLookup, StateSchema, StepLocation
from opttree._selection import EVERYTHING, Selection

StateEntry = MutableMapping[str, object]


def group_by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` split into lists of one device and dtype each, so that every
    ``_foreach`` call takes the fused multi-tensor path; grouped by torch in C++."""
    if not tensors:
        return []
    groups = _group_tensors_by_device_and_dtype([cast(list[torch.Tensor | None], tensors)])
    return [cast(list[torch.Tensor], lists[0]) for lists, _ in groups.values()]


def step_number(value: object) -> float | None:
    """A step counter's value (the largest, for a tensor of several), or None if it is none."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return float(value.item())
        return float(value.max()) if value.numel() else None
    return float(value) if isinstance(value, (int, float)) else None


@define
class ResetPlan:
    """Everything a reset will do, gathered before anything is done."""

    zero: list[torch.Tensor] = field(factory=list)
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

    def add_step(self, owner: StateEntry, value: object) -> None:
        if isinstance(value, torch.Tensor):
            self.zero.append(value)
        else:
            self.number_steps.append(owner)
        self.steps += 1

    def execute(self) -> ResetReport:
        with torch.no_grad():
            for tensors in group_by_device_and_dtype(self.zero):
                torch._foreach_zero_(tensors)
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
        grouped: set[int] = set()
        for index, group in enumerate(optimizer.param_groups):
            params = group["params"]
            grouped.update(id(p) for p in params)
            step = group.get("step")
            if self.schema.step is StepLocation.PER_GROUP and step is not None and self.selection.resets("step"):
                self.plan_group_step(index, group, params, step)
            if step_number(step) and not any(p in state for p in params):
                self.problem(ProblemKind.EMPTY_STATE, f"a group says step {step} but none of its parameters has state")
        self.plan.leaves += 1
        for param, entry in state.items():
            if id(param) not in grouped:
                self.problem(ProblemKind.ORPHAN_STATE, "holds state for a tensor that is in no param group")
            if chosen is None or id(param) in chosen:
                self.inspect_entry(optimizer, param, entry)

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
        self.plan.add_step(group, step)

    def inspect_entry(self, optimizer: torch.optim.Optimizer, param: torch.Tensor, entry: StateEntry) -> None:
        """The hot loop of a reset: one dictionary look-up per state key."""
        plan = self.plan
        actions = self.actions
        zero = plan.zero
        for key, value in entry.items():
            action = actions.get(key)
            if action is KeyAction.ZERO and isinstance(value, torch.Tensor):
                zero.append(value)
                plan.tensors_zeroed += 1
                plan.bytes_reset += value.nbytes
                if self.schema.scale_of is not None:
                    self.plan_scale(self.schema.scale_of, optimizer, param, key)
            elif action is KeyAction.STEP:
                plan.add_step(entry, value)
            elif action is KeyAction.KEEP:
                plan.kept_keys.add(key)
                if isinstance(value, torch.Tensor):
                    plan.tensors_kept += 1
                    plan.bytes_kept += value.nbytes
            elif action is KeyAction.DROP and isinstance(value, torch.Tensor):
                plan.drop.append((entry, key))
                plan.bytes_reset += value.nbytes
            elif action is None:
                known = ", ".join(sorted(actions)) or "no keys"
                self.problem(ProblemKind.UNSUPPORTED_STATE, f"not in the schema ({known})", key)
            else:
                self.problem(
                    ProblemKind.UNSUPPORTED_STATE, f"history is a {type(value).__qualname__}, expected a tensor", key
                )

    def plan_scale(self, scale_of: ScaleLookup, optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str) -> None:
        try:
            scale = scale_of(optimizer, param, key)
        except OptTreeError as error:
            self.problem(ProblemKind.UNSUPPORTED_STATE, str(error), key)
            return
        if scale is not None:
            self.plan.scales.append(scale)
