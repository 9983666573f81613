"""fp16 loss scalers: a reset puts a DynamicGradScaler back to its config's start, as a
fresh optimizer's, or keeps it on request; scalers it does not know are refused."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import cast

import numpy
import pytest
import torch
from megatron.core.optimizer.grad_scaler import DynamicGradScaler

import opttree
from opttree import testing
from tests import megatron_parts

K = 6  # steps whose scaled gradients overflow, backing the scale off, and then grow it (loss_scale_window=2 in the recipe)


def trained() -> tuple[testing.MegatronStack, DynamicGradScaler]:
    stack = testing.build("fp16")
    stack.train(0, K)
    (wrapper,) = getattr(stack.optimizer, "chained_optimizers")
    scaler = wrapper.grad_scaler
    assert isinstance(scaler, DynamicGradScaler)
    return stack, scaler


def fresh_like(stack: testing.MegatronStack) -> testing.MegatronStack:
    fresh = testing.build(stack.name)
    fresh.copy_weights_from(stack)
    return fresh


def same_weights(a: testing.MegatronStack, b: testing.MegatronStack) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.main_params(), b.main_params(), strict=True))


def scaler_state(scaler: DynamicGradScaler) -> tuple[float, int, int]:
    return float(scaler.scale), scaler._growth_tracker, scaler._hysteresis_tracker


def test_reset_trains_like_a_fresh_optimizer_and_keeping_the_scale_does_not() -> None:
    stack, scaler = trained()
    grown = scaler_state(scaler)
    assert grown[0] != 2.0**18  # the recipe's initial_loss_scale

    report = opttree.reset(stack.optimizer)

    assert report.loss_scales_reset == 1 and "1 loss scale reset" in str(report)
    fresh = fresh_like(stack)
    (fresh_wrapper,) = getattr(fresh.optimizer, "chained_optimizers")
    assert scaler_state(scaler) == scaler_state(fresh_wrapper.grad_scaler)
    stack.train(K, 4)
    fresh.train(K, 4)
    assert same_weights(stack, fresh)

    kept, kept_scaler = trained()
    report = opttree.reset(kept.optimizer, keep_loss_scale=True)
    assert report.loss_scales_kept == 1 and report.loss_scales_reset == 0
    assert scaler_state(kept_scaler) == grown
    fresh = fresh_like(kept)
    kept.train(K, 4)
    fresh.train(K, 4)
    assert not same_weights(kept, fresh)  # why the default resets it


def test_the_scale_tensor_is_reset_in_place_and_describe_shows_it() -> None:
    stack, scaler = trained()
    scale = scaler.scale
    assert f"loss_scale={float(scale):.8g} (DynamicGradScaler)" in opttree.describe(stack.optimizer)

    opttree.reset(stack.optimizer)

    assert scaler.scale is scale and float(scale) == 2.0**18
    assert "loss_scale=262144 (DynamicGradScaler)" in opttree.describe(stack.optimizer)


@pytest.mark.parametrize(
    "keep",
    [
        lambda optimizer: opttree.reset(optimizer, keys=["exp_avg"]),
        lambda optimizer: opttree.prune(optimizer, 0.5),
        lambda optimizer: opttree.scale(optimizer, 0.5),
    ],
    ids=["partial-reset", "prune", "scale"],
)
def test_what_keeps_steps_keeps_the_scaler_and_counts_it_kept(keep: Callable[[object], opttree.ResetReport]) -> None:
    stack, scaler = trained()
    before = scaler_state(scaler)
    report = keep(stack.optimizer)
    assert (report.loss_scales_reset, report.loss_scales_kept) == (0, 1) and scaler_state(scaler) == before


def test_a_constant_scaler_is_counted_neither_reset_nor_kept() -> None:
    """A ``ConstantGradScaler`` has nothing to reset: a reset counted it kept where it kept
    steps or the scale, and not otherwise."""
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler

    stack, _ = trained()
    (wrapper,) = getattr(stack.optimizer, "chained_optimizers")
    with stack.device:
        wrapper.grad_scaler = ConstantGradScaler(2.0**10)
    reports = [
        opttree.reset(stack.optimizer),
        opttree.reset(stack.optimizer, keep_loss_scale=True),
        opttree.reset(stack.optimizer, keys=["exp_avg"]),
        opttree.scale(stack.optimizer, 0.5),
    ]
    assert [(report.loss_scales_reset, report.loss_scales_kept) for report in reports] == [(0, 0)] * 4
    assert float(wrapper.get_loss_scale()) == 2.0**10


def test_a_scaler_not_built_from_the_config_is_refused_with_nothing_changed() -> None:
    stack, scaler = trained()
    scaler.hysteresis = 5
    before = [v.clone() for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values()]

    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'grad_scaler': its hysteresis is 5 and the wrapper's config says 2"):
        opttree.reset(stack.optimizer)

    after = [v for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    (problem,) = opttree.validate(stack.optimizer)
    assert problem.key == "grad_scaler" and problem.cls == "Float16OptimizerWithFloat16Params"


def test_a_scaler_of_unknown_class_is_refused() -> None:
    class HomegrownScaler:
        def __init__(self) -> None:
            self._scale = torch.ones(1)

    stack, _ = trained()
    (wrapper,) = getattr(stack.optimizer, "chained_optimizers")
    wrapper.grad_scaler = HomegrownScaler()

    with pytest.raises(opttree.UnsupportedOptimizerState, match="HomegrownScaler: only DynamicGradScaler and ConstantGradScaler"):
        opttree.reset(stack.optimizer)
    assert "loss_scale=1 (HomegrownScaler)" in opttree.describe(stack.optimizer)


class CleanCountingScaler(DynamicGradScaler):
    """A scaler that counts its clean steps, for a warm-up of its own."""

    def update(self, found_inf: bool) -> None:
        self.clean_steps = 0 if found_inf else getattr(self, "clean_steps", 0) + 1
        super().update(found_inf)


def counting_update(self: DynamicGradScaler, found_inf: bool) -> None:
    """``DynamicGradScaler.update`` with a count of its own, patched in from here."""
    setattr(self, "updates", getattr(self, "updates", 0) + 1)


def scaler_state_of(stack: testing.MegatronStack, scaler: DynamicGradScaler) -> list[object]:
    return [*scaler_state(scaler), *(v.clone() for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values())]


@pytest.mark.parametrize("how", ["subclass", "patched class", "instance method"])
def test_a_scaler_running_code_of_its_own_is_refused_with_nothing_changed(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reset puts back what a DynamicGradScaler keeps: a subclass, a patched class or a
    method on the instance may count or keep more (a warm-up's count of clean steps), which
    the reset kept while it reported the scale reset, and the stack trained unlike a fresh
    one. Refused, as a leaf or a wrapper running code of its own is; ``keep_loss_scale``
    leaves the scaler to its owner."""
    stack, scaler = trained()
    if how == "subclass":
        scaler.__class__ = CleanCountingScaler
        expected = r"is a tests\.test_loss_scale\.CleanCountingScaler, which defines update of its own over megatron\.core\.optimizer\.grad_scaler\.DynamicGradScaler"
    elif how == "patched class":
        monkeypatch.setattr(DynamicGradScaler, "update", counting_update)
        expected = r"is a megatron\.core\.optimizer\.grad_scaler\.DynamicGradScaler, whose .*DynamicGradScaler\.update runs code from .*test_loss_scale\.py, outside Megatron"
    else:
        setattr(scaler, "update", counting_update.__get__(scaler))
        expected = r"holds its own update on the instance, otherwise than its class megatron\.core\.optimizer\.grad_scaler\.DynamicGradScaler"
    before = scaler_state_of(stack, scaler)

    (problem,) = opttree.validate(stack.optimizer)
    assert problem.kind is opttree.ProblemKind.UNSUPPORTED_STATE and problem.key == "grad_scaler"
    with pytest.raises(opttree.UnsupportedOptimizerState, match=f"key 'grad_scaler': its loss scaler {expected}"):
        opttree.reset(stack.optimizer)
    after = scaler_state_of(stack, scaler)
    assert len(after) == len(before) and all(torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b for a, b in zip(after, before, strict=True))

    report = opttree.reset(stack.optimizer, keep_loss_scale=True)
    assert report.loss_scales_kept == 1 and report.loss_scales_reset == 0 and list(scaler_state(scaler)) == before[:3]


def test_a_scale_tensor_that_cannot_be_written_is_refused_saying_why() -> None:
    stack, scaler = trained()
    with torch.inference_mode():
        scaler._scale = scaler._scale.clone()

    (problem,) = opttree.validate(stack.optimizer)
    assert problem.key == "grad_scaler" and "its scale tensor cannot be written in place: it is an inference tensor" in problem.message
    with pytest.raises(opttree.UnsupportedOptimizerState, match="it is an inference tensor"):
        opttree.reset(stack.optimizer)


def test_a_scale_tensor_that_cannot_hold_the_initial_scale_is_refused_with_nothing_changed() -> None:
    """An fp16 scale tensor holds at most 65504, below the recipe's initial 2**18: filling
    it would write inf, a scale no fresh optimizer starts from."""
    stack, scaler = trained()
    scaler._scale = scaler._scale.half()
    before = [v.clone() for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values()]

    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'grad_scaler': its scale tensor cannot hold .*262144 is beyond float16's"):
        opttree.reset(stack.optimizer)

    after = [v for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_a_wrapper_twice_in_a_chain_resets_its_scaler_once() -> None:
    stack, scaler = trained()
    (wrapper,) = getattr(stack.optimizer, "chained_optimizers")
    twice = megatron_parts.chained([wrapper, wrapper])

    report = opttree.reset(twice)

    assert report.loss_scales_reset == 1 and "1 loss scale reset" in str(report)
    assert float(scaler.scale) == 2.0**18


def with_min_loss_scale(stack: testing.MegatronStack, min_loss_scale: float) -> testing.MegatronStack:
    """``stack`` with the scaler Megatron's factory builds from ``min_loss_scale`` (its
    config's other values as they are), and that value in the config."""
    (wrapper,) = getattr(stack.optimizer, "chained_optimizers")
    config = wrapper.config
    config.min_loss_scale = min_loss_scale
    with stack.device:
        wrapper.grad_scaler = DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
        )
    return stack


def test_a_min_loss_scale_that_float32_rounds_is_the_configs() -> None:
    """``DynamicGradScaler`` keeps ``min_scale`` in a float32 tensor, where 1e-4 is
    9.99999975e-05: the scaler is still the config's, reset, and trains as a fresh one."""
    stack = with_min_loss_scale(testing.build("fp16"), 1e-4)
    stack.train(0, K)
    (wrapper,) = getattr(stack.optimizer, "chained_optimizers")
    assert float(wrapper.grad_scaler.min_scale) != 1e-4

    assert opttree.reset(stack.optimizer).loss_scales_reset == 1

    fresh = with_min_loss_scale(fresh_like(stack), 1e-4)
    stack.train(K, 4)
    fresh.train(K, 4)
    assert same_weights(stack, fresh)

    wrapper.config.min_loss_scale = 2e-4  # a scaler built from another config is still refused
    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"its min_scale is 9.99999974\d*e-05 and the wrapper's config says 0.0002"):
        opttree.reset(stack.optimizer)


def test_a_min_loss_scale_beyond_a_float_is_reported_not_raised() -> None:
    stack = testing.build("fp16")
    stack.train(0, 2)
    (wrapper,) = getattr(stack.optimizer, "chained_optimizers")
    wrapper.config.min_loss_scale = 10**400
    (problem,) = opttree.validate(stack.optimizer)
    assert problem.key == "grad_scaler" and "its min_scale is 1.0 and the wrapper's config says an int beyond a float's range" in problem.message
    with pytest.raises(opttree.UnsupportedOptimizerState, match="its min_scale is 1.0"):
        opttree.reset(stack.optimizer)


def _freed_scale() -> torch.Tensor:
    scale = torch.tensor([65536.0])
    scale.untyped_storage().resize_(0)  # as an offload that frees storage leaves it
    return scale


@pytest.mark.parametrize(
    "make",
    [_freed_scale, lambda: torch.tensor([1 + 2j]), lambda: torch.nested.nested_tensor([torch.tensor([1.0])])],
    ids=["freed", "complex", "nested"],
)
def test_a_scale_that_cannot_be_read_is_shown_as_unknown_and_refused(make: Callable[[], torch.Tensor]) -> None:
    """``describe`` shows it as ``?`` (it once called ``float()`` on it and raised torch's
    error); ``validate`` names it, and a reset refuses it with nothing changed."""
    stack, scaler = trained()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's nested tensors are a prototype
        scaler._scale = make()
    before = [v.clone() for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values()]

    assert "loss_scale=? (DynamicGradScaler)" in opttree.describe(stack.optimizer)
    (problem,) = opttree.validate(stack.optimizer)
    assert problem.key == "grad_scaler" and problem.severity is opttree.Severity.ERROR
    with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'grad_scaler'"):
        opttree.reset(stack.optimizer)

    after = [v for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize(("name", "value"), [("growth_factor", 4.0), ("backoff_factor", 0.25)])
def test_a_scaler_with_other_factors_than_megatrons_factory_is_refused(name: str, value: float) -> None:
    """Megatron's factory builds every DynamicGradScaler with a growth factor of 2 and a
    backoff factor of 0.5: one built otherwise was built by hand, and its start is not known."""
    stack, scaler = trained()
    setattr(scaler, name, torch.tensor([value]))
    before = [v.clone() for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values()]
    with pytest.raises(opttree.UnsupportedOptimizerState, match=rf"its {name} is {value} and Megatron's factory builds it with"):
        opttree.reset(stack.optimizer)
    after = [v for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert opttree.reset(stack.optimizer, keep_loss_scale=True).loss_scales_kept == 1


@pytest.mark.parametrize("factor", ["growth_factor", "backoff_factor", "min_scale"])
def test_a_scale_that_is_one_of_the_scalers_own_tensors_is_refused_with_nothing_changed(factor: str) -> None:
    """The scaler's other tensors are kept memory, read by name: a scale tensor that is
    its growth factor itself was left out with the scale, and the reset wrote the initial
    scale into the factor, which then grew the scale 262144-fold a window, in silence."""
    stack, scaler = trained()
    shared = getattr(scaler, factor)
    scaler._scale = shared
    before = shared.clone()

    (problem,) = opttree.validate(stack.optimizer)

    assert problem.kind is opttree.ProblemKind.ALIASED_STATE and f"grad_scaler.{factor}" in problem.message
    with pytest.raises(opttree.UnsupportedOptimizerState, match=rf"key 'grad_scaler': shares memory with 'grad_scaler\.{factor}'"):
        opttree.reset(stack.optimizer)
    assert torch.equal(shared, before)


class _Unequal:
    """A value whose own ``==`` raises."""

    def __eq__(self, other: object) -> bool:
        raise ValueError("no ==")

    __hash__ = None  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("owner", "name", "value", "said"),
    [
        ("config", "initial_loss_scale", 2**1024, "no positive, finite initial_loss_scale"),
        ("config", "hysteresis", torch.tensor([2, 2]), "its hysteresis is 2 and the wrapper's config says a Tensor"),
        ("config", "loss_scale", torch.tensor([1.0, 1.0]), "config's loss_scale is a Tensor, where Megatron takes a number or None"),
        ("scaler", "min_scale", _Unequal(), "its min_scale is a _Unequal and the wrapper's config says 1.0"),
        ("scaler", "hysteresis", 10**5000, "its hysteresis is an int beyond a float's range and the wrapper's config says 2"),
        ("scaler", "hysteresis", numpy.int64(3), "its hysteresis is 3 and the wrapper's config says 2"),
    ],
    ids=["int-beyond-float", "tensor-hysteresis", "tensor-loss-scale", "unequal", "int-of-5001-digits", "numpy-int"],  # str() refuses 10**5000
)
def test_a_scaler_or_config_value_that_is_no_number_is_reported_not_raised_from(owner: str, name: str, value: object, said: str) -> None:
    """An int beyond a float, a tensor of several elements and a value whose ``==`` raises
    raised OverflowError, RuntimeError and ValueError from validate and reset."""
    stack, scaler = trained()
    (wrapper,) = getattr(stack.optimizer, "chained_optimizers")
    setattr(wrapper.config if owner == "config" else scaler, name, value)
    before = scaler_state(scaler)

    (problem,) = opttree.validate(stack.optimizer)

    assert problem.key == "grad_scaler" and said in problem.message
    assert "loss_scale=" in opttree.describe(stack.optimizer)
    with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'grad_scaler'"):
        opttree.reset(stack.optimizer)
    assert scaler_state(scaler) == before


@pytest.mark.parametrize("shared_with", ["master weight", "history"])
def test_a_scale_sharing_memory_with_a_weight_or_history_is_refused_with_nothing_changed(shared_with: str) -> None:
    """A reset writes the scale as it writes history: one that is a view of a master weight
    would write the initial scale into that weight, one of history would leave it non-zero."""
    stack, scaler = trained()
    (leaf,) = stack.leaves()
    target = stack.main_params()[0] if shared_with == "master weight" else next(iter(leaf.state.values()))["exp_avg"]
    scaler._scale = target.detach().view(-1)[:1]
    before = target.detach().clone()

    problems = opttree.validate(stack.optimizer)

    (problem,) = problems
    assert problem.kind is opttree.ProblemKind.ALIASED_STATE and "grad_scaler" in f"{problem.key} {problem.message}"
    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"shares memory with"):
        opttree.reset(stack.optimizer)
    assert torch.equal(target.detach(), before) and float(scaler.scale) == float(before.view(-1)[0])


@pytest.mark.parametrize("kept_by", ["keep_loss_scale", "a partial reset of history"])
def test_a_kept_scale_sharing_memory_with_zeroed_history_is_refused_with_nothing_changed(kept_by: str) -> None:
    """A scale the reset keeps is memory it must leave alone: zeroing the history it is a
    view of would set it to 0, and the next step would divide the gradients by it."""
    stack, scaler = trained()
    (leaf,) = stack.leaves()
    history = next(iter(leaf.state.values()))["exp_avg"]
    scaler._scale = history.detach().view(-1)[:1]
    before = history.detach().clone()
    arguments: dict[str, object] = {"keep_loss_scale": True} if kept_by == "keep_loss_scale" else {"keys": ["exp_avg"]}

    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"shares memory with"):
        opttree.reset(stack.optimizer, **arguments)  # type: ignore[arg-type]

    assert torch.equal(history.detach(), before) and float(scaler.scale) == float(before.view(-1)[0]) != 0


MOE_FP16 = testing.Recipe("moe_fp16", "adam", fp16=True, experts=True, description="a dense and an expert fp16 wrapper, chained")


def chain_scales(stack: testing.MegatronStack) -> list[tuple[float, int, int]]:
    return [scaler_state(member.grad_scaler) for member in getattr(stack.optimizer, "chained_optimizers")]


def expert(name: str) -> bool:
    return "expert" in name


def initial_scale(stack: testing.MegatronStack) -> float:
    return float(getattr(stack.optimizer, "chained_optimizers")[0].config.initial_loss_scale)


@pytest.mark.parametrize("how", ["params", "subtree"])
def test_a_reset_of_some_of_a_chains_loss_scalers_is_refused_with_nothing_changed(how: str) -> None:
    """A ChainedOptimizer scales its loss by its first member's scaler and each fp16 member
    unscales by its own: resetting the expert member's alone (its steps taken by a partial
    reset, or its subtree reset) put its scale back to the start and left the other where
    training had moved it, in silence: unlike a fresh optimizer's and unlike the chain's."""
    stack = testing.build(MOE_FP16)
    stack.train(0, K)
    scales = chain_scales(stack)
    assert all(scale[0] != initial_scale(stack) for scale in scales)
    before = [t.clone() for leaf in stack.leaves() for entry in leaf.state.values() for t in entry.values()]

    with pytest.raises(opttree.PartialResetRefused, match=r"loss scalers, of 1 of the 2 fp16 wrappers .*keep_loss_scale=True") as caught:
        if how == "params":
            opttree.reset(stack.optimizer, params=expert, model=stack.model, keys=["exp_avg", "exp_avg_sq", "step"])
        else:
            opttree.reset(opttree.tree(stack.optimizer).children[1])

    assert caught.value.problem is not None and caught.value.problem.kind is opttree.ProblemKind.PARTIAL_LOSS_SCALE
    assert chain_scales(stack) == scales
    after = [t for leaf in stack.leaves() for entry in leaf.state.values() for t in entry.values()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_a_chains_loss_scalers_are_reset_all_together_or_kept_all_together() -> None:
    stack = testing.build(MOE_FP16)
    stack.train(0, K)
    scales = chain_scales(stack)

    kept = opttree.reset(stack.optimizer, params=expert, model=stack.model, keys=["exp_avg", "exp_avg_sq", "step"], keep_loss_scale=True)
    assert kept.loss_scales_reset == 0 and chain_scales(stack) == scales
    assert opttree.reset(stack.optimizer).loss_scales_reset == 2
    config = getattr(stack.optimizer, "chained_optimizers")[0].config
    assert chain_scales(stack) == [(float(config.initial_loss_scale), 0, config.hysteresis)] * 2
    fresh = testing.build(MOE_FP16)
    fresh.copy_weights_from(stack)
    stack.train(K, 3)
    fresh.train(K, 3)
    assert same_weights(stack, fresh)


def test_megatron_scales_a_frozen_chains_loss_by_its_stubs_scaler_which_never_backs_off() -> None:
    """Megatron's side, which opttree leaves as it is: with the dense layers frozen, the
    chain's first member is a stub holding no parameters, whose scaler the chain scales the
    loss by. It sees no gradient, so no overflow, and grows at every window, while the
    expert member unscales by its own scaler, overflows and skips its steps from then on.
    A reset puts both back to the config's start, as a fresh stack's are, and training
    goes on as the fresh stack's: stalled again after a few steps."""
    stack = testing.build("frozen_fp16")
    stack.train(0, 12)
    stub, expert = getattr(stack.optimizer, "chained_optimizers")
    (leaf,) = stack.leaves()
    steps = {float(entry["step"]) for entry in leaf.state.values()}
    stack.train(12, 4)

    assert float(stub.grad_scaler.scale) > 2.0**18 * 2**4 > 2.0**18 > float(expert.grad_scaler.scale)
    assert {float(entry["step"]) for entry in leaf.state.values()} == steps and max(steps) < 12  # no step taken

    opttree.reset(stack.optimizer)
    assert float(stub.grad_scaler.scale) == float(expert.grad_scaler.scale) == 2.0**18
    fresh = fresh_like(stack)
    stack.train(16, 6)
    fresh.train(16, 6)
    assert same_weights(stack, fresh)


def test_a_hysteresis_of_any_whole_number_type_is_reset_and_a_fraction_refused_saying_so() -> None:
    """Megatron counts the hysteresis down whatever whole number type it is (a NumPy int
    from a config read off a file): reset as the scaler holds it. A fraction was refused
    as if the config asked for a constant loss scale."""
    stack, scaler = trained()
    scaler.hysteresis = numpy.int64(2)  # type: ignore[assignment]
    assert opttree.validate(stack.optimizer) == ()
    opttree.reset(stack.optimizer)
    tracker = cast(object, scaler._hysteresis_tracker)
    assert type(tracker) is numpy.int64 and int(tracker) == 2  # as a fresh scaler's starts

    (wrapper,) = getattr(stack.optimizer, "chained_optimizers")
    scaler.hysteresis = wrapper.config.hysteresis = 2.5  # type: ignore[assignment]
    (problem,) = opttree.validate(stack.optimizer)
    assert problem.key == "grad_scaler" and "its hysteresis is 2.5 (a float), where Megatron's factory gives it a whole number" in problem.message
