"""Typed visitors over the node tree, after mypy's ``NodeVisitor[T]`` / ``TraverserVisitor``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, TypeVar

from opttree._nodes import ChainedNode, HybridNode, LeafNode, Node, WrapperNode
from opttree._problems import MAX_DEPTH, too_deep

T = TypeVar("T")


class NodeVisitor(ABC, Generic[T]):
    """One ``visit_*`` method per node kind; ``T`` is what a visit returns."""

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

    _depth = 0
    """How many nodes above the one visited: a tree built by hand nested deeper than a
    built one may is refused, not walked into a ``RecursionError``."""

    def visit_children(self, node: Node) -> None:
        """Visit each child of ``node`` in order."""
        if self._depth >= MAX_DEPTH and node.children:
            raise too_deep(node.optimizer, node.path).to_error()
        self._depth += 1
        try:
            for child in node.children:
                child.accept(self)
        finally:
            self._depth -= 1

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
