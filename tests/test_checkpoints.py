"""Checkpoints after a reset, through Megatron's own save and load.

In memory, ``state_dict()`` then ``load_state_dict()`` into a fresh stack after a full
reset trains bitwise like a fresh optimizer. The sharded path is Megatron's gap, shown
here: ``sharded_state_dict`` writes the common step only ``if step:``, so right after a
reset (step 0) it writes none, and a load then leaves torch's Adam without a step.
"""

from __future__ import annotations

import io

import pytest
import torch
from megatron.core.transformer.module import MegatronModule

import opttree
from opttree import testing

K = 2


def fresh_like(stack: testing.MegatronStack) -> testing.MegatronStack:
    fresh = testing.build(stack.name)
    fresh.copy_weights_from(stack)
    return fresh


@pytest.mark.parametrize("name", [n for n in ("fp32", "bf16", "moe", "muon") if n in testing.available()])
def test_reset_save_load_train_equals_a_fresh_optimizer(name: str) -> None:
    stack = testing.build(name)
    stack.train(0, K)
    opttree.reset(stack.optimizer)
    reference = fresh_like(stack)

    buffer = io.BytesIO()
    with stack.device:
        torch.save(stack.optimizer.state_dict(), buffer)
    loaded = fresh_like(stack)
    with loaded.device:
        loaded.optimizer.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))

    loaded.train(K, K)
    reference.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(loaded.main_params(), reference.main_params(), strict=True))


def sharded_state(stack: testing.MegatronStack) -> dict[str, object]:
    module = stack.model.module
    assert isinstance(module, MegatronModule)
    with stack.device:
        return stack.optimizer.sharded_state_dict(module.sharded_state_dict())


def common_steps(state: object) -> list[object]:
    """Every ``common_step`` in a (chained) sharded optimizer state dict."""
    if isinstance(state, dict):
        found = [state["common_step"]] if "common_step" in state else []
        return found + [step for value in state.values() for step in common_steps(value)]
    return []


def test_megatron_writes_no_common_step_for_a_reset_optimizer() -> None:
    stack = testing.build("fp32")
    stack.train(0, K)
    assert [float(torch.as_tensor(step)) for step in common_steps(sharded_state(stack))] == [K]

    opttree.reset(stack.optimizer)

    assert common_steps(sharded_state(stack)) == []  # `if step:` with a step of 0
