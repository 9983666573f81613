"""Megatron's sharded checkpoints at step 0, saved and loaded without patching Megatron.

megatron-core (0.16.1 and 0.19.2 measured) writes the step that ``FP32Optimizer`` and
``Float16OptimizerWithFloat16Params`` share across their parameters into
``sharded_state_dict`` only ``if step:``. Right after a reset every step is 0, so the
checkpoint holds none, and Megatron's own ``load_state_dict`` hands torch's Adam entries
without ``step``: torch raises ``KeyError: 'step'``. (A fresh optimizer, which has no
state yet, cannot be checkpointed this way at all: Megatron's load asks for history the
checkpoint does not hold.)

:func:`sharded_state_dict` returns Megatron's own sharded state dict with that zero step
put back, under ``common_step``, the key Megatron's load reads, so the checkpoint loads
with Megatron's own code. :func:`load_state_dict` loads a checkpoint that Megatron itself
saved at step 0: Megatron writes the step whenever it is not 0, so history without one
was saved at step 0, and the step given back is 0, of the type the leaf's optimizer
starts it as (a float tensor for torch's, an int for LaProp's: see ``StateSchema.step_type``).

``DistributedOptimizer`` writes its step into the param groups whatever its value, and
leaves that count steps per group (TE and apex ``FusedAdam``) keep them in the param
groups too: neither needs anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from opttree import _registry
from opttree._adapter import instance_attribute, mapping_attribute
from opttree._api import tree
from opttree._dispatch import LazyDispatch
from opttree._nodes import LeafNode, Node
from opttree._problems import Problem, ProblemKind
from opttree._schema import StepLocation, StepType

STEP_KEY = "common_step"
"""Where Megatron's ``sharded_state_dict`` puts the step its parameters share."""

StateDicts = Iterator[tuple[LeafNode, dict[object, object]]]
Locate = Callable[[Node, object], StateDicts]
"""A wrapper kind's layout: from its node and its part of a (sharded) state dict, each
leaf that counts steps per parameter with the torch-format state dict Megatron holds for it."""


def _layout_error(node: Node, key: object, message: str) -> Problem:
    return Problem(ProblemKind.CHECKPOINT_LAYOUT, node.path, type(node.optimizer).__qualname__, message, str(key))


def _part(node: Node, state: object, key: object) -> object:
    """``state[key]``: a member's state dict from a dict, or, for a chain's in-memory
    ``state_dict()``, from the list it returns for several members."""
    if isinstance(state, list) and isinstance(key, int) and 0 <= key < len(state):
        return state[key]
    return _dict(node, state, key)[key]


def _dict(node: Node, state: object, key: object) -> dict[object, object]:
    """``state``, checked to be a dict holding ``key`` as Megatron writes it."""
    if not isinstance(state, dict) or key not in state:
        what = type(state).__qualname__
        raise _layout_error(node, key, f"its state dict ({what}) has no {key!r}, as Megatron writes it").to_error()
    return state


def _walk(node: Node, state: object) -> StateDicts:
    if isinstance(node, LeafNode):
        yield from ()
        return
    locate = _LAYOUTS.lookup(type(node.optimizer))
    if locate is not None:
        yield from locate(node, state)
    elif _counts_per_parameter(node):
        cls = type(node.optimizer)
        message = f"where {cls.__module__}.{cls.__qualname__} keeps its leaves' state in a state dict is not known"
        raise _layout_error(node, STEP_KEY, message).to_error()


def _counts_per_parameter(node: Node) -> bool:
    if isinstance(node, LeafNode):
        return _registry.step_location(type(node.optimizer)) is StepLocation.PER_PARAMETER
    return any(map(_counts_per_parameter, node.children))


def _torch_format(node: Node, state: object) -> StateDicts:
    """A wrapper whose state dict is its leaf's, in torch's format (``FP32Optimizer``)."""
    if not node.children:  # a stub on a rank without parameters
        return
    (inner,) = node.children
    if isinstance(inner, LeafNode) and _counts_per_parameter(inner):
        yield inner, _dict(node, state, "state")
    else:
        yield from _walk(inner, state)


def _float16(node: Node, state: object) -> StateDicts:
    """``Float16OptimizerWithFloat16Params``: its leaf's state dict under ``"optimizer"``."""
    if node.children:
        yield from _torch_format(node, _part(node, state, "optimizer"))


def _steps_in_groups(node: Node, state: object) -> StateDicts:
    """``DistributedOptimizer`` writes its step into the param groups, even a step of 0."""
    yield from ()


def _chained(node: Node, state: object) -> StateDicts:
    """``ChainedOptimizer``: a single member's state dict as it is, else one per index (a
    dict by index sharded, a list in memory), one for each member."""
    members = node.children
    if len(members) == 1:
        yield from _walk(members[0], state)
        return
    if isinstance(state, list) and len(state) != len(members):
        message = f"its state dict holds {len(state)} members' state dicts, and it has {len(members)} members"
        raise _layout_error(node, len(state), message).to_error()
    for index, member in enumerate(members):
        yield from _walk(member, _part(node, state, index))


def _mimo(node: Node, state: object) -> StateDicts:
    """``MimoOptimizer``: one state dict per active module, by module name."""
    infos = mapping_attribute(node.optimizer, "module_infos", node.path)
    held = [name for name, info in infos.items() if instance_attribute(info, "optimizer", node.path) is not None]
    for name, member in zip(held, node.children, strict=True):
        if getattr(infos[name], "is_active", True):
            yield from _walk(member, _part(node, state, name))


_MEGATRON = "megatron.core.optimizer."
_LAYOUTS: LazyDispatch[Locate] = LazyDispatch()
for _dotted, _locate in {
    _MEGATRON + "optimizer.FP32Optimizer": _torch_format,
    _MEGATRON + "optimizer.Float16OptimizerWithFloat16Params": _float16,
    _MEGATRON + "distrib_optimizer.DistributedOptimizer": _steps_in_groups,
    _MEGATRON + "optimizer.ChainedOptimizer": _chained,
    "megatron.core.models.mimo.optimizer.MimoOptimizer": _mimo,
}.items():
    _LAYOUTS.register_lazy(_dotted, _locate)


def _leaf_steps(leaf: LeafNode) -> list[object]:
    return [entry["step"] for entry in leaf.optimizer.state.values() if isinstance(entry, dict) and "step" in entry]


def _is_zero(step: object) -> bool:
    if isinstance(step, torch.Tensor):
        return step.numel() == 1 and not bool(step)
    return step == 0


def _has_steps(entries: dict[object, object]) -> bool:
    """Whether a torch-format ``state`` keeps its steps per entry, as ``state_dict()`` does."""
    return any(isinstance(entry, dict) and "step" in entry for entry in entries.values())


def _megatron_root(optimizer: object) -> Node:
    root = tree(optimizer)
    if isinstance(root, LeafNode) or not hasattr(optimizer, "sharded_state_dict"):
        problem = Problem(
            ProblemKind.CHECKPOINT_LAYOUT,
            root.path,
            type(optimizer).__qualname__,
            "not a Megatron optimizer: it has no sharded_state_dict",
        )
        raise problem.to_error()
    return root


def sharded_state_dict(
    optimizer: object,
    model_sharded_state_dict: dict[str, object],
    *,
    is_loading: bool = False,
    metadata: dict[str, object] | None = None,
) -> dict[str, object]:
    """Megatron's ``optimizer.sharded_state_dict(...)``, with the step put back where
    Megatron drops a step of 0 (right after a reset), so that the checkpoint loads.

    Raises :class:`~opttree.UnsupportedCheckpoint` for a stack whose state dict layout
    opttree does not know, where a leaf counts its steps per parameter.
    """
    root = _megatron_root(optimizer)
    sharded_state_dict_of = getattr(optimizer, "sharded_state_dict")
    state: dict[str, object] = sharded_state_dict_of(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)
    if is_loading:
        return state
    for leaf, leaf_state in _walk(root, state):
        entries = leaf_state["state"]
        steps = _leaf_steps(leaf)
        if isinstance(entries, dict) and STEP_KEY not in entries and steps and all(map(_is_zero, steps)):
            entries[STEP_KEY] = steps[0]  # as Megatron writes a step that is not 0
    return state


def load_state_dict(optimizer: object, state_dict: dict[str, object] | list[dict[str, object]]) -> None:
    """Megatron's ``optimizer.load_state_dict(state_dict)``, for a checkpoint that may have
    been saved by Megatron's own ``sharded_state_dict`` at step 0: each leaf state that
    holds history but no step is given the step 0 it was saved at."""
    root = _megatron_root(optimizer)
    for leaf, leaf_state in _walk(root, state_dict):
        entries = leaf_state["state"]
        if isinstance(entries, dict) and entries and STEP_KEY not in entries and not _has_steps(entries):
            entries[STEP_KEY] = _fresh_step(leaf)
    getattr(optimizer, "load_state_dict")(state_dict)


def _fresh_step(leaf: LeafNode) -> object:
    """A step of 0, as the leaf's optimizer creates its steps (its schema's ``step_type``)."""
    schema = _registry.schema_for(type(leaf.optimizer))
    if schema is not None and schema.step_type is StepType.INT:
        return 0
    return torch.tensor(0.0)  # torch's Adam starts from this; its load moves it
