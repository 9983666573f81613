"""Megatron runs one optimizer per rank: 2 and 4 gloo ranks on loopback, bounded in time."""

from __future__ import annotations

import functools
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

import opttree
from opttree import testing
from tests.helpers import needs_dp_reshardable, trains_as_fresh_stack
from tests.test_checkpoints import model_state
from tests.test_malformed_state import Entry

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


class _Unreadable(Entry):
    """A state entry whose reads raise, which validate and describe report: as a mapping
    that is not a dict, before anything reads it."""

    def __getitem__(self, key: str) -> object:
        raise ValueError("entry refuses reads")


def gathered_with_an_unreadable_entry() -> tuple[str, tuple[str, ...]]:
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.ones(3)
    optimizer = torch.optim.AdamW([param])
    optimizer.step()
    optimizer.state[param] = _Unreadable(dict(optimizer.state[param]))
    text = opttree.describe(optimizer, group=dist.group.WORLD)
    return text, tuple(p.message for p in opttree.validate(optimizer, group=dist.group.WORLD))


def test_describe_and_validate_of_a_group_report_an_entry_whose_reads_raise() -> None:
    """Each rank's summary once read the entry unguarded and raised before the gather."""
    results = testing.run_ranks(gathered_with_an_unreadable_entry, 2)
    leader_text, leader_problems = results[0]
    refused = "a state entry is a _Unreadable, which reads its keys by its own __len__"
    assert "ranks: 2" in leader_text and f"malformed: {refused}" in leader_text
    assert len(leader_problems) == 2 and all(refused in message for message in leader_problems)


class PartialResult(NamedTuple):
    rank: int
    holds_shard: bool
    changed: int
    by_name_accepted: bool


def partial_reset_of_one_parameter() -> PartialResult:
    """Every rank resets ``down.weight``'s history, in one collective call as training code
    makes it: the rank holding its shard resets it, the others have nothing to reset."""
    stack = testing.build("dist_fp32")
    stack.train(0, K)
    named = dict(stack.model.named_parameters())
    target = named["module.down.weight"]
    optimizer = stack.optimizer
    members: list[object] = getattr(optimizer, "chained_optimizers")
    holds = any(target is param for member in members for param in getattr(member, "model_param_gbuf_map"))
    before = [v.clone() for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values()]
    opttree.reset(optimizer, params=[target], keys=["exp_avg", "exp_avg_sq"])
    after = [v for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values()]
    changed = sum(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    opttree.reset(optimizer, params=lambda name: name.endswith("down.weight"), model=stack.model, keys=["exp_avg"])
    return PartialResult(dist.get_rank(), holds, changed, True)


def layer_wise_selection() -> list[str]:
    """Each rank of a ``LayerWiseDistributedOptimizer`` steps whole parameters: one another
    rank steps is selected with nothing to reset here."""
    stack = testing.build("dist_muon")
    accepted = []
    for name, param in stack.model.named_parameters():
        opttree.reset(stack.optimizer, params=[param], keys=["momentum_buffer"] if param.dim() == 2 else ["exp_avg"])
        accepted.append(name)
    return accepted


def test_a_partial_reset_on_every_rank_resets_the_shards_each_holds() -> None:
    """A parameter whose shard lives wholly on another rank is selected with nothing to
    reset here, not refused as held by no optimizer: refusing on some ranks while others
    reset would leave the ranks' states apart."""
    results = testing.run_ranks(partial_reset_of_one_parameter, 2)

    assert [r.rank for r in results] == [0, 1]
    assert all(r.by_name_accepted for r in results)
    assert all((r.changed > 0) == r.holds_shard for r in results)
    assert any(r.holds_shard for r in results) and not all(r.holds_shard for r in results)


@pytest.mark.skipif(not testing.is_available("dist_muon"), reason="no dist_muon recipe in this lane")
def test_a_layer_wise_partial_reset_selects_parameters_of_other_ranks_with_nothing_to_reset() -> None:
    results = testing.run_ranks(layer_wise_selection, 2)

    everything = [name for name, _ in testing.build("dist_muon").model.named_parameters()]
    assert results == [everything, everything]


class AgreedResult(NamedTuple):
    rank: int
    alone: str
    agreed: str
    changed: int


def refused_on_one_rank(name: str = "dist_fp32") -> AgreedResult:
    """``"step"`` for ``up`` and ``down.weight``, three of the DistributedOptimizer's four
    parameters, which it saves one step for on all its ranks. Counted by this rank's own
    shards, the rank holding ``down.weight`` but not ``down.bias`` refused and the other,
    holding all of its own, reset: a checkpoint then loaded one rank's step for both. Counted
    by the parameters every rank lists, every rank refuses alike, alone or in agreement."""
    stack = testing.build(name)
    stack.train(0, K)
    named = dict(stack.model.named_parameters())
    chosen = [named["module.up.weight"], named["module.up.bias"], named["module.down.weight"]]
    before = [v.clone() for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values()]
    scales = [float(member.get_loss_scale()) for member in getattr(stack.optimizer, "chained_optimizers")]
    outcomes = []
    for group in (None, dist.group.WORLD):
        try:
            opttree.reset(stack.optimizer, params=chosen, keys=["step"], group=group)
            outcomes.append("reset")
        except opttree.OptTreeError as error:
            outcomes.append(f"{type(error).__name__}: {error}")
        if group is None:  # put it back, to try again in agreement
            after = [v for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values()]
            with torch.no_grad():
                for old, new in zip(before, after, strict=True):
                    new.copy_(old)
    after = [v for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values()]
    changed = sum(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    changed += sum(float(member.get_loss_scale()) != scale for member, scale in zip(getattr(stack.optimizer, "chained_optimizers"), scales, strict=True))
    return AgreedResult(dist.get_rank(), outcomes[0], outcomes[1], changed)


def refused_on_one_rank_fp16() -> AgreedResult:
    """:func:`refused_on_one_rank` over an fp16 DistributedOptimizer, whose loss scaler
    the rank resetting alone reset too, leaving the ranks' scales apart."""
    return refused_on_one_rank("dist_fp16")


def refused_on_one_rank_offloaded() -> AgreedResult:
    """:func:`refused_on_one_rank` over a precision-aware DistributedOptimizer over a
    HybridDeviceOptimizer, whose leaves step the hybrid's copies of its shards: counted by
    this rank's shards, one rank reset its steps and the other refused, or kept them."""
    return refused_on_one_rank("offload_0.75")


@pytest.mark.parametrize(
    "ranks", [refused_on_one_rank, refused_on_one_rank_fp16, refused_on_one_rank_offloaded], ids=["fp32", "fp16", "offloaded"]
)
def test_ranks_refuse_a_partial_reset_of_a_step_saved_once_alike(ranks: Callable[[], AgreedResult]) -> None:
    results = testing.run_ranks(ranks, 2)

    for r in results:
        assert r.alone.startswith("PartialResetRefused") and "3 of the 4 parameters" in r.alone
        assert r.agreed.startswith("PartialResetRefused") and r.changed == 0
    assert results[0].alone.replace("rank 0", "rank 1") == results[1].alone.replace("rank 0", "rank 1")


def _state_and_scale(stack: testing.MegatronStack) -> list[torch.Tensor]:
    held = [v.clone() for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values()]
    return [*held, *(member.get_loss_scale().clone() for member in getattr(stack.optimizer, "chained_optimizers"))]


def asked_apart() -> tuple[int, list[str], bool, bool]:
    """Each rank calls with arguments of its own (a flag computed per rank), under ``group``:
    the ranks agreed only on refusing, and each carried out its own call, leaving one
    DistributedOptimizer's step and loss scale, which it saves once for all ranks, apart
    (rank 0 kept its grown scale, rank 1 reset its own). Refused on every rank, nothing
    changed; the same call on every rank goes ahead."""
    stack = testing.build("dist_fp16")
    stack.train(0, 5)
    rank = dist.get_rank()
    before = _state_and_scale(stack)
    calls: list[Callable[[], object]] = [
        lambda: opttree.reset(stack.optimizer, keep_loss_scale=rank == 0, group=dist.group.WORLD),
        lambda: opttree.reset(stack.optimizer, keys=["exp_avg", *(["step"] if rank == 0 else [])], group=dist.group.WORLD),
        lambda: opttree.prune(stack.optimizer, 0.5 if rank == 0 else 0.25, keys=["exp_avg"], group=dist.group.WORLD),
        lambda: opttree.scale(stack.optimizer, 0.5, keys=["exp_avg"] if rank == 0 else None, group=dist.group.WORLD),
        lambda: opttree.reset(stack.optimizer, keys=["exp_avg"], group=dist.group.WORLD)
        if rank == 0
        else opttree.prune(stack.optimizer, 0.5, keys=["exp_avg"], group=dist.group.WORLD),
    ]
    outcomes = []
    for call in calls:
        try:
            call()
            outcomes.append("done")
        except opttree.OptTreeError as error:
            outcomes.append(f"{type(error).__name__}: {error}")
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _state_and_scale(stack), strict=True))
    opttree.reset(stack.optimizer, group=dist.group.WORLD)
    fresh = testing.build("dist_fp16")
    return rank, outcomes, unchanged, trains_as_fresh_stack(stack, fresh, 5, 2)


def test_ranks_given_different_arguments_under_a_group_refuse_alike_and_change_nothing() -> None:
    results = testing.run_ranks(asked_apart, 2)

    for rank, outcomes, unchanged, fresh in results:
        assert unchanged and fresh
        assert all(o.startswith("OptTreeError: the ranks were given different arguments") for o in outcomes)
        assert "keep_loss_scale is True on rank 0 and False on rank 1" in outcomes[0]
        assert "'step' in keys is True on rank 0 and False on rank 1" in outcomes[1]
        assert "fraction is 0.5 on rank 0 and 0.25 on rank 1" in outcomes[2]
        assert "keys is ['exp_avg'] on rank 0 and None on rank 1" in outcomes[3]
        assert "call is 'reset' on rank 0 and 'prune' on rank 1" in outcomes[4]
    assert results[0][1] == results[1][1]


def keys_per_stage() -> tuple[int, str]:
    """Ranks holding different optimizers, as pipeline stages may (AdamW on one, SGD with
    momentum on the other): each names the history its own optimizer holds, which is not
    a difference of arguments to refuse."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4))
    param.grad = torch.ones(4)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW([param]) if dist.get_rank() == 0 else torch.optim.SGD([param], lr=0.1, momentum=0.9)
    optimizer.step()
    key = "exp_avg" if dist.get_rank() == 0 else "momentum_buffer"
    report = opttree.reset(optimizer, keys=[key], group=dist.group.WORLD)
    return dist.get_rank(), str(report)


def test_ranks_holding_different_optimizers_may_name_their_own_history_keys() -> None:
    results = testing.run_ranks(keys_per_stage, 2)

    assert [r for r, _ in results] == [0, 1] and all("1 tensors zeroed" in text or "dropped" in text for _, text in results)


def reset_saved_and_loaded(directory: str) -> tuple[int, bool]:
    """A DistributedOptimizer on every rank, reset and saved sharded through
    ``megatron.core.dist_checkpointing`` (whose save starts a process of its own, which a
    daemonic rank may not), then loaded into a fresh stack: it trains as a fresh stack
    over the same weights."""
    from megatron.core import dist_checkpointing

    world = dist.group.WORLD
    metadata: dict[str, object] = {"distrib_optim_sharding_type": "dp_reshardable"}
    stack = testing.build("dist_bf16")
    stack.train(0, K)
    opttree.reset(stack.optimizer, group=world)
    with stack.device:
        state = opttree.sharded_state_dict(stack.optimizer, model_state(stack), metadata=metadata, group=world)
        dist_checkpointing.save(state, directory)
    dist.barrier()
    loaded = testing.build("dist_bf16")
    with loaded.device:
        getattr(loaded.optimizer, "chained_optimizers")[0]._init_optimizer_states_with_dummy_values()  # as Megatron's training does
        wanted = opttree.sharded_state_dict(loaded.optimizer, model_state(loaded), is_loading=True, metadata=metadata, group=world)
        opttree.load_state_dict(loaded.optimizer, dist_checkpointing.load(wanted, directory), group=world)
    loaded.copy_weights_from(stack)  # the dummy init stepped them; a whole checkpoint's load gives them back
    return dist.get_rank(), trains_as_fresh_stack(loaded, testing.build("dist_bf16"), K, K)


@needs_dp_reshardable
def test_a_reset_saved_and_loaded_on_every_rank_trains_as_a_fresh_stack(tmp_path: Path) -> None:
    results = testing.run_ranks(functools.partial(reset_saved_and_loaded, str(tmp_path)), 2, timeout=300)

    assert results == [(0, True), (1, True)]


def steps_apart() -> tuple[int, list[str], list[str]]:
    """A hand-written reset of rank 1's steps and loss scale alone (no opttree call, so no
    agreement) leaves what its DistributedOptimizer saves once for all ranks unlike rank
    0's: ``validate(group=)`` on rank 0 warns of it, naming rank 1 and both values."""
    stack = testing.build("dist_fp16")
    stack.train(0, 5)
    before = [str(p) for p in opttree.validate(stack.optimizer, group=dist.group.WORLD)]
    if dist.get_rank() == 1:
        with torch.no_grad():
            for leaf in stack.leaves():
                for entry in leaf.state.values():
                    entry["step"].zero_()
    after = [str(p) for p in opttree.validate(stack.optimizer, group=dist.group.WORLD)]
    return dist.get_rank(), before, after


def test_validate_of_a_group_warns_where_the_ranks_save_different_steps() -> None:
    (_, before, after), (_, _, rank_one) = testing.run_ranks(steps_apart, 2)

    assert before == [] and rank_one == []
    assert len(after) == 1 and after[0].startswith("rank 1: warning: DistributedOptimizer at chained[0]: key 'step': what it saves once")
    assert "(step 0, loss scale 1048576) differs from rank 0's (step 4, loss scale 1048576)" in after[0]


def failing_on_rank_one() -> tuple[int, str]:
    """A ``params`` generator that raises on rank 1 only, in the user's code: with ``group``,
    rank 0 must not wait in the agreement for a rank that left it."""
    stack = testing.build("dist_fp32")
    stack.train(0, 1)

    def chosen() -> Iterator[torch.Tensor]:
        if dist.get_rank() == 1:
            raise ValueError("no parameters here")
        yield next(stack.model.parameters())

    try:
        opttree.reset(stack.optimizer, params=chosen(), keys=["exp_avg"], group=dist.group.WORLD)
        return dist.get_rank(), "reset"
    except Exception as error:  # noqa: BLE001  # what each rank raised is the result
        return dist.get_rank(), f"{type(error).__name__}: {error}"


def test_a_rank_failing_in_the_users_code_is_not_waited_for_by_the_others() -> None:
    (_, zero), (_, one) = testing.run_ranks(failing_on_rank_one, 2)
    failure = "the parameters params gives cannot be read: iterating it raised ValueError: no parameters here"
    assert zero == f"OptTreeError: rank 1: {failure}"
    assert one == f"OptTreeError: {failure}"


def hanging() -> None:
    """A rank that never returns, as one waiting in a collective for a rank that left."""
    threading.Event().wait()


def unpicklable() -> object:
    return lambda: None


def test_a_run_past_its_timeout_is_stopped_with_an_error() -> None:
    with pytest.raises(RuntimeError, match=r"2 ranks did not finish within 5 s"):
        testing.run_ranks(hanging, 2, timeout=5)


def failing_beside_a_manager(pids: str) -> None:
    """Each rank starts a process of its own (as Megatron's ``dist_checkpointing.save``
    starts a ``multiprocessing.Manager``); once both have, rank 0 fails and rank 1 never
    returns, as one waiting in a collective for a rank that left."""
    manager = multiprocessing.Manager()
    with open(pids, "a", encoding="ascii") as out:
        out.write(f"{getattr(manager, '_process').pid}\n")
    if dist.get_rank() == 1:
        threading.Event().wait()
    while len(Path(pids).read_text(encoding="ascii").split()) < 2:
        time.sleep(0.05)
    raise ValueError("rank 0 failed")


def test_what_a_rank_started_does_not_outlive_a_run_stopped_early(tmp_path: Path) -> None:
    """Killed alone, a rank left its Manager's server running, its parent gone. The run is
    stopped by a rank's failure once both Managers run, not by a timeout, which a loaded
    machine can reach before the ranks have started them; a timeout ends a run the same way."""
    pids = tmp_path / "pids"
    with pytest.raises(RuntimeError, match=r"rank 0 failed"):
        testing.run_ranks(functools.partial(failing_beside_a_manager, str(pids)), 2, timeout=600)

    started = [int(pid) for pid in pids.read_text(encoding="ascii").split()]
    deadline = time.monotonic() + 10  # killed, they are reaped by init, not at once
    while any(os.path.exists(f"/proc/{pid}") for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(started) == 2 and not any(os.path.exists(f"/proc/{pid}") for pid in started)


def test_a_result_that_cannot_be_pickled_is_a_rank_failure_not_a_timeout() -> None:
    with pytest.raises(RuntimeError, match=r"rank \d failed:[\s\S]*pickle"):
        testing.run_ranks(unpicklable, 2, timeout=120)


def test_a_function_the_ranks_cannot_import_is_refused_before_any_rank_starts() -> None:
    """A lambda cannot be sent to a fresh process: pickle's own AttributeError escaped."""
    with pytest.raises(opttree.OptTreeError, match="fn must be importable by name"):
        testing.run_ranks(lambda: 1, 2)


NARROW_MOE = testing.Recipe("narrow_dist_moe", "adam", distributed=True, experts=True, hidden=4)
"""An expert layer of 16 elements: on 2 ranks the expert buffer, padded, lies on rank 0,
and rank 1's expert DistributedOptimizer holds no parameter."""


class NoShardResult(NamedTuple):
    rank: int
    expert_elements: int
    described: str
    partial: str
    changed: int
    same_as_fresh: bool


def reset_where_a_rank_holds_no_shard() -> NoShardResult:
    """On every rank: the expert member's parameters, what describe shows of them, a partial
    reset of their step (saved once for the member, so refused alike on both ranks, rank 1
    holding none of them), then a full reset, trained against a fresh stack."""
    stack = testing.build(NARROW_MOE)
    stack.train(0, K)
    expert = stack.leaves()[-1]
    elements = sum(p.numel() for group in expert.param_groups for p in group["params"])
    described = opttree.describe(stack.optimizer, group=dist.group.WORLD)
    before = [v.clone() for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values()]
    experts = [p for name, p in stack.model.named_parameters() if "expert" in name]
    try:
        opttree.reset(stack.optimizer, params=experts, keys=["step"], group=dist.group.WORLD)
        partial = "reset"
    except opttree.OptTreeError as error:
        partial = type(error).__name__
    after = [v for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values()]
    changed = sum(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    opttree.reset(stack.optimizer, group=dist.group.WORLD)
    fresh = testing.build(NARROW_MOE)
    fresh.copy_weights_from(stack)
    stack.train(K, K)
    fresh.train(K, K)
    same = all(torch.equal(a, b) for a, b in zip(stack.main_params(), fresh.main_params(), strict=True))
    same &= all(torch.equal(a, b) for a, b in zip(stack.model.parameters(), fresh.model.parameters(), strict=True))
    return NoShardResult(dist.get_rank(), elements, described, partial, changed, same)


def test_a_rank_that_holds_no_shard_of_a_distributed_optimizer_resets_and_refuses_as_the_others() -> None:
    results = testing.run_ranks(reset_where_a_rank_holds_no_shard, 2)

    assert [r.expert_elements for r in results] == [16, 0]  # rank 1 holds no shard of the expert buffer
    assert "params=0 (0 elements) state=empty" in results[1].described
    assert [r.partial for r in results] == ["PartialResetRefused"] * 2 and all(r.changed == 0 for r in results)
    assert all(r.same_as_fresh for r in results)


class CheckpointResult(NamedTuple):
    rank: int
    megatron: str
    ours: str
    agreed: str


def _outcome(call: Callable[[], object]) -> str:
    """What ``call()`` raised, as its class and, for an opttree error, its message; or "done"."""
    try:
        call()
    except opttree.OptTreeError as error:
        return f"{type(error).__name__}: {error}"
    except Exception as error:  # noqa: BLE001  # what each rank raised is the result
        return type(error).__name__
    return "done"


def checkpoint_where_a_rank_holds_no_shard() -> CheckpointResult:
    """Megatron's own ``state_dict()`` and opttree's ``sharded_state_dict`` on each rank of a
    stack where rank 1's expert DistributedOptimizer holds no parameter."""
    from megatron.core.transformer.module import MegatronModule

    stack = testing.build(NARROW_MOE)
    stack.train(0, K)
    module = stack.model.module
    assert isinstance(module, MegatronModule)
    with stack.device:
        model_state = module.sharded_state_dict()
        megatron = _outcome(stack.optimizer.state_dict)
        metadata: dict[str, object] = {"distrib_optim_sharding_type": "dp_reshardable"}
        ours = _outcome(lambda: opttree.sharded_state_dict(stack.optimizer, model_state, metadata=metadata))
        agreed = _outcome(lambda: opttree.sharded_state_dict(stack.optimizer, model_state, metadata=metadata, group=dist.group.WORLD))
    return CheckpointResult(dist.get_rank(), megatron, ours, agreed)


@needs_dp_reshardable
def test_megatron_cannot_checkpoint_a_rank_that_holds_no_shard_and_opttree_refuses_there() -> None:
    """Megatron's side: ``DistributedOptimizer.state_dict()`` asserts one step among its inner
    optimizer's states, and rank 1's has none. opttree's: its ``sharded_state_dict`` (in the
    ``dp_reshardable`` format, the one Megatron saves on the CPU) refuses on that rank, as
    ``UnsupportedCheckpoint``, before Megatron's runs, and gives the other its state dict,
    which would go on into Megatron's save and wait there; with ``group=``, both ranks
    refuse, rank 0 naming rank 1, before Megatron's runs on either (in a format that
    gathers, rank 0 would otherwise wait in Megatron's gather)."""
    results = testing.run_ranks(checkpoint_where_a_rank_holds_no_shard, 2)

    assert [r.megatron for r in results] == ["done", "AssertionError"]
    assert results[0].ours == "done" and results[1].ours.startswith("UnsupportedCheckpoint: ")
    assert "holds no step on this rank (no parameter, or none stepped), and Megatron's own state_dict asserts one" in results[1].ours
    assert results[1].agreed == results[1].ours
    assert results[0].agreed.startswith("UnsupportedCheckpoint: ") and "rank 1" in results[0].agreed
    assert "holds no step on this rank" in results[0].agreed


class LoadResult(NamedTuple):
    rank: int
    outcome: str
    lr: float


def load_refused_on_rank_one(group: dist.ProcessGroup | None, past_the_checks: bool) -> LoadResult:
    """Each rank loads its own state dict of a trained ``dist_fp32`` stack, saved with an lr
    of 0.5. Rank 1's is refused: by opttree's checks (a step of 1.5 in one of its param
    groups, where the others hold 2), or, ``past_the_checks``, by Megatron's own load (made
    to raise on that rank). Returns what the load raised and the lr the stack holds after it."""
    stack = testing.build("dist_fp32")
    stack.train(0, K)
    saved = stack.optimizer.state_dict()
    assert isinstance(saved, dict)
    groups = saved["optimizer"]["param_groups"]
    for saved_group in groups:
        saved_group["lr"] = 0.5
    if dist.get_rank() == 1:
        if past_the_checks:
            setattr(stack.optimizer, "load_state_dict", lambda state_dict: (_ for _ in ()).throw(RuntimeError("disk gone")))
        else:
            groups[0]["step"] = 1.5
    outcome = _outcome(lambda: opttree.load_state_dict(stack.optimizer, saved, group=group))
    lr = float(stack.leaves()[0].param_groups[0]["lr"])
    return LoadResult(dist.get_rank(), outcome, lr)


def load_refused_alone() -> LoadResult:
    return load_refused_on_rank_one(None, past_the_checks=False)


def load_refused_in_agreement() -> LoadResult:
    return load_refused_on_rank_one(dist.group.WORLD, past_the_checks=False)


def load_failing_in_megatron_in_agreement() -> LoadResult:
    return load_refused_on_rank_one(dist.group.WORLD, past_the_checks=True)


def test_a_checkpoint_one_rank_refuses_is_loaded_by_no_rank_with_group() -> None:
    """Alone, rank 0 loads its checkpoint (lr 0.5) while rank 1 refuses its own: the ranks
    then train apart. With ``group=``, no rank loads, and both raise, rank 0 naming rank 1."""
    alone = testing.run_ranks(load_refused_alone, 2)
    assert alone[0].outcome == "done" and alone[0].lr == 0.5
    assert alone[1].outcome.startswith("UnsupportedCheckpoint: ") and "do not hold one step" in alone[1].outcome and alone[1].lr != 0.5

    agreed = testing.run_ranks(load_refused_in_agreement, 2)
    assert all(r.outcome.startswith("UnsupportedCheckpoint: ") and r.lr != 0.5 for r in agreed)
    assert "rank 1" in agreed[0].outcome and "do not hold one step" in agreed[0].outcome


def test_a_load_megatron_fails_on_one_rank_raises_on_every_rank_with_group() -> None:
    """Past opttree's checks, Megatron's own load fails on rank 1 (made to raise): rank 0,
    which loaded, raises too, naming rank 1, instead of training on beside it."""
    results = testing.run_ranks(load_failing_in_megatron_in_agreement, 2)

    assert results[0].lr == 0.5 and results[1].lr != 0.5
    assert all(r.outcome.startswith("UnsupportedCheckpoint: ") for r in results)
    assert "Megatron's own load_state_dict raised RuntimeError: disk gone" in results[1].outcome
    assert "rank 1" in results[0].outcome and "disk gone" in results[0].outcome


class SyncResult(NamedTuple):
    rank: int
    outcome: str
    stale_after: int


def sync_refused_on_rank_one(group: dist.ProcessGroup | None) -> SyncResult:
    """New weights written into a ``bf16`` stack's model on every rank, out of band; rank 1
    names a model its stack does not step, which its sync refuses. Returns what the sync
    raised and how many masters are stale after it."""
    stack = testing.build("bf16")
    stack.train(0, K)
    with torch.no_grad():
        for p in stack.model.parameters():
            p.add_(1.0)
    model = stack.model if dist.get_rank() == 0 else torch.nn.Linear(2, 2)
    outcome = _outcome(lambda: opttree.sync_masters(stack.optimizer, model=model, group=group))
    stale = sum(p.kind is opttree.ProblemKind.STALE_MASTER for p in opttree.validate(stack.optimizer, model=stack.model))
    return SyncResult(dist.get_rank(), outcome, stale)


def sync_refused_alone() -> SyncResult:
    return sync_refused_on_rank_one(None)


def sync_refused_in_agreement() -> SyncResult:
    return sync_refused_on_rank_one(dist.group.WORLD)


def test_a_sync_one_rank_refuses_writes_no_master_on_any_rank_with_group() -> None:
    """Alone, rank 0 syncs its masters and rank 1 refuses, its masters left stale (its next
    step would write the old weights back). With ``group=``, both refuse, rank 0 naming
    rank 1, and neither writes a master."""
    alone = testing.run_ranks(sync_refused_alone, 2)
    assert alone[0].outcome == "done" and alone[0].stale_after == 0
    assert alone[1].outcome.startswith("StaleMaster: ") and alone[1].stale_after > 0

    agreed = testing.run_ranks(sync_refused_in_agreement, 2)
    assert all(r.outcome.startswith("StaleMaster: ") and r.stale_after > 0 for r in agreed)
    assert "rank 1" in agreed[0].outcome and agreed[0].stale_after == alone[1].stale_after
