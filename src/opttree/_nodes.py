"""The typed tree: one frozen attrs node per optimizer object in a wrapper stack.

Nodes are plain values, compared and hashed without recursion. They are built from a live optimizer by :func:`opttree.tree`
and walked by visitors (:mod:`opttree._visitor`); each knows its path from the root
and the live object it stands for, and never mutates it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice, repeat
from typing import TYPE_CHECKING, TypeGuard, TypeVar, cast

import torch
from attrs import Attribute, field, fields, frozen

from opttree._dispatch import is_megatron_class
from opttree._errors import OptTreeError
from opttree._fields import kind_of, of

if TYPE_CHECKING:
    from opttree._visitor import NodeVisitor

T = TypeVar("T")


def _visit(visitor: NodeVisitor[T], name: str) -> Callable[[Node], T]:
    """``visitor``'s method ``name`` (``visit_leaf``, ...): ``accept(None)``, a visitor class, or an object
    without that method, callable, raised Python's own AttributeError or TypeError
    from inside the walk."""
    method = None if isinstance(visitor, type) else getattr(visitor, name, None)
    if not callable(method):
        given = f"the class {visitor.__qualname__}" if isinstance(visitor, type) else kind_of(visitor)
        msg = f"accept takes a NodeVisitor instance (opttree.DescribeVisitor(), a TraverserVisitor subclass's), whose {name} it calls; got {given}"
        raise OptTreeError(msg)
    return cast(Callable[[Node], T], method)

_CHILD_FIELDS = frozenset({"members", "cpu", "gpu", "inner"})
"""The fields of the node kinds that hold child nodes."""


def _held_count(value: object) -> int:
    """How many nodes a child field holds: a tuple's length, or one node or none."""
    return len(value) if isinstance(value, tuple) else int(value is not None)


def _nodes(node: object, attribute: Attribute[object], value: object) -> None:
    """A tree built by hand holds nodes where a built one does: refused where it is made,
    not met as an AttributeError wherever it is walked."""
    if not isinstance(value, tuple) or not all(map(isinstance, value, repeat(Node))):
        msg = f"{type(node).__name__}.{attribute.name} must be a tuple of nodes, got {kind_of(value)}{_holding(value)}"
        raise OptTreeError(msg)


def _holding(value: object) -> str:
    """What a tuple that should hold nodes holds instead (its values' own reprs may raise)."""
    if not isinstance(value, tuple):
        return ""
    wrong = next((item for item in value if not isinstance(item, Node)), None)
    return f" holding {kind_of(wrong)}"


def _under(node: object, attribute: Attribute[tuple[str, object] | None], value: tuple[str, object] | None) -> None:
    """``under`` is None or what :func:`opttree.tree` records: the path and object of a
    Megatron wrapper."""
    given: object = value
    if given is None:
        return
    if isinstance(given, tuple) and len(given) == 2 and isinstance(given[0], str) and is_megatron_class(type(given[1])):
        return
    found = f"a pair of {kind_of(given[0])} and {kind_of(given[1])}" if isinstance(given, tuple) and len(given) == 2 else kind_of(given)
    msg = f"{type(node).__name__}.under must be None or the (path, Megatron wrapper) pair opttree.tree records, got {found}"
    raise OptTreeError(msg)


@frozen(repr=False, eq=False)
class Node(ABC):
    """Base of the four node kinds. Its repr names the class of the object it stands for
    and its path, as ``describe`` does: ``LeafNode(AdamW @ chained[0].optimizer)``."""

    path: str = field(validator=of(str))
    under: tuple[str, object] | None = field(default=None, kw_only=True, repr=False, validator=_under)
    """The path and object of the outermost Megatron wrapper above this node, where
    :func:`opttree.tree` built it under one: Megatron checkpoints such a wrapper's state
    whole, so a reset of this node alone is checked against it."""

    def __repr__(self) -> str:
        children = f", {len(self.children)} children" if self.children else ""
        return f"{type(self).__name__}({type(self.optimizer).__qualname__} @ {self.path}{children})"

    def __eq__(self, other: object) -> bool:
        """Trees are equal where their nodes are, kind, fields and children alike, compared
        level by level: a tree nested deeper than Python recurses compares too."""
        if not isinstance(other, Node):
            return NotImplemented
        pairs: list[tuple[Node, Node]] = [(self, other)]
        while pairs:
            mine, theirs = pairs.pop()
            if mine is theirs:
                continue
            if type(mine) is not type(theirs) or mine._own_fields() != theirs._own_fields():
                return False
            pairs.extend(zip(mine.children, theirs.children))
        return True

    def __hash__(self) -> int:
        """Of the node's kind and path, which equal trees share; no walk below it."""
        return hash((type(self), self.path))

    def _own_fields(self) -> tuple[object, ...]:
        """The node's fields, with each that holds nodes given as how many it holds."""
        return tuple(
            _held_count(value) if name in _CHILD_FIELDS else value
            for name, value in ((attribute.name, getattr(self, attribute.name)) for attribute in fields(type(self)))
        )

    @property
    @abstractmethod
    def optimizer(self) -> object:
        """The live object this node stands for."""

    @property
    @abstractmethod
    def children(self) -> tuple[Node, ...]:
        """The child nodes, in the order the wrapper steps them."""

    @abstractmethod
    def accept(self, visitor: NodeVisitor[T]) -> T:
        """Call the ``visit_*`` method of ``visitor`` that matches this node's kind."""


@frozen(repr=False, eq=False)
class ChainedNode(Node):
    """A ``ChainedOptimizer`` (or ``LayerWiseDistributedOptimizer``): members stepped in turn."""

    optimizer: object = field(repr=False)
    members: tuple[Node, ...] = field(validator=_nodes)

    @property
    def children(self) -> tuple[Node, ...]:
        """The child nodes, in the order the wrapper steps them."""
        return self.members

    def accept(self, visitor: NodeVisitor[T]) -> T:
        """Call the ``visit_*`` method of ``visitor`` that matches this node's kind."""
        return _visit(visitor, "visit_chained")(self)


@frozen(repr=False, eq=False)
class HybridNode(Node):
    """A ``HybridDeviceOptimizer``: CPU sub-optimizers and at most one GPU sub-optimizer.

    Its own ``state`` only mirrors the sub-optimizers' state dicts, so all state is
    reached through the children.
    """

    optimizer: torch.optim.Optimizer = field(repr=False)
    cpu: tuple[Node, ...] = field(validator=_nodes)
    gpu: Node | None = field(validator=of(Node, optional=True, what="a node"))

    @property
    def children(self) -> tuple[Node, ...]:
        """The child nodes, in the order the wrapper steps them."""
        return self.cpu if self.gpu is None else (*self.cpu, self.gpu)

    def accept(self, visitor: NodeVisitor[T]) -> T:
        """Call the ``visit_*`` method of ``visitor`` that matches this node's kind."""
        return _visit(visitor, "visit_hybrid")(self)


@frozen(repr=False, eq=False)
class WrapperNode(Node):
    """A wrapper that holds inner optimizers, such as Megatron's ``.optimizer`` wrappers.

    A Megatron stub optimizer (``optimizer is None``, on a rank without parameters)
    is a wrapper with no children.
    """

    optimizer: object = field(repr=False)
    inner: tuple[Node, ...] = field(validator=_nodes)

    @property
    def children(self) -> tuple[Node, ...]:
        """The child nodes, in the order the wrapper steps them."""
        return self.inner

    @property
    def is_stub(self) -> bool:
        """Whether this is a Megatron stub optimizer, with no optimizer on this rank: a
        Megatron wrapper whose ``optimizer`` is None (one of a user's kind holding none is
        not one, nor one whose registered kind finds nothing where it holds an optimizer)."""
        if self.inner or not is_megatron_class(type(self.optimizer)):
            return False
        try:
            return getattr(self.optimizer, "optimizer", False) is None
        except Exception:  # noqa: BLE001  # a ChainedOptimizer's optimizer property reads its members, which may be anything
            return False

    def accept(self, visitor: NodeVisitor[T]) -> T:
        """Call the ``visit_*`` method of ``visitor`` that matches this node's kind."""
        return _visit(visitor, "visit_wrapper")(self)


@frozen(repr=False, eq=False)
class LeafNode(Node):
    """A ``torch.optim.Optimizer`` that holds state.

    ``shared_with`` is the path where the same optimizer object was first reached; such
    a leaf is described but never reset twice.
    """

    optimizer: torch.optim.Optimizer = field(repr=False, validator=of(torch.optim.Optimizer, what="a torch.optim.Optimizer"))
    shared_with: str | None = None

    @property
    def children(self) -> tuple[Node, ...]:
        """The child nodes, in the order the wrapper steps them."""
        return ()

    def accept(self, visitor: NodeVisitor[T]) -> T:
        """Call the ``visit_*`` method of ``visitor`` that matches this node's kind."""
        return _visit(visitor, "visit_leaf")(self)


_LEAF_FIELDS = tuple(attribute.name for attribute in fields(LeafNode))


def leaves_in_bulk(paths: Sequence[str], optimizers: Sequence[torch.optim.Optimizer], under: tuple[str, object] | None) -> list[LeafNode]:
    """``LeafNode(path, optimizer, under=under)`` for each pair, the fields' checks run
    over the lists at once and the slots filled at C speed: attrs' ``__init__`` and its
    validators, called once per leaf, cost most of a HybridDeviceOptimizer's tree (one
    leaf per parameter). Where a check fails, the leaves are made one by one, so that
    the failing field's validator names it."""
    if not paths:
        return []
    first = LeafNode(paths[0], optimizers[0], under=under)  # checks ``under`` once for all
    if not all(map(isinstance, paths, repeat(str))) or not all(map(isinstance, optimizers, repeat(torch.optim.Optimizer))):
        return [first, *(LeafNode(path, optimizer, under=under) for path, optimizer in zip(paths[1:], optimizers[1:], strict=True))]
    nodes = [first, *map(object.__new__, repeat(LeafNode, len(paths) - 1))]
    values: dict[str, Iterable[object]] = {"path": paths, "under": repeat(under), "optimizer": optimizers, "shared_with": repeat(None)}
    for name in _LEAF_FIELDS:
        slot = getattr(LeafNode, name)  # the slot's member descriptor, which a frozen class's __setattr__ does not guard
        deque(map(slot.__set__, islice(nodes, 1, None), islice(values[name], 1, None)), maxlen=0)
    return nodes


def is_node(value: object) -> TypeGuard[Node]:
    """:func:`~opttree._fields.is_a` for the abstract :class:`Node`."""
    return issubclass(type(value), Node)


def tree_nodes(root: Node) -> Iterator[Node]:
    """``root`` and every node below it, in tree order (each before its children, children
    in order), without recursion (a tree built by hand may nest deeper than Python recurses)."""
    pending = [root]
    while pending:
        node = pending.pop()
        pending.extend(reversed(node.children))
        yield node
