"""Shards a Megatron wrapper steps in place, which must still be views of the model's weights.

A precision-aware ``DistributedOptimizer`` (``use_precision_aware_optimizer``, which CPU
offloading turns on) hands its inner optimizer the shards of the model's parameters
themselves, views of DDP's parameter buffer (``shard_float16_groups``, and
``shard_fp32_groups`` for fp32 ones), and copies nothing back after a step: the step
writes the weights through the views. Megatron's own ``offload_to_cpu()`` and
``restore_from_cpu()`` (megatron-core 0.15 to 0.19, for colocated RL) move every tensor
of its inner optimizer's param groups with ``p.data = p.data.cpu()`` and back, which
gives each shard memory of its own: from then on no step reaches the model, and no
reset makes the stack train as a fresh one. Found by where each shard's memory lies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from opttree._adapter import instance_attribute
from opttree._dispatch import LazyDispatch
from opttree._errors import OptTreeError
from opttree._nodes import Node
from opttree._preflight import plain_reads, ranges
from opttree._problems import Problem, ProblemKind
from opttree._selection import paired

_DetachedShards = Callable[[object, str], list[str]]


def _distributed_detached(wrapper: object, path: str) -> list[str]:
    """The model parameters, by position, whose shard a precision-aware
    DistributedOptimizer steps in place but which no longer lie in their memory. Not
    precision-aware (its inner optimizer steps fp32 copies of the fp16/bf16 shards, and
    copies every shard back into the model after a step): none."""
    pairs = [
        (f"{inner} (parameter {index} of them)", model, shard)
        for outer, inner in (("model_float16_groups", "shard_float16_groups"), ("model_fp32_groups", "shard_fp32_groups"))
        for index, (model, (shard,)) in enumerate(paired(wrapper, path, outer, inner))
    ]
    inner_optimizer = instance_attribute(wrapper, "optimizer", path)
    groups = getattr(inner_optimizer, "param_groups", ())
    # a malformed group is the leaf's own problem, reported where the leaf is checked
    stepped = {id(p) for group in groups if isinstance(group, dict) and isinstance(group.get("params"), (list, tuple)) for p in group["params"]}
    float16 = {id(shard) for name, _, shard in pairs if name.startswith("shard_float16")}
    if stepped.isdisjoint(float16):
        return []
    with plain_reads():
        return [name for name, model, shard in pairs if id(shard) in stepped and not _within(shard, model)]


def _within(shard: torch.Tensor, model: torch.Tensor) -> bool:
    """Whether ``shard``'s elements lie in ``model``'s memory, as a view of it."""
    if shard.untyped_storage().data_ptr() != model.untyped_storage().data_ptr():
        return False
    found = ranges([shard, model])
    (shard_start, start), (shard_end, end) = found.starts, found.ends
    return start <= shard_start and shard_end <= end


def _builtin() -> LazyDispatch[_DetachedShards]:
    table: LazyDispatch[_DetachedShards] = LazyDispatch()
    table.register_lazy("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer", _distributed_detached)
    return table


_DETACHABLE = _builtin()


def detached_shards(node: Node) -> Problem | None:
    """The problem of a wrapper whose in-place shards no longer lie in the model's weights, or None."""
    find = _DETACHABLE.lookup(type(node.optimizer))
    if find is None:
        return None
    try:
        detached = find(node.optimizer, node.path)
    except OptTreeError:  # its groups cannot be read: reported where its own checks read them
        return None
    if not detached:
        return None
    message = (
        f"{len(detached)} of the model's parameter shards it steps in place ({detached[0]} first) no longer lie in the "
        "model's weights, whose views they were: its steps no longer reach the model (Megatron's "
        "offload_to_cpu()/restore_from_cpu() gives them memory of their own on a precision-aware optimizer), and no "
        "reset makes it train as a fresh one; rebuild the optimizer, or load a checkpoint into a new one"
    )
    return Problem(ProblemKind.DETACHED_SHARD, node.path, type(node.optimizer).__qualname__, message)
