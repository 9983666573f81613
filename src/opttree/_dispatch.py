"""A class-keyed ``functools.singledispatch`` table with lazy registrations by dotted path.

``singledispatch`` has no lazy hook, so this wraps it thinly (after dask's ``Dispatch``):
a registration by dotted path (``"apex.optimizers.fused_adam.FusedAdam"``) waits in a
second table until a looked-up class has that path somewhere in its MRO. The class
then exists, so its module was imported by the user, never by opttree.

Every class in the MRO is resolved before dispatching, so a lazily registered subclass
is found even when its parent was resolved earlier.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")


def dotted_name(cls: type) -> str:
    """``module.QualName`` of a class, as lazy registrations name it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _unregistered(_: object) -> type | None:
    return None


def _owner_of(cls: type) -> Callable[[object], type | None]:
    return lambda _: cls


class LazyDispatch(Generic[V]):
    """Maps a class to the value registered for it or its nearest registered ancestor."""

    def __init__(self) -> None:
        self._owners = functools.singledispatch(_unregistered)
        self._values: dict[type, V] = {}
        self._lazy: dict[str, V] = {}
        self._resolved: set[type] = set()

    def register(self, cls: type, value: V) -> None:
        self._values[cls] = value
        self._owners.register(cls, _owner_of(cls))

    def register_lazy(self, dotted: str, value: V) -> None:
        self._lazy[dotted] = value
        self._resolved.clear()

    def is_registered(self, cls_or_dotted: type | str) -> bool:
        if isinstance(cls_or_dotted, str):
            return cls_or_dotted in self._lazy or any(
                dotted_name(cls) == cls_or_dotted for cls in self._values
            )
        return cls_or_dotted in self._values or dotted_name(cls_or_dotted) in self._lazy

    def lookup(self, cls: type) -> V | None:
        if cls not in self._resolved:
            self._resolve_lazy(cls)
        owner = self._owners.dispatch(cls)(None)
        return None if owner is None else self._values[owner]

    def _resolve_lazy(self, cls: type) -> None:
        for klass in cls.__mro__:
            dotted = dotted_name(klass)
            if dotted in self._lazy:
                self.register(klass, self._lazy.pop(dotted))
        self._resolved.add(cls)
