"""Reusing a leaf's state plan across resets.

Frameworks reset after every rollout, over the same state tensors, and on the CPU the
per-tensor work of planning costs as much as the zeroing. A full reset therefore keeps
the plan of each leaf whose pass found nothing wrong, once it has run, and the next full
reset reuses it after checking that the state holds the very same parameters, entry
dicts, keys (entry by entry) and tensor objects (by identity, never by value: a tensor's
``==`` compares elements), the groups the very same parameters in the same order, and
that every tensor it zeroes still has the data address it was planned with (a storage
freed in place, or swapped by ``.data =``, has another). The checks run over flattened
views of the state, at C speed; anything else is a miss, and the leaf is planned afresh.

The cache holds the state it planned, so it is dropped when the optimizer loads a state
dict, and dies with the optimizer. Optimizers that are not keys of their own (see
:mod:`opttree._identity`) are never cached.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable, Iterator, MutableMapping
from itertools import chain
from typing import TYPE_CHECKING

import torch
from attrs import frozen

from opttree._identity import by_identity
from opttree._schema import StateSchema

if TYPE_CHECKING:
    from opttree._plan import StatePlan

MIN_ENTRIES = 64
"""Leaves with fewer state entries are not cached."""

_State = MutableMapping[torch.Tensor, MutableMapping[str, object]]


def _values(state: _State) -> Iterator[object]:
    return chain.from_iterable(map(dict.values, state.values()))  # type: ignore[arg-type]


def _keys(state: _State) -> list[str]:
    return list(chain.from_iterable(state.values()))


def _same_objects(now: Iterable[object], then: list[object]) -> bool:
    """Whether ``now`` yields the very objects of ``then``, in order; ``now`` must not be
    longer than ``then`` (the callers check lengths first, cheaply)."""
    return all(map(operator.is_, now, then))


def _addresses(part: StatePlan) -> list[int]:
    return list(map(torch.Tensor.data_ptr, chain.from_iterable(part.lists.values())))


@frozen(eq=False)
class _Stored:
    schema: StateSchema
    in_groups: list[object]
    params: list[object]
    entries: list[object]
    sizes: list[int]
    keys: list[str]
    values: list[object]
    addresses: list[int]
    part: StatePlan

    def matches(self, state: _State, schema: StateSchema, in_groups: list[torch.Tensor]) -> bool:
        return (
            schema is self.schema
            and len(in_groups) == len(self.in_groups)
            and _same_objects(in_groups, self.in_groups)
            and len(state) == len(self.params)
            and _same_objects(state, self.params)
            and _same_objects(state.values(), self.entries)
            and list(map(len, state.values())) == self.sizes  # so the values are as many
            and _keys(state) == self.keys
            and _same_objects(_values(state), self.values)
            and _addresses(self.part) == self.addresses
        )


_plans: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Stored] = weakref.WeakKeyDictionary()
_hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def forget(optimizer: torch.optim.Optimizer) -> None:
    """Drop the plan kept for ``optimizer``, if any."""
    _plans.pop(optimizer, None)


def store(optimizer: torch.optim.Optimizer, schema: StateSchema, in_groups: list[torch.Tensor], part: StatePlan) -> None:
    """Keep ``part`` for the next reset, where the optimizer keys a dict by identity and
    every state entry is a plain dict (the flattened views read ``dict.values``)."""
    state = optimizer.state
    if not by_identity(type(optimizer)) or set(map(type, state.values())) != {dict}:
        return
    entries = list(state.values())
    _plans[optimizer] = _Stored(
        schema,
        list(in_groups),
        list(state),
        entries,
        list(map(len, entries)),
        _keys(state),
        list(_values(state)),
        _addresses(part),
        part,
    )
    if optimizer not in _hooked:
        optimizer.register_load_state_dict_post_hook(forget)
        _hooked.add(optimizer)


def lookup(optimizer: torch.optim.Optimizer, schema: StateSchema, in_groups: list[torch.Tensor]) -> StatePlan | None:
    """The stored plan if the state and the groups' parameters (``in_groups``, in order)
    are exactly what it was planned from, else None."""
    stored = _plans.get(optimizer) if by_identity(type(optimizer)) else None
    if stored is None:
        return None
    if stored.matches(optimizer.state, schema, in_groups):
        return stored.part
    forget(optimizer)
    return None
