"""What a reset will do, gathered before anything is done, and doing it.

Tensors to zero are listed by state key and by the device and dtype of their leaf's
parameters: the supported optimizers create history like its parameter, so each list
takes ``torch._foreach_zero_``'s multi-tensor path (a mixed list would still be zeroed
correctly, tensor by tensor), and thousands of one-parameter leaves share a few lists.
Execution allocates no tensors.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Literal

import torch
from attrs import define, field

from opttree._preflight import Extents
from opttree._report import ResetReport
from opttree._scalers import ScalerReset
from opttree._schema import StateSchema
from opttree._zeroing import zero_lists

StateEntry = MutableMapping[str, object]
ListKey = tuple[str, torch.dtype | None, torch.device | None]
"""A zero list: the state key, and the dtype and device of the leaf's parameters."""


@define
class StatePlan:
    """What a reset does to some state: one leaf's, or, merged, a whole tree's.

    ``written``, ``step_ranges`` and ``kept_ranges`` are the address ranges of what the
    reset writes (history, scales, group step tensors), of per-parameter step tensors,
    and of what it must leave alone (parameters, kept state), for the aliasing check.
    """

    lists: dict[ListKey, list[torch.Tensor]] = field(factory=dict)
    fills: dict[tuple[ListKey, float], list[torch.Tensor]] = field(factory=dict)
    identities: list[tuple[str, torch.Tensor]] = field(factory=list)
    """Square history by key, also in ``lists``, whose diagonal is set to one once zeroed."""
    number_steps: list[tuple[StateEntry, int | float]] = field(factory=list)
    release: list[tuple[torch.optim.Optimizer, list[torch.Tensor]]] = field(factory=list)
    """Optimizers, each with the parameters whose state entries a release deletes."""
    drop: list[tuple[StateEntry, str]] = field(factory=list)
    scales: list[torch.Tensor] = field(factory=list)
    zeroed: int = 0
    filled: int = 0
    steps: int = 0
    kept: int = 0
    released: int = 0
    bytes_released: int = 0
    bytes_reset: int = 0
    bytes_kept: int = 0
    kept_keys: set[str] = field(factory=set)
    written: Extents = field(factory=Extents)
    step_ranges: Extents = field(factory=Extents)
    kept_ranges: Extents = field(factory=Extents)

    @property
    def reusable(self) -> bool:
        """Whether the same state will still be there after this reset, and the same plan
        right for it: nothing dropped or released, no scales, which TE may rebuild, no
        fills, whose values follow the groups' (an ``lr`` a scheduler changes), and every
        tensor zeroed the whole of its own storage (see :mod:`opttree._plan_cache`)."""
        return (
            not self.drop
            and not self.scales
            and not self.fills
            and not self.release
            and self.written.whole
            and self.step_ranges.whole
        )

    def zero_list(self, key: ListKey) -> list[torch.Tensor]:
        found = self.lists.get(key)
        if found is None:
            found = self.lists[key] = []
        return found

    def fill_list(self, key: ListKey, value: float) -> list[torch.Tensor]:
        found = self.fills.get((key, value))
        if found is None:
            found = self.fills[(key, value)] = []
        return found

    def merge(self, other: StatePlan) -> None:
        for key, tensors in other.lists.items():
            self.zero_list(key).extend(tensors)
        for (key, value), tensors in other.fills.items():
            self.fill_list(key, value).extend(tensors)
        self.identities.extend(other.identities)
        self.number_steps.extend(other.number_steps)
        self.release.extend(other.release)
        self.released += other.released
        self.bytes_released += other.bytes_released
        self.drop.extend(other.drop)
        self.scales.extend(other.scales)
        self.zeroed += other.zeroed
        self.filled += other.filled
        self.steps += other.steps
        self.kept += other.kept
        self.bytes_reset += other.bytes_reset
        self.bytes_kept += other.bytes_kept
        self.kept_keys |= other.kept_keys
        self.written.extend(other.written)
        self.step_ranges.extend(other.step_ranges)
        self.kept_ranges.extend(other.kept_ranges)


Layout = tuple[list[int], list[int], list[int]]
"""How flattened lists split among optimizers: each one's number of param groups, each
group's number of parameters, and each one's number of state entries."""


@define
class Reusable:
    """A part planned afresh that the next reset may reuse, once this one has run, and
    what it was planned from: one leaf, or a run of alike leaves planned as one (their
    optimizers, in order), how their parts split among them, their groups' parameters,
    the tensors their state is held for and its entries, each in order."""

    optimizers: list[torch.optim.Optimizer]
    schema: StateSchema
    layout: Layout
    params: list[torch.Tensor]
    held: list[torch.Tensor]
    entries: list[StateEntry]
    part: StatePlan


@define
class ResetPlan:
    """Everything a reset will do, gathered before anything is done.

    ``state`` gathers the plans of small leaves; each large leaf's plan is one of
    ``parts``, kept apart rather than merged, because a part taken from the plan cache
    would otherwise be copied on every reset. ``fresh`` counts the parts planned afresh
    and ``reused`` those taken from the plan cache, which were checked for aliasing when
    they were planned.
    """

    state: StatePlan = field(factory=StatePlan)
    parts: list[StatePlan] = field(factory=list)
    leaves: int = 0
    shared_leaves: int = 0
    shared_steps: int = 0
    fresh: int = 0
    reused: int = 0
    to_store: list[Reusable] = field(factory=list)
    scalers: list[ScalerReset] = field(factory=list)
    scalers_kept: int = 0

    @property
    def all_parts(self) -> list[StatePlan]:
        return [self.state, *self.parts]

    def ranges(self, name: Literal["written", "step_ranges", "kept_ranges"]) -> Extents:
        """The ranges ``name`` of every part, in one list."""
        merged = Extents()
        for part in self.all_parts:
            merged.extend(getattr(part, name))
        return merged

    def execute(self) -> ResetReport:
        parts = self.all_parts
        with torch.no_grad():
            lists = [tensors for part in parts for tensors in part.lists.values()]
            zero_lists(lists, total_bytes=sum(part.bytes_reset for part in parts))
            for part in parts:
                for (_, value), tensors in part.fills.items():
                    for tensor in tensors:  # as full_like makes it: complex history is (v, v)
                        tensor.fill_(complex(value, value) if tensor.is_complex() else value)
                for _, matrix in part.identities:
                    matrix.diagonal().fill_(1.0)
                for scale in part.scales:
                    scale.fill_(1.0)
            for scaler in self.scalers:
                scaler.apply()
        for part in parts:
            for entry, key in part.drop:
                del entry[key]
            for entry, zero in part.number_steps:
                entry["step"] = zero
            for optimizer, held in part.release:
                for param in held:
                    del optimizer.state[param]
        return self.report()

    def report(self) -> ResetReport:
        """What executing this plan changes."""
        parts = self.all_parts
        return ResetReport(
            leaves=self.leaves,
            tensors_zeroed=sum(part.zeroed for part in parts),
            tensors_filled=sum(part.filled for part in parts),
            tensors_dropped=sum(len(part.drop) for part in parts),
            bytes_reset=sum(part.bytes_reset for part in parts),
            steps=sum(part.steps for part in parts) - self.shared_steps,
            tensors_kept=sum(part.kept for part in parts),
            bytes_kept=sum(part.bytes_kept for part in parts),
            kept_keys=tuple(sorted(set().union(*(part.kept_keys for part in parts)))),
            shared_leaves=self.shared_leaves,
            loss_scales_reset=len(self.scalers),
            loss_scales_kept=self.scalers_kept,
            entries_released=sum(part.released for part in parts),
            bytes_released=sum(part.bytes_released for part in parts),
        )
