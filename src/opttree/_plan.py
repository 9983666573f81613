"""What a reset will do, gathered before anything is done, and doing it.

Tensors to zero are listed by state key and by the device and dtype of their leaf's
parameters: the supported optimizers create history like its parameter, so each list
takes ``torch._foreach_zero_``'s multi-tensor path (a mixed list would still be zeroed
correctly, tensor by tensor), and thousands of one-parameter leaves share a few lists.
Execution allocates no tensors.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Literal, cast

import torch
from attrs import define, field

from opttree._preflight import Extents, bytes_once, plain_torch
from opttree._report import ResetReport
from opttree._scalers import ScalerReset
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
    number_writes: list[tuple[StateEntry, str, int | float]] = field(factory=list)
    """Numbers a reset sets: step counters held as numbers, in entries or groups, and group counters."""
    attribute_writes: list[tuple[object, str, int | float | None]] = field(factory=list)
    """Optimizers, each with an attribute counter a reset sets back (deletes, where None)."""
    step_holders: list[tuple[str, list[StateEntry]]] = field(factory=list)
    """Per state key, the entries whose tensor steps are zeroed, to find one shared."""
    unshared: list[tuple[StateEntry, str]] = field(factory=list)
    """Entries that held a step tensor held earlier by another: each gets one of its own."""
    release: list[tuple[torch.optim.Optimizer, list[torch.Tensor]]] = field(factory=list)
    """Optimizers, each with the parameters whose state entries a release deletes."""
    drop: list[tuple[StateEntry, str]] = field(factory=list)
    cleared: list[tuple[object, str]] = field(factory=list)
    """Optimizers, each with an attribute where it caches what it derives from its
    parameters (the schema's ``cached``), set back to None."""
    scales: list[torch.Tensor] = field(factory=list)
    scaled_keys: set[str] = field(factory=set)
    """The keys whose history ``scales`` scale: not zero at the start, as a whole."""
    zeroed: int = 0
    dropped: int = 0
    """The tensors among the dropped values, and inside those that are lists."""
    filled: int = 0
    steps: int = 0
    released: int = 0
    bytes_released: int = 0
    bytes_reset: int = 0
    kept_tensors: set[int] = field(factory=set)
    """The state tensors kept, by identity: one shared by several entries is one."""
    kept_state: Extents = field(factory=Extents)
    """Their memory, which the report counts once however many entries or leaves hold it."""
    kept_keys: set[str] = field(factory=set)
    found_keys: set[object] = field(factory=set)
    """The state keys the planned entries and groups hold, ``"step"`` for a group step."""
    written: Extents = field(factory=Extents)
    step_ranges: Extents = field(factory=Extents)
    kept_ranges: Extents = field(factory=Extents)
    entries: Extents = field(factory=Extents)
    """The state entries planned, by identity (see :func:`~opttree._preflight.identities`)."""

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
        self.number_writes.extend(other.number_writes)
        self.attribute_writes.extend(other.attribute_writes)
        self.step_holders.extend(other.step_holders)
        self.unshared.extend(other.unshared)
        self.release.extend(other.release)
        self.released += other.released
        self.bytes_released += other.bytes_released
        self.drop.extend(other.drop)
        self.cleared.extend(other.cleared)
        self.scales.extend(other.scales)
        self.scaled_keys |= other.scaled_keys
        self.zeroed += other.zeroed
        self.dropped += other.dropped
        self.filled += other.filled
        self.steps += other.steps
        self.kept_tensors |= other.kept_tensors
        self.bytes_reset += other.bytes_reset
        self.kept_state.extend(other.kept_state)
        self.kept_keys |= other.kept_keys
        self.found_keys |= other.found_keys
        self.written.extend(other.written)
        self.step_ranges.extend(other.step_ranges)
        self.kept_ranges.extend(other.kept_ranges)
        self.entries.extend(other.entries)


@define
class ResetPlan:
    """Everything a reset will do, gathered before anything is done: the tree's state
    plans merged into ``state``, and its fp16 loss scalers."""

    state: StatePlan = field(factory=StatePlan)
    leaves: int = 0
    shared_leaves: int = 0
    shared_steps: int = 0
    scalers: list[ScalerReset] = field(factory=list)
    scalers_kept: int = 0

    def ranges(self, name: Literal["written", "step_ranges", "kept_ranges", "entries"]) -> Extents:
        """A copy of the ranges ``name``, to be extended without touching the plan."""
        copied = Extents()
        copied.extend(getattr(self.state, name))
        return copied

    def execute(self) -> ResetReport:
        state = self.state
        with plain_torch(), torch.no_grad():
            with torch.inference_mode(False):  # a reset called in inference mode (a rollout's) must not make the next step's counters inference tensors
                own_steps = [torch.zeros_like(cast(torch.Tensor, entry[key])) for entry, key in state.unshared]  # before any write
            zero_lists(list(state.lists.values()), total_bytes=state.bytes_reset)
            for (_, value), tensors in state.fills.items():
                for tensor in tensors:  # as full_like makes it: complex history is (v, v)
                    tensor.fill_(complex(value, value) if tensor.is_complex() else value)
            for _, matrix in state.identities:
                matrix.diagonal().fill_(1.0)
            for scale in state.scales:
                scale.fill_(1.0)
            for scaler in self.scalers:
                scaler.apply()
        for entry, key in state.drop:
            del entry[key]
        for holder, name in state.cleared:
            setattr(holder, name, None)
        for (entry, key), step in zip(state.unshared, own_steps, strict=True):
            entry[key] = step
        for entry, key, number in state.number_writes:
            entry[key] = number
        for holder, name, start in state.attribute_writes:
            if start is None:
                delattr(holder, name)
            else:
                setattr(holder, name, start)
        for optimizer, held in state.release:
            for param in held:
                del optimizer.state[param]
        return self.report()

    def report(self) -> ResetReport:
        """What executing this plan changes."""
        state = self.state
        return ResetReport(
            leaves=self.leaves,
            tensors_zeroed=state.zeroed,
            tensors_filled=state.filled,
            tensors_dropped=state.dropped,
            bytes_reset=state.bytes_reset,
            steps=state.steps - self.shared_steps,
            tensors_kept=len(state.kept_tensors),
            bytes_kept=bytes_once(state.kept_state),
            kept_keys=tuple(sorted(state.kept_keys)),
            shared_leaves=self.shared_leaves,
            loss_scales_reset=len(self.scalers),
            loss_scales_kept=self.scalers_kept,
            entries_released=state.released,
            bytes_released=state.bytes_released,
        )
