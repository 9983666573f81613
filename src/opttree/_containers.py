"""Whether a leaf's containers are what torch optimizers hold, before anything reads them.

``validate`` and ``describe`` report a malformed leaf instead of raising from deep inside,
and a reset refuses it.
"""

from __future__ import annotations

import functools
import operator
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from itertools import accumulate, chain, repeat
from typing import NamedTuple, TypeVar, cast

import torch
from opttree._fields import kind_of
from opttree._held import key_text


def _tensor_classes(classes: set[type]) -> bool:
    return all(issubclass(cls, torch.Tensor) for cls in classes)


def tensors_in(values: list[object]) -> list[torch.Tensor]:
    """The tensors among ``values``: the list itself where all are, as they usually are,
    which is checked at C speed."""
    if all(map(isinstance, values, repeat(torch.Tensor))):
        return cast(list[torch.Tensor], values)
    return [value for value in values if isinstance(value, torch.Tensor)]


def tensors_held(values: list[object]) -> list[torch.Tensor]:
    """The tensors among ``values`` and inside those that are lists, tuples or dicts, at
    any depth (LBFGS keeps its past directions in lists): the memory that state dropped or
    kept holds; a kept tensor passed over would let a reset zero memory it keeps. Read
    level by level, without recursion, each container once (a list that holds itself ends
    there), by the built-in types' own methods, which a subclass's ``__iter__`` or
    ``values`` does not replace."""
    tensors = tensors_in(values)
    if len(tensors) == len(values):
        return tensors
    found = list(tensors)
    seen: set[int] = set()
    while values:
        containers = [value for value in values if isinstance(value, (dict, list, tuple))]
        fresh = [value for value in containers if object.__hash__(value) not in seen]
        seen.update(map(object.__hash__, fresh))
        values = list(chain.from_iterable(map(_items, fresh)))
        found.extend(tensors_in(values))
    return found


def _items(value: object) -> list[object]:
    if isinstance(value, dict):
        return list(dict.values(value))
    if isinstance(value, list):
        return list.copy(value)
    if isinstance(value, tuple):
        return list(tuple.__getitem__(value, slice(None)))
    return []


_Read = TypeVar("_Read")


def _guarded(check: Callable[[_Read], str | None]) -> Callable[[_Read], str | None]:
    """``check``, with an error that a container's own code raises while it is read (a
    mapping whose ``__iter__`` refuses) reported as what is wrong, not raised."""

    @functools.wraps(check)
    def guarded(value: _Read) -> str | None:
        try:
            return check(value)
        except Exception as error:  # noqa: BLE001  # a container's own code may raise anything
            return reading_fault(error)

    return guarded


def reading_fault(error: Exception) -> str:
    """What is wrong with a leaf whose containers raised ``error`` while read."""
    return f"reading its param groups or state raised {type(error).__name__}: {error}"


_DICT_SETITEMS = (dict.__setitem__, OrderedDict.__setitem__)
_DICT_DELITEMS = (dict.__delitem__, OrderedDict.__delitem__)


def _writes_as_dict(cls: type) -> bool:
    """Read afresh each time, not cached per class, so that a method set on the class after
    opttree first met it is looked at again. Once the two methods are read, the check is
    two lookups in short tuples: a cache keyed by them (as ``_registry._own_builder``'s
    is) would save nothing."""
    return issubclass(cls, dict) and getattr(cls, "__setitem__") in _DICT_SETITEMS and getattr(cls, "__delitem__") in _DICT_DELITEMS


_DICT_READS = ("__len__", "__bool__", "__iter__", "keys", "values", "items", "__contains__", "get", "__getitem__")
"""What a reset reads a dict's keys and values through."""


def own_read(cls: type) -> str | None:
    """The first of :data:`_DICT_READS` that a mapping class ``cls`` runs code of its own
    for (where a dict, or an ``OrderedDict``, runs its own), or None: one whose
    ``__len__``, ``__iter__`` or ``values`` hide entries torch's step reads by
    ``state[param]`` would make a reset pass them over, reporting success. A mapping that
    is not a dict reads everything by its own code. Read afresh each time, as
    :func:`_writes_as_dict` is."""
    base = OrderedDict if issubclass(cls, OrderedDict) else dict
    return next((name for name in _DICT_READS if getattr(cls, name, None) is not getattr(base, name, None)), None)


def builds_missing_entries(state: object) -> bool:
    """Whether reading a deleted entry of ``state`` gives a new empty dict, as torch's
    ``defaultdict(dict)`` does: a subclass's own ``__missing__`` or ``__getitem__`` may not."""
    cls = type(state)
    return (
        isinstance(state, defaultdict)
        and state.default_factory is dict
        and getattr(cls, "__missing__") is defaultdict.__missing__
        and getattr(cls, "__getitem__") is defaultdict.__getitem__
    )


def own_writes(containers: Sequence[object]) -> type | None:
    """The first class among ``containers`` that sets or deletes keys by code of its own,
    or None. A reset deletes keys and sets step counters after it has zeroed history, so
    it writes only into containers that do so as a dict does (a ``defaultdict``, an
    ``OrderedDict``), which cannot fail for a key they hold; it refuses the others first."""
    return next((cls for cls in set(map(type, containers)) if not _writes_as_dict(cls)), None)


def malformed(optimizer: torch.optim.Optimizer) -> str | None:
    """What is wrong with a leaf's containers, or None: ``param_groups`` a list of dicts
    each holding a ``"params"`` list of tensors, ``state`` a mapping from tensors to dicts."""
    return malformed_outline(optimizer) or malformed_state(optimizer.state)


@_guarded
def malformed_outline(optimizer: torch.optim.Optimizer) -> str | None:
    """:func:`malformed` but for the keys and entries of ``state``, which are checked
    apart, once the groups have been read."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, (list, tuple)):
        return f"param_groups is {kind_of(groups)}, expected a list"
    for index, group in enumerate(groups):
        if not isinstance(group, MutableMapping):
            return f"param group {index} is {kind_of(group)}, expected a dict"
        params = group["params"] if "params" in group else None  # read as every later read does
        if not isinstance(params, (list, tuple)):
            return f"param group {index} has no 'params' list"
        if not _tensor_classes(set(map(type, params))):
            return f"param group {index} holds 'params' that are not all tensors"
    state = getattr(optimizer, "state", None)
    if not isinstance(state, Mapping):
        return f"state is {kind_of(state)}, expected a mapping"
    read = own_read(type(state))
    if read is not None:
        return f"state is a {type(state).__qualname__}, which reads its entries by its own {read}: a reset could not tell that it sees them all"
    return None


@_guarded
def malformed_state(state: Mapping[torch.Tensor, object]) -> str | None:
    if not _tensor_classes(set(map(type, state))):
        key: object = next(key for key in state if not isinstance(key, torch.Tensor))
        named = f"{key_text(key)}, {kind_of(key)}" if isinstance(key, (str, int)) else kind_of(key)
        return f"state is keyed by something other than tensors (by {named}: a state_dict's layout?)"
    entries = set(map(type, state.values()))
    if entries != {dict} and not all(issubclass(cls, MutableMapping) for cls in entries):
        wrong = next(cls for cls in entries if not issubclass(cls, MutableMapping))
        return f"a state entry is a {wrong.__qualname__}, expected a dict"
    reading = next(((cls, read) for cls in entries if cls is not dict and (read := own_read(cls)) is not None), None)
    if reading is not None:
        return f"a state entry is a {reading[0].__qualname__}, which reads its keys by its own {reading[1]}: a reset could not tell that it sees them all"
    return None


class Pooled(NamedTuple):
    """The containers of many leaves, flattened in order: their param groups, those
    groups' parameters, their states, the tensors those are held for, and their entries."""

    groups: list[dict[str, object]]
    params: list[torch.Tensor]
    states: list[dict[torch.Tensor, MutableMapping[str, object]]]
    held: list[torch.Tensor]
    entries: list[dict[str, object]]


_PARAM_GROUPS = operator.attrgetter("param_groups")
_STATE = operator.attrgetter("state")
_PARAMS = operator.itemgetter("params")
PLAIN_STATES = {dict, defaultdict}
"""What torch optimizers keep ``state`` in. A subclass may order its keys apart from its
values (``OrderedDict.move_to_end``), and the pooled pass reads them apart."""


def pooled(optimizers: Sequence[torch.optim.Optimizer]) -> Pooled | None:
    """The common case of :func:`malformed` for many leaves at once, at C speed, and
    their containers flattened: plain dicts and lists throughout. None sends the leaves
    to the one-by-one path."""
    try:
        group_lists = list(map(_PARAM_GROUPS, optimizers))
        states = list(map(_STATE, optimizers))
    except Exception:  # noqa: BLE001  # a missing attribute, or a property whose own code raises
        return None
    if not set(map(type, group_lists)) <= {list, tuple}:
        return None
    groups = list(chain.from_iterable(group_lists))
    if set(map(type, groups)) != {dict} or not all(map(operator.contains, groups, repeat("params"))):
        return None
    param_lists = list(map(_PARAMS, groups))
    if not set(map(type, param_lists)) <= {list}:
        return None
    params = list(chain.from_iterable(param_lists))
    if not _tensor_classes(set(map(type, params))) or not set(map(type, states)) <= PLAIN_STATES:
        return None
    held = list(chain.from_iterable(states))
    if not _tensor_classes(set(map(type, held))):
        return None
    entries = list(chain.from_iterable(map(dict.values, states)))
    if not set(map(type, entries)) <= {dict}:
        return None
    return Pooled(groups, params, states, held, entries)


def param_counts(optimizers: Sequence[torch.optim.Optimizer], groups: list[dict[str, object]]) -> list[int]:
    """How many parameters each optimizer's groups hold, given all their groups in order."""
    group_counts = list(map(len, map(_PARAM_GROUPS, optimizers)))
    per_group = list(map(len, map(_PARAMS, groups)))
    if group_counts.count(1) == len(group_counts):
        return per_group
    ends = list(accumulate(group_counts))
    return [sum(per_group[end - count : end]) for end, count in zip(ends, group_counts, strict=True)]
