"""Whether a leaf's containers are what torch optimizers hold, before anything reads them.

``validate`` and ``describe`` report a malformed leaf instead of raising from deep inside,
and a reset refuses it.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, MutableMapping, Sequence
from itertools import chain

import torch


def _tensor_classes(classes: set[type]) -> bool:
    return all(issubclass(cls, torch.Tensor) for cls in classes)


def malformed(optimizer: torch.optim.Optimizer) -> str | None:
    """What is wrong with a leaf's containers, or None: ``param_groups`` a list of dicts
    each holding a ``"params"`` list of tensors, ``state`` a mapping from tensors to dicts."""
    return malformed_outline(optimizer) or malformed_state(optimizer.state)


def malformed_outline(optimizer: torch.optim.Optimizer) -> str | None:
    """:func:`malformed` but for the keys and entries of ``state``, which a reused plan
    has already seen to be the very same objects."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, (list, tuple)):
        return f"param_groups is a {type(groups).__qualname__}, expected a list"
    for index, group in enumerate(groups):
        if not isinstance(group, MutableMapping):
            return f"param group {index} is a {type(group).__qualname__}, expected a dict"
        params = group.get("params")
        if not isinstance(params, (list, tuple)):
            return f"param group {index} has no 'params' list"
        if not _tensor_classes(set(map(type, params))):
            return f"param group {index} holds 'params' that are not all tensors"
    state = getattr(optimizer, "state", None)
    if not isinstance(state, Mapping):
        return f"state is a {type(state).__qualname__}, expected a mapping"
    return None


def malformed_state(state: Mapping[torch.Tensor, object]) -> str | None:
    if not _tensor_classes(set(map(type, state))):
        return "state is keyed by something other than tensors (a state_dict's layout?)"
    entries = set(map(type, state.values()))
    if entries != {dict} and not all(issubclass(cls, MutableMapping) for cls in entries):
        wrong = next(cls for cls in entries if not issubclass(cls, MutableMapping))
        return f"a state entry is a {wrong.__qualname__}, expected a dict"
    return None


def well_formed(optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """The common case of :func:`malformed` for many leaves at once, at C speed: plain
    dicts and lists throughout. False sends the leaves to the one-by-one path."""
    groups = [group for optimizer in optimizers for group in optimizer.param_groups]
    if set(map(type, groups)) != {dict} or not all(map(operator.contains, groups, ["params"] * len(groups))):
        return False
    states = [optimizer.state for optimizer in optimizers]
    if not all(issubclass(cls, dict) for cls in set(map(type, states))):
        return False
    if not _tensor_classes(set(map(type, chain.from_iterable(states)))):
        return False
    entries = set(map(type, chain.from_iterable(state.values() for state in states)))
    lists = [group["params"] for group in groups]
    return entries <= {dict} and set(map(type, lists)) <= {list} and _tensor_classes(set(map(type, chain.from_iterable(lists))))
