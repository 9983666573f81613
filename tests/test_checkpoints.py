"""Checkpoints after a reset, through Megatron's own save and load.

In memory, ``state_dict()`` then ``load_state_dict()`` into a fresh stack after a full
reset trains bitwise like a fresh optimizer. Sharded, through
``megatron.core.dist_checkpointing`` on the CPU, Megatron's ``sharded_state_dict`` writes
the common step only ``if step:``, so a checkpoint saved right after a reset (step 0)
fails to load in Megatron's own ``load_state_dict``; ``opttree.sharded_state_dict`` (save)
and ``opttree.load_state_dict`` (load) each make the round trip work, shown here on both
sides for every recipe whose round trip Megatron's own code completes without a reset.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from types import MappingProxyType

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from torch.distributed.checkpoint.api import CheckpointException
from megatron.core.transformer.module import MegatronModule

import opttree
from opttree import testing
from tests.helpers import megatron_release, needs_dp_reshardable
from tests.megatron_parts import mimo_over

K = 2

SHARDED_ROUND_TRIP = [
    n for n in ("fp32", "bf16", "moe", "muon", "adaptive_muon", "dist_muon", "lion", "laprop") if n in testing.available()
]
"""Recipes whose sharded round trip Megatron's own code completes on the CPU."""


def fresh_like(stack: testing.MegatronStack) -> testing.MegatronStack:
    fresh = testing.build(stack.name)
    fresh.copy_weights_from(stack)
    return fresh


IN_MEMORY_ROUND_TRIP = [n for n in ("fp32", "bf16", "moe", "muon", "lion", "laprop", "soap", "rekls") if n in testing.available()]
"""Recipes whose ``state_dict()``/``load_state_dict()`` round trip Megatron completes."""


@pytest.mark.parametrize("name", IN_MEMORY_ROUND_TRIP)
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


def _steps(stack: testing.MegatronStack) -> list[torch.Tensor]:
    return [entry["step"] for leaf in stack.leaves() for entry in leaf.state.values()]


@pytest.mark.parametrize("name", [n for n in ("dist_fp32", "dist_bf16", "offload_0.75") if n in testing.available()])
def test_a_distributed_optimizers_load_through_opttree_gives_each_entry_its_own_step(name: str) -> None:
    """``DistributedOptimizer.load_state_dict`` puts every parameter's state on one step
    tensor, which torch's Adam then advances once per parameter and step (its
    ``state_dict()`` holds no history: Megatron saves that apart, and its load leaves the
    history unset until ``load_parameter_state``). Through opttree each entry has its own,
    in the sub-optimizers a HybridDeviceOptimizer builds anew at its load too."""
    stack = testing.build(name)
    stack.train(0, K)
    opttree.reset(stack.optimizer)
    with stack.device:
        state = stack.optimizer.state_dict()
    megatrons, ours = fresh_like(stack), fresh_like(stack)
    with stack.device:
        megatrons.optimizer.load_state_dict(copy.deepcopy(state))
        opttree.load_state_dict(ours.optimizer, copy.deepcopy(state))

    shared, own = _steps(megatrons), _steps(ours)
    assert len(shared) == len(own) > 1
    assert len({id(step) for step in shared}) == 1 and len({id(step) for step in own}) == len(own)
    assert all(float(step) == 0 for step in own)
    assert opttree.ProblemKind.SHARED_STEP in [p.kind for p in opttree.validate(megatrons.optimizer)]
    assert opttree.ProblemKind.SHARED_STEP not in [p.kind for p in opttree.validate(ours.optimizer)]


def model_state(stack: testing.MegatronStack) -> dict[str, object]:
    module = stack.model.module
    assert isinstance(module, MegatronModule)
    with stack.device:
        return module.sharded_state_dict()


def sharded_state(stack: testing.MegatronStack) -> dict[str, object]:
    with stack.device:
        return stack.optimizer.sharded_state_dict(model_state(stack))


def save(stack: testing.MegatronStack, directory: Path, *, with_opttree: bool) -> None:
    with stack.device:
        if with_opttree:
            state = opttree.sharded_state_dict(stack.optimizer, model_state(stack))
        else:
            state = stack.optimizer.sharded_state_dict(model_state(stack))
        dist_checkpointing.save(state, str(directory))


def load(stack: testing.MegatronStack, directory: Path, *, with_opttree: bool) -> None:
    with stack.device:
        wanted = stack.optimizer.sharded_state_dict(model_state(stack), is_loading=True)
        state = dist_checkpointing.load(wanted, str(directory))
        if with_opttree:
            opttree.load_state_dict(stack.optimizer, state)
        else:
            stack.optimizer.load_state_dict(state)


def reset_and_save(name: str, directory: Path, *, with_opttree: bool) -> testing.MegatronStack:
    """A stack trained ``K`` steps, reset and saved sharded; returns a fresh stack over its weights."""
    stack = testing.build(name)
    stack.train(0, K)
    opttree.reset(stack.optimizer)
    save(stack, directory, with_opttree=with_opttree)
    return fresh_like(stack)


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


@pytest.mark.parametrize("name", SHARDED_ROUND_TRIP)
@pytest.mark.parametrize(("save_with", "load_with"), [("opttree", "megatron"), ("megatron", "opttree")])
def test_sharded_round_trip_after_reset_equals_a_fresh_optimizer(
    name: str, save_with: str, load_with: str, tmp_path: Path
) -> None:
    reference = reset_and_save(name, tmp_path, with_opttree=save_with == "opttree")
    loaded = fresh_like(reference)
    load(loaded, tmp_path, with_opttree=load_with == "opttree")
    assert opttree.validate(loaded.optimizer) == ()

    loaded.train(K, K)
    reference.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(loaded.main_params(), reference.main_params(), strict=True))


@pytest.mark.parametrize("name", SHARDED_ROUND_TRIP)
def test_megatron_alone_cannot_load_its_checkpoint_saved_after_a_reset(name: str, tmp_path: Path) -> None:
    loaded = reset_and_save(name, tmp_path, with_opttree=False)
    steps = {opttree._registry.step_location(type(leaf)) for leaf in loaded.leaves()}
    if opttree.StepLocation.PER_PARAMETER not in steps:
        # megatron-core 0.17 builds lion in its own path, Lion alone: no step to lose
        load(loaded, tmp_path, with_opttree=False)
        return
    with pytest.raises(KeyError, match="step"):
        load(loaded, tmp_path, with_opttree=False)


@pytest.mark.parametrize("name", SHARDED_ROUND_TRIP)
def test_opttree_leaves_a_trained_checkpoint_as_megatron_writes_it(name: str, tmp_path: Path) -> None:
    stack = testing.build(name)
    stack.train(0, K)
    ours, megatrons = (opttree.sharded_state_dict(stack.optimizer, model_state(stack)), sharded_state(stack))
    assert [float(torch.as_tensor(s)) for s in common_steps(ours)] == [float(torch.as_tensor(s)) for s in common_steps(megatrons)]

    save(stack, tmp_path, with_opttree=True)
    loaded = fresh_like(stack)
    load(loaded, tmp_path, with_opttree=True)
    loaded.train(K, K)
    stack.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(loaded.main_params(), stack.main_params(), strict=True))


@pytest.mark.parametrize(("name", "step_type"), [("fp32", torch.Tensor), ("laprop", int)])
def test_a_step_megatron_did_not_write_comes_back_as_the_optimizer_starts_it(name: str, step_type: type, tmp_path: Path) -> None:
    """LaProp starts its steps as Python ints: given a tensor step, its bias correction
    computes in float32 instead of float64, and training differs from a fresh LaProp's."""
    if name not in testing.available():
        pytest.skip(f"no {name} recipe in this lane")
    loaded = reset_and_save(name, tmp_path, with_opttree=False)
    load(loaded, tmp_path, with_opttree=True)
    first, *chained = loaded.leaves()  # LaProp's recipe chains an AdamW, which starts a tensor
    steps = [entry["step"] for entry in first.state.values()]
    assert steps and all(isinstance(step, step_type) and not step for step in steps)
    assert all(isinstance(entry["step"], torch.Tensor) for leaf in chained for entry in leaf.state.values())


def test_opttree_load_keeps_the_steps_of_an_in_memory_state_dict() -> None:
    """``state_dict()`` keeps a step per entry; the load must not replace them by 0."""
    stack = testing.build("fp32")
    stack.train(0, K)
    loaded = fresh_like(stack)
    buffer = io.BytesIO()
    with stack.device:
        torch.save(stack.optimizer.state_dict(), buffer)
        opttree.load_state_dict(loaded.optimizer, torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    loaded.train(K, K)
    stack.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(loaded.main_params(), stack.main_params(), strict=True))


# A DistributedOptimizer's round trip fails at the save from megatron-core 0.16 on (its
# default format's ``flattened_range``), and before that at the load: 0.13 to 0.15 save it,
# but a fresh DistributedOptimizer, asked for the state to load into, asserts that the
# still-empty state of its torch optimizer has a single step.
DISTRIBUTED_ROUND_TRIP_ERRORS = (CheckpointingException, AssertionError)


MEGATRON_ROUND_TRIP_FAILS: list[tuple[str, type[Exception] | tuple[type[Exception], ...]]] = [
    ("sgd", TypeError),
    ("dist_fp32", DISTRIBUTED_ROUND_TRIP_ERRORS),
    ("offload_1.0", DISTRIBUTED_ROUND_TRIP_ERRORS),
    # "Optimizer shape ((32, 32) does not match model shape ((32, 16))": the Kronecker factors
    ("soap", AssertionError),
    ("rekls", AssertionError),
]


@pytest.mark.parametrize(("name", "error"), [(n, e) for n, e in MEGATRON_ROUND_TRIP_FAILS if n in testing.available()])
def test_recipes_whose_round_trip_megatron_fails_without_a_reset(
    name: str, error: type[Exception] | tuple[type[Exception], ...], tmp_path: Path
) -> None:
    """Why they are not in SHARDED_ROUND_TRIP: on the CPU, Megatron cannot load SGD's
    checkpoint (no ``init_state_fn``), nor round-trip a ``DistributedOptimizer``'s in its
    default format, nor save SOAP's or REKLS's, whose Kronecker factors and eigenbases are
    not shaped as their parameter, trained and never reset."""
    stack = testing.build(name)
    stack.train(0, K)
    with pytest.raises(error):
        save(stack, tmp_path, with_opttree=False)
        load(fresh_like(stack), tmp_path, with_opttree=False)


def test_a_plain_torch_optimizer_has_no_sharded_checkpoint() -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(opttree.UnsupportedCheckpoint, match="no sharded_state_dict"):
        opttree.sharded_state_dict(optimizer, {})


def test_a_state_dict_not_laid_out_as_megatron_writes_it_is_refused() -> None:
    stack = testing.build("bf16")
    stack.train(0, K)
    with pytest.raises(opttree.UnsupportedCheckpoint, match="has no 'optimizer'") as caught:
        opttree.load_state_dict(stack.optimizer, {"state": {}})
    assert caught.value.problem is not None
    assert caught.value.problem.cls == "Float16OptimizerWithFloat16Params"


@pytest.mark.parametrize("name", [n for n in ("dist_bf16", "offload_0.75") if n in testing.available()])
def test_a_reset_after_megatrons_load_gives_each_parameter_its_own_step(name: str) -> None:
    """Megatron's side: the first call of any sharded load, ``sharded_state_dict(...,
    is_loading=True)``, runs ``DistributedOptimizer.load_state_dict``, which without TE or
    apex leaves every parameter on one step tensor, that torch's Adam advances once per
    parameter. opttree's side: the reset warns, gives each parameter a step of its own,
    and training matches a fresh optimizer's."""
    stack = testing.build(name)
    stack.train(0, K)
    with stack.device:
        stack.optimizer.sharded_state_dict(model_state(stack), is_loading=True, metadata={"distrib_optim_sharding_type": "dp_zero_gather_scatter"})
    steps = [entry["step"] for leaf in stack.leaves() for entry in leaf.state.values()]
    assert len({id(step) for step in steps}) < len(steps)  # Megatron's load shares them

    problems = opttree.validate(stack.optimizer)
    opttree.reset(stack.optimizer)

    assert opttree.ProblemKind.SHARED_STEP in {problem.kind for problem in problems}
    steps = [entry["step"] for leaf in stack.leaves() for entry in leaf.state.values()]
    assert len({id(step) for step in steps}) == len(steps)
    fresh = fresh_like(stack)
    stack.train(K, K)
    fresh.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(stack.main_params(), fresh.main_params(), strict=True))


def trained_chain_of_two(name: str) -> tuple[testing.MegatronStack, list[dict[str, object]]]:
    """A recipe whose chain has two members, trained (not reset: a load that did nothing
    would train apart), and its in-memory ``state_dict()``: one per member, in a list."""
    stack = testing.build(name)
    stack.train(0, K)
    with stack.device:
        saved = stack.optimizer.state_dict()
    assert isinstance(saved, list) and len(saved) == 2
    return stack, saved


@pytest.mark.skipif("moe" not in testing.available(), reason="the moe recipe needs megatron-core's MoE")
def test_load_state_dict_takes_the_list_a_chain_of_several_members_writes_in_memory() -> None:
    """``ChainedOptimizer.state_dict()`` returns one state dict per member, in a list, for
    several members: opttree's load takes it as Megatron's does, and refuses one of
    another length, changing nothing."""
    stack, saved = trained_chain_of_two("moe")
    ours, megatrons = fresh_like(stack), fresh_like(stack)
    with ours.device:
        with pytest.raises(opttree.UnsupportedCheckpoint, match="holds 1 members' state dicts, and it has 2 members"):
            opttree.load_state_dict(ours.optimizer, saved[:1])
        opttree.load_state_dict(ours.optimizer, copy.deepcopy(saved))  # a load may change what it is given
    with megatrons.device:
        megatrons.optimizer.load_state_dict(copy.deepcopy(saved))

    ours.train(K, K)
    megatrons.train(K, K)
    stack.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(ours.main_params(), megatrons.main_params(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ours.main_params(), stack.main_params(), strict=True))


@pytest.mark.skipif("dist_muon" not in testing.available(), reason="no layer-wise Muon in this lane")
def test_a_layer_wise_chains_own_in_memory_state_dict_is_refused_with_the_form_its_load_reads() -> None:
    """Megatron's side (0.19.2): ``LayerWiseDistributedOptimizer.state_dict()`` gives the
    list of its members' state dicts, and its ``load_state_dict`` reads several members'
    by index from a dict (``.values()``), raising AttributeError before it loads
    anything. opttree's load refuses that list before Megatron runs, saying so and
    naming the dict by index it reads, which loads."""
    stack, saved = trained_chain_of_two("dist_muon")
    megatrons, ours = fresh_like(stack), fresh_like(stack)
    with megatrons.device, pytest.raises(AttributeError, match="'list' object has no attribute 'values'"):
        megatrons.optimizer.load_state_dict(copy.deepcopy(saved))
    with ours.device:
        with pytest.raises(opttree.UnsupportedCheckpoint, match=r"reads several members' state dicts from a dict by index.*before it loads anything.*dict\(enumerate\(state_dict\)\)"):
            opttree.load_state_dict(ours.optimizer, copy.deepcopy(saved))
        assert not any(leaf.state for leaf in ours.leaves())
        opttree.load_state_dict(ours.optimizer, dict(enumerate(copy.deepcopy(saved))))

    ours.train(K, K)
    stack.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(ours.main_params(), stack.main_params(), strict=True))


def _emptied(state: dict[str, object], *indices: int) -> dict[str, object]:
    entries = state["state"]
    assert isinstance(entries, dict)
    for index in indices:
        entries[index] = {}
    return state


@pytest.mark.parametrize("common_step", [None, 0, 2], ids=["saved-at-step-0", "common-step-0", "common-step-2"])
def test_an_empty_saved_entry_is_left_for_the_optimizer_to_build(common_step: int | None) -> None:
    """An entry saved empty (a parameter whose entry a read created, never stepped) is built
    whole by torch's Adam at its next step. Megatron's own load writes a common step into
    it, and torch's Adam, taking the entry for built, raises KeyError; opttree's load gives
    the step only to entries that hold history, as a fresh optimizer holds them."""
    stack = testing.build("fp32")
    stack.train(0, K)
    with stack.device:
        state = _emptied(copy.deepcopy(stack.optimizer.state_dict()), 0)
    entries = state["state"]
    assert isinstance(entries, dict)
    for entry in entries.values():
        entry.pop("step", None)
    if common_step is not None:
        entries["common_step"] = torch.tensor(float(common_step))

    if common_step is not None:
        megatrons = fresh_like(stack)
        with megatrons.device:
            megatrons.optimizer.load_state_dict(copy.deepcopy(state))
        with pytest.raises(KeyError):
            megatrons.train(K, 1)

    ours = fresh_like(stack)
    with ours.device:
        opttree.load_state_dict(ours.optimizer, state)
    (leaf,) = ours.leaves()
    loaded = list(leaf.state.values())
    assert loaded[0] == {} and all(int(entry["step"]) == (common_step or 0) for entry in loaded[1:])
    ours.train(K, 1)
    # built at step 1 beside entries at 3, which Megatron cannot checkpoint: validate says so
    expected = [] if not common_step else [opttree.ProblemKind.UNEQUAL_STEPS]
    assert [p.kind for p in opttree.validate(ours.optimizer)] == expected


def test_a_state_dict_of_only_empty_entries_loads_as_megatron_loads_it() -> None:
    """Nothing to give a step to: opttree's load adds none, and the optimizer trains as one
    loaded by Megatron's own code (before, a step written into each empty entry made the
    next step raise KeyError)."""
    stack = testing.build("fp32")
    stack.train(0, K)
    with stack.device:
        state = copy.deepcopy(stack.optimizer.state_dict())
    entries = state["state"]
    assert isinstance(entries, dict)
    _emptied(state, *[index for index in entries if isinstance(index, int)])
    megatrons, ours = fresh_like(stack), fresh_like(stack)
    with megatrons.device:
        megatrons.optimizer.load_state_dict(copy.deepcopy(state))
        opttree.load_state_dict(ours.optimizer, state)
    megatrons.train(K, K)
    ours.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(ours.main_params(), megatrons.main_params(), strict=True))


def test_a_tensor_step_where_the_optimizer_counts_in_an_int_is_refused_before_it_loads() -> None:
    """LaProp counts its steps in Python ints, as its ``state_dict()`` saves them: a tensor
    step loads as it is, and its bias correction then computes in float32, so it trains
    unlike the LaProp that saved it."""
    if "laprop" not in testing.available():
        pytest.skip("no laprop recipe in this lane")
    stack = testing.build("laprop")
    stack.train(0, K)
    with stack.device:
        state = copy.deepcopy(stack.optimizer.state_dict())
    assert isinstance(state, list)
    laprop_entries = state[0]["state"]
    assert all(isinstance(entry["step"], int) for entry in laprop_entries.values())  # as Megatron saves it
    for entry in laprop_entries.values():
        entry["step"] = torch.tensor(float(entry["step"]))

    megatrons = fresh_like(stack)
    with megatrons.device:
        megatrons.optimizer.load_state_dict(copy.deepcopy(state))
    megatrons.train(K, K)
    stack.train(K, K)
    assert not all(torch.equal(a, b) for a, b in zip(megatrons.main_params(), stack.main_params(), strict=True))

    ours = fresh_like(stack)
    with ours.device, pytest.raises(opttree.UnsupportedCheckpoint, match="its 'step' is a float32 tensor, where LaProp counts steps from 0 in a Python int"):
        opttree.load_state_dict(ours.optimizer, state)


DP_RESHARDABLE = {"distrib_optim_sharding_type": "dp_reshardable"}


@needs_dp_reshardable
@pytest.mark.parametrize("is_loading", [False, True])
def test_a_distributed_optimizers_default_format_is_refused_naming_one_that_loads(is_loading: bool, tmp_path: Path) -> None:
    """Megatron's side: with no format in ``metadata``, a ``DistributedOptimizer`` writes
    ``fully_sharded_model_space``, whose flattened ranges Megatron's own
    ``dist_checkpointing`` refuses (from megatron-core 0.16 on). opttree's error says so and
    names the format to pass, with which the same calls save and load (any mapping: a
    ``dict[str, str]`` type-checks, and a read-only one is passed to Megatron as a dict)."""
    stack = testing.build("dist_bf16")
    stack.train(0, K)
    with stack.device:
        with pytest.raises(CheckpointingException, match="flattened_range"):
            stack.optimizer.sharded_state_dict(model_state(stack), is_loading=is_loading)
        with pytest.raises(opttree.UnsupportedCheckpoint, match=r"writes fully_sharded_model_space, Megatron's default[\s\S]*'dp_reshardable'"):
            opttree.sharded_state_dict(stack.optimizer, model_state(stack), is_loading=is_loading)
        with pytest.raises(opttree.UnsupportedCheckpoint, match="writes fully_sharded_model_space, as metadata asks"):
            opttree.sharded_state_dict(stack.optimizer, model_state(stack), is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_sharded_model_space"})
        dist_checkpointing.save(opttree.sharded_state_dict(stack.optimizer, model_state(stack), metadata=MappingProxyType(DP_RESHARDABLE)), str(tmp_path))
        state = dist_checkpointing.load(opttree.sharded_state_dict(stack.optimizer, model_state(stack), is_loading=True, metadata=DP_RESHARDABLE), str(tmp_path))
    opttree.load_state_dict(stack.optimizer, state)


@needs_dp_reshardable
@pytest.mark.parametrize(("name", "inner"), [("dist_bf16", "AdamW"), ("offload_0.75", "HybridDeviceOptimizer")])
def test_a_loading_state_dict_of_a_fresh_distributed_optimizer_is_refused_saying_how_to_build_its_state(name: str, inner: str, tmp_path: Path) -> None:
    """Megatron's side: its loading ``sharded_state_dict`` of a fresh stack's
    ``DistributedOptimizer`` reads its ``state_dict``, which asserts a step its torch Adam
    does not hold yet (with TE's or apex's, Megatron's ``init_state_fn`` builds it), nor a
    HybridDeviceOptimizer's: a bare ``AssertionError``. opttree refuses before Megatron
    runs, saying how to build the state; once built, the same call loads the checkpoint."""
    stack = testing.build(name)
    stack.train(0, K)
    with stack.device:
        dist_checkpointing.save(opttree.sharded_state_dict(stack.optimizer, model_state(stack), metadata=DP_RESHARDABLE), str(tmp_path))
    loaded = fresh_like(stack)
    with loaded.device:
        with pytest.raises(AssertionError):
            loaded.optimizer.sharded_state_dict(model_state(loaded), is_loading=True, metadata=DP_RESHARDABLE)
        with pytest.raises(opttree.UnsupportedCheckpoint, match=rf"its {inner} holds no step on this rank \(a fresh stack: no parameter stepped\).*_init_optimizer_states_with_dummy_values"):
            opttree.sharded_state_dict(loaded.optimizer, model_state(loaded), is_loading=True, metadata=DP_RESHARDABLE)
        getattr(loaded.optimizer, "chained_optimizers")[0]._init_optimizer_states_with_dummy_values()
        state = dist_checkpointing.load(opttree.sharded_state_dict(loaded.optimizer, model_state(loaded), is_loading=True, metadata=DP_RESHARDABLE), str(tmp_path))
        opttree.load_state_dict(loaded.optimizer, state)


@pytest.mark.parametrize("name", ["frozen_fp16", "frozen_dist_bf16"])
def test_a_chain_holding_a_stub_is_refused_before_megatrons_save_and_load_raise(name: str) -> None:
    """Megatron's side: its stub for frozen layers holds no optimizer, and its own
    ``state_dict`` and ``sharded_state_dict`` read it and raise ``AttributeError``.
    opttree's refuses, saving and loading, before Megatron's runs, naming the stub."""
    stack = testing.build(name)
    stack.train(0, K)
    with stack.device:
        with pytest.raises(AttributeError):
            stack.optimizer.state_dict()
        with pytest.raises(AttributeError):
            stack.optimizer.sharded_state_dict(model_state(stack), metadata=DP_RESHARDABLE)
        for is_loading in (False, True):
            with pytest.raises(opttree.UnsupportedCheckpoint, match=r"at chained\[0\]: key 'optimizer': is a Megatron stub holding no optimizer"):
                opttree.sharded_state_dict(stack.optimizer, model_state(stack), is_loading=is_loading, metadata=DP_RESHARDABLE)


def test_only_a_distributed_optimizers_failing_default_format_is_advised_on() -> None:
    """An error of Megatron's own sharded_state_dict of another cause (a model state dict
    that maps none of the parameters), under a DistributedOptimizer in its default format
    too, gets no word on formats."""
    for name, said in (("fp32", "does not match any model sharded param"), ("dist_bf16", "Model param")):
        stack = testing.build(name)
        stack.train(0, K)
        with stack.device, pytest.raises(opttree.UnsupportedCheckpoint, match=said) as raised:
            opttree.sharded_state_dict(stack.optimizer, {})
        assert "fully_sharded_model_space" not in str(raised.value)


def _dp_reshardable_round_trip(stack: testing.MegatronStack, tmp_path: Path, *, with_opttree: bool) -> testing.MegatronStack:
    """``stack``'s checkpoint in the ``dp_reshardable`` format loaded into a fresh stack
    whose state Megatron's dummy-state init built, as Megatron's training does, by
    Megatron's own load or opttree's. The dummy-state init steps the model's weights too,
    which a whole checkpoint's load gives back; here they are copied back."""
    tmp_path.mkdir(exist_ok=True)
    with stack.device:
        dist_checkpointing.save(stack.optimizer.sharded_state_dict(model_state(stack), metadata=DP_RESHARDABLE), str(tmp_path))
    loaded = fresh_like(stack)
    with loaded.device:
        getattr(loaded.optimizer, "chained_optimizers", [loaded.optimizer])[0]._init_optimizer_states_with_dummy_values()
        wanted = loaded.optimizer.sharded_state_dict(model_state(loaded), is_loading=True, metadata=DP_RESHARDABLE)
        state = dist_checkpointing.load(wanted, str(tmp_path))
        if with_opttree:
            opttree.load_state_dict(loaded.optimizer, state)
        else:
            loaded.optimizer.load_state_dict(state)
        with torch.no_grad():
            for mine, saved in zip(loaded.model.parameters(), stack.model.parameters(), strict=True):
                mine.copy_(saved)
    return loaded


@needs_dp_reshardable
@pytest.mark.parametrize("name", [n for n in ("dist_bf16", "offload_0.75") if n in testing.available()])
@pytest.mark.parametrize("with_opttree", [False, True], ids=["megatron", "opttree"])
def test_a_dp_reshardable_load_gives_every_parameter_the_saved_step(name: str, with_opttree: bool, tmp_path: Path) -> None:
    """Megatron's side: a ``DistributedOptimizer``'s ``dp_reshardable`` load, into a stack
    whose state Megatron's dummy-state init built (one step), leaves every parameter on one
    step tensor holding that 1 where 2 was saved, and training goes on unlike the optimizer
    that saved it. opttree's side: each parameter gets a tensor of its own holding the saved
    step, and training goes on bitwise as it would have; over a HybridDeviceOptimizer too,
    whose sub-optimizers count the steps."""
    stack = testing.build(name)
    stack.train(0, K)
    loaded = _dp_reshardable_round_trip(stack, tmp_path, with_opttree=with_opttree)

    steps = _steps(loaded)
    assert [float(step) for step in steps] == [float(K if with_opttree else 1)] * len(steps)
    assert len({id(step) for step in steps}) == (len(steps) if with_opttree else 1)
    loaded.train(K, K)
    stack.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(loaded.main_params(), stack.main_params(), strict=True)) is with_opttree


@needs_dp_reshardable
@pytest.mark.skipif("offload_0.75" not in testing.available(), reason="no HybridDeviceOptimizer recipe in this lane")
@pytest.mark.parametrize("with_opttree", [False, True], ids=["megatron", "opttree"])
def test_a_dp_reshardable_load_over_a_hybrid_optimizer_leaves_no_bucket_flag(with_opttree: bool, tmp_path: Path) -> None:
    """Megatron's side: megatron-core 0.16's ``dp_reshardable`` load writes its bucket
    state's ``padding`` flag into every state entry of a HybridDeviceOptimizer (0.19's
    does not), which no step reads and a reset refuses as a key it does not know.
    opttree's side: its load leaves no such flag, and a reset after it trains as a
    fresh optimizer, over either release."""
    stack = testing.build("offload_0.75")
    stack.train(0, K)
    loaded = _dp_reshardable_round_trip(stack, tmp_path, with_opttree=with_opttree)

    flagged = [entry for leaf in loaded.leaves() for entry in leaf.state.values() if "padding" in entry]
    if with_opttree or megatron_release() >= (0, 17):
        assert not flagged
        assert not [p for p in opttree.validate(loaded.optimizer) if p.severity is opttree.Severity.ERROR]  # Megatron's shared step warns
        opttree.reset(loaded.optimizer)
        fresh = fresh_like(loaded)
        loaded.train(K, K)
        fresh.train(K, K)
        assert all(torch.equal(a, b) for a, b in zip(loaded.main_params(), fresh.main_params(), strict=True))
    else:
        assert flagged and len(flagged) == sum(len(leaf.state) for leaf in loaded.leaves())
        with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'padding': not in the schema"):
            opttree.reset(loaded.optimizer)


@needs_dp_reshardable
@pytest.mark.skipif("dist_fp32" not in testing.available(), reason="no dist_fp32 recipe in this lane")
@pytest.mark.parametrize("reset_first", [False, True], ids=["trained", "reset"])
def test_a_dp_reshardable_load_of_fp32_weights_runs_outside_autograd(reset_first: bool, tmp_path: Path) -> None:
    """Megatron's side: with fp32 weights the main parameters a ``dp_reshardable`` load
    copies the checkpoint into are views of the model's leaves, and its
    ``_set_main_param_and_optimizer_states`` copies outside ``torch.no_grad()`` (its other
    loads run inside): torch raises, part of the checkpoint loaded. opttree's side: its load
    runs Megatron's inside ``torch.no_grad()``, and training goes on bitwise as the saver's."""
    stack = testing.build("dist_fp32")
    stack.train(0, K)
    if reset_first:
        opttree.reset(stack.optimizer)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place operation"):
        _dp_reshardable_round_trip(stack, tmp_path / "megatron", with_opttree=False)

    loaded = _dp_reshardable_round_trip(stack, tmp_path / "opttree", with_opttree=True)
    assert [float(step) for step in _steps(loaded)] == [float(step) for step in _steps(stack)]
    loaded.train(K, K)
    stack.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(loaded.main_params(), stack.main_params(), strict=True))


def _vision_state(stack: testing.MegatronStack) -> dict[str, object]:
    module = stack.model.module
    assert isinstance(module, MegatronModule)
    return module.sharded_state_dict(prefix="vision.")


@pytest.mark.parametrize("name", [n for n in ("bf16", "fp16") if n in testing.available()])
@pytest.mark.parametrize("with_opttree", [False, True], ids=["megatron", "opttree"])
def test_a_sharded_mimo_checkpoint_of_a_mixed_precision_module_loads_and_trains_on(name: str, with_opttree: bool, tmp_path: Path) -> None:
    """Mimo's ``sharded_state_dict`` moves each module's param groups and loss scaler under
    ``_mimo_`` keys, which its load puts back before loading the module: opttree's checks
    read them as it puts them back, where they once refused every such checkpoint that
    Megatron's own load takes. Training goes on bitwise as the saver's, either way."""
    stack = testing.build(name)
    saver = mimo_over(stack)
    stack.train(0, K)
    with stack.device:
        dist_checkpointing.save(getattr(saver, "sharded_state_dict")(_vision_state(stack)), str(tmp_path))
    loaded = fresh_like(stack)
    mimo = mimo_over(loaded)
    with loaded.device:
        wanted = getattr(mimo, "sharded_state_dict")(_vision_state(loaded), is_loading=True)
        state = dist_checkpointing.load(wanted, str(tmp_path))
        if with_opttree:
            opttree.load_state_dict(mimo, state)
        else:
            getattr(mimo, "load_state_dict")(state)
    loaded.train(K, K)
    stack.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(loaded.main_params(), stack.main_params(), strict=True))


def _everything(stack: testing.MegatronStack) -> list[object]:
    """Every state tensor, param-group option and loss scale of a stack, as values."""
    values: list[object] = []
    for leaf in stack.leaves():
        values += [value.clone() if isinstance(value, torch.Tensor) else value for entry in leaf.state.values() for value in entry.values()]
        values += [{key: value for key, value in group.items() if key != "params"} for group in leaf.param_groups]
    values += [float(member.get_loss_scale()) for member in getattr(stack.optimizer, "chained_optimizers", [stack.optimizer])]
    values += [p.detach().clone() for p in stack.main_params()]
    return values


def _same(a: list[object], b: list[object]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y for x, y in zip(a, b, strict=True))


@needs_dp_reshardable
@pytest.mark.skipif("dist_fp16" not in testing.available(), reason="no dist_fp16 recipe in this lane")
@pytest.mark.parametrize("sharding", ["fully_reshardable", "dp_zero_gather_scatter"])
@pytest.mark.parametrize("with_opttree", [False, True], ids=["megatron", "opttree"])
def test_a_checkpoint_format_without_steps_is_refused_before_megatron_loads_half_of_it(sharding: str, with_opttree: bool, tmp_path: Path) -> None:
    """Megatron's side: its load writes a step tensor into every state entry of torch's
    AdamW and then copies the checkpoint's tensors into each, and these formats hold no
    step: it raises ``KeyError: 'step'`` with the param groups, steps and loss scale of
    the checkpoint already loaded. opttree's side: its save refuses to write such a
    checkpoint, and its load refuses the one Megatron's save writes, naming the format,
    with the stack as it was."""
    metadata: dict[str, object] = {"distrib_optim_sharding_type": sharding}
    saver = testing.build("dist_fp16")
    saver.train(0, K)
    with saver.device:
        with pytest.raises(opttree.UnsupportedCheckpoint, match=f"a {sharding} checkpoint holds no per-parameter step, and AdamW counts its steps per parameter: no load takes it"):
            opttree.sharded_state_dict(saver.optimizer, model_state(saver), metadata=metadata)
        dist_checkpointing.save(saver.optimizer.sharded_state_dict(model_state(saver), metadata=metadata), str(tmp_path))  # Megatron's own save writes it
    live = testing.build("dist_fp16")
    live.train(0, 2 * K)
    with live.device:
        state = dist_checkpointing.load(live.optimizer.sharded_state_dict(model_state(live), is_loading=True, metadata=metadata), str(tmp_path))
    before = _everything(live)

    if with_opttree:
        with live.device, pytest.raises(opttree.UnsupportedCheckpoint, match=f"a {sharding} checkpoint holds no per-parameter step, and AdamW counts"):
            opttree.load_state_dict(live.optimizer, state)
        assert _same(_everything(live), before)
    else:
        with live.device, pytest.raises(KeyError, match="step"), torch.no_grad():
            live.optimizer.load_state_dict(state)
        assert not _same(_everything(live), before)


def test_a_sharding_type_that_is_not_a_name_is_refused_not_raised_from() -> None:
    stack = testing.build("dist_bf16") if "dist_bf16" in testing.available() else None
    if stack is None:
        pytest.skip("no dist_bf16 recipe in this lane")
    stack.train(0, K)
    with stack.device:
        state = stack.optimizer.state_dict()
    assert isinstance(state, dict)
    state["param_state"], state["param_state_sharding_type"] = {}, ["dp_reshardable"]
    with pytest.raises(opttree.UnsupportedCheckpoint, match=r"param_state_sharding_type': \['dp_reshardable'\] is not one of"):
        opttree.load_state_dict(stack.optimizer, state)


@pytest.mark.parametrize("name", [n for n in ("fp32", "fp16") if n in testing.available()])
def test_a_stack_that_has_not_stepped_is_refused_a_sharded_save_that_no_load_takes(name: str, tmp_path: Path) -> None:
    """Megatron's side: its sharded save of an ``FP32Optimizer`` or a mixed-precision
    wrapper whose torch optimizer has built no history yet writes none, and its load,
    which builds that history first to load into, raises (``dist_checkpointing.load``
    raises torch's ``CheckpointException`` before any ``load_state_dict`` runs). opttree's save refuses it, naming why; after one step it saves."""
    stack = testing.build(name)
    for folder in ("megatron", "opttree", "stepped"):
        (tmp_path / folder).mkdir()
    save(stack, tmp_path / "megatron", with_opttree=False)
    with pytest.raises(CheckpointException, match="CheckpointException"):  # raised by dist_checkpointing's load, before either load_state_dict
        load(fresh_like(stack), tmp_path / "megatron", with_opttree=True)

    with pytest.raises(opttree.UnsupportedCheckpoint, match=r"key 'state': its AdamW has not stepped yet and holds none of the exp_avg, exp_avg_sq it builds with every entry"):
        save(stack, tmp_path / "opttree", with_opttree=True)
    stack.train(0, 1)
    save(stack, tmp_path / "stepped", with_opttree=True)
    loaded = fresh_like(stack)
    load(loaded, tmp_path / "stepped", with_opttree=True)


def state_tensors(stack: testing.MegatronStack) -> list[torch.Tensor]:
    return [v for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("name", [n for n in ("fp32", "bf16") if n in SHARDED_ROUND_TRIP])
def test_a_reset_inside_inference_mode_refuses_the_state_megatrons_load_made_there(name: str, tmp_path: Path) -> None:
    """Megatron's own load inside ``torch.inference_mode()`` (a rollout's) leaves the state
    inference tensors, which no training step outside it can update. A reset inside it
    once zeroed them, reporting success, and the next step raised; it is refused there
    as outside, with nothing changed. opttree's own load of the same checkpoint, in the
    same mode, loads state that trains as a load outside it does."""
    stack = testing.build(name)
    stack.train(0, K)
    save(stack, tmp_path, with_opttree=True)
    by_megatron, by_opttree, outside = fresh_like(stack), fresh_like(stack), fresh_like(stack)
    for loaded, with_opttree in ((by_megatron, False), (by_opttree, True)):
        with loaded.device:
            state = dist_checkpointing.load(loaded.optimizer.sharded_state_dict(model_state(loaded), is_loading=True), str(tmp_path))
            with torch.inference_mode():
                if with_opttree:
                    opttree.load_state_dict(loaded.optimizer, state)
                else:
                    loaded.optimizer.load_state_dict(state)
    load(outside, tmp_path, with_opttree=True)

    assert any(t.is_inference() for t in state_tensors(by_megatron))
    before = [t.clone() for t in state_tensors(by_megatron)]
    with torch.inference_mode():
        problems = opttree.validate(by_megatron.optimizer)
        with pytest.raises(opttree.UnsupportedOptimizerState, match="an inference tensor"):
            opttree.reset(by_megatron.optimizer)
    assert problems and all(p.kind is opttree.ProblemKind.UNWRITABLE_STATE for p in problems)
    assert all(torch.equal(a, b) for a, b in zip(state_tensors(by_megatron), before, strict=True))
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        by_megatron.train(K, 1)  # Megatron's side: its own load made state no step can update

    assert not any(t.is_inference() for t in state_tensors(by_opttree))
    with torch.inference_mode():
        opttree.reset(by_opttree.optimizer)
    opttree.reset(outside.optimizer)
    by_opttree.train(K, K)
    outside.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(by_opttree.main_params(), outside.main_params(), strict=True))


def test_a_distributed_optimizers_load_inside_inference_mode_gives_state_that_trains() -> None:
    """A DistributedOptimizer's in-memory load inside ``torch.inference_mode()``: Megatron's
    own leaves inference tensors (the next step raises); opttree's, in the same mode,
    trains as the load outside it does."""
    if "dist_fp32" not in testing.available():
        pytest.skip(testing.missing_feature("dist_fp32") or "")
    stack = testing.build("dist_fp32")
    stack.train(0, K)
    saved = stack.optimizer.state_dict()
    inside, outside, by_megatron = fresh_like(stack), fresh_like(stack), fresh_like(stack)
    for loaded in (inside, outside, by_megatron):
        loaded.train(0, 1)
    with inside.device, torch.inference_mode():
        opttree.load_state_dict(inside.optimizer, copy.deepcopy(saved))
    with outside.device:
        opttree.load_state_dict(outside.optimizer, copy.deepcopy(saved))
    with by_megatron.device, torch.inference_mode():
        by_megatron.optimizer.load_state_dict(copy.deepcopy(saved))

    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        by_megatron.train(K, 1)
    assert not any(t.is_inference() for t in state_tensors(inside))
    inside.train(K, K)
    outside.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(inside.main_params(), outside.main_params(), strict=True))


OFFLOADED_WITHOUT_PRECISION_AWARE = testing.Recipe(
    "offload_plain", "adam", bf16=True, distributed=True, offload_fraction=0.5, precision_aware=False,
    description="a HybridDeviceOptimizer under the DistributedOptimizer's own main weights",
)
"""Megatron's factory offloading without the precision-aware optimizer (which the offload
recipes use): a configuration its config accepts and trains, whose loading sharded state
dict Megatron cannot build."""


def test_a_loading_sharded_state_dict_that_megatron_fails_after_loading_says_what_stays() -> None:
    """Megatron's loading sharded_state_dict runs its DistributedOptimizer's
    load_state_dict (sharing the step tensors, giving the hybrid's groups a step) and
    then raises KeyError for a parameter, with or without a reset: the refusal said
    nothing changed, and printed the parameter's values, cut after one line."""
    stack = testing.build(OFFLOADED_WITHOUT_PRECISION_AWARE)
    stack.train(0, 3)
    with stack.device, pytest.raises(opttree.UnsupportedCheckpoint) as refused:
        opttree.sharded_state_dict(
            stack.optimizer, model_state(stack), is_loading=True, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
        )

    message = str(refused.value)
    assert "\n" not in message and "raised KeyError: a Tensor of shape" in message and "(a key it did not find)" in message
    assert "loading, it runs the optimizer's load_state_dict first, and what that loaded or built before it raised stays so" in message
    assert [p.kind for p in opttree.validate(stack.optimizer)] == [opttree.ProblemKind.SHARED_STEP]  # what it left
