"""Megatron's ``offload_to_cpu()`` and ``restore_from_cpu()``, which colocated RL calls
around generation, on the stacks the recipes build: on a precision-aware
DistributedOptimizer (CPU offloading) the round trip gives the shards it steps in place
memory of their own, and its steps stop reaching the model (Megatron's bug, shown here);
opttree refuses such a stack. Elsewhere the round trip is harmless, and a reset after it exact."""

from __future__ import annotations

import re
import pytest
import torch

import opttree
from opttree import testing
from opttree.testing import MegatronStack
from tests.helpers import trains_as_fresh_stack

OFFLOADED = [name for name in ("offload_0.75", "offload_1.0") if testing.is_available(name)]
NOT_IN_PLACE = [name for name in ("fp32", "bf16", "dist_fp32", "dist_bf16", "dist_fp16") if testing.is_available(name)]


def round_trip(stack: MegatronStack) -> None:
    if not hasattr(stack.optimizer, "offload_to_cpu"):
        pytest.skip("this megatron-core has no offload_to_cpu (added in 0.15)")
    with stack.device:
        for member in getattr(stack.optimizer, "chained_optimizers"):
            member.offload_to_cpu()
            member.restore_from_cpu()


def weights(stack: MegatronStack) -> list[torch.Tensor]:
    return [p.detach().clone() for p in stack.model.parameters()]


@pytest.mark.parametrize("name", OFFLOADED)
def test_megatrons_round_trip_stops_a_precision_aware_optimizer_from_reaching_the_model(name: str) -> None:
    stack = testing.build(name)
    stack.train(0, 2)
    before = weights(stack)
    stack.train(2, 1)
    assert any(not torch.equal(a, b) for a, b in zip(before, weights(stack), strict=True))  # steps reach the model

    round_trip(stack)
    before = weights(stack)
    stack.train(3, 2)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(stack), strict=True))  # Megatron's: they no longer do


@pytest.mark.parametrize("name", OFFLOADED)
def test_a_precision_aware_optimizer_after_megatrons_round_trip_is_refused_with_nothing_changed(name: str) -> None:
    stack = testing.build(name)
    stack.train(0, 2)
    assert opttree.validate(stack.optimizer) == ()
    round_trip(stack)
    before = [v.clone() for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]

    problems = opttree.validate(stack.optimizer)
    assert [(p.kind, p.path) for p in problems] == [(opttree.ProblemKind.DETACHED_SHARD, "chained[0]")]
    assert "shard_float16_groups" in problems[0].message and "a shard it steps in place no longer in its weight" in problems[0].message
    with stack.device, pytest.raises(opttree.MalformedWrapper, match="offload_to_cpu"):
        opttree.reset(stack.optimizer)
    after = [v for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("name", NOT_IN_PLACE)
def test_where_the_optimizer_steps_copies_a_reset_after_the_round_trip_is_exact(name: str) -> None:
    stack = testing.build(name)
    stack.train(0, 2)
    round_trip(stack)
    assert opttree.validate(stack.optimizer) == ()
    with stack.device:
        opttree.reset(stack.optimizer)
    assert trains_as_fresh_stack(stack, testing.build(name), 2, 2)


DISTRIBUTED = [name for name in ("dist_fp32", "dist_bf16", "dist_fp16", "offload_0.75") if testing.is_available(name)]


@pytest.mark.parametrize("name", DISTRIBUTED)
def test_a_weight_given_memory_of_its_own_under_a_distributed_optimizer_is_refused(name: str) -> None:
    """Any DistributedOptimizer writes its updated shards into DDP's parameter buffer, of
    which the model's weights are views (precision-aware or not). A weight whose ``.data``
    is swapped for memory of its own is no longer updated by Megatron's steps (shown), and
    no reset makes the stack train as a fresh one: validate said nothing and the reset went
    through. Refused, with nothing changed."""
    stack = testing.build(name)
    stack.train(0, 2)
    weight = next(stack.model.parameters())
    weight.data = weight.data.clone()  # the same values, memory of its own
    before = [v.clone() for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]

    problems = opttree.validate(stack.optimizer)

    assert [(p.kind, p.path) for p in problems] == [(opttree.ProblemKind.DETACHED_SHARD, "chained[0]")]
    # precision-aware, its shard (a view of the buffer) is no longer in the weight; else the weight is not in the buffer
    named = "shard_float16" if name.startswith("offload") else "model_(float16|fp32)"
    assert re.search(rf"\({named}_groups \(parameter \d of them\) first\)", problems[0].message)
    with stack.device, pytest.raises(opttree.MalformedWrapper, match="no longer lie where its step writes them"):
        opttree.reset(stack.optimizer)
    after = [v for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))

    swapped = weight.detach().clone()
    stack.train(2, 2)
    assert torch.equal(weight.detach(), swapped)  # Megatron's steps no longer reach it
