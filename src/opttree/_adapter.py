"""The adapter: a live optimizer stack in, a typed node tree out.

Wrapper kinds are looked up by class through a :class:`LazyDispatch`; Megatron's classes
are registered by dotted path, because importing ``megatron.core.optimizer`` imports
TransformerEngine, apex and ``emerging_optimizers`` where they are installed.

Attributes are read from the instance ``__dict__``, never through properties:
``ChainedOptimizer.optimizer`` raises ``AssertionError`` when it has several members.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain
from typing import TypeGuard, cast

import torch
from attrs import evolve

from opttree import _paths
from opttree._dispatch import LazyDispatch, is_megatron_class
from opttree._errors import OptTreeError
from opttree._held import instance_attributes, own_attributes
from opttree._identity import by_identity, identity_key
from opttree._nodes import ChainedNode, HybridNode, LeafNode, Node, WrapperNode, leaves_in_bulk
from opttree._problems import MAX_DEPTH, Problem, ProblemKind, too_deep
from opttree._visitor import NodeVisitor
from opttree._fields import article, kind_of

_CHILDREN = operator.attrgetter("children")

ChildrenFn = Callable[[object], Iterable[tuple[str, object]]]
"""A wrapper's children as ``(label, child)`` pairs, in stepping order."""


def refusal(kind: ProblemKind, obj: object, path: str, message: str) -> OptTreeError:
    """The error for an object the adapter cannot build a node for."""
    return Problem(kind, path, type(obj).__qualname__, message).to_error()


def too_deep_in(root: Node) -> list[Problem]:
    """The nodes of a tree built by hand that nest deeper than a built tree may, as
    problems: found level by level, with no recursion and no visit below the limit."""
    level = [root]
    for _ in range(MAX_DEPTH):
        level = list(chain.from_iterable(map(_CHILDREN, level)))
    return [too_deep(node.optimizer, node.path) for node in level if node.children]


def unlike_built(given: Node, built: Node) -> Problem | None:
    """Where a tree built by hand differs from the tree the adapter builds for its root's
    optimizer at its root's path, as a problem; None where they are alike. A hand-built
    node that stands for a leaf shared elsewhere, or a wrapper without the children it
    holds, would make a reset pass state over in silence. Compared level by level, by
    identity, within the depth :func:`too_deep_in` allows."""
    pairs = [(given, built)]
    while pairs:
        mine, theirs = pairs.pop()
        difference = _difference(mine, theirs)
        if difference is not None:
            message = (
                f"{difference}: a tree passed in must be the one opttree.tree(optimizer) builds, "
                "or a reset could pass state over"
            )
            return Problem(ProblemKind.FOREIGN_TREE, mine.path, type(mine.optimizer).__qualname__, message)
        pairs.extend(reversed(list(zip(mine.children, theirs.children))))
    return None


def _difference(mine: Node, theirs: Node) -> str | None:
    if type(mine) is not type(theirs):
        return f"{article(type(mine).__name__)} where opttree builds {article(type(theirs).__name__)}"
    if mine.path != theirs.path:
        return f"a node at {mine.path!r} where opttree builds one at {theirs.path!r}"
    if mine.optimizer is not theirs.optimizer:
        return f"a node for another {type(mine.optimizer).__qualname__} than the one opttree finds there"
    if len(mine.children) != len(theirs.children):
        return f"{len(mine.children)} children where opttree builds {len(theirs.children)}"
    if not _same_under(mine.under, theirs.under):
        where = "under no Megatron wrapper" if theirs.under is None else f"under the {type(theirs.under[1]).__qualname__} at {theirs.under[0]!r}"
        return f"a record of the wrapper above it (under) other than opttree's: it is {where}"
    if isinstance(mine, LeafNode) and isinstance(theirs, LeafNode) and mine.shared_with != theirs.shared_with:
        return f"shared with {mine.shared_with!r} where opttree finds it shared with {theirs.shared_with!r}"
    if isinstance(mine, HybridNode) and isinstance(theirs, HybridNode) and (mine.gpu is None) != (theirs.gpu is None):
        return "a GPU sub-optimizer where opttree builds none" if theirs.gpu is None else "no GPU sub-optimizer where opttree builds one"
    return None


def _same_under(mine: tuple[str, object] | None, theirs: tuple[str, object] | None) -> bool:
    if mine is None or theirs is None:
        return mine is theirs
    return mine[0] == theirs[0] and mine[1] is theirs[1]


def node_at(root: Node, path: str) -> Node | None:
    """The node at ``path`` in a built tree, or None: found level by level."""
    level = [root]
    for _ in range(MAX_DEPTH + 1):
        found = next((node for node in level if node.path == path), None)
        if found is not None or not level:
            return found
        level = list(chain.from_iterable(map(_CHILDREN, level)))
    return None


class Truncated(NodeVisitor[Node]):
    """A copy of a tree built by hand in which each node nested :data:`MAX_DEPTH` deep
    stands without children, as a lenient :class:`TreeBuilder` leaves a wrapper it refuses."""

    def _copies(self, nodes: tuple[Node, ...]) -> tuple[Node, ...]:
        with self._below():
            return tuple(node.accept(self) for node in nodes)

    def _cut(self, node: Node) -> WrapperNode | None:
        return None if self._too_deep(node) is None else WrapperNode(node.path, node.optimizer, ())

    def visit_chained(self, node: ChainedNode) -> Node:
        return self._cut(node) or evolve(node, members=self._copies(node.members))

    def visit_hybrid(self, node: HybridNode) -> Node:
        cut = self._cut(node)
        if cut is not None:
            return cut
        below = self._copies(node.children)
        return evolve(node, cpu=below[: len(node.cpu)], gpu=None if node.gpu is None else below[-1])

    def visit_wrapper(self, node: WrapperNode) -> Node:
        return self._cut(node) or evolve(node, inner=self._copies(node.inner))

    def visit_leaf(self, node: LeafNode) -> Node:
        return node


class TreeBuilder:
    """One build: tracks the wrappers on the current path (cycles) and leaves seen (sharing).

    With a ``problems`` list the build is lenient, for ``validate`` and ``describe``: an
    object the adapter refuses is recorded there and stands in the tree as a wrapper
    without children, so the rest of the tree is still built and checked.
    """

    def __init__(self, kind_of: Callable[[type], Expander | None], problems: list[Problem] | None = None) -> None:
        self._kind_of = kind_of
        self._problems = problems
        self._on_path: set[int] = set()
        self._under: tuple[str, object] | None = None
        """The outermost Megatron wrapper on the current path, as nodes record it."""
        self._leaves: dict[object, str] = {}  # by identity_key
        self._kinds: dict[type, Expander | None] = {}

    def kind(self, cls: type) -> Expander | None:
        if cls in self._kinds:
            return self._kinds[cls]
        expand = self._kinds[cls] = self._kind_of(cls)
        return expand

    def build(self, obj: object, path: str) -> Node:
        expand = self.kind(type(obj))
        if expand is expand_leaf:
            # A leaf contains nothing, so it cannot close a cycle: no path bookkeeping.
            return self.leaf(cast(torch.optim.Optimizer, obj), path)
        try:
            return self.expand(expand, obj, path)
        except OptTreeError as error:
            if self._problems is None or error.problem is None or error.problem.path != path:
                raise
            self._problems.append(error.problem)
            return WrapperNode(path, obj, ())

    def expand(self, expand: Expander | None, obj: object, path: str) -> Node:
        if expand is None:
            raise refusal(
                ProblemKind.NOT_AN_OPTIMIZER,
                obj,
                path,
                "not an optimizer: expected a torch.optim.Optimizer, a Megatron optimizer or a registered wrapper",
            )
        if len(self._on_path) >= MAX_DEPTH:
            raise too_deep(obj, path).to_error()
        key = id(obj)
        if key in self._on_path:
            raise refusal(ProblemKind.OPTIMIZER_CYCLE, obj, path, "contains itself")
        self._on_path.add(key)
        outer = self._under
        if outer is None and is_megatron_class(type(obj)):
            self._under = (path, obj)
        try:
            node = expand(self, obj, path)
        finally:
            self._on_path.discard(key)
            self._under = outer
        return node if outer is None else evolve(node, under=outer)

    def members(self, parent: str, name: str, objects: list[object]) -> Sequence[Node]:
        """The nodes of a sequence attribute's members.

        Members that are all leaves met for the first time, such as HybridDeviceOptimizer's
        one optimizer per parameter, are built in one batch, at C speed.
        """
        paths = _paths.items(_paths.child(parent, name), len(objects))
        if self.fresh_leaves(objects):
            leaves = cast(list[torch.optim.Optimizer], objects)
            self._leaves.update(zip(leaves, paths, strict=True))
            return leaves_in_bulk(paths, leaves, self._under)
        return [self.build(obj, path) for obj, path in zip(objects, paths, strict=True)]

    def fresh_leaves(self, objects: list[object]) -> bool:
        """Whether ``objects`` are all of leaf kinds that are keys of their own (see
        :mod:`opttree._identity`), each met for the first time."""
        if any(self.kind(cls) is not expand_leaf or not by_identity(cls) for cls in set(map(type, objects))):
            return False
        distinct = set(objects)
        return len(distinct) == len(objects) and self._leaves.keys().isdisjoint(distinct)

    def leaf(self, optimizer: torch.optim.Optimizer, path: str) -> LeafNode:
        first = self._leaves.setdefault(identity_key(optimizer), path)
        return LeafNode(path, optimizer, None if first == path else first, under=self._under)


Expander = Callable[[TreeBuilder, object, str], Node]


def instance_attribute(obj: object, name: str, path: str, owner: object = None) -> object:
    """``obj.name`` read from the instance dict, bypassing properties. A missing one is a
    malformed wrapper: ``owner`` (default ``obj``), the wrapper at ``path``."""
    attributes = own_attributes(obj)
    if name not in attributes:
        what = type(obj).__qualname__
        raise refusal(ProblemKind.MALFORMED_WRAPPER, obj if owner is None else owner, path, f"{what} has no attribute {name!r}")
    return attributes[name]


def sequence_attribute(obj: object, name: str, path: str) -> list[object]:
    value = instance_attribute(obj, name, path)
    if not isinstance(value, (list, tuple)):
        message = f"{name} is {kind_of(value)}, expected a list"
        raise refusal(ProblemKind.MALFORMED_WRAPPER, obj, path, message)
    return list(value)


def mapping_attribute(obj: object, name: str, path: str) -> dict[object, object]:
    value = instance_attribute(obj, name, path)
    if not isinstance(value, dict):
        message = f"{name} is {kind_of(value)}, expected a dict"
        raise refusal(ProblemKind.MALFORMED_WRAPPER, obj, path, message)
    return value


def expand_leaf(builder: TreeBuilder, obj: object, path: str) -> Node:
    return builder.leaf(cast(torch.optim.Optimizer, obj), path)  # registered for Optimizer


def expand_chained(builder: TreeBuilder, obj: object, path: str) -> Node:
    members = sequence_attribute(obj, "chained_optimizers", path)
    return ChainedNode(path, obj, tuple(builder.members(path, "chained", members)))


def expand_megatron_wrapper(builder: TreeBuilder, obj: object, path: str) -> Node:
    inner = instance_attribute(obj, "optimizer", path)
    if inner is None:
        return WrapperNode(path, obj, ())
    return WrapperNode(path, obj, (builder.build(inner, _paths.child(path, "optimizer")),))


def expand_mimo(builder: TreeBuilder, obj: object, path: str) -> Node:
    """megatron-core's ``MimoOptimizer`` keeps ``optimizer = None`` and one Megatron
    optimizer per module in ``module_infos[name].optimizer`` (``None`` where this rank
    has no part of the module)."""
    infos = mapping_attribute(obj, "module_infos", path)
    inner: list[Node] = []
    for name, info in infos.items():
        label = _paths.key(_paths.child(path, "module_infos"), name)
        optimizer = instance_attribute(info, "optimizer", path, owner=obj)
        if optimizer is not None:
            inner.append(builder.build(optimizer, _paths.child(label, "optimizer")))
    return WrapperNode(path, obj, tuple(inner))


def expand_unknown_megatron(builder: TreeBuilder, obj: object, path: str) -> Node:
    """A ``MegatronOptimizer`` subclass of no known kind: where it keeps its optimizers is
    not known, so it is refused rather than guessed to be an ``.optimizer`` wrapper."""
    cls = type(obj)
    raise refusal(
        ProblemKind.UNKNOWN_WRAPPER,
        obj,
        path,
        f"{cls.__module__}.{cls.__qualname__} is a MegatronOptimizer of no known kind: "
        "register it with opttree.register_wrapper(cls, children=...) to say where its optimizers are",
    )


def refusing_kind(reason: str) -> Expander:
    """The kind of a class whose objects are refused as wrappers of no known kind, for ``reason``."""

    def expand_refused(builder: TreeBuilder, obj: object, path: str) -> Node:
        raise refusal(ProblemKind.UNKNOWN_WRAPPER, obj, path, reason)

    return expand_refused


def expand_hybrid(builder: TreeBuilder, obj: object, path: str) -> Node:
    hybrid = cast(torch.optim.Optimizer, obj)  # HybridDeviceOptimizer subclasses it
    cpu = sequence_attribute(obj, "cpu_optimizers", path)
    gpu = instance_attribute(obj, "gpu_optimizer", path)
    subs = [*cpu, gpu] if gpu is not None else cpu
    nodes = builder.members(path, "sub_optimizers", subs)
    if gpu is None:
        return HybridNode(path, hybrid, tuple(nodes), None)
    return HybridNode(path, hybrid, tuple(nodes[:-1]), nodes[-1])


def function_failed(function: str, wrapper: object, path: str, error: Exception) -> OptTreeError:
    """The refusal of a wrapper whose user-registered ``function`` raised ``error``."""
    message = f"its {function} function failed: {type(error).__name__}: {error}"
    return refusal(ProblemKind.MALFORMED_WRAPPER, wrapper, path, message)


def yielded_wrongly(function: str, wrapper: object, path: str, item: object, expected: str) -> OptTreeError:
    """The refusal of a wrapper whose user-registered ``function`` yielded ``item``, which
    is not what it should yield: ``expected``."""
    message = f"its {function} function yielded {yielded_text(item)}, expected {expected}"
    return refusal(ProblemKind.MALFORMED_WRAPPER, wrapper, path, message)


def yielded_text(item: object) -> str:
    """What a registered function yielded, in a few words: its type, and a tuple's length."""
    if isinstance(item, tuple) and len(item) != 2:
        return f"a tuple of {len(item)}"
    if isinstance(item, tuple):
        return f"a pair of {kind_of(item[0])} and {kind_of(item[1])}"
    return kind_of(item)


def is_pair(item: object) -> TypeGuard[tuple[object, object]]:
    return isinstance(item, tuple) and len(item) == 2


def labelled(pairs: list[object], wrapper: object, path: str) -> list[tuple[str, object]]:
    """A children function's output, each item checked to be a ``(label, inner)`` pair,
    each label given once: two children at one path would be one node to every check."""
    for item in pairs:
        if not is_pair(item) or not isinstance(item[0], str):
            raise yielded_wrongly("children", wrapper, path, item, "(label, inner) pairs with a str label")
    # each label as the plain str it holds: a str subclass's own __hash__ or __eq__ runs no code of its own here
    checked = [(str.__str__(label), inner) for label, inner in cast(list[tuple[str, object]], pairs)]
    labels = [label for label, _ in checked]
    if len(set(labels)) < len(labels):
        twice = next(label for label in labels if labels.count(label) > 1)
        message = f"its children function gave the label {twice!r} to more than one child: give each its own label"
        raise refusal(ProblemKind.MALFORMED_WRAPPER, wrapper, path, message)
    pathless = next((label for label in labels if label == _paths.ROOT or "" in label.split(".")), None)
    if pathless is not None:
        message = (
            f"its children function gave a child the label {pathless!r}, which names no path below it (empty, the "
            "root's, or with nothing between dots): give each a label of its own"
        )
        raise refusal(ProblemKind.MALFORMED_WRAPPER, wrapper, path, message)
    return checked


def _label_below_a_parent(children: list[tuple[str, Node]]) -> str | None:
    """Why two children's labels could give two nodes one path, or None: a label may itself
    be a path (``optimizers[0]``, or a submodule's name, ``encoder.attn`` beside a leaf
    ``encoder``), but not one below a sibling that holds nodes of its own (``a`` and ``a.b``,
    where a child ``b`` of ``a`` is ``a.b`` too)."""
    parents = {label for label, node in children if node.children}
    for label, _ in children:
        for cut, char in enumerate(label):
            if char in ".[" and label[:cut] in parents:
                return (
                    f"its children function gave the labels {label[:cut]!r} and {label!r}: the second's path lies below the "
                    "first's, whose nodes could have it too; give each a label of its own"
                )
    return None


def _kept_iterator(wrapper: object, given: object) -> bool:
    """Whether ``given`` is an iterator that ``wrapper`` holds in an instance attribute (in
    its ``__dict__`` or its slots), which one build uses up (a fresh generator each call is
    not held)."""
    if not isinstance(given, Iterator):
        return False
    return any(value is given for _, value in instance_attributes(wrapper))


def _called_children(children: ChildrenFn, wrapper: object, path: str) -> list[object]:
    """What ``children`` gives for ``wrapper``, at ``path``. Whatever it raises is this
    wrapper's malformed-wrapper problem, an ``OptTreeError`` too: one from a nested opttree
    call names that call's object and path, which are not in this tree."""
    try:
        given = children(wrapper)
        kept = _kept_iterator(wrapper, given)
        pairs: list[object] = [] if kept else list(given)
    except Exception as error:
        raise function_failed("children", wrapper, path, error) from error
    if kept:
        message = (
            "the children function returned an iterator the wrapper keeps: the first build uses it up, and "
            "every later one would find no children and reset none; return a new iterable each call"
        )
        raise refusal(ProblemKind.MALFORMED_WRAPPER, wrapper, path, message)
    return pairs


def children_expander(children: ChildrenFn) -> Expander:
    """An expander for a user-registered wrapper kind, guarding its children function."""

    def expand(builder: TreeBuilder, obj: object, path: str) -> Node:
        pairs = _called_children(children, obj, path)
        built = [(label, builder.build(child, _paths.child(path, label))) for label, child in labelled(pairs, obj, path)]
        nested = _label_below_a_parent(built)
        if nested is not None:
            raise refusal(ProblemKind.MALFORMED_WRAPPER, obj, path, nested)
        return WrapperNode(path, obj, tuple(node for _, node in built))

    return expand


_MEGATRON = "megatron.core.optimizer."
MEGATRON_KINDS: dict[str, Expander] = {
    _MEGATRON + "optimizer.MegatronOptimizer": expand_unknown_megatron,
    _MEGATRON + "optimizer.FP32Optimizer": expand_megatron_wrapper,
    _MEGATRON + "optimizer.Float16OptimizerWithFloat16Params": expand_megatron_wrapper,
    _MEGATRON + "distrib_optimizer.DistributedOptimizer": expand_megatron_wrapper,
    _MEGATRON + "optimizer.ChainedOptimizer": expand_chained,
    _MEGATRON + "layer_wise_optimizer.LayerWiseDistributedOptimizer": expand_chained,
    _MEGATRON + "cpu_offloading.hybrid_optimizer.HybridDeviceOptimizer": expand_hybrid,
    "megatron.core.models.mimo.optimizer.MimoOptimizer": expand_mimo,
}
"""Megatron's wrapper kinds by dotted path. Any other ``MegatronOptimizer`` is refused."""


def builtin_kinds() -> LazyDispatch[Expander]:
    table: LazyDispatch[Expander] = LazyDispatch()
    table.register(torch.optim.Optimizer, expand_leaf)
    for dotted, expand in MEGATRON_KINDS.items():
        table.register_lazy(dotted, expand)
    return table
