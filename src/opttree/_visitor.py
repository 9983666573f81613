"""Typed visitors over the node tree, after mypy's ``NodeVisitor[T]`` / ``TraverserVisitor``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

from opttree._nodes import ChainedNode, HybridNode, LeafNode, Node, WrapperNode
from opttree._problems import MAX_DEPTH, Problem, too_deep

T = TypeVar("T")


class NodeVisitor(ABC, Generic[T]):
    """One ``visit_*`` method per node kind; ``T`` is what a visit returns."""

    _depth = 0
    """How many nodes above the one visited, where a walk goes :meth:`_below` them."""

    def _too_deep(self, node: Node) -> Problem | None:
        """The problem of ``node`` where a tree built by hand nests it deeper than a built
        one may, with more below: a walk stops there, not in a ``RecursionError``."""
        return too_deep(node.optimizer, node.path) if self._depth >= MAX_DEPTH and node.children else None

    @contextmanager
    def _below(self) -> Iterator[None]:
        """Visit the children of the node visited, one level deeper."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    @abstractmethod
    def visit_chained(self, node: ChainedNode) -> T:
        """Visit a ``ChainedOptimizer`` node."""

    @abstractmethod
    def visit_hybrid(self, node: HybridNode) -> T:
        """Visit a ``HybridDeviceOptimizer`` node."""

    @abstractmethod
    def visit_wrapper(self, node: WrapperNode) -> T:
        """Visit a wrapper node."""

    @abstractmethod
    def visit_leaf(self, node: LeafNode) -> T:
        """Visit a leaf optimizer node."""


class TraverserVisitor(NodeVisitor[None]):
    """Walks every node depth-first; subclasses override the kinds they care about."""

    def visit_children(self, node: Node) -> None:
        """Visit each child of ``node`` in order; a tree nested too deep is refused."""
        problem = self._too_deep(node)
        if problem is not None:
            raise problem.to_error()
        with self._below():
            for child in node.children:
                child.accept(self)

    def visit_chained(self, node: ChainedNode) -> None:
        """Visit the members in order."""
        self.visit_children(node)

    def visit_hybrid(self, node: HybridNode) -> None:
        """Visit the CPU sub-optimizers, then the GPU one."""
        self.visit_children(node)

    def visit_wrapper(self, node: WrapperNode) -> None:
        """Visit the inner optimizers."""
        self.visit_children(node)

    def visit_leaf(self, node: LeafNode) -> None:
        """Leaves have no children; the default visit does nothing."""
