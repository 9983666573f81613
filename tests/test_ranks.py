"""Megatron runs one optimizer per rank: 2 and 4 gloo ranks on loopback, bounded in time."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

import opttree
from opttree import testing

K = 2


class RankResult(NamedTuple):
    rank: int
    shard_elements: int
    zeroed: int
    all_zero: bool
    same_as_fresh: bool


def sharded_reset_matches_fresh() -> RankResult:
    """On every rank: a DistributedOptimizer whose state is sharded across the ranks."""
    stack = testing.build("dist_fp32")
    stack.train(0, K)
    shard_elements = sum(p.numel() for p in stack.main_params())
    report = opttree.reset(stack.optimizer)
    zero = all(
        not v.any() for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values()
    )
    fresh = testing.build("dist_fp32")
    fresh.copy_weights_from(stack)
    stack.train(K, K)
    fresh.train(K, K)
    same = all(torch.equal(a, b) for a, b in zip(stack.main_params(), fresh.main_params(), strict=True))
    return RankResult(dist.get_rank(), shard_elements, report.tensors_zeroed, zero, same)


def gathered_summaries() -> tuple[str, tuple[str, ...]]:
    """The last rank holds a stub optimizer, as a rank without parameters does."""
    stack = testing.build("fp32")
    stack.train(0, 1)
    optimizer: object = stack.optimizer
    if dist.get_rank() == dist.get_world_size() - 1:
        from tests.megatron_parts import chained, fp32

        optimizer = chained([fp32(None)])
    text = opttree.describe(optimizer, group=dist.group.WORLD)
    problems = opttree.validate(optimizer, group=dist.group.WORLD)
    return text, tuple(str(p) for p in problems)


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_sharded_distributed_optimizer_is_reset_on_every_rank(world_size: int) -> None:
    results = testing.run_ranks(sharded_reset_matches_fresh, world_size)

    assert [r.rank for r in results] == list(range(world_size))
    assert all(r.all_zero and r.same_as_fresh and r.zeroed > 0 for r in results)
    # Each rank holds only its shard of the main weights; together they are the whole model.
    whole = sum(p.numel() for p in testing.build("dist_fp32").model.parameters())
    assert all(0 < r.shard_elements < whole for r in results)
    assert sum(r.shard_elements for r in results) == whole


def test_describe_and_validate_gather_every_rank_to_rank_zero() -> None:
    world_size = 4
    results = testing.run_ranks(gathered_summaries, world_size)

    leader_text, leader_problems = results[0]
    assert f"ranks: {world_size}" in leader_text
    for rank in range(world_size):
        assert f"  rank {rank}: state " in leader_text
    assert "rank 3: state 0 B  ChainedOptimizer[FP32Optimizer]" in leader_text
    assert leader_problems == (
        "rank 3: warning: ChainedOptimizer at <root>: tree shape ChainedOptimizer[FP32Optimizer] differs "
        "from rank 0's ChainedOptimizer[FP32Optimizer[AdamW]]",
    )
    for text, problems in results[1:]:
        assert "ranks:" not in text and problems == ()
