"""The public functions. Each accepts a live optimizer or a tree already built from one."""

from __future__ import annotations

from opttree import _paths, _registry
from opttree._adapter import TreeBuilder
from opttree._describe import DescribeVisitor
from opttree._nodes import Node
from opttree._problems import Problem
from opttree._report import ResetReport
from opttree._reset import ResetVisitor
from opttree._validate import ValidateVisitor


def tree(optimizer: object) -> Node:
    """Build the typed tree of an optimizer stack.

    Raises :class:`~opttree.NotAnOptimizer` for an object that is neither an optimizer
    nor a known wrapper, and :class:`~opttree.OptimizerCycle` for a wrapper that
    contains itself.
    """
    if isinstance(optimizer, Node):
        return optimizer
    return TreeBuilder(_registry.kind_for).build(optimizer, _paths.ROOT)


def validate(optimizer: object) -> tuple[Problem, ...]:
    """Every problem in the tree, errors and warnings, without raising for them."""
    visitor = ValidateVisitor()
    tree(optimizer).accept(visitor)
    return tuple(visitor.problems)


def reset(optimizer: object) -> ResetReport:
    """Reset all optimizer history so the next step equals a fresh optimizer's.

    History tensors and per-parameter step tensors are zeroed in place; keys the
    optimizer creates lazily are dropped; per-group steps become 0; master weights and
    other non-history state are kept. The whole tree is validated first: on any
    unsupported leaf or key this raises and changes nothing.
    """
    return ResetVisitor().reset(tree(optimizer))


def describe(optimizer: object) -> str:
    """An indented description of the tree: class, path, parameters, state bytes, step."""
    return DescribeVisitor().render(tree(optimizer))
