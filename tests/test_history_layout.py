"""History an optimizer builds ``zeros_like`` its parameter is laid out in memory as the
parameter was when it was built. A parameter laid out anew later (``model.to(memory_format=
torch.channels_last)`` swaps each weight's ``.data``) leaves it in the old layout, which a
reset in place keeps where a fresh optimizer builds the new one: refused, as history of
another shape or dtype is, with ``release=True`` as the way out."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

import pytest
import torch

import opttree
from tests.helpers import snapshot, unchanged

needs_emerging = pytest.mark.skipif(importlib.util.find_spec("emerging_optimizers") is None, reason="no emerging-optimizers in this lane")


def conv() -> torch.nn.Conv2d:
    torch.manual_seed(0)
    return torch.nn.Conv2d(2, 3, 2, bias=False)


def channels_last(model: torch.nn.Conv2d) -> torch.nn.Conv2d:
    """``model.to(memory_format=torch.channels_last)``, as it does it (each parameter's and
    gradient's ``.data`` swapped), which torch 2.13's type stubs do not declare."""
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.contiguous(memory_format=torch.channels_last)
            if param.grad is not None:
                param.grad = param.grad.contiguous(memory_format=torch.channels_last)
    return model


def train(model: torch.nn.Conv2d, optimizer: torch.optim.Optimizer, steps: range) -> None:
    """The same inputs and the same global random numbers (PSGD's noise) at step ``k`` in every run."""
    for k in steps:
        x = torch.randn(2, 2, 5, 5, generator=torch.Generator().manual_seed(1000 + k))
        if model.weight.is_contiguous(memory_format=torch.channels_last):
            x = x.contiguous(memory_format=torch.channels_last)
        torch.manual_seed(2000 + k)
        model.zero_grad()
        torch.autograd.backward(model(x).square().mean())
        optimizer.step()


def psgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    psgd_pro = getattr(importlib.import_module("emerging_optimizers.psgd.psgd"), "PSGDPro")
    optimizer: torch.optim.Optimizer = psgd_pro(params, lr=1e-2)
    return optimizer


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


Build = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def trained_then_channels_last(build: Build) -> tuple[torch.nn.Conv2d, torch.optim.Optimizer]:
    model = conv()
    optimizer = build(list(model.parameters()))
    train(model, optimizer, range(3))
    weight = model.weight
    channels_last(model)
    assert model.weight is weight and weight.is_contiguous(memory_format=torch.channels_last)
    return model, optimizer


def as_fresh(model: torch.nn.Conv2d, optimizer: torch.optim.Optimizer, build: Build) -> bool:
    """Whether three more steps of ``optimizer`` equal a fresh one's over the same weights."""
    twin = channels_last(conv())
    with torch.no_grad():
        twin.weight.copy_(model.weight)
    fresh = build(list(twin.parameters()))
    train(model, optimizer, range(100, 103))
    train(twin, fresh, range(100, 103))
    return torch.equal(model.weight, twin.weight)


def fused_adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


@pytest.mark.parametrize("build", [pytest.param(psgd, marks=needs_emerging), fused_adamw], ids=["psgd", "fused adamw"])
def test_history_of_a_layout_its_parameter_no_longer_has_is_refused(build: Build) -> None:
    """PSGD draws its noise like its history; a fused kernel reads history as
    ``zeros_like`` lays it out."""
    model, optimizer = trained_then_channels_last(build)
    before = snapshot(optimizer)

    problems = opttree.validate(optimizer)
    assert {p.kind for p in problems} == {opttree.ProblemKind.UNSUPPORTED_STATE}
    assert {p.key for p in problems} == ({"exp_avg"} if build is psgd else {"exp_avg", "exp_avg_sq"})
    assert "history laid out with strides (8, 4, 2, 1) where a fresh optimizer builds it with strides (8, 1, 4, 2)" in problems[0].message
    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"memory format changed after it was built.*release=True"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)

    opttree.reset(optimizer, release=True)
    assert as_fresh(model, optimizer, build)


ELEMENTWISE: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "AdamW for-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "Adam amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, initial_accumulator_value=0.1),
    "RMSprop centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, centered=True),
}


@pytest.mark.parametrize("build", ELEMENTWISE.values(), ids=ELEMENTWISE.keys())
def test_elementwise_history_in_an_old_layout_is_reset_and_steps_as_a_fresh_optimizers(build: Build) -> None:
    """An optimizer whose steps are elementwise steps each element of its history alike
    in any memory order: history left in a weight's old layout (a column-major copy
    swapped in through ``.data``, ``channels_last``) is reset in place, and the next steps
    are bitwise a fresh optimizer's, on a weight wide enough for torch's vector loops."""
    x = [torch.randn(9, 64, generator=torch.Generator().manual_seed(k)) for k in range(14)]

    def step(w: torch.nn.Parameter, stepped: torch.optim.Optimizer, k: int) -> None:
        stepped.zero_grad()
        torch.autograd.backward((x[k] @ w.t()).tanh().pow(2).mean())
        stepped.step()

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(48, 64) * 0.3)
    optimizer = build([weight])
    for k in range(3):
        step(weight, optimizer, k)
    weight.data = weight.data.t().contiguous().t()
    old_layout = [v for v in optimizer.state[weight].values() if isinstance(v, torch.Tensor) and v.shape == weight.shape]
    assert old_layout and all(v.stride() == (64, 1) for v in old_layout) and weight.stride() == (1, 48)

    assert opttree.validate(optimizer) == ()
    opttree.reset(optimizer)
    twin = torch.nn.Parameter(weight.detach().clone().t().contiguous().t())
    fresh = build([twin])
    for k in range(10, 14):
        step(weight, optimizer, k)
        step(twin, fresh, k)
    assert torch.equal(weight, twin)

    model, conv_optimizer = trained_then_channels_last(build)
    assert opttree.validate(conv_optimizer) == ()
    opttree.reset(conv_optimizer)
    assert as_fresh(model, conv_optimizer, build)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("relaid", ["order", "gaps"])
@pytest.mark.parametrize("build", ELEMENTWISE.values(), ids=ELEMENTWISE.keys())
def test_elementwise_history_of_complex_weights_in_any_layout_is_reset_and_steps_as_a_fresh_optimizers(
    build: Build, relaid: str, dtype: torch.dtype
) -> None:
    """torch's elementwise optimizers step a complex weight's history as its real view,
    float32 or float64: left in the weight's old memory order, or with gaps between its
    elements, it is reset in place, and the next steps are bitwise a fresh optimizer's."""
    weight, optimizer = stepped_then_relaid(build, relaid, dtype)
    assert any(v.stride() != weight.stride() for v in optimizer.state[weight].values() if v.shape == weight.shape)

    assert opttree.validate(optimizer) == ()
    opttree.reset(optimizer)
    twin = torch.nn.Parameter(laid_out_as_relaid(weight.detach().clone(), relaid))
    fresh = build([twin])
    sine_steps(weight, optimizer, range(3, 9))
    sine_steps(twin, fresh, range(3, 9))
    assert torch.equal(torch.view_as_real(weight), torch.view_as_real(twin))


def stepped_then_relaid(build: Build, relaid: str, dtype: torch.dtype) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    """A weight of ``dtype`` (complex ones with an imaginary part) and ``build``'s optimizer
    over it, three steps in; then its history given gaps between its elements
    (``relaid="gaps"``), or the weight laid out anew in column-major order (``"order"``)."""
    values = torch.randn(29, 67, generator=torch.Generator().manual_seed(0)) * 0.3
    weight = torch.nn.Parameter(values.to(dtype) * (1 + 0.5j) if dtype.is_complex else values.to(dtype))
    optimizer = build([weight])
    sine_steps(weight, optimizer, range(3))
    if relaid == "gaps":
        optimizer.state[weight] = {k: with_row_gaps(v) if v.shape == weight.shape else v for k, v in optimizer.state[weight].items()}
    else:
        weight.data = laid_out_as_relaid(weight.data, relaid)
    return weight, optimizer


def laid_out_as_relaid(tensor: torch.Tensor, relaid: str) -> torch.Tensor:
    return tensor.t().contiguous().t() if relaid == "order" else tensor


def sine_steps(weight: torch.nn.Parameter, optimizer: torch.optim.Optimizer, steps: range) -> None:
    """Gradients of the weight's sine, worked out in at least float32."""
    for k in steps:
        weight.grad = torch.sin(weight.detach().to(torch.promote_types(weight.dtype, torch.float32)) * 0.7 + k).to(weight.dtype)
        optimizer.step()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("build", "relaid"),
    [
        (lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, eps=1e-3), "gaps"),  # 1e-8 is 0 in float16
        (lambda ps: torch.optim.Adadelta(ps, lr=0.1), "order"),
    ],
    ids=["RMSprop momentum, gaps", "Adadelta, old order"],
)
def test_elementwise_history_of_half_precision_weights_is_laid_out_as_a_fresh_optimizers(
    build: Build, relaid: str, dtype: torch.dtype
) -> None:
    """torch's CPU loops round bfloat16 and float16 after each operation where operands
    are laid out unlike each other: elementwise steps over such history, zeroed in place,
    moved weights unlike a fresh optimizer's (``param.add_(buf, alpha=-lr)``). Its layout
    is compared as any schema's is, and the reset refused with nothing changed."""
    weight, optimizer = stepped_then_relaid(build, relaid, dtype)
    before = snapshot(optimizer)

    with pytest.raises(opttree.UnsupportedOptimizerState, match="history laid out with strides"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)

    for key, value in optimizer.state[weight].items():  # what the reset would have done
        if key != "step":
            value.zero_()
    optimizer.state[weight]["step"].zero_()
    twin = torch.nn.Parameter(laid_out_as_relaid(weight.detach().clone(), relaid))
    fresh = build([twin])
    sine_steps(weight, optimizer, range(3, 8))
    sine_steps(twin, fresh, range(3, 8))
    assert not torch.equal(weight.view(torch.int16), twin.view(torch.int16))


@needs_emerging
def test_psgd_history_zeroed_in_its_old_layout_trains_unlike_a_fresh_optimizer() -> None:
    """The other side: what a reset in place would leave. Reset (exactly) while the weight
    is still contiguous, then laid out anew: the zeroed history keeps the old layout, and
    PSGD, which draws its noise with ``randn_like(exp_avg)`` in the history's memory order,
    trains unlike a fresh optimizer."""
    model = conv()
    optimizer = psgd(list(model.parameters()))
    train(model, optimizer, range(3))
    opttree.reset(optimizer)
    channels_last(model)

    assert not as_fresh(model, optimizer, psgd)


def test_history_laid_out_as_a_fresh_optimizer_lays_it_out_is_not_refused() -> None:
    """No false refusal: a parameter that is a strided slice (not dense) gets contiguous
    history from ``zeros_like``, and a transposed one history transposed alike; both as
    built, and as an optimizer built after the change builds them."""
    base = torch.randn(4, 6)
    sliced = torch.nn.Parameter(base[:, ::2])
    transposed = torch.nn.Parameter(torch.randn(5, 3).t())
    optimizer = torch.optim.AdamW([sliced, transposed], lr=1e-2)
    for p in (sliced, transposed):
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert optimizer.state[sliced]["exp_avg"].stride() == (3, 1) and optimizer.state[transposed]["exp_avg"].stride() == (1, 3)

    assert opttree.validate(optimizer) == ()
    opttree.reset(optimizer)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="no torch.optim.Muon in this torch")
def test_history_built_like_a_gradient_set_by_hand_is_refused_and_released() -> None:
    """torch's Muon builds its momentum ``zeros_like`` the gradient, which a gradient set by
    hand may lay out otherwise than its parameter. That gradient says nothing of the next
    one, which autograd lays out as the parameter, and a fresh optimizer builds its momentum
    so: refused (a stale gradient once vouched for PSGD's history, whose reset then stepped
    unlike a fresh one, below). ``release=True`` deletes the entry, which the next step
    builds from the gradient it meets."""
    param = torch.nn.Parameter(torch.randn(6, 4))
    optimizer = torch.optim.Muon([param], lr=1e-2)
    param.grad = torch.randn(4, 6).t()
    optimizer.step()  # type: ignore[no-untyped-call]
    assert optimizer.state[param]["momentum_buffer"].stride() == (1, 6) and param.stride() == (4, 1)

    problems = opttree.validate(optimizer)

    assert [p.key for p in problems] == ["momentum_buffer"] and "release=True" in problems[0].message
    assert opttree.reset(optimizer, release=True).entries_released == 1


def _transposed_slice() -> torch.nn.Parameter:
    """Rows of a weight stored transposed: a parameter with gaps, whose gradient autograd
    lays out contiguous, where ``zeros_like`` of the parameter keeps its column order."""
    return torch.nn.Parameter(torch.randn(16, 40, generator=torch.Generator().manual_seed(1)).t()[:24])


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda ps: torch.optim.Muon(ps, lr=1e-2), marks=pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="no torch.optim.Muon in this torch"), id="torch Muon"),
        pytest.param(psgd, marks=needs_emerging, id="PSGDPro"),
    ],
)
def test_history_built_like_the_gradient_of_a_parameter_with_gaps_is_as_built(build: Build) -> None:
    """History built ``zeros_like`` the gradient (``like_grad``) is laid out as autograd
    lays out the gradient: contiguous for a parameter with gaps. Compared with the
    parameter's own order instead, ordinary training of such a parameter was refused."""
    x = [torch.randn(5, 16, generator=torch.Generator().manual_seed(k)) for k in range(14)]

    def step(w: torch.nn.Parameter, stepped: torch.optim.Optimizer, k: int) -> None:
        torch.manual_seed(1000 + k)
        stepped.zero_grad()
        torch.autograd.backward((x[k] @ w.t()).tanh().pow(2).mean())
        stepped.step()

    weight = _transposed_slice()
    optimizer = build([weight])
    for k in range(3):
        step(weight, optimizer, k)
    history = [v for v in optimizer.state[weight].values() if isinstance(v, torch.Tensor) and v.shape == weight.shape]
    assert weight.stride() == (1, 40) and history and all(v.stride() == (16, 1) for v in history)  # contiguous, as the gradient

    assert opttree.validate(optimizer) == ()
    opttree.reset(optimizer)
    twin = _transposed_slice()
    with torch.no_grad():
        twin.copy_(weight)
    fresh = build([twin])
    for k in range(10, 14):
        step(weight, optimizer, k)
        step(twin, fresh, k)
    assert torch.equal(weight, twin)


@needs_emerging
def test_a_stale_gradient_does_not_vouch_for_history_built_like_the_gradient() -> None:
    """PSGD builds its ``exp_avg`` ``zeros_like`` the gradient. A weight laid out anew
    through ``.data`` keeps its stale gradient until the next backward: history laid out as
    that gradient was taken as built, and PSGD, reset so, stepped unlike a fresh one."""
    x = [torch.randn(9, 64, generator=torch.Generator().manual_seed(k)) for k in range(14)]
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(48, 64) * 0.3)
    optimizer = psgd([weight])

    def step(w: torch.nn.Parameter, stepped: torch.optim.Optimizer, k: int) -> None:
        torch.manual_seed(1000 + k)
        stepped.zero_grad()
        torch.autograd.backward((x[k] @ w.t()).tanh().pow(2).mean())
        stepped.step()

    for k in range(3):
        step(weight, optimizer, k)
    weight.data = weight.data.t().contiguous().t()
    assert weight.grad is not None and weight.grad.stride() == (64, 1)
    before = snapshot(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'exp_avg': history laid out with strides \(64, 1\) where a fresh optimizer builds it with strides \(1, 48\)"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)

    optimizer.state[weight]["exp_avg"].zero_()  # what the reset would have done
    optimizer.state[weight].pop("Q")
    optimizer.state[weight].pop("L")
    optimizer.state[weight]["step"] = 0
    twin = torch.nn.Parameter(weight.detach().clone())
    fresh = psgd([twin])
    for k in range(10, 14):
        step(weight, optimizer, k)
        step(twin, fresh, k)
    assert not torch.equal(weight, twin)


class AdagradPair:
    def __init__(self, optimizers: list[torch.optim.Adagrad]) -> None:
        self.optimizers = optimizers


opttree.register_wrapper(AdagradPair, children=lambda pair: [(f"adagrad{i}", leaf) for i, leaf in enumerate(pair.optimizers)])


def stepped_adagrad(fused: bool) -> tuple[torch.nn.Parameter, torch.optim.Adagrad]:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    optimizer = torch.optim.Adagrad([param], lr=0.01, initial_accumulator_value=0.1, fused=fused, foreach=None if fused else True)
    for i in range(2):
        param.grad = torch.sin(param.detach() * 3 + i)
        optimizer.step()
    return param, optimizer


def with_gaps(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied into every second element of a buffer twice its size."""
    strided = torch.zeros(2 * tensor.numel(), dtype=tensor.dtype)[::2]
    return strided.copy_(tensor)


def test_history_with_gaps_is_refused_in_a_fused_group_and_reset_in_another() -> None:
    """A fused kernel steps history as ``zeros_like`` lays it out: a fused Adagrad whose
    ``sum`` was a slice with gaps (same shape, dtype and order of dimensions) was reset in
    place, and the next step differed from a fresh optimizer's. Refused there, alone and
    in a run of alike leaves, with nothing changed; a foreach Adagrad steps it as a fresh
    one, and is reset."""
    param, fused = stepped_adagrad(fused=True)
    _, other = stepped_adagrad(fused=True)
    fused.state[param]["sum"] = with_gaps(fused.state[param]["sum"])
    before = snapshot(fused)
    for target in (fused, AdagradPair([other, fused])):
        with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'sum': history laid out with strides \(2,\) where a fresh optimizer builds it with strides \(1,\).*runs a fused kernel over it"):
            opttree.reset(target)
    assert unchanged(fused, before)

    mixed = torch.optim.Adagrad([param], lr=0.01, fused=True)  # a fused group, and the gaps in another one
    other_param = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    mixed.add_param_group({"params": [other_param], "fused": False, "foreach": True})
    for weight in (param, other_param):
        weight.grad = torch.ones_like(weight)
    mixed.step()
    mixed.state[other_param]["sum"] = with_gaps(mixed.state[other_param]["sum"])
    assert opttree.validate(mixed) == ()

    param, foreach = stepped_adagrad(fused=False)
    foreach.state[param]["sum"] = with_gaps(foreach.state[param]["sum"])
    opttree.reset(foreach)
    twin = torch.nn.Parameter(param.detach().clone())
    fresh = torch.optim.Adagrad([twin], lr=0.01, initial_accumulator_value=0.1, foreach=True)
    for stepped, weight in ((foreach, param), (fresh, twin)):
        weight.grad = torch.sin(weight.detach() * 3 + 10)
        stepped.step()
    assert torch.equal(param, twin)


def emerging_muon(weight: torch.nn.Parameter) -> torch.optim.Optimizer:
    muon = getattr(importlib.import_module("emerging_optimizers.orthogonalized_optimizers.muon"), "Muon")
    optimizer: torch.optim.Optimizer = muon([weight], lr=1e-2, fp32_matmul_prec="highest")
    return optimizer


def matrix_steps(weight: torch.nn.Parameter, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for k in steps:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(k))
        optimizer.zero_grad()
        torch.autograd.backward((x @ weight.t()).tanh().pow(2).mean())
        optimizer.step()


def stepped_matrix(build: Callable[[torch.nn.Parameter], torch.optim.Optimizer]) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(5, 6) * 0.3)
    optimizer = build(weight)
    matrix_steps(weight, optimizer, range(2))
    return weight, optimizer


@needs_emerging
def test_a_stale_gradient_does_not_vouch_for_history_built_like_its_parameter() -> None:
    """A weight laid out anew through ``.data`` keeps the gradient of its old layout until
    the next backward, which autograd lays out as the weight. History built ``zeros_like``
    the weight (``like_param``, not ``like_grad``) laid out as that stale gradient was
    taken as built: emerging-optimizers' Muon, reset so, stepped unlike a fresh one."""
    weight, optimizer = stepped_matrix(emerging_muon)
    weight.data = weight.data.t().contiguous().t()  # the same values, column-major
    assert weight.grad is not None and weight.grad.stride() == (6, 1)
    before = snapshot(optimizer)

    problems = opttree.validate(optimizer)

    assert [p.key for p in problems] == ["momentum_buffer"]
    assert "strides (6, 1) where a fresh optimizer builds it with strides (1, 5)" in problems[0].message
    with pytest.raises(opttree.UnsupportedOptimizerState, match="history laid out with strides"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)


def with_row_gaps(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (a matrix) copied into every second element of a buffer twice its size:
    its memory order kept, with gaps."""
    strided = torch.zeros(*tensor.shape, 2, dtype=tensor.dtype)[..., 0]
    return strided.copy_(tensor)


@needs_emerging
def test_history_with_gaps_is_refused_where_the_schema_does_not_say_its_steps_are_elementwise() -> None:
    """emerging-optimizers' Muon multiplies its momentum as a matrix: zeroed in place with
    gaps between its elements, it steps unlike a fresh optimizer's dense one, in the last
    bits. Its schema is not ``elementwise``, so such history is refused with nothing
    changed; torch's Adam, whose schema is, is reset and steps as a fresh one."""
    weight, optimizer = stepped_matrix(emerging_muon)
    optimizer.state[weight]["momentum_buffer"] = with_row_gaps(optimizer.state[weight]["momentum_buffer"])
    before = snapshot(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'momentum_buffer': history laid out with strides \(12, 2\) where a fresh optimizer builds it with strides \(6, 1\)"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)

    optimizer.state[weight]["momentum_buffer"].zero_()  # what the reset would have done
    twin = torch.nn.Parameter(weight.detach().clone())
    fresh = emerging_muon(twin)
    matrix_steps(weight, optimizer, range(10, 13))
    matrix_steps(twin, fresh, range(10, 13))
    assert not torch.equal(weight, twin)

    weight, elementwise = stepped_matrix(lambda w: adamw([w]))
    elementwise.state[weight]["exp_avg"] = with_row_gaps(elementwise.state[weight]["exp_avg"])
    opttree.reset(elementwise)
    twin = torch.nn.Parameter(weight.detach().clone())
    fresh = adamw([twin])
    matrix_steps(weight, elementwise, range(10, 13))
    matrix_steps(twin, fresh, range(10, 13))
    assert torch.equal(weight, twin)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"like_grad": {"exp_avg"}}, r"like_grad names \['exp_avg'\], which are not like_param keys"),
        ({"like_param": {"exp_avg"}, "elementwise": "yes"}, "elementwise must be True or False, got 'yes'"),
    ],
)
def test_layout_fields_that_say_nothing_true_are_refused_at_registration(fields: dict[str, object], message: str) -> None:
    with pytest.raises(opttree.RegistrationError, match=message):
        opttree.StateSchema(zero={"exp_avg"}, **fields)  # type: ignore[arg-type]
