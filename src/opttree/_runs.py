"""Runs of alike leaves: consecutive siblings that are leaves of one optimizer class,
each reached for the first time.

Validation and ``describe`` take such a run in bulk. A HybridDeviceOptimizer with
overlap holds one CPU optimizer per parameter, and thousands of one-parameter leaves
would otherwise cost more in per-leaf Python than their state does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import groupby
from typing import cast

from opttree._dispatch import class_namespace, static_attribute
from opttree._nodes import HybridNode, LeafNode, Node

LeafRun = tuple[LeafNode, ...]
"""Two or more alike leaves, in sibling order."""


def sibling_groups(node: Node) -> tuple[tuple[Node, ...], ...]:
    """A node's children, in order, in the groups within which runs may form: a
    HybridNode's GPU sub-optimizer, often of its CPU ones' class, never joins them, as
    its state lives on another device."""
    if isinstance(node, HybridNode) and node.gpu is not None:
        return node.cpu, (node.gpu,)
    return (node.children,)


def _run_key(node: Node) -> object:
    """Alike leaves share their class as key; any other node has a key of its own."""
    if isinstance(node, LeafNode) and node.shared_with is None:
        return type(node.optimizer)
    return id(node)


def alike_runs(nodes: Iterable[Node]) -> Iterator[Node | LeafRun]:
    """``nodes`` in order, each run of two or more alike leaves yielded as one tuple."""
    for _, group in groupby(nodes, _run_key):
        run = tuple(group)
        yield run[0] if len(run) == 1 else cast(LeafRun, run)


def visits_leaves_as(visitor: object, owner: type) -> bool:
    """Whether ``visitor`` visits a leaf by ``owner``'s own ``visit_leaf``, which taking
    a run in bulk stands for: a subclass that overrides it (to pass some leaves over, or
    to describe them its way) has it called for every leaf, wherever its siblings are of
    its class."""
    return static_attribute(type(visitor), "visit_leaf") is class_namespace(owner).get("visit_leaf")
