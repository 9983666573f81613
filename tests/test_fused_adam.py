"""TransformerEngine and apex FusedAdam, through stand-ins that mirror their state layout."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import opttree
from tests import megatron_parts
from tests.helpers import clone_model, model, refused_in_place, snapshot, train, unchanged, weights_equal
from tests.standins import ApexFusedAdam, TEFusedAdam

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]

CASES: dict[str, Factory] = {
    "te": lambda p: TEFusedAdam(p, lr=1e-2, weight_decay=0.01),
    "te_capturable": lambda p: TEFusedAdam(p, lr=1e-2, capturable=True),
    "te_fp16_moments": lambda p: TEFusedAdam(p, lr=1e-2, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16),
    "te_bf16_moments": lambda p: TEFusedAdam(p, lr=1e-2, exp_avg_dtype=torch.bfloat16),
    "apex": lambda p: ApexFusedAdam(p, lr=1e-2),
    "apex_capturable": lambda p: ApexFusedAdam(p, lr=1e-2, capturable=True),
}


def test_standins_resolve_through_the_real_dotted_paths() -> None:
    assert type(TEFusedAdam([torch.zeros(1)])).__module__ == "transformer_engine.pytorch.optimizers.fused_adam"
    for factory in CASES.values():
        assert not opttree.validate(factory([torch.nn.Parameter(torch.zeros(2))]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_reset_then_train_equals_fresh_then_train(name: str) -> None:
    net = model()
    optimizer = CASES[name](list(net.parameters()))
    train(net, optimizer, 0, 4)
    twin = clone_model(net)
    fresh = CASES[name](list(twin.parameters()))

    report = opttree.reset(optimizer)

    assert report.steps == 1  # one group, one per-group counter
    train(net, optimizer, 4, 4)
    train(twin, fresh, 4, 4)
    assert weights_equal(net, twin)


def test_per_group_int_step_becomes_zero() -> None:
    net = model()
    optimizer = TEFusedAdam(net.parameters())
    train(net, optimizer, 0, 3)

    opttree.reset(optimizer)

    assert optimizer.param_groups[0]["step"] == 0


def test_capturable_step_tensor_is_zeroed_in_place() -> None:
    net = model()
    optimizer = TEFusedAdam(net.parameters(), capturable=True)
    train(net, optimizer, 0, 3)
    step = optimizer.param_groups[0]["step"]
    assert isinstance(step, torch.Tensor) and step.dtype == torch.int32 and int(step) == 3

    opttree.reset(optimizer)

    assert optimizer.param_groups[0]["step"] is step and int(step) == 0 and step.dtype == torch.int32


def test_fp16_moment_scales_are_reset_with_the_moments() -> None:
    net = model()
    optimizer = CASES["te_fp16_moments"](list(net.parameters()))
    train(net, optimizer, 0, 3)
    scales = [s for per_param in optimizer._scales.values() for s in per_param.values()]  # type: ignore[attr-defined]
    assert scales and all(float(s) != 1.0 for s in scales)

    opttree.reset(optimizer)

    assert all(float(s) == 1.0 for s in scales)


def test_master_weights_and_int16_remainders_are_kept_bitwise() -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(6, 3).to(torch.bfloat16)
    optimizer = TEFusedAdam(net.parameters(), lr=1e-2, master_weights=True, store_param_remainders=True)
    train_bf16(net, optimizer, 0, 3)
    remainders = [entry["master_param"] for entry in optimizer.state.values()]
    assert all(r.dtype == torch.int16 and r.any() for r in remainders)
    kept = [r.clone() for r in remainders]

    report = opttree.reset(optimizer)

    assert report.kept_keys == ("master_param",) and report.tensors_kept == 2
    assert all(torch.equal(a, b) for a, b in zip(remainders, kept, strict=True))


def train_bf16(net: torch.nn.Module, optimizer: torch.optim.Optimizer, start: int, steps: int) -> None:
    for i in range(start, start + steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        optimizer.zero_grad()
        out: torch.Tensor = net(x)
        torch.autograd.backward(out.float().pow(2).mean())
        optimizer.step()


def test_fp8_moments_are_refused_and_nothing_changes() -> None:
    net = model()
    optimizer = TEFusedAdam(net.parameters())
    train(net, optimizer, 0, 2)
    optimizer.name_to_dtype_map["exp_avg"] = torch.uint8  # as FusedAdam(exp_avg_dtype=torch.uint8)
    before = snapshot(optimizer)

    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"FusedAdam at <root>: key 'exp_avg': FP8"):
        opttree.reset(optimizer)

    assert unchanged(optimizer, before) and optimizer.param_groups[0]["step"] == 2


def test_a_step_in_a_hybrid_optimizers_own_groups_is_deleted_as_a_fresh_one_has_none() -> None:
    """A Megatron load hands a HybridDeviceOptimizer param groups carrying the saved step,
    and it copies its groups into its sub-optimizers' before every step: a step kept or
    zeroed there would overwrite the group step TE's FusedAdam counts with."""
    stack = megatron_parts.hybrid([64, 32, 16, 8], offload=0.5, gpu_optimizer_cls=TEFusedAdam)
    megatron_parts.train_hybrid(stack, 0, 3)
    optimizer, params, device = stack
    with device:
        saved = optimizer.state_dict()
        for group in saved["param_groups"]:
            group["step"] = 3  # as DistributedOptimizer.load_state_dict passes them
        optimizer.load_state_dict(saved)
    assert [group.get("step") for group in optimizer.param_groups] == [3]

    report = opttree.reset(optimizer)

    assert [group.get("step") for group in optimizer.param_groups] == [None]
    assert report.steps >= 1
    fresh = megatron_parts.hybrid([64, 32, 16, 8], offload=0.5, gpu_optimizer_cls=TEFusedAdam, like=[p.detach() for p in params])
    megatron_parts.train_hybrid(stack, 3, 3)
    megatron_parts.train_hybrid(fresh, 3, 3)
    assert all(torch.equal(a, b) for a, b in zip(params, fresh[1], strict=True))


@pytest.mark.parametrize("offload", [1.0, 0.5])
def test_a_partial_reset_of_all_a_hybrid_groups_parameters_takes_its_own_group_step(offload: float) -> None:
    """A selection names the copies the sub-optimizers step, not the hybrid's own
    parameters: its groups are matched through them, neither kept in silence (every
    parameter copied) nor refused as partly selected (some of them copied)."""
    stack = megatron_parts.hybrid([8, 6, 4, 2], offload=offload)
    megatron_parts.train_hybrid(stack, 0, 3)
    optimizer, params, device = stack
    with device:
        saved = optimizer.state_dict()
        for group in saved["param_groups"]:
            group["step"] = 3
        optimizer.load_state_dict(saved)

    opttree.reset(optimizer, params=params, keys=["exp_avg", "exp_avg_sq", "step"])

    assert [group.get("step") for group in optimizer.param_groups] == [None]


def test_one_group_step_tensor_held_by_two_groups_is_unshared() -> None:
    net = model()
    params = list(net.parameters())

    def build(tensors: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return TEFusedAdam([{"params": tensors[:2]}, {"params": tensors[2:]}], lr=1e-2, capturable=True)

    optimizer = build(params)
    train(net, optimizer, 0, 3)
    optimizer.param_groups[1]["step"] = optimizer.param_groups[0]["step"]
    twin = clone_model(net)
    fresh = build(list(twin.parameters()))

    problems = opttree.validate(optimizer)
    opttree.reset(optimizer)

    assert [problem.kind for problem in problems] == [opttree.ProblemKind.SHARED_STEP]
    assert optimizer.param_groups[1]["step"] is not optimizer.param_groups[0]["step"]
    train(net, optimizer, 3, 3)
    train(twin, fresh, 3, 3)
    assert weights_equal(net, twin)


@pytest.mark.parametrize("name", ["te", "apex"])
def test_an_entry_lacking_a_moment_is_refused_where_the_next_step_would_raise(name: str) -> None:
    """TE's and apex's FusedAdam build both moments where an entry is empty and read both
    at every step: an entry holding one is refused in place, where the next step raises."""
    net = model()
    optimizer = CASES[name](list(net.parameters()))
    train(net, optimizer, 0, 2)
    del next(iter(optimizer.state.values()))["exp_avg_sq"]

    refused_in_place(optimizer, "exp_avg_sq", "key 'exp_avg_sq': 1 of its 4 state entries lack it")
    with pytest.raises(KeyError):
        train(net, optimizer, 2, 1)


def stepped_te(**options: object) -> tuple[list[torch.nn.Parameter], TEFusedAdam]:
    params = [torch.nn.Parameter(torch.linspace(-1, 1, 8)) for _ in range(2)]
    optimizer = TEFusedAdam(params, lr=1e-2, **options)  # type: ignore[arg-type]
    for i in range(3):
        for p in params:
            p.grad = torch.linspace(-1, 1, 8).sin() * (i + 1)
        optimizer.step()
    return params, optimizer


@pytest.mark.parametrize(("options", "advice"), [
    ({"exp_avg_dtype": torch.float16, "exp_avg_sq_dtype": torch.float16}, "no key of it starts at zero here"),
    ({"exp_avg_dtype": torch.float16}, r"name the keys to change \(keys=\['exp_avg_sq'\] start at zero here\)"),
])
def test_prune_and_scale_refuse_fp16_moments_and_advise_only_keys_they_take(options: dict[str, object], advice: str) -> None:
    """fp16 moments are stored scaled, so zeroing part of one, or multiplying it, would
    have to rescale it: refused with nothing changed, advising only keys that can be taken."""
    _, optimizer = stepped_te(**options)
    before = snapshot(optimizer)
    with pytest.raises(opttree.PartialResetRefused, match=advice):
        opttree.prune(optimizer, 0.5)
    with pytest.raises(opttree.PartialResetRefused, match=advice):
        opttree.scale(optimizer, 0.5)
    assert unchanged(optimizer, before)
    if "keys=" in advice:
        opttree.prune(optimizer, 0.5, keys=["exp_avg_sq"])


def test_bf16_moments_are_pruned_and_scaled_as_fp32_ones_are() -> None:
    """TE keeps bf16 state unscaled (its scale stays the 1 it was made as), so a change in
    place is the change TE's own arithmetic sees."""
    params, optimizer = stepped_te(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    moments = [optimizer.state[p]["exp_avg"] for p in params]
    halved = [m.clone() * 0.5 for m in moments]

    opttree.scale(optimizer, 0.5, keys=["exp_avg"])

    assert all(torch.equal(m, h) for m, h in zip(moments, halved, strict=True))
    assert all(float(s) == 1.0 for per_param in optimizer._scales.values() for s in per_param.values())


def test_the_te_standin_refuses_what_te_refuses_and_scales_what_it_stores_in_place() -> None:
    """As TE 2.x's FusedAdam: capturable takes fp32 state only, and storing an fp16 state
    scales the fp32 values it is given in place (a loaded state dict's too)."""
    with pytest.raises(RuntimeError, match="Capturable mode"):
        TEFusedAdam([torch.nn.Parameter(torch.ones(2))], capturable=True, exp_avg_dtype=torch.float16)
    params, optimizer = stepped_te(exp_avg_dtype=torch.float16)
    given = torch.full((8,), 1e6)
    optimizer.set_scaled_state(params[0], "exp_avg", given)
    assert float(given.abs().max()) < 65504
