"""Field validators for the public attrs values a user may also build by hand (nodes,
problems, reports): a field of the wrong type is an :class:`~opttree.OptTreeError` where
the value is made, not an ``AttributeError`` or ``KeyError`` wherever it is later read."""

from __future__ import annotations

import builtins
from collections.abc import Callable, Collection
from typing import TypeGuard, TypeVar

from attrs import Attribute

from opttree._errors import OptTreeError

T = TypeVar("T")


def is_a(value: object, cls: type[T]) -> TypeGuard[T]:
    """``isinstance`` by the value's type alone: where the type does not match,
    ``isinstance`` reads the object's ``__class__``, whose own property may raise."""
    return issubclass(type(value), cls)


def article(name: str) -> str:
    """``a`` or ``an``, as the name is said: a name opening on two capitals is spelt out
    (an SGD, an LBFGS, an RAdam, a TensorParallelMuon), any other read as a word (an int),
    an unsigned dtype's as its "u" is said (a uint8)."""
    spelt = name[:2].isupper() and name[:2].isalpha()
    said_as_you = name.startswith("uint")
    return f"an {name}" if name[:1] in ("AEFHILMNORSX" if spelt else "AEIOUaeiou") and not said_as_you else f"a {name}"


def kind_of(value: object) -> str:
    """What a value is, as messages say it: ``a str``, ``an int``; a class named as a
    builtin but not one by its module too (``a numpy.bool``, not ``a bool``)."""
    cls = type(value)
    name = cls.__qualname__
    if cls.__module__ != "builtins" and hasattr(builtins, name):
        name = f"{cls.__module__}.{name}"
    return article(name)


def of(*kinds: type, optional: bool = False, what: str | None = None) -> Callable[[object, Attribute[T], T], None]:
    """A validator accepting instances of ``kinds`` (a bool is not an int), and None where
    ``optional``; ``what`` names them in its message, in place of their class names."""
    names = (what or " or ".join(article(kind.__name__) for kind in kinds)) + (" or None" if optional else "")

    def check(instance: object, attribute: Attribute[T], value: T) -> None:
        if value is None and optional:
            return
        if isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds):
            return
        msg = f"{type(instance).__name__}.{attribute.name} must be {names}, got {kind_of(value)}"
        raise OptTreeError(msg)

    return check


def tuple_of(kind: type, *, what: str) -> Callable[[object, Attribute[T], T], None]:
    """A validator accepting a tuple of instances of ``kind``, named ``what`` in its message."""

    def check(instance: object, attribute: Attribute[T], value: T) -> None:
        if isinstance(value, tuple) and all(isinstance(item, kind) for item in value):
            return
        wrong = next((item for item in value if not isinstance(item, kind)), None) if isinstance(value, tuple) else None
        holding = f" holding {kind_of(wrong)}" if isinstance(value, tuple) else ""
        msg = f"{type(instance).__name__}.{attribute.name} must be a tuple of {what}, got {kind_of(value)}{holding}"
        raise OptTreeError(msg)

    return check


def one_of(choices: Collection[T]) -> Callable[[object, Attribute[T], T], None]:
    """A validator accepting one of ``choices``."""

    def check(instance: object, attribute: Attribute[T], value: T) -> None:
        if value not in choices:
            msg = f"{type(instance).__name__}.{attribute.name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
            raise OptTreeError(msg)

    return check
