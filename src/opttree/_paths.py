"""Tree paths: how a node is reached from the root, written like attribute access."""

from __future__ import annotations

ROOT = "<root>"
"""The root's path: it is reached through no label of its own."""


def child(parent: str, label: str) -> str:
    """The path of a child reached from ``parent`` through ``label``."""
    return label if parent == ROOT else f"{parent}.{label}"


def items(sequence: str, count: int) -> list[str]:
    """The paths of the first ``count`` members of the sequence at path ``sequence``."""
    return [f"{sequence}[{index}]" for index in range(count)]


def key(mapping: str, name: object) -> str:
    """The path of the value stored under ``name`` in the mapping at path ``mapping``."""
    return f"{mapping}[{name!r}]"


def within(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or a path below it."""
    if root == ROOT or path == root:
        return True
    return path.startswith((f"{root}.", f"{root}["))
