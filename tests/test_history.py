"""prune and scale: history changed in place through the reset's selection and checks,
step counters kept; checked against a straightforward reference (ReLoRA's per-tensor
quantile) on torch leaves and a Megatron recipe."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
from typing import Literal

import pytest
import torch
import torch.distributed as dist

import opttree
from opttree import testing
from tests.helpers import Refuse, RefuseCalls, model, snapshot, stepped_adamw, train, unchanged

HISTORY = ("exp_avg", "exp_avg_sq")


def trained() -> tuple[torch.nn.Module, torch.optim.AdamW]:
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train(net, optimizer, 0, 3)
    return net, optimizer


def history(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [entry[key].clone() for entry in optimizer.state.values() for key in HISTORY]


def steps(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(entry["step"]) for entry in optimizer.state.values()]


def relora_magnitude(tensor: torch.Tensor, fraction: float) -> torch.Tensor:
    magnitude = tensor.abs()
    threshold = torch.quantile(magnitude.flatten().to(torch.float32), fraction).to(tensor.dtype)
    return torch.where(magnitude > threshold, tensor, torch.zeros_like(tensor))  # a mask multiplied in makes inf history NaN


@pytest.mark.parametrize("fraction", [0.0, 0.5, 0.9, 0.99])
def test_magnitude_pruning_matches_the_per_tensor_quantile_and_keeps_steps(fraction: float) -> None:
    _, optimizer = trained()
    expected = [relora_magnitude(t, fraction) for t in history(optimizer)]
    before_steps = steps(optimizer)

    opttree.prune(optimizer, fraction)

    assert all(torch.equal(a, b) for a, b in zip(history(optimizer), expected, strict=True))
    assert steps(optimizer) == before_steps == [3.0] * len(before_steps)


@pytest.mark.parametrize(
    ("values", "fraction"),
    [([1.0, float("inf")], 0.0), ([5.0, 1.0, float("inf")], 0.5), ([1.0, 2.0, 3.0, float("inf")], 0.5), ([1.0, float("inf")], 0.5), ([float("inf")] * 3, 0.5)],
)
def test_overflowed_history_is_ordered_as_torch_quantile_orders_it(values: list[float], fraction: float) -> None:
    """History that overflowed to inf (an fp16 second moment) is the largest: the quantile
    is not NaN, which is above nothing and would prune every element."""
    param = torch.nn.Parameter(torch.zeros(len(values)))
    optimizer = torch.optim.Adam([param])
    param.grad = torch.ones_like(param)
    optimizer.step()
    moment = optimizer.state[param]["exp_avg"]
    moment.copy_(torch.tensor(values))
    expected = relora_magnitude(moment.clone(), fraction)

    opttree.prune(optimizer, fraction, keys=["exp_avg"])

    assert torch.equal(moment, expected)


def bits(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Tensors' bits, which tell -0 from +0 and one NaN from another, as torch.equal does not."""
    return [t.view(torch.int32).tolist() for t in tensors]


@pytest.mark.parametrize("by", ["magnitude", "random"])
def test_pruning_everything_equals_a_reset_of_the_history_keys_bitwise(by: Literal["magnitude", "random"]) -> None:
    """Pruned elements are set to +0, as a reset sets them, where a mask multiplied in
    would leave negative history at -0 and NaN history at NaN."""
    _, pruned = trained()
    _, reset = trained()
    for optimizer in (pruned, reset):
        first = next(iter(optimizer.state.values()))
        first["exp_avg"].view(-1)[0] = float("nan")
        assert (first["exp_avg"] < 0).any()
    opttree.prune(pruned, 1.0, by=by)
    opttree.reset(reset, keys=list(HISTORY))
    assert bits(history(pruned)) == bits(history(reset))
    assert not any(t.any() for t in history(pruned))


def test_random_pruning_is_reproducible_with_a_generator_and_matches_its_reference() -> None:
    _, optimizer = trained()
    generator = torch.Generator().manual_seed(7)
    reference = torch.Generator().manual_seed(7)
    by_key = [entry[key].clone() for key in HISTORY for entry in optimizer.state.values()]  # the draw order
    expected = [t * (torch.rand(t.shape, generator=reference) > 0.9).to(t.dtype) for t in by_key]

    opttree.prune(optimizer, 0.9, by="random", generator=generator)

    after = [entry[key] for key in HISTORY for entry in optimizer.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(after, expected, strict=True))


def test_prune_and_scale_run_under_none_of_the_callers_modes() -> None:
    """As a reset's, their writes are plain torch calls: a dispatch mode of the caller's
    (one that refuses everything, here) sees none of them."""
    _, optimizer = trained()
    _, reference = trained()
    with Refuse():  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode is unannotated
        opttree.prune(optimizer, 0.5)
        opttree.scale(optimizer, 0.5, keys=["exp_avg"])
    opttree.prune(reference, 0.5)
    opttree.scale(reference, 0.5, keys=["exp_avg"])
    assert bits(history(optimizer)) == bits(history(reference))


def test_reset_prune_and_scale_make_no_torch_call_a_function_mode_of_the_callers_sees() -> None:
    """Not even ``torch.no_grad()``'s, which a mode entered before them would see."""
    _, optimizer = trained()
    _, reference = trained()
    params = [next(iter(optimizer.state))]
    with RefuseCalls():
        opttree.prune(optimizer, 0.5)
        opttree.scale(optimizer, 0.5, keys=["exp_avg"])
        opttree.prune(optimizer, 0.5, by="random", generator=torch.Generator().manual_seed(0))
        opttree.reset(optimizer, params=params)
    opttree.prune(reference, 0.5)
    opttree.scale(reference, 0.5, keys=["exp_avg"])
    opttree.prune(reference, 0.5, by="random", generator=torch.Generator().manual_seed(0))
    opttree.reset(reference, params=[next(iter(reference.state))])
    assert bits(history(optimizer)) == bits(history(reference))


def test_scale_halves_the_first_moment_only() -> None:
    _, optimizer = trained()
    before = history(optimizer)
    report = opttree.scale(optimizer, 0.5, keys=["exp_avg"])
    after = history(optimizer)
    assert all(torch.equal(a, b * 0.5) for a, b in zip(after[0::2], before[0::2], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(after[1::2], before[1::2], strict=True))
    assert steps(optimizer) == [3.0] * len(steps(optimizer))
    assert str(report).startswith(f"scale 1 optimizers: {len(before) // 2} tensors scaled")
    assert str(opttree.prune(optimizer, 0.5, keys=["exp_avg"])).startswith(f"prune 1 optimizers: {len(before) // 2} tensors pruned")


def test_prune_through_megatron_wrappers_by_parameter_name_keeps_a_checkpointable_state() -> None:
    stack = testing.build("bf16")
    stack.train(0, 3)
    (leaf,) = stack.leaves()
    before = [(entry["exp_avg"].clone(), float(entry["step"])) for entry in leaf.state.values()]

    report = opttree.prune(stack.optimizer, 0.5, params=lambda name: "up" in name, model=stack.model)

    after = [(entry["exp_avg"], float(entry["step"])) for entry in leaf.state.values()]
    changed = [not torch.equal(a, b) for (a, _), (b, _) in zip(after, before, strict=True)]
    assert sum(changed) == 2 and report.tensors_zeroed == 4  # up.weight and up.bias, two keys each
    assert [s for _, s in after] == [s for _, s in before]
    assert opttree.validate(stack.optimizer) == ()
    with stack.device:
        stack.optimizer.state_dict()


def test_what_prune_cannot_change_in_place_is_refused_with_nothing_changed() -> None:
    _, optimizer = trained()
    with pytest.raises(opttree.PartialResetRefused, match="keeps step counters"):
        opttree.prune(optimizer, 0.5, keys=["exp_avg", "step"])
    net = model()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    train(net, sgd, 0, 2)
    buffers = [entry["momentum_buffer"].clone() for entry in sgd.state.values()]
    with pytest.raises(opttree.PartialResetRefused, match="SGD at <root>: key 'momentum_buffer': prune changes history in place, and it is not zero at the start") as refused:
        opttree.prune(sgd, 0.5)
    problem = refused.value.problem
    assert problem is not None and (problem.kind, problem.cls, problem.key) == (opttree.ProblemKind.UNCHANGEABLE_HISTORY, "SGD", "momentum_buffer")
    assert all(torch.equal(entry["momentum_buffer"], b) for entry, b in zip(sgd.state.values(), buffers, strict=True))
    with pytest.raises(opttree.PartialResetRefused, match="fraction must be a number between 0 and 1"):
        opttree.prune(optimizer, 1.5)
    with pytest.raises(opttree.PartialResetRefused, match=r"fraction must be a number between 0 and 1, got '0.5' \(a str\)"):
        opttree.prune(optimizer, "0.5")  # type: ignore[arg-type]  # what an untyped config may pass
    with pytest.raises(opttree.PartialResetRefused, match=r"fraction must be a number between 0 and 1, got an AdamW: the optimizer comes first"):
        opttree.prune(0.5, optimizer)  # type: ignore[arg-type]  # the arguments swapped: named, not printed whole
    with pytest.raises(opttree.PartialResetRefused, match="generator must be a torch.Generator or None, got 0"):
        opttree.prune(optimizer, 0.5, by="random", generator=0)  # type: ignore[arg-type]  # as above


@pytest.mark.parametrize("action", ["prune", "scale"])
def test_history_a_fill_starts_at_zero_is_pruned_and_scaled_and_other_fills_refused(action: str) -> None:
    """Adagrad's ``sum`` starts at its group's ``initial_accumulator_value`` (a fill): at 0,
    the default, it starts at zero as moments do, and is pruned or scaled as they are; at
    0.1 pruning it below its start is refused, changing nothing (torch fills every group's
    from the constructor's value, whatever a group says)."""
    change: Callable[[torch.optim.Optimizer], opttree.ResetReport] = (
        (lambda optimizer: opttree.prune(optimizer, 1.0)) if action == "prune" else (lambda optimizer: opttree.scale(optimizer, 0.0))
    )
    net = model()
    adagrad = torch.optim.Adagrad(net.parameters(), lr=0.1)
    train(net, adagrad, 0, 2)
    steps = [float(entry["step"]) for entry in adagrad.state.values()]

    report = change(adagrad)

    assert (report.tensors_zeroed, report.tensors_filled) == (len(steps), 0)
    assert all(not entry["sum"].any() for entry in adagrad.state.values())
    assert [float(entry["step"]) for entry in adagrad.state.values()] == steps
    filled = torch.optim.Adagrad(net.parameters(), lr=0.1, initial_accumulator_value=0.1)
    train(net, filled, 0, 2)
    before = snapshot(filled)
    with pytest.raises(opttree.PartialResetRefused, match=f"Adagrad at <root>: key 'sum': {action} changes history in place, and it is not zero at the start"):
        change(filled)
    assert unchanged(filled, before)


class FromLearningRate(torch.optim.Optimizer):
    """Builds each entry at its first step from its group's lr, as Rprop builds its
    ``step_size``, and counts no steps."""

    def __init__(self, params: object) -> None:
        super().__init__(params, {"lr": 0.1})  # type: ignore[arg-type]

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                accumulated = self.state[p].setdefault("acc", torch.full_like(p, group["lr"]))
                accumulated.mul_(1.1).add_(p.grad.abs())
                p.sub_(p.grad.sign() * accumulated, alpha=0.01)


def learning_rate(group: Mapping[str, object], defaults: Mapping[str, object]) -> float:
    lr = group["lr"]
    assert isinstance(lr, float)
    return lr


opttree.register_schema(FromLearningRate, opttree.StateSchema(fill={"acc": learning_rate}, rebuilds_missing=True, starts_at_first_step=True))


@pytest.mark.parametrize("change", ["prune", "scale"])
def test_history_a_reset_deletes_rather_than_writes_is_refused_by_prune_and_scale(change: str) -> None:
    """A reset of entries built at the first step deletes them; prune and scale write in
    place and delete nothing, so they refuse, where they reported released entries."""
    net = model()
    optimizer = FromLearningRate(net.parameters())
    train(net, optimizer, 0, 2)
    before = [entry["acc"].clone() for entry in optimizer.state.values()]

    with pytest.raises(opttree.PartialResetRefused, match="FromLearningRate builds its entries at its first step from its group's values"):
        opttree.prune(optimizer, 1.0) if change == "prune" else opttree.scale(optimizer, 0.0)

    assert all(torch.equal(entry["acc"], old) for entry, old in zip(optimizer.state.values(), before, strict=True))


class AdamAndLbfgs:
    """A registered wrapper holding an Adam and an LBFGS, whose dropped keys hold numbers."""

    def __init__(self, adam: torch.optim.Optimizer, lbfgs: torch.optim.Optimizer) -> None:
        self.adam, self.lbfgs = adam, lbfgs


opttree.register_wrapper(AdamAndLbfgs, children=lambda w: [("adam", w.adam), ("lbfgs", w.lbfgs)])


def test_a_refusal_over_history_holding_no_tensor_names_its_leaf() -> None:
    """LBFGS drops counters that are numbers (``func_evals``): the refusal named no leaf
    (class 'history' at '<root>'), where the memory of a tensor names the others'."""
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    adam, lbfgs = torch.optim.Adam([params[0]]), torch.optim.LBFGS([params[1]])
    params[0].grad = torch.ones(3)
    adam.step()

    def closure() -> torch.Tensor:
        lbfgs.zero_grad()
        loss = (params[1] ** 2).sum()
        torch.autograd.backward(loss)
        return loss

    lbfgs.step(closure)  # type: ignore[no-untyped-call]
    for change in (opttree.prune, opttree.scale):
        with pytest.raises(opttree.PartialResetRefused, match="LBFGS at lbfgs: key 'func_evals'") as refused:
            change(AdamAndLbfgs(adam, lbfgs), 0.5)
        assert refused.value.problem is not None and (refused.value.problem.path, refused.value.problem.cls) == ("lbfgs", "LBFGS")


class UnprintableFactor:
    """An argument whose own ``__repr__`` raises: the refusal names its class instead."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@pytest.mark.parametrize(
    "factor",
    [-0.5, float("nan"), float("inf"), 10**400, True, "0.5", torch.tensor([0.5, 0.5]), UnprintableFactor()],
    ids=["negative", "nan", "inf", "int-beyond-float", "bool", "str", "two-element-tensor", "unprintable"],
)
def test_scale_refuses_a_factor_that_would_break_the_next_step(factor: object) -> None:
    _, optimizer = trained()
    before = history(optimizer)
    with pytest.raises(opttree.PartialResetRefused, match="factor must be a finite number >= 0"):
        opttree.scale(optimizer, factor)  # type: ignore[arg-type]  # as above
    assert bits(history(optimizer)) == bits(before)


@pytest.mark.parametrize("factor", [0.0, -0.0, 0])
def test_scale_by_zero_leaves_zeros_as_a_fresh_optimizer_holds_them(factor: float) -> None:
    """Multiplied by zero, a negative first moment became -0.0 (and by -0.0, which passes
    ">= 0", every element did), a zero whose sign bit a fresh optimizer's history never has."""
    _, optimizer = trained()
    assert any(bool(torch.signbit(tensor).any()) for tensor in history(optimizer))
    opttree.scale(optimizer, factor)
    for tensor in history(optimizer):
        assert not torch.signbit(tensor).any() and not tensor.any()


def pruned_shard_matches_its_own_quantile() -> tuple[int, int, bool]:
    """On each rank of a DistributedOptimizer: the threshold is this rank's shard's."""
    stack = testing.build("dist_fp32")
    stack.train(0, 3)
    (leaf,) = stack.leaves()
    expected = [relora_magnitude(entry["exp_avg"], 0.5) for entry in leaf.state.values()]
    opttree.prune(stack.optimizer, 0.5, keys=["exp_avg"])
    after = [entry["exp_avg"] for entry in leaf.state.values()]
    shard = sum(t.numel() for t in after)
    return dist.get_rank(), shard, all(torch.equal(a, b) for a, b in zip(after, expected, strict=True))


def test_on_two_ranks_each_shard_is_pruned_by_its_own_threshold() -> None:
    results = testing.run_ranks(pruned_shard_matches_its_own_quantile, 2)
    assert [rank for rank, _, _ in results] == [0, 1]
    assert all(shard > 0 for _, shard, _ in results) and all(ok for _, _, ok in results)


def test_numpy_and_tensor_numbers_are_numbers() -> None:
    """What a config or a schedule hands over: NumPy scalars and one-element tensors."""
    numpy = pytest.importorskip("numpy")
    _, optimizer = trained()
    _, reference = trained()
    opttree.prune(optimizer, numpy.float32(0.5))
    opttree.scale(optimizer, torch.tensor(0.5), keys=["exp_avg"])
    opttree.prune(reference, 0.5)
    opttree.scale(reference, 0.5, keys=["exp_avg"])
    assert bits(history(optimizer)) == bits(history(reference))


def test_history_of_a_dtype_prune_or_scale_cannot_change_is_refused_before_any_write() -> None:
    """Complex history has no magnitude order, and integer history no fractional scale:
    torch raised from the last parameter's tensor after pruning or scaling the others."""
    params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4, dtype=torch.complex64))]
    optimizer = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    before = history(optimizer)
    with pytest.raises(opttree.PartialResetRefused, match="key 'exp_avg': prune changes float16, bfloat16, float32 or float64 history, and this holds torch.complex64"):
        opttree.prune(optimizer, 0.5)
    assert bits(history(optimizer)) == bits(before)
    opttree.scale(optimizer, 0.5)  # complex history scales
    assert all(torch.equal(a, 0.5 * b) for a, b in zip(history(optimizer), before, strict=True))
    trained_adamw = after_float_history(torch.ones(3, dtype=torch.int32))
    kept = history(trained_adamw)
    with pytest.raises(opttree.PartialResetRefused, match="key 'exp_avg': scale changes floating-point or complex history, and this holds torch.int32"):
        opttree.scale(trained_adamw, 0.5)
    assert bits(history(trained_adamw)) == bits(kept)


def test_scale_refuses_a_factor_that_would_make_history_infinite() -> None:
    _, optimizer = trained()
    before = history(optimizer)
    with pytest.raises(opttree.PartialResetRefused, match=r"AdamW at <root>: key 'exp_avg(_sq)?': scale by 1e\+300 would carry torch.float32 history \(up to .*\) past its largest value"):
        opttree.scale(optimizer, 1e300)
    assert bits(history(optimizer)) == bits(before)
    opttree.scale(optimizer, 2.0)
    assert all(torch.equal(a, 2 * b) for a, b in zip(history(optimizer), before, strict=True))


def one_adamw(history: torch.Tensor, key: str = "exp_avg") -> torch.optim.AdamW:
    """An AdamW over a parameter shaped and typed as ``history`` and an empty one, stepped
    once where torch's AdamW steps that dtype, whose first ``key`` is ``history``."""
    steps = history.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    params = [torch.nn.Parameter(torch.zeros_like(history), requires_grad=steps), torch.nn.Parameter(torch.ones(0))]
    optimizer = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p) if p.requires_grad else None
    optimizer.step()
    optimizer.state[params[0]][key] = history
    return optimizer


def after_float_history(history: torch.Tensor) -> torch.optim.AdamW:
    """An AdamW stepped over a float32 parameter, then holding ``history`` as the
    ``exp_avg`` of a parameter of its dtype and shape that torch's AdamW does not step."""
    first, second = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.zeros_like(history), requires_grad=False)
    optimizer = torch.optim.AdamW([first, second])
    first.grad = torch.ones_like(first)
    optimizer.step()
    optimizer.state[second].update(exp_avg=history, exp_avg_sq=torch.zeros_like(history), step=torch.tensor(1.0))
    return optimizer


@pytest.mark.parametrize(
    ("history", "factor", "reason"),
    [
        (torch.tensor([0.0, 1e-39, 0.0, 0.0]), 1e39, "past its largest value"),  # the factor itself overflows float32
        (torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float16), 1e6, "past its largest value"),
        (torch.tensor([1.0, float("inf"), 0.0, 0.0]), 0.0, "holding inf or NaN"),  # 0 x inf is NaN
        (torch.tensor([1.0, float("nan"), 0.0, 0.0]), 0.5, "holding inf or NaN"),
        (torch.tensor([3e38 + 3e38j, 0, 0, 0], dtype=torch.complex64), 1.25, "past its largest value"),
    ],
    ids=["factor-beyond-float32", "factor-beyond-float16", "zero-times-inf", "nan", "complex-part-beyond-float32"],
)
def test_scale_refuses_what_would_not_be_finite(history: torch.Tensor, factor: float, reason: str) -> None:
    optimizer = after_float_history(history) if history.is_complex() else one_adamw(history)
    before = bits([torch.view_as_real(history) if history.is_complex() else history.float()])
    with pytest.raises(opttree.PartialResetRefused, match=reason):
        opttree.scale(optimizer, factor, keys=["exp_avg"])
    assert bits([torch.view_as_real(history) if history.is_complex() else history.float()]) == before


@pytest.mark.parametrize(("element", "factor"), [(3e38 + 3e38j, 0.5), (3e38 + 3e38j, 1.0), (2e38 + 2e38j, 1.25)])
def test_complex_history_scales_where_both_parts_stay_finite(element: complex, factor: float) -> None:
    """Scaling by a real factor scales each part: a modulus past float32's largest value
    (3e38+3e38j has |z| of 4.2e38) is no overflow."""
    history = torch.tensor([element, 0, 0, 0], dtype=torch.complex64)
    optimizer = after_float_history(history)
    expected = history * factor

    opttree.scale(optimizer, factor, keys=["exp_avg"])

    assert torch.equal(history, expected) and bool(torch.view_as_real(history).isfinite().all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("factor", [0.3, 1 / 3, 1.7])
def test_scale_multiplies_as_a_hand_written_mul_does(dtype: torch.dtype, factor: float) -> None:
    """``tensor.mul_(factor)`` computes half-precision history in float32; torch's CPU
    ``_foreach_mul_`` rounds the factor to the history's dtype first (0.3 is 0.30078125 in
    bfloat16), which scaled about half the elements otherwise."""
    history = (torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 10).to(dtype)
    optimizer = after_float_history(history)
    expected = history.clone().mul_(factor)
    if dtype in (torch.float16, torch.bfloat16):
        foreach = [history.clone()]
        torch._foreach_mul_(foreach, factor)
        assert not torch.equal(foreach[0], expected)  # what a foreach multiply gives instead

    opttree.scale(optimizer, factor, keys=["exp_avg"])

    assert torch.equal(history, expected)


def test_scale_multiplies_each_part_of_complex_history_by_the_real_factor() -> None:
    """A complex product by ``factor + 0j`` adds cross terms that turn a part of -0.0
    into +0.0; the parts each multiplied keep their signs, as ``view_as_real`` shows."""
    history = torch.complex(torch.tensor([-0.0, -0.0, 1.0, -1.0]), torch.tensor([-1.0, 1.0, -0.0, -0.0]))
    optimizer = after_float_history(history)
    expected = torch.view_as_real(history) * 0.5
    assert bits([torch.view_as_real(history.clone().mul_(0.5))]) != bits([expected])  # torch's complex multiply

    opttree.scale(optimizer, 0.5, keys=["exp_avg"])

    assert bits([torch.view_as_real(history)]) == bits([expected])


def test_prune_keeps_an_element_just_above_the_quantile() -> None:
    """The 0.9 quantile of magnitudes 1 and 1 + 2**-23 lies below the second: interpolated
    in float32 it rounded onto it, and both were pruned."""
    history = torch.tensor([1.0, 1.0 + 2.0**-23])
    optimizer = after_float_history(history)

    opttree.prune(optimizer, 0.9, keys=["exp_avg"])

    assert history.tolist() == [0.0, 1.0 + 2.0**-23]


def test_scale_of_float64_history_by_a_factor_beyond_float32_is_not_refused() -> None:
    """torch multiplies float64 history by the factor itself: 1e300 is inf only in float32."""
    history = torch.tensor([1e-300, -2e-300, 3e-300, 0.0], dtype=torch.float64)
    optimizer = after_float_history(history)
    expected = history.clone().mul_(1e300)

    opttree.scale(optimizer, 1e300, params=[optimizer.param_groups[0]["params"][1]], keys=["exp_avg"])

    assert torch.equal(history, expected) and bool(history.isfinite().all())


def test_scale_passes_over_empty_history() -> None:
    optimizer = one_adamw(torch.full((4,), 0.5))
    opttree.scale(optimizer, 2.0, keys=["exp_avg"])
    assert [entry["exp_avg"].tolist() for entry in optimizer.state.values()] == [[1.0] * 4, []]


def test_float8_history_is_refused_by_prune_before_any_write() -> None:
    """torch compares no float8 tensors: prune raised after pruning the tensors before."""
    optimizer = after_float_history(torch.ones(3).to(torch.float8_e4m3fn))
    before = [t.float() for t in history(optimizer)]
    with pytest.raises(opttree.PartialResetRefused, match="key 'exp_avg': .* this holds torch.float8_e4m3fn"):
        opttree.prune(optimizer, 0.5)
    with pytest.raises(opttree.PartialResetRefused, match="key 'exp_avg': .* this holds torch.float8_e4m3fn"):
        opttree.scale(optimizer, 0.5)
    assert bits([t.float() for t in history(optimizer)]) == bits(before)


def test_float64_history_is_pruned_by_a_float64_threshold() -> None:
    """A float32 threshold rounds 1 - k * 1e-9 to 1 and pruned all ten, where three are
    at or below the 0.3 quantile."""
    values = torch.tensor([1 - k * 1e-9 for k in range(10)], dtype=torch.float64)
    optimizer = one_adamw(values.clone())
    opttree.prune(optimizer, 0.3, keys=["exp_avg"])
    pruned = next(iter(optimizer.state.values()))["exp_avg"]
    assert int((pruned == 0).sum()) == 3 and torch.equal(pruned, values * (values > torch.quantile(values, 0.3)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_history_is_compared_with_an_unrounded_threshold(dtype: torch.dtype) -> None:
    """The 0.9 quantile of [1, 1.0078125] is 1.00703; rounded to bfloat16 it is 1.0078125,
    which would prune the element above it too."""
    values = torch.tensor([1.0, 1.0078125], dtype=dtype)
    optimizer = one_adamw(values.clone())
    opttree.prune(optimizer, 0.9, keys=["exp_avg"])
    pruned = next(iter(optimizer.state.values()))["exp_avg"]
    assert pruned.tolist() == [0.0, 1.0078125]


def test_nan_history_is_pruned_and_the_rest_ranked_among_themselves() -> None:
    """11 NaN among 1000: the quantile of the 989 others keeps their largest 1%, where a
    quantile over NaN is NaN and would prune every element."""
    values = torch.arange(1.0, 1001.0)
    values[:11] = float("nan")
    optimizer = one_adamw(values.clone())
    opttree.prune(optimizer, 0.99, keys=["exp_avg"])
    pruned = next(iter(optimizer.state.values()))["exp_avg"]
    finite = values[11:]
    kept = finite > torch.quantile(finite, 0.99)
    assert not pruned[:11].isnan().any() and not pruned[:11].any()
    assert torch.equal(pruned[11:] != 0, kept) and int(kept.sum()) == 10


def inf_on_rank_zero(group: bool) -> tuple[int, str, bool]:
    """History holding inf on rank 0 only: scale refuses there and goes ahead elsewhere,
    unless the ranks agree."""
    optimizer = stepped_adamw(2)
    if dist.get_rank() == 0:
        next(iter(optimizer.state.values()))["exp_avg"][0] = float("inf")
    before = [t.clone() for t in history(optimizer)]
    try:
        opttree.scale(optimizer, 0.5, group=dist.group.WORLD if group else None)
        outcome = "scaled"
    except opttree.PartialResetRefused as error:
        outcome = str(error)
    return dist.get_rank(), outcome, bits(history(optimizer)) == bits(before)


def agreeing() -> tuple[int, str, bool]:
    return inf_on_rank_zero(True)


def alone() -> tuple[int, str, bool]:
    return inf_on_rank_zero(False)


def test_ranks_given_the_group_refuse_a_scale_alike() -> None:
    (_, zero, _), (_, one, one_unchanged) = testing.run_ranks(alone, 2)
    assert "holding inf or NaN" in zero and one == "scaled" and not one_unchanged  # apart

    for rank, outcome, unchanged_here in testing.run_ranks(agreeing, 2):
        assert "holding inf or NaN" in outcome and unchanged_here
        assert rank == 0 or outcome.startswith("rank 0:")


PRUNE_SHORT_OF_MEMORY = textwrap.dedent(
    """
    import resource, torch, opttree
    small = torch.nn.Parameter(torch.randn(1000))
    big = torch.nn.Parameter(torch.randn(20_000_000))  # sorting its history needs far more than the limit leaves
    optimizer = torch.optim.AdamW([small, big])
    small.grad, big.grad = torch.randn_like(small), torch.randn_like(big)
    optimizer.step()
    small.grad = big.grad = None
    before = optimizer.state[small]["exp_avg"].clone()
    with open("/proc/self/status") as status:
        used = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (used + 200 * 2**20, resource.RLIM_INFINITY))
    try:
        opttree.prune(optimizer, 0.5, keys=["exp_avg"])
        print("pruned")
    except Exception as error:
        print(type(error).__name__)
    print("unchanged" if torch.equal(before, optimizer.state[small]["exp_avg"]) else "changed")
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status are Linux's")
def test_a_prune_that_runs_out_of_memory_is_refused_having_changed_nothing() -> None:
    """Ordering by magnitude allocates a sorted copy of each tensor: all are ordered, and
    the masks' buffers allocated, before the first write, so memory running out (a limit
    on the address space stands in for a GPU's) refuses the prune with nothing pruned,
    where the tensors before the large one were pruned and torch's error raised."""
    result = subprocess.run([sys.executable, "-c", PRUNE_SHORT_OF_MEMORY], capture_output=True, text=True, timeout=300)

    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["PartialResetRefused", "unchanged"]


def short_of_memory_on_rank_one() -> tuple[int, str, bool]:
    """Rank 1 holds history too large to order under the address-space limit it sets."""
    import resource

    rank = dist.get_rank()
    torch.manual_seed(rank)
    params = [torch.nn.Parameter(torch.randn(1000))]
    if rank == 1:
        params.append(torch.nn.Parameter(torch.randn(20_000_000)))
    optimizer = torch.optim.AdamW(params)
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    before = optimizer.state[params[0]]["exp_avg"].clone()
    if rank == 1:
        with open("/proc/self/status") as status:
            used = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (used + 200 * 2**20, resource.RLIM_INFINITY))
    try:
        opttree.prune(optimizer, 0.5, keys=["exp_avg"], group=dist.group.WORLD)
        outcome = "pruned"
    except opttree.PartialResetRefused as error:
        outcome = str(error)
    return rank, outcome, torch.equal(before, optimizer.state[params[0]]["exp_avg"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status are Linux's")
def test_ranks_given_the_group_refuse_a_prune_one_of_them_has_no_memory_for() -> None:
    """Each rank orders its tensors and allocates its masks before the ranks agree: rank 1
    running out of memory refuses the prune on both, where rank 0 had pruned already."""
    (zero, zero_says, zero_unchanged), (one, one_says, one_unchanged) = testing.run_ranks(short_of_memory_on_rank_one, 2)
    assert (zero, one) == (0, 1)
    assert zero_says.startswith("rank 1: prune could not allocate") and one_says.startswith("prune could not allocate")
    assert zero_unchanged and one_unchanged


@pytest.mark.skipif("soap" not in testing.available(), reason="no soap recipe in this lane")
def test_prune_without_keys_over_an_identity_names_the_keys_it_could_take() -> None:
    """SOAP's eigenbases start as identities, which pruning toward zero would not give:
    ``prune(optimizer, 0.99)`` is refused, naming the history that starts at zero, and
    pruning those keys goes through."""
    stack = testing.build("soap")
    stack.train(0, 2)
    (soap, *_) = stack.leaves()
    bases = [entry["Q_L"].clone() for entry in soap.state.values()]

    with pytest.raises(opttree.PartialResetRefused, match=r"SOAP at chained\[0\].optimizer: key 'Q_L': prune changes history in place, and it is not zero at the start .*: name the keys to change \(keys=\['L', 'R', 'exp_avg', 'exp_avg_sq'\] start at zero here\)"):
        opttree.prune(stack.optimizer, 0.99)
    assert all(torch.equal(entry["Q_L"], base) for entry, base in zip(soap.state.values(), bases, strict=True))
    report = opttree.prune(stack.optimizer, 0.99, keys=["L", "R", "exp_avg", "exp_avg_sq"])
    assert report.action == "prune" and "Q_L" in report.kept_keys


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.complex64], ids=str)
def test_scale_near_the_largest_value_refuses_or_stays_finite(dtype: torch.dtype) -> None:
    """A product finite in float64 can pass the largest value where torch multiplies with
    the factor rounded (to float16 by torch's CPU ``_foreach_mul_``: 48064 in float16, by
    1.36285, was written as inf); near the limit every scale either refuses or keeps the
    history finite."""
    largest = torch.finfo(dtype).max
    generator = random.Random(0)
    refused = 0
    for _ in range(200):
        factor = 1 + generator.random()
        value = torch.tensor(largest / factor * (1 + (generator.random() - 0.5) * 1e-2)).to(dtype)
        optimizer = after_float_history(torch.stack([value, torch.ones((), dtype=dtype)]))
        try:
            opttree.scale(optimizer, factor, keys=["exp_avg"])
        except opttree.PartialResetRefused:
            refused += 1
            continue
        held = optimizer.state[optimizer.param_groups[0]["params"][1]]["exp_avg"]
        assert bool(torch.isfinite(held).all()), (float(value.real), factor)
    assert 0 < refused < 200


def centered_rmsprop(centered: bool = True) -> tuple[torch.nn.Parameter, torch.optim.RMSprop]:
    """An RMSprop stepped over one gradient until its variance is all but zero."""
    param = torch.nn.Parameter(torch.zeros(16))
    optimizer = torch.optim.RMSprop([param], lr=1e-2, alpha=0.5, centered=centered)
    for _ in range(20):
        param.grad = torch.ones(16)
        optimizer.step()
    return param, optimizer


def test_scaled_apart_centered_rmsprop_history_makes_the_next_step_nan() -> None:
    """torch's side: square_avg less grad_avg squared, made negative, is rooted."""
    param, optimizer = centered_rmsprop()
    for key in ("square_avg", "grad_avg"):
        optimizer.state[param][key].mul_(2.0)
    param.grad = torch.ones(16)
    optimizer.step()
    assert bool(param.isnan().any())


@pytest.mark.parametrize(
    ("change", "keys"),
    [("scale", None), ("scale", ["square_avg"]), ("scale", ["grad_avg"]), ("prune", None), ("prune", ["square_avg"])],
)
def test_prune_and_scale_refuse_history_bound_to_other_history(change: str, keys: list[str] | None) -> None:
    param, optimizer = centered_rmsprop()
    before = {key: value.clone() for key, value in optimizer.state[param].items()}

    with pytest.raises(opttree.PartialResetRefused, match=r"RMSprop at <root>: key '(grad|square)_avg': .*grad_avg, square_avg, whose values bound one another|RMSprop at <root>: key '(grad|square)_avg': its grad_avg, square_avg bound one another"):
        if change == "scale":
            opttree.scale(optimizer, 2.0, keys=keys)
        else:
            opttree.prune(optimizer, 0.5, keys=keys)

    assert all(torch.equal(value, before[key]) for key, value in optimizer.state[param].items())


def test_uncentered_rmsprop_history_and_a_centered_ones_momentum_are_scaled() -> None:
    param, optimizer = centered_rmsprop(centered=False)
    expected = optimizer.state[param]["square_avg"] * 0.5
    opttree.scale(optimizer, 0.5)
    assert torch.equal(optimizer.state[param]["square_avg"], expected)
    param = torch.nn.Parameter(torch.zeros(4))
    centered = torch.optim.RMSprop([param], momentum=0.9, centered=True)
    param.grad = torch.ones(4)
    centered.step()
    opttree.scale(centered, 0.5, keys=["momentum_buffer"])


def test_a_schema_binds_two_or_more_of_its_history_keys_together() -> None:
    with pytest.raises(opttree.RegistrationError, match=r"bound_together names \['a'\]: two or more"):
        opttree.StateSchema(zero={"a", "b"}, bound_together={"a"})
    with pytest.raises(opttree.RegistrationError, match=r"bound_together names \['a', 'c'\]"):
        opttree.StateSchema(zero={"a"}, keep={"c"}, bound_together={"a", "c"})


def test_a_schema_rebuilds_two_or_more_of_its_dropped_keys_together() -> None:
    with pytest.raises(opttree.RegistrationError, match=r"rebuilt_together names \['a'\]: two or more dropped keys"):
        opttree.StateSchema(drop={"a", "b"}, rebuilt_together={"a"})
    with pytest.raises(opttree.RegistrationError, match=r"rebuilt_together names \['a', 'c'\]"):
        opttree.StateSchema(drop={"a"}, zero={"c"}, rebuilt_together={"a", "c"})


def test_bound_history_changed_all_alike_so_as_to_keep_the_bound_is_changed() -> None:
    """Centered RMSprop's square_avg and grad_avg both scaled by at most 1 keep square_avg
    at least grad_avg squared, and a prune of everything is a reset of both; halving one
    alone is refused."""
    param, optimizer = centered_rmsprop()
    square, mean = (optimizer.state[param][key].clone() for key in ("square_avg", "grad_avg"))

    opttree.scale(optimizer, 0.5)

    assert torch.equal(optimizer.state[param]["square_avg"], square * 0.5) and torch.equal(optimizer.state[param]["grad_avg"], mean * 0.5)
    with pytest.raises(opttree.PartialResetRefused, match="square_avg bound one another .* keys names square_avg without grad_avg"):
        opttree.scale(optimizer, 0.5, keys=["square_avg"])
    opttree.prune(optimizer, 1.0)
    assert not optimizer.state[param]["square_avg"].any() and not optimizer.state[param]["grad_avg"].any()
    param.grad = torch.ones(16)
    optimizer.step()
    assert bool(param.isfinite().all())


def test_a_partial_reset_of_some_of_the_history_bound_together_is_refused() -> None:
    """Centered RMSprop's square_avg zeroed under its kept grad_avg: the next step roots a
    negative number and writes NaN into the weights."""
    param, optimizer = centered_rmsprop()
    before = {key: value.clone() for key, value in optimizer.state[param].items()}

    with pytest.raises(opttree.PartialResetRefused, match=r"RMSprop at <root>: key 'square_avg': its grad_avg, square_avg bound one another .* keys names square_avg without grad_avg"):
        opttree.reset(optimizer, keys=["square_avg"])
    assert all(torch.equal(value, before[key]) for key, value in optimizer.state[param].items())
    assert opttree.reset(optimizer, keys=["square_avg", "grad_avg"]).tensors_zeroed == 2

    optimizer.state[param]["grad_avg"].copy_(before["grad_avg"])
    optimizer.state[param]["square_avg"].zero_()  # torch's side: the reset refused, done by hand
    param.grad = torch.ones(16)
    optimizer.step()
    assert bool(param.isnan().any())


class _OwnDtype(torch.Tensor):
    """A tensor subclass whose own ``dtype`` property raises: torch's reader is not it."""

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        raise ValueError("a subclass's own dtype ran")


@pytest.mark.parametrize("action", ["prune", "scale"])
def test_history_of_a_subclass_with_attributes_of_its_own_is_changed_as_torch_reads_it(action: str) -> None:
    """A reset reads history through torch's own readers; prune and scale read a
    subclass's own ``dtype`` and raised its ValueError from inside. They change it as
    plain memory, as a plain tensor of its values would be changed."""
    optimizer = stepped_adamw(2, 8)
    first = next(iter(optimizer.state.values()))
    twin = torch.linspace(-1, 1, 8)  # magnitudes in four pairs: half of them at or below the median
    first["exp_avg"] = twin.clone().as_subclass(_OwnDtype)

    if action == "prune":
        opttree.prune(optimizer, 0.5, keys=["exp_avg"])
        threshold = twin.abs().sort().values[3]
        expected = twin.masked_fill(twin.abs() <= threshold, 0)
    else:
        opttree.scale(optimizer, 0.5, keys=["exp_avg"])
        expected = twin.mul(0.5)

    assert torch.equal(first["exp_avg"].as_subclass(torch.Tensor), expected)
