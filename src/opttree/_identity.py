"""Keying optimizers by identity without ``id()``.

``id()`` raises an audit event, and an audit hook (filelock, which Megatron's imports
bring in, installs one) makes every call a Python call. Optimizers that hash and compare
as ``object`` does are keys of their own, looked up at C speed; others, which may be
unhashable or equal to one another, are keyed by ``id()``.
"""

from __future__ import annotations

from opttree._dispatch import static_attribute


def by_identity(cls: type) -> bool:
    """Whether instances of ``cls`` hash and compare by identity, as ``object``'s do."""
    return static_attribute(cls, "__hash__") is object.__hash__ and static_attribute(cls, "__eq__") is object.__eq__


def identity_key(obj: object) -> object:
    """A dict key that stands for ``obj`` itself and no other object."""
    return obj if by_identity(type(obj)) else id(obj)


def identity_keys(objects: list[object]) -> set[object]:
    """The :func:`identity_key` of each object, at C speed where all are keys of their own."""
    if all(map(by_identity, set(map(type, objects)))):
        return set(objects)
    return set(map(identity_key, objects))
