"""Reusing a state plan across resets.

Frameworks reset after every rollout, over the same state tensors, and on the CPU the
per-tensor work of planning costs several times the zeroing. A full reset therefore keeps
the plan of each large leaf, and of each large run of alike leaves planned as one, once
it has run and found nothing at all, and the next full reset reuses it after checking
that it is still exactly right:

- the very same optimizers, group parameters and state keys, in order (by identity),
  split among the optimizers alike;
- entries that are plain dicts of the same sizes, each holding the very same tensors
  under the same keys, and values of the same types where they are not tensors;
- every tensor it zeroes at the data address and of the size it was planned with, every
  kept state tensor too, and every parameter at its data address.

A plan is only kept where each tensor it zeroes is the whole of a storage of its own
(:attr:`~opttree._preflight.Extents.whole`). Freeing, resizing or rebinding such a
tensor's memory in place changes its data address or its size (a storage resized in
place is allocated anew), and a parameter cannot come to share its memory without its
own address changing: so what the checks let through is what a fresh plan would find,
with no aliasing and the same bytes. Anything else is a miss, planned afresh.

The checks run over flattened lists at C speed: per tensor they compare its identity and
read its address and size, where planning it afresh reads eight of its fields and sorts
every address range.

The cache keeps nothing alive: optimizers, parameters and tensors by weak reference, state
entries not at all (they are taken by position each time). Memory the optimizer lets go of
is freed at once: Megatron's ``offload_to_cpu()`` replaces every state tensor with a copy,
and ``state.clear()`` drops them all. Once any of them is gone, the plan is stale and is
never reused; it dies with the optimizer it is kept for.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable, Iterable, Sequence
from itertools import chain, compress
from typing import TYPE_CHECKING, cast

import torch
from attrs import define, evolve

from opttree._identity import by_identity
from opttree._schema import StateSchema

if TYPE_CHECKING:
    from opttree._plan import Layout, ListKey, Reusable, StateEntry, StatePlan

MIN_ENTRIES = 64
"""Leaves, or runs of leaves, with fewer state entries are not kept: they are planned
faster than checked."""

_DATA_PTR = torch.Tensor.data_ptr
_NBYTES = operator.attrgetter("nbytes")
_Ref = weakref.ref[object]


def _refs(objects: Iterable[object]) -> list[_Ref]:
    """Weak references without callbacks, which are shared: an object's second one is its
    first, so a plan made again over the same state allocates none."""
    return list(map(weakref.ref, objects))


def _same(now: Sequence[object], refs: list[_Ref]) -> bool:
    """Whether ``now`` holds the very objects ``refs`` refer to, in order. A reference
    whose object is gone gives None: callers make sure that None is not in ``now``."""
    return len(now) == len(refs) and all(map(operator.is_, now, map(operator.call, refs)))


Pick = Callable[[list[object]], list[object]]
"""Picks some of the flattened state values, by position."""


def _picker(positions: list[int]) -> Pick:
    """A pick of ``positions``: a slice where they are evenly spaced, as each key's are
    in entries of one layout, else an ``itemgetter``."""
    if len(positions) > 1:
        start, step = positions[0], positions[1] - positions[0]
        if step > 0 and positions == list(range(start, positions[-1] + 1, step)):
            window = slice(start, positions[-1] + 1, step)
            return lambda values: values[window]
        get = operator.itemgetter(*positions)
        return lambda values: list(get(values))
    return lambda values: [values[at] for at in positions]


def _same_objects(now: Sequence[object], then: Sequence[object]) -> bool:
    return len(now) == len(then) and all(map(operator.is_, now, then))


def _pick(values: list[object], positions: list[int]) -> list[object]:
    return _picker(positions)(values)


_Entry = dict[str, object]


def _values(entries: list[StateEntry], sizes: list[int], keys: list[str]) -> list[object]:
    """The values of plain-dict ``entries`` under ``keys`` (each entry's, flattened);
    ``KeyError`` where one is missing."""
    return list(map(dict.__getitem__, _per_key(cast(list[_Entry], entries), sizes), keys))


def _per_key(entries: list[_Entry], sizes: list[int]) -> list[_Entry]:
    """Each entry repeated once per key it holds, so that ``dict.__getitem__`` can be
    mapped over it and the flattened keys; entries of one size are spread by slices."""
    width = sizes[0] if sizes else 0
    if sizes.count(width) == len(sizes):
        spread: list[_Entry] = [{}] * (width * len(entries))
        for offset in range(width):
            spread[offset::width] = entries
        return spread
    return list(chain.from_iterable(map(itertools.repeat, entries, sizes)))


def _addresses_and_sizes(tensors: Sequence[torch.Tensor]) -> tuple[list[int], list[int]]:
    return list(map(_DATA_PTR, tensors)), list(map(_NBYTES, tensors))


@define(eq=False)
class _Stored:
    """A plan and what it was planned from, by weak reference and by position among the
    flattened state values (each entry's values in order, entry after entry)."""

    schema: StateSchema
    optimizers: list[_Ref]
    layout: Layout
    params: list[_Ref]
    held: list[_Ref] | None
    """The tensors the state is held for; None where they are the parameters, in order."""
    sizes: list[int]
    keys: list[str]
    tensors_at: Pick | None
    """Picks the tensor values; None where every value is a tensor."""
    tensors: list[_Ref]
    others_at: Pick
    other_types: list[type]
    lists: dict[ListKey, Pick]
    identities: list[tuple[str, int]]
    number_steps: list[tuple[int, int | float]]
    """Entry positions, with the zero each gets."""
    written: tuple[list[int], list[int]]
    """Addresses and sizes of the tensors the plan zeroes, lists in order."""
    kept_at: Pick
    kept: tuple[list[int], list[int]]
    """Addresses and sizes of the state tensors it leaves alone."""
    param_addresses: list[int]
    part: StatePlan
    """The plan with its object lists emptied; :meth:`reuse` fills them again."""

    def reuse(
        self,
        optimizers: list[torch.optim.Optimizer],
        layout: Layout,
        params: list[torch.Tensor],
        held: list[torch.Tensor],
        entries: list[StateEntry],
    ) -> StatePlan | None:
        """The plan, over the current objects, if they are exactly what it was planned
        from (see the module's docstring); else None."""
        # Optimizers and group parameters are never None (the leaf's outline was checked);
        # a tensor value that is None now fails the address read below.
        if layout != self.layout or not (_same(optimizers, self.optimizers) and _same(params, self.params)):
            return None
        if self.held is None:
            if not _same_objects(held, params):
                return None
        elif not (all(map(operator.is_not, held, itertools.repeat(None))) and _same(held, self.held)):
            return None
        if list(map(len, entries)) != self.sizes:
            return None
        try:  # plain dicts of equal sizes holding every planned key: the same keys, entry by entry
            values = _values(entries, self.sizes, self.keys)
            tensors = values if self.tensors_at is None else self.tensors_at(values)
            if not _same(tensors, self.tensors) or list(map(type, self.others_at(values))) != self.other_types:
                return None
            lists = {key: cast(list[torch.Tensor], pick(values)) for key, pick in self.lists.items()}
            if _addresses_and_sizes(list(chain.from_iterable(lists.values()))) != self.written:
                return None
            if _addresses_and_sizes(cast(list[torch.Tensor], self.kept_at(values))) != self.kept:
                return None
        except (KeyError, TypeError):  # a missing key, an entry that is no dict, a None
            return None
        if list(map(_DATA_PTR, params)) != self.param_addresses:
            return None
        return evolve(
            self.part,
            lists=lists,
            identities=[(key, cast(torch.Tensor, values[at])) for key, at in self.identities],
            number_steps=[(entries[at], zero) for at, zero in self.number_steps],
        )


_plans: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Stored] = weakref.WeakKeyDictionary()


def forget(optimizer: torch.optim.Optimizer) -> None:
    """Drop the plan kept for ``optimizer``, if any."""
    _plans.pop(optimizer, None)


def store(planned: Reusable) -> None:
    """Keep ``planned`` for the next reset, where its first optimizer is a key of its own
    (see :mod:`opttree._identity`), every entry a plain dict and every tensor it zeroes
    the whole of its own storage."""
    part, entries = planned.part, planned.entries
    first = planned.optimizers[0]
    if not (by_identity(type(first)) and part.written.whole and part.step_ranges.whole):
        return
    if set(map(type, entries)) != {dict}:
        return
    sizes = list(map(len, entries))
    keys = list(chain.from_iterable(entries))
    values = _values(entries, sizes, keys)
    # object.__hash__ is unique among live objects, as id() is, without id()'s audit event
    position = dict(zip(map(object.__hash__, values), range(len(values))))
    entry_position = dict(zip(map(object.__hash__, entries), range(len(entries))))
    is_tensor = [isinstance(value, torch.Tensor) for value in values]
    tensors_at = list(compress(range(len(values)), is_tensor))
    others_at = [at for at, tensor in enumerate(is_tensor) if not tensor]
    try:
        lists = {key: list(map(position.__getitem__, map(object.__hash__, tensors))) for key, tensors in part.lists.items()}
        identities = [(key, position[object.__hash__(t)]) for key, t in part.identities]
        number_steps = [(entry_position[object.__hash__(entry)], zero) for entry, zero in part.number_steps]
        written = set(chain.from_iterable(lists.values()))
        kept_at = [at for at in tensors_at if at not in written]
        stored = _Stored(
            schema=planned.schema,
            optimizers=_refs(planned.optimizers),
            layout=planned.layout,
            params=_refs(planned.params),
            held=None if _same_objects(planned.held, planned.params) else _refs(planned.held),
            sizes=sizes,
            keys=keys,
            tensors_at=None if len(tensors_at) == len(values) else _picker(tensors_at),
            tensors=_refs(_pick(values, tensors_at)),
            others_at=_picker(others_at),
            other_types=[type(values[at]) for at in others_at],
            lists={key: _picker(positions) for key, positions in lists.items()},
            identities=identities,
            number_steps=number_steps,
            written=_addresses_and_sizes(list(chain.from_iterable(part.lists.values()))),
            kept_at=_picker(kept_at),
            kept=_addresses_and_sizes(cast(list[torch.Tensor], _pick(values, kept_at))),
            param_addresses=list(map(_DATA_PTR, planned.params)),
            part=evolve(part, lists={}, identities=[], number_steps=[]),
        )
    except (KeyError, RuntimeError, TypeError):
        return  # a tensor written that is not a state value, one without data, or no weak reference
    _plans[first] = stored


def lookup(
    schema: StateSchema,
    optimizers: list[torch.optim.Optimizer],
    layout: Layout,
    params: list[torch.Tensor],
    held: list[torch.Tensor],
    entries: list[StateEntry],
) -> StatePlan | None:
    """The plan kept for ``optimizers`` (one leaf, or a run planned as one) if their
    layout, groups' parameters, the tensors their state is held for and its entries are
    exactly what it was planned from, else None."""
    first = optimizers[0]
    stored = _plans.get(first) if by_identity(type(first)) else None
    if stored is None:
        return None
    part = stored.reuse(optimizers, layout, params, held, entries) if stored.schema is schema else None
    if part is None:
        forget(first)
    return part
