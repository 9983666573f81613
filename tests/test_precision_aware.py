"""Megatron's precision-aware DistributedOptimizer keeps its main weights in TE FusedAdam's
``state[shard]["master_param"]``, not in shards of its own: ``validate(model=...)`` finds
them stale after an out-of-band weight load and ``sync_masters`` writes them, where
Megatron's own ``reload_model_params()`` leaves them as they were (it returns early on
this path); remainders (int16) cannot go stale. TE cannot be installed here: the stack is
Megatron's own, built by its factory over the TE stand-in (see ``megatron_parts``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.transformer.module import MegatronModule

import opttree
from opttree import testing
from tests import megatron_parts
from tests.helpers import megatron_release, needs_dp_reshardable
from tests.standins import TEFusedAdam

K = 3


def write_new_weights(stack: testing.MegatronStack) -> None:
    with torch.no_grad():
        for p in stack.model.parameters():
            p.add_(0.25)


def te_masters(stack: testing.MegatronStack) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each TE parameter (a bf16 shard of the model) with its master."""
    (leaf,) = stack.leaves()
    assert isinstance(leaf, TEFusedAdam)
    return [(p, leaf.state[p]["master_param"]) for group in leaf.param_groups for p in group["params"]]


def stale_count(stack: testing.MegatronStack) -> int:
    return sum(not torch.equal(master.to(p.dtype), p.detach()) for p, master in te_masters(stack))


def test_megatron_keeps_the_main_weights_in_te_and_its_reload_leaves_them_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """What opttree works around: Megatron's reload does not reach TE's masters, and the next
    step writes them back over the new weights."""
    stack = megatron_parts.precision_aware(monkeypatch, remainders=False)
    stack.train(0, K)
    assert all(master.dtype == torch.float32 for _, master in te_masters(stack)) and stale_count(stack) == 0
    write_new_weights(stack)
    new = [p.detach().clone() for p in stack.model.parameters()]

    with stack.device:
        stack.optimizer.reload_model_params()
    stack.step(K)

    assert stale_count(stack) == 0  # the step wrote the old masters back over the new weights
    moved = max(float((a.float() - b.float()).abs().max()) for a, b in zip(new, stack.model.parameters(), strict=True))
    assert moved > 0.2  # back by about the 0.25 written, far beyond one step at lr=1e-2


def test_stale_te_masters_are_named_synced_and_then_reset_trains_like_a_fresh_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    stack = megatron_parts.precision_aware(monkeypatch, remainders=False)
    stack.train(0, K)
    assert opttree.validate(stack.optimizer, model=stack.model) == ()

    write_new_weights(stack)

    stale = opttree.validate(stack.optimizer, model=stack.model)
    assert len(stale) == len(te_masters(stack)) == stale_count(stack) > 0
    assert all(p.kind is opttree.ProblemKind.STALE_MASTER and p.cls == "FusedAdam" for p in stale)
    names = {n for n, _ in stack.model.named_parameters()}
    assert all(any(n in p.message for n in names) for p in stale)

    with stack.device:
        report = opttree.sync_masters(stack.optimizer, model=stack.model)

    assert report.reloaded and report.stale == len(stale) and len(report.written) == len(stale)
    assert opttree.validate(stack.optimizer, model=stack.model) == () and stale_count(stack) == 0
    opttree.reset(stack.optimizer)
    fresh = megatron_parts.precision_aware(monkeypatch, remainders=False, seed=1)
    with torch.no_grad():
        for a, b in zip(fresh.model.parameters(), stack.model.parameters(), strict=True):
            a.copy_(b)
    stack.train(K, K)
    fresh.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(stack.model.parameters(), fresh.model.parameters(), strict=True))


def test_int16_remainders_always_round_to_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Their high bits are the bf16 weights themselves: new weights make the masters stand
    for them, with the low bits they had, so nothing is stale and a step starts from them."""
    stack = megatron_parts.precision_aware(monkeypatch, remainders=True)
    stack.train(0, K)
    assert all(master.dtype == torch.int16 and master.any() for _, master in te_masters(stack))
    write_new_weights(stack)
    new = [p.detach().clone() for p in stack.model.parameters()]

    assert opttree.validate(stack.optimizer, model=stack.model) == ()
    stack.step(K)

    moved = max(float((a.float() - b.float()).abs().max()) for a, b in zip(new, stack.model.parameters(), strict=True))
    assert moved < 0.05  # one step from the new weights


@needs_dp_reshardable
@pytest.mark.parametrize("remainders", [False, True], ids=["fp32_masters", "remainders"])
def test_reset_then_a_sharded_round_trip_trains_as_the_reset_stack(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, remainders: bool) -> None:
    """Megatron saves TE's state through ``get_unscaled_state`` (masters renamed ``param``)
    and loads it through ``set_scaled_state``."""
    saver = megatron_parts.precision_aware(monkeypatch, remainders=remainders)
    saver.train(0, K)
    opttree.reset(saver.optimizer)
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    with saver.device:
        state = opttree.sharded_state_dict(saver.optimizer, model_state(saver), metadata=dict(metadata))
        dist_checkpointing.save(state, str(tmp_path))
    loader = megatron_parts.precision_aware(monkeypatch, remainders=remainders, seed=1)
    with torch.no_grad():
        for a, b in zip(loader.model.parameters(), saver.model.parameters(), strict=True):
            a.copy_(b)
    with loader.device:
        wanted = loader.optimizer.sharded_state_dict(model_state(loader), is_loading=True, metadata=dict(metadata))
        loaded = dist_checkpointing.load(wanted, str(tmp_path))
        if megatron_release() < (0, 17):
            # 0.16's dp_reshardable state holds each bucket's ``padding`` bool beside the
            # tensors, and its precision-aware load hands that to TE's set_scaled_state too,
            # which raises (TE asserts a tensor's dtype): refused, naming Megatron's load.
            with pytest.raises(opttree.UnsupportedCheckpoint, match=r"Megatron's own load_state_dict raised AttributeError"):
                opttree.load_state_dict(loader.optimizer, loaded)
            return
        opttree.load_state_dict(loader.optimizer, loaded)

    saver.train(K, K)
    loader.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(saver.model.parameters(), loader.model.parameters(), strict=True))


def model_state(stack: testing.MegatronStack) -> dict[str, object]:
    module = stack.model.module
    assert isinstance(module, MegatronModule)
    with stack.device:
        return module.sharded_state_dict()


@pytest.mark.parametrize("remainders", [False, True], ids=["fp32_masters", "remainders"])
def test_copy_weights_from_makes_te_masters_equal_too(monkeypatch: pytest.MonkeyPatch, remainders: bool) -> None:
    source = megatron_parts.precision_aware(monkeypatch, remainders=remainders)
    source.train(0, K)
    target = megatron_parts.precision_aware(monkeypatch, remainders=remainders, seed=1)
    target.train(0, 1)

    target.copy_weights_from(source)

    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(te_masters(target), te_masters(source), strict=True))
    opttree.reset(source.optimizer)
    opttree.reset(target.optimizer)
    source.train(K, K)
    target.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(source.model.parameters(), target.model.parameters(), strict=True))


class Float8Like(torch.Tensor):
    """A tensor subclass standing for TE's ``Float8Tensor`` weights (which need CUDA)."""


def test_the_master_of_a_weight_of_a_tensor_subclass_is_not_compared() -> None:
    """TE steps FP8 weights through fp32 masters too; how those round to the quantized
    weight is the weight class's own, so the master is reported as not compared, and a
    sync refuses rather than guess."""
    param = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    optimizer = TEFusedAdam([param], lr=1e-2, master_weights=True)
    param.grad = torch.ones_like(param)
    optimizer.step()
    entry = optimizer.state.pop(param)
    weight = torch.nn.Parameter(param.detach().as_subclass(Float8Like))
    optimizer.param_groups[0]["params"] = [weight]
    optimizer.state[weight] = entry

    (problem,) = opttree.validate(optimizer, model=torch.nn.ParameterList([weight]))

    assert problem.kind is opttree.ProblemKind.UNCHECKED_MASTER and "Float8Like" in problem.message
    with pytest.raises(opttree.OptTreeError, match="cannot be compared"):
        opttree.sync_masters(optimizer, model=torch.nn.ParameterList([weight]))
