"""The adapter: a live optimizer stack in, a typed node tree out.

Wrapper kinds are looked up by class through a :class:`LazyDispatch`; Megatron's classes
are registered by dotted path, because importing ``megatron.core.optimizer`` imports
TransformerEngine, apex and ``emerging_optimizers`` where they are installed.

Attributes are read from the instance ``__dict__``, never through properties:
``ChainedOptimizer.optimizer`` raises ``AssertionError`` when it has several members.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch

from opttree import _paths
from opttree._dispatch import LazyDispatch
from opttree._errors import MalformedWrapper, NotAnOptimizer, OptimizerCycle, OptTreeError
from opttree._identity import by_identity, identity_key
from opttree._nodes import ChainedNode, HybridNode, LeafNode, Node, WrapperNode

MAX_DEPTH = 64
"""Deeper stacks are refused: no real optimizer nests this far, and a clear error beats
a ``RecursionError`` from a pathological one."""

ChildrenFn = Callable[[object], Iterable[tuple[str, object]]]
"""A wrapper's children as ``(label, child)`` pairs, in stepping order."""


class TreeBuilder:
    """One build: tracks the wrappers on the current path (cycles) and leaves seen (sharing)."""

    def __init__(self, kind_of: Callable[[type], Expander | None]) -> None:
        self._kind_of = kind_of
        self._on_path: set[int] = set()
        self._leaves: dict[object, str] = {}  # by identity_key
        self._kinds: dict[type, Expander | None] = {}

    def kind(self, cls: type) -> Expander | None:
        if cls in self._kinds:
            return self._kinds[cls]
        expand = self._kinds[cls] = self._kind_of(cls)
        return expand

    def build(self, obj: object, path: str) -> Node:
        if len(self._on_path) >= MAX_DEPTH:
            msg = f"optimizer stack at {_paths.display(path)} is nested deeper than {MAX_DEPTH}"
            raise OptTreeError(msg)
        expand = self.kind(type(obj))
        if expand is expand_leaf:
            # A leaf contains nothing, so it cannot close a cycle: no path bookkeeping.
            return self.leaf(cast(torch.optim.Optimizer, obj), path)
        if expand is None:
            msg = (
                f"{type(obj).__qualname__} at {_paths.display(path)} is not an optimizer: "
                "expected a torch.optim.Optimizer, a Megatron optimizer or a registered wrapper"
            )
            raise NotAnOptimizer(msg)
        key = id(obj)
        if key in self._on_path:
            msg = f"{type(obj).__qualname__} at {_paths.display(path)} contains itself"
            raise OptimizerCycle(msg)
        self._on_path.add(key)
        try:
            return expand(self, obj, path)
        finally:
            self._on_path.discard(key)

    def members(self, parent: str, name: str, objects: list[object]) -> list[Node]:
        """The nodes of a sequence attribute's members.

        Members that are all leaves met for the first time, such as HybridDeviceOptimizer's
        one optimizer per parameter, are built in one batch, at C speed but for the nodes.
        """
        paths = _paths.items(_paths.child(parent, name), len(objects))
        if self.fresh_leaves(objects):
            leaves = cast(list[torch.optim.Optimizer], objects)
            self._leaves.update(zip(leaves, paths, strict=True))
            return list(map(LeafNode, paths, leaves))
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
        return LeafNode(path, optimizer, None if first == path else first)


Expander = Callable[[TreeBuilder, object, str], Node]


def instance_attribute(obj: object, name: str, path: str) -> object:
    """``obj.name`` read from the instance dict, bypassing properties."""
    attributes = getattr(obj, "__dict__", {})
    if name not in attributes:
        msg = f"{type(obj).__qualname__} at {_paths.display(path)} has no attribute {name!r}"
        raise MalformedWrapper(msg)
    return attributes[name]


def sequence_attribute(obj: object, name: str, path: str) -> list[object]:
    value = instance_attribute(obj, name, path)
    if not isinstance(value, (list, tuple)):
        msg = (
            f"{type(obj).__qualname__}.{name} at {_paths.display(path)} is a "
            f"{type(value).__qualname__}, expected a list"
        )
        raise MalformedWrapper(msg)
    return list(value)


def mapping_attribute(obj: object, name: str, path: str) -> dict[torch.Tensor, torch.Tensor]:
    value = instance_attribute(obj, name, path)
    if not isinstance(value, dict):
        msg = (
            f"{type(obj).__qualname__}.{name} at {_paths.display(path)} is a "
            f"{type(value).__qualname__}, expected a dict"
        )
        raise MalformedWrapper(msg)
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


def expand_hybrid(builder: TreeBuilder, obj: object, path: str) -> Node:
    hybrid = cast(torch.optim.Optimizer, obj)  # HybridDeviceOptimizer subclasses it
    cpu = sequence_attribute(obj, "cpu_optimizers", path)
    gpu = instance_attribute(obj, "gpu_optimizer", path)
    subs = [*cpu, gpu] if gpu is not None else cpu
    nodes = builder.members(path, "sub_optimizers", subs)
    if gpu is None:
        return HybridNode(path, hybrid, tuple(nodes), None)
    return HybridNode(path, hybrid, tuple(nodes[:-1]), nodes[-1])


def children_expander(children: ChildrenFn) -> Expander:
    """An expander for a user-registered wrapper kind, guarding its children function."""

    def expand(builder: TreeBuilder, obj: object, path: str) -> Node:
        try:
            pairs = list(children(obj))
        except OptTreeError:
            raise
        except Exception as error:
            msg = (
                f"children function for {type(obj).__qualname__} at {_paths.display(path)} "
                f"failed: {type(error).__name__}: {error}"
            )
            raise MalformedWrapper(msg) from error
        return WrapperNode(
            path, obj, tuple(builder.build(child, _paths.child(path, label)) for label, child in pairs)
        )

    return expand


def builtin_kinds() -> LazyDispatch[Expander]:
    table: LazyDispatch[Expander] = LazyDispatch()
    table.register(torch.optim.Optimizer, expand_leaf)
    table.register_lazy("megatron.core.optimizer.optimizer.MegatronOptimizer", expand_megatron_wrapper)
    table.register_lazy("megatron.core.optimizer.optimizer.ChainedOptimizer", expand_chained)
    table.register_lazy(
        "megatron.core.optimizer.cpu_offloading.hybrid_optimizer.HybridDeviceOptimizer",
        expand_hybrid,
    )
    return table
