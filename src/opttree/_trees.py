"""The tree of an optimizer stack, built or verified: a tree passed in is used only where
it is the one opttree builds for its root's optimizer."""

from __future__ import annotations

import operator

from attrs import evolve

from opttree._eager import eager
from opttree import _paths, _registry
from opttree._adapter import TreeBuilder, Truncated, node_at, too_deep_in, unlike_built
from opttree._nodes import ChainedNode, HybridNode, LeafNode, Node, WrapperNode, is_node
from opttree._problems import Problem, ProblemKind


@eager
def tree(optimizer: object) -> Node:
    """Build the typed tree of an optimizer stack.

    Raises :class:`~opttree.NotAnOptimizer` for an object that is neither an optimizer
    nor a known wrapper (:class:`~opttree.UnknownWrapper` for a Megatron optimizer class
    of no known kind), :class:`~opttree.OptimizerCycle` for a wrapper that contains
    itself or nests deeper than 64 (a tree built by hand too), and
    :class:`~opttree.MalformedWrapper` for a known wrapper that lacks its parts. A tree
    passed in is returned as it is where it is the one this builds for its root's
    optimizer, and refused (``MalformedWrapper``) where it is not.
    """
    if is_node(optimizer):
        problems = too_deep_in(optimizer)
        if problems:
            raise problems[0].to_error(others=problems[1:])
        optimizer = _own_root(optimizer)
        unlike = _unlike(optimizer, _built_for(optimizer, None))
        if unlike is not None:
            raise unlike.to_error()
        return optimizer
    return TreeBuilder(_registry.kind_for).build(optimizer, _paths.ROOT)


def lenient_tree(optimizer: object) -> tuple[Node, list[Problem]]:
    """The tree, and the objects the adapter refused, each standing in it as a wrapper
    without children, for ``validate`` and ``describe``, which report instead of raising;
    a tree built by hand is refused where it nests too deep, as a built one would be, and
    reported where it is not the tree built for its root's optimizer, whose tree is then
    the one checked."""
    problems: list[Problem] = []
    if is_node(optimizer):
        too_deep = too_deep_in(optimizer)
        if too_deep:
            return optimizer.accept(Truncated()), too_deep
        optimizer = _own_root(optimizer)
        built = _built_for(optimizer, problems)
        unlike = _unlike(optimizer, built)
        if unlike is None:
            return optimizer, problems
        own = TreeBuilder(_registry.kind_for, problems).build(optimizer.optimizer, optimizer.path) if built is None else built
        return own, [*problems, unlike]
    return TreeBuilder(_registry.kind_for, problems).build(optimizer, _paths.ROOT), problems


def _own_root(given: Node) -> Node:
    """A subtree holding leaves its tree reaches first outside it (``shared_with`` a path
    outside the subtree: the wrapper of a second reach of one optimizer, or that leaf
    alone) stands for those optimizers itself, as passing them would: their first reach
    inside the subtree holds their state, and a later one inside is shared with it.
    Marked shared with a node outside, a reset of the subtree passed their state over."""
    seen: dict[int, str] = {}

    def owned(node: Node) -> Node:
        if isinstance(node, LeafNode):
            mark = node.shared_with
            if mark is None or _paths.within(mark, given.path):
                seen.setdefault(id(node.optimizer), node.path)
                return node
            first = seen.setdefault(id(node.optimizer), node.path)
            return evolve(node, shared_with=None if first == node.path else first)
        children = tuple(map(owned, node.children))
        if all(map(operator.is_, children, node.children)):
            return node
        if isinstance(node, ChainedNode):
            return evolve(node, members=children)
        if isinstance(node, HybridNode):
            return evolve(node, cpu=children[: len(node.cpu)], gpu=None if node.gpu is None else children[-1])
        if isinstance(node, WrapperNode):
            return evolve(node, inner=children)
        return node

    return owned(given)


def _built_for(given: Node, problems: list[Problem] | None) -> Node | None:
    """The node opttree builds where a tree passed in stands: built from its root's
    optimizer at its path, or, where its root records the Megatron wrapper above it
    (``under``), found at its path in the tree of that wrapper; None where that tree has
    no node at its path."""
    if given.under is None:
        return TreeBuilder(_registry.kind_for, problems).build(given.optimizer, given.path)
    path, wrapper = given.under
    found: list[Problem] = []
    built = node_at(TreeBuilder(_registry.kind_for, found).build(wrapper, path), given.path)
    inside = [problem for problem in found if _paths.within(problem.path, given.path)]  # a sibling's are not the subtree's
    if problems is None and inside:
        raise inside[0].to_error(others=inside[1:])
    if problems is not None:
        problems.extend(inside)
    return None if built is None else _own_root(built)


def _unlike(given: Node, built: Node | None) -> Problem | None:
    if built is not None:
        return unlike_built(given, built)
    path, wrapper = given.under or ("", None)
    message = (
        f"it records the {type(wrapper).__qualname__} at {path!r} above it (under), whose tree has no node at {given.path!r}: "
        "a tree passed in must be the one opttree.tree(optimizer) builds"
    )
    return Problem(ProblemKind.FOREIGN_TREE, given.path, type(given.optimizer).__qualname__, message)
