"""Megatron's ``offload_to_cpu()`` and ``restore_from_cpu()``, which colocated RL calls
around generation, on the stacks the recipes build: on a precision-aware
DistributedOptimizer (CPU offloading) the round trip gives the shards it steps in place
memory of their own, and its steps stop reaching the model (Megatron's bug, shown here);
opttree refuses such a stack. Elsewhere the round trip is harmless, and a reset after it exact."""

from __future__ import annotations

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
    assert "no longer lie in the model's weights" in problems[0].message
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
