"""Shards a Megatron wrapper steps in place, which must still be views of the model's weights.

A precision-aware ``DistributedOptimizer`` (``use_precision_aware_optimizer``, which CPU
offloading turns on) hands its inner optimizer the shards of the model's parameters
themselves, views of DDP's parameter buffer (``shard_float16_groups``, and
``shard_fp32_groups`` for fp32 ones), and copies nothing back after a step: the step
writes the weights through the views. Megatron's own ``offload_to_cpu()`` and
``restore_from_cpu()`` (megatron-core 0.15 to 0.19, for colocated RL) move every tensor
of its inner optimizer's param groups with ``p.data = p.data.cpu()`` and back, which
gives each shard memory of its own: from then on no step reaches the model, and no
reset makes the stack train as a fresh one. Any ``DistributedOptimizer`` (precision-aware
or not) writes its updated shards into DDP's parameter buffer, of which the model's
weights are views: a weight given memory of its own through ``.data`` is no longer
updated, whatever a reset does. Found by where each shard's and weight's memory lies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from opttree._adapter import instance_attribute
from opttree._held import own_attributes
from opttree._dispatch import LazyDispatch
from opttree._errors import OptTreeError
from opttree._nodes import Node
from opttree._preflight import plain_reads, ranges
from opttree._problems import Problem, ProblemKind
from opttree._selection import paired

_DetachedShards = Callable[[object, str], list[str]]


def _distributed_detached(wrapper: object, path: str) -> list[str]:
    """The model parameters, by position, whose shard a precision-aware
    DistributedOptimizer steps in place but which no longer lie in their memory, and, of
    any DistributedOptimizer, those no longer in DDP's parameter buffer (see
    :func:`_outside_buffers`). Not precision-aware, its inner optimizer steps fp32 copies of
    the fp16/bf16 shards and copies every shard back into the buffer after a step."""
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
    in_place = not stepped.isdisjoint(float16)
    with plain_reads():
        apart = [(name, model) for name, model, shard in pairs if in_place and id(shard) in stepped and not _within(shard, model)]
        told = {id(model) for _, model in apart}
        models = [(name.replace("shard_", "model_"), model) for name, model, _ in pairs if id(model) not in told]
        return [name for name, _ in apart] + _outside_buffers(wrapper, models)


def _outside_buffers(wrapper: object, models: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The model parameters (of ``models``, named by group and position) that no longer lie in the bucket of DDP's parameter
    buffer that Megatron maps them to (``model_param_gbuf_map``): its step copies each
    updated shard into that bucket's ``param_data`` (or, precision-aware, steps views of
    it), which the model's weights are views of, so a weight given memory of its own
    through ``.data`` is no longer updated. A weight of a tensor subclass (a quantized one)
    keeps its data otherwise, and a layout other than Megatron's says nothing: neither is
    looked at."""
    attributes = own_attributes(wrapper)
    gbuf_map, buffers = attributes.get("model_param_gbuf_map"), attributes.get("buffers")
    if not isinstance(gbuf_map, dict) or not isinstance(buffers, list):
        return []
    found: list[str] = []
    for name, model in models:
        if type(model) not in _PLAIN:
            continue
        try:
            gbuf_index, _, bucket_id = gbuf_map[model]
            bucket_data = buffers[gbuf_index].buckets[bucket_id].param_data
        except Exception:  # noqa: BLE001  # not Megatron's layout, whose own code would raise there
            continue
        if isinstance(bucket_data, torch.Tensor) and not _within(model, bucket_data):
            found.append(name)
    return found


_PLAIN = (torch.nn.Parameter, torch.Tensor)


def _within(shard: torch.Tensor, model: torch.Tensor) -> bool:
    """Whether ``shard``'s elements lie in ``model``'s memory, as a view of it (or a
    weight's in its bucket's)."""
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
        f"{len(detached)} of the model's weights or their shards ({detached[0]} first) no longer lie where its step "
        "writes them: a shard it steps in place no longer in its weight, whose view it was (Megatron's "
        "offload_to_cpu()/restore_from_cpu() gives them memory of their own on a precision-aware optimizer), or a "
        "weight no longer in DDP's parameter buffer, into which its step copies the updated shards (a weight's .data "
        "swapped for memory of its own): its steps no longer reach the model, and no reset makes it train as a fresh "
        "one; rebuild the optimizer, or load a checkpoint into a new one"
    )
    return Problem(ProblemKind.DETACHED_SHARD, node.path, type(node.optimizer).__qualname__, message)
