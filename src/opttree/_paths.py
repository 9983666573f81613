"""Tree paths: how a node is reached from the root, written like attribute access."""

from __future__ import annotations

ROOT = ""


def child(parent: str, label: str) -> str:
    """The path of a child reached from ``parent`` through ``label``."""
    return label if parent == ROOT else f"{parent}.{label}"


def indexed(parent: str, name: str, index: int) -> str:
    """The path of the ``index``-th member of the sequence ``name``."""
    return child(parent, f"{name}[{index}]")


def display(path: str) -> str:
    """A path as printed in messages: the root has no label of its own."""
    return path or "<root>"
