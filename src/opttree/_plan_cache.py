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

The cache holds the state's tensors only weakly, so that it never keeps memory alive:
Megatron's ``offload_to_cpu()`` replaces every state tensor with a CPU copy, and the
device memory of the old ones is freed as soon as nothing else holds them. Once any of
them is gone, the plan is stale and is never reused. The plan is also dropped when the
optimizer loads a state dict, and dies with the optimizer. Optimizers that are not keys
of their own (see :mod:`opttree._identity`) are never cached.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from itertools import chain
from typing import TYPE_CHECKING, cast

import torch
from attrs import define, evolve, field

from opttree._identity import by_identity
from opttree._schema import StateSchema

if TYPE_CHECKING:
    from opttree._plan import ListKey, StatePlan

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


def _addresses(lists: Iterable[list[torch.Tensor]]) -> list[int]:
    return list(map(torch.Tensor.data_ptr, chain.from_iterable(lists)))


class _Held:
    """A strong reference with a weak reference's call: for a state value that is not a
    tensor (a Python step count), which holds no memory worth freeing."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __call__(self) -> object:
        return self.value


Ref = Callable[[], object]
Pick = Callable[[list[object]], list[torch.Tensor]]
"""Picks a plan's tensor list out of the state's values, flattened, by position."""


def _picker(positions: list[int]) -> Pick:
    if len(positions) == 1:
        (only,) = positions
        return lambda values: [cast(torch.Tensor, values[only])]
    get = operator.itemgetter(*positions)
    return lambda values: list(get(values)) if positions else []


class _Gone:
    """The weak references' callback: whether any planned-from tensor is gone. It holds
    nothing of the plan, so that a dropped plan is freed at once, not by the cycle
    collector, and its weak references with it."""

    __slots__ = ("any",)

    def __init__(self) -> None:
        self.any = False

    def __call__(self, _: object) -> None:
        self.any = True


@define(eq=False)
class _Stored:
    """A plan and what it was planned from; tensors by weak reference only, and the plan's
    tensor lists by their positions among the state's values."""

    schema: StateSchema
    in_groups: list[object]
    params: list[object]
    entries: list[object]
    sizes: list[int]
    keys: list[str]
    values: list[Ref]
    lists: dict[ListKey, Pick]
    identities: list[tuple[str, int]]
    addresses: list[int]
    part: StatePlan
    """The plan with its tensor lists emptied; :meth:`reuse` fills them again."""
    gone: _Gone = field(factory=lambda: _Gone())

    def reuse(self, state: _State, schema: StateSchema, in_groups: list[torch.Tensor]) -> StatePlan | None:
        """The plan, over the very tensors it was made for, if the state and the groups'
        parameters are exactly what it was planned from and each tensor it writes has the
        data address it was planned with; else None."""
        if (
            self.gone.any  # else every referent is alive, and the values compared are the planned ones
            or schema is not self.schema
            or len(in_groups) != len(self.in_groups)
            or not _same_objects(in_groups, self.in_groups)
            or len(state) != len(self.params)
            or not _same_objects(state, self.params)
            or not _same_objects(state.values(), self.entries)
            or list(map(len, state.values())) != self.sizes  # so the values are as many
            or _keys(state) != self.keys
        ):
            return None
        values = [ref() for ref in self.values]
        if not _same_objects(_values(state), values):
            return None
        lists = {key: pick(values) for key, pick in self.lists.items()}
        if _addresses(lists.values()) != self.addresses:
            return None
        identities = [(key, cast(torch.Tensor, values[at])) for key, at in self.identities]
        return evolve(self.part, lists=lists, identities=identities)


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
    values = list(_values(state))
    # object.__hash__ is unique among live objects, as id() is, without id()'s audit event
    position = {object.__hash__(value): at for at, value in enumerate(values)}
    try:
        lists = {key: [position[object.__hash__(t)] for t in tensors] for key, tensors in part.lists.items()}
        identities = [(key, position[object.__hash__(t)]) for key, t in part.identities]
    except KeyError:
        return  # a tensor written that is not a state value
    entries = list(state.values())
    stored = _Stored(
        schema,
        list(in_groups),
        list(state),
        entries,
        list(map(len, entries)),
        _keys(state),
        [],
        {key: _picker(positions) for key, positions in lists.items()},
        identities,
        _addresses(part.lists.values()),
        evolve(part, lists={}, identities=[]),
    )
    gone = stored.gone
    stored.values.extend(weakref.ref(v, gone) if isinstance(v, torch.Tensor) else _Held(v) for v in values)
    _plans[optimizer] = stored
    if optimizer not in _hooked:
        optimizer.register_load_state_dict_post_hook(forget)
        _hooked.add(optimizer)


def lookup(optimizer: torch.optim.Optimizer, schema: StateSchema, in_groups: list[torch.Tensor]) -> StatePlan | None:
    """The stored plan if the state and the groups' parameters (``in_groups``, in order)
    are exactly what it was planned from, else None."""
    stored = _plans.get(optimizer) if by_identity(type(optimizer)) else None
    if stored is None:
        return None
    part = stored.reuse(optimizer.state, schema, in_groups)
    if part is None:
        forget(optimizer)
    return part
