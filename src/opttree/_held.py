"""Optimizers a wrapper holds in its attributes, found without knowing its layout.

A safety net under the adapter: a wrapper kind says where its children are, but a
wrapper that also keeps an optimizer elsewhere (a list of "active" optimizers, a dict
of per-module records) would make a reset silently miss that optimizer's state. Every
optimizer object reachable from a wrapper's instance attributes, directly or inside a
list, tuple, dict or dataclass (and a dataclass inside one of those), must therefore be
a node of the tree. Containers are screened by the classes they hold, at C speed, so a
list of ten thousand optimizers or parameters costs little.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

IsOptimizer = Callable[[type], bool]
Held = tuple[str, list[object], bool]
"""An attribute path (``module_infos['vision'].optimizer``), the optimizers found there,
and whether they are the members of a sequence at that path (``cpu_optimizers[i]``)."""


def _is_container(cls: type) -> bool:
    return issubclass(cls, (list, tuple, dict)) or _is_record(cls)


def _key_label(key: object) -> str:
    return repr(key) if isinstance(key, (str, int)) else f"<{type(key).__qualname__}>"


def _members(value: object, label: str) -> list[tuple[str, object]]:
    """A container's members with their paths; ``value`` passed :func:`_is_container`."""
    if isinstance(value, (list, tuple)):
        return [(f"{label}[{index}]", item) for index, item in enumerate(value)]
    if isinstance(value, dict):
        return [(f"{label}[{_key_label(key)}]", item) for key, item in value.items()]
    return [(f"{label}.{name}", item) for name, item in _fields(value)]


def _fields(value: object) -> list[tuple[str, object]]:
    return [(f.name, getattr(value, f.name, None)) for f in dataclasses.fields(value)]  # type: ignore[arg-type]


def _values(value: object) -> list[object]:
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, dict):
        return list(value.values())
    return [item for _, item in _fields(value)]


def held_optimizers(wrapper: object, is_optimizer: IsOptimizer, *, depth: int = 2) -> Iterator[Held]:
    """The optimizers in ``wrapper``'s instance attributes, by attribute path."""
    attributes = getattr(wrapper, "__dict__", None)
    if isinstance(attributes, dict):
        yield from _search(list(attributes.items()), is_optimizer, depth)


def _search(items: list[tuple[str, object]], is_optimizer: IsOptimizer, depth: int) -> Iterator[Held]:
    for label, value in items:
        if is_optimizer(type(value)):
            yield label, [value], False
            continue
        if depth == 0 or not _is_container(type(value)):
            continue
        values = _values(value)
        classes = set(map(type, values))
        if classes and all(map(is_optimizer, classes)) and isinstance(value, (list, tuple)):
            yield label, values, True  # such as HybridDeviceOptimizer.cpu_optimizers, in one piece
        elif any(is_optimizer(cls) or _is_record(cls) for cls in classes):
            # Only optimizers and dataclass records are looked into: a list of param
            # groups or a dict of per-parameter dicts holds none.
            members = [(name, item) for name, item in _members(value, label) if is_optimizer(type(item)) or _is_record(type(item))]
            yield from _search(members, is_optimizer, depth - 1)


def _is_record(cls: type) -> bool:
    return dataclasses.is_dataclass(cls) and isinstance(cls, type)
