"""Reset then train equals fresh then train, bitwise, for each supported torch leaf."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

import opttree
from opttree._report import format_bytes
from tests.helpers import OptimizerFactory, clone_model, model, state_tensors, stepped_lbfgs, train, weights_equal

FACTORIES: dict[str, OptimizerFactory] = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "sgd_dampening": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, dampening=0.5),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_reset_then_train_equals_fresh_then_train(name: str) -> None:
    factory = FACTORIES[name]
    net = model()
    optimizer = factory(list(net.parameters()))
    train(net, optimizer, 0, 4)

    twin = clone_model(net)
    fresh = factory(list(twin.parameters()))
    report = opttree.reset(optimizer)

    assert report.leaves == 1
    train(net, optimizer, 4, 4)
    train(twin, fresh, 4, 4)
    assert weights_equal(net, twin)


@pytest.mark.parametrize("name", ["adam", "adamw_amsgrad", "adam_fused"])
def test_history_and_steps_are_zeroed_in_place(name: str) -> None:
    net = model()
    optimizer = FACTORIES[name](list(net.parameters()))
    train(net, optimizer, 0, 3)
    before = {id(v): (v.data_ptr(), v.dtype, v.device) for _, v in state_tensors(optimizer)}

    report = opttree.reset(optimizer)

    after = state_tensors(optimizer)
    assert {id(v): (v.data_ptr(), v.dtype, v.device) for _, v in after} == before
    assert all(not v.any() for _, v in after)
    steps = [v for k, v in after if k == "step"]
    assert len(steps) == report.steps == 4
    keys = {k for k, _ in after if k != "step"}
    assert report.tensors_zeroed == len(after) - len(steps)
    assert keys >= {"exp_avg", "exp_avg_sq"}


def test_sgd_momentum_buffers_are_dropped() -> None:
    net = model()
    optimizer = FACTORIES["sgd_dampening"](list(net.parameters()))
    train(net, optimizer, 0, 2)

    report = opttree.reset(optimizer)

    assert report.tensors_dropped == 4 and report.tensors_zeroed == 0
    assert all("momentum_buffer" not in entry for entry in optimizer.state.values())


def test_reset_before_first_step_changes_nothing() -> None:
    net = model()
    optimizer = torch.optim.AdamW(net.parameters())

    report = opttree.reset(optimizer)

    assert (report.leaves, report.tensors_zeroed, report.steps) == (1, 0, 0)
    assert len(optimizer.state) == 0
    assert opttree.validate(optimizer) == ()


def test_report_reads_as_one_line_and_as_a_dict() -> None:
    net = model()
    optimizer = torch.optim.AdamW(net.parameters())
    train(net, optimizer, 0, 1)

    report = opttree.reset(optimizer)

    assert "\n" not in str(report)
    assert str(report).startswith("reset 1 optimizers: 8 tensors zeroed")
    values = report.to_dict()
    assert values["tensors_zeroed"] == 8 and values["steps"] == 4
    assert values["bytes_reset"] == 2 * 4 * sum(p.numel() for p in net.parameters())


def test_report_dict_holds_numbers_only_and_the_kept_keys_stay_on_the_report() -> None:
    net = model()
    optimizer = torch.optim.AdamW(net.parameters())
    train(net, optimizer, 0, 1)
    for p in net.parameters():
        optimizer.state[p]["master_param"] = p.detach().clone()

    report = opttree.reset(optimizer)

    assert all(type(value) is int for value in report.to_dict().values())
    assert "kept_keys" not in report.to_dict() and report.kept_keys == ("master_param",)


def test_lbfgs_history_in_lists_counts_in_the_report_and_in_describe() -> None:
    """LBFGS keeps its past directions and steps in lists of tensors: a reset drops them
    with the rest, and both the report and ``describe`` count their tensors and bytes."""
    _, optimizer = stepped_lbfgs()
    (entry,) = optimizer.state.values()
    tensors = [v for v in entry.values() if isinstance(v, torch.Tensor)]
    tensors += [t for v in entry.values() if isinstance(v, list) for t in v if isinstance(t, torch.Tensor)]
    in_lists = len(tensors) - sum(isinstance(v, torch.Tensor) for v in entry.values())
    assert in_lists >= 6  # old_dirs, old_stps and ro hold at least two each
    total = sum(t.nbytes for t in tensors)
    before = dict(entry)

    assert f"state={format_bytes(total)} [float32@cpu {format_bytes(total)}]" in opttree.describe(optimizer)
    assert opttree.validate(optimizer) == ()
    assert entry.keys() == before.keys() and all(entry[key] is value for key, value in before.items())

    report = opttree.reset(optimizer)

    assert (report.tensors_dropped, report.bytes_reset, report.tensors_zeroed) == (len(tensors), total, 0)
    assert entry == {}


FIRST_STEP_FILLS: dict[str, OptimizerFactory] = {
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.01),
}


@pytest.mark.parametrize("name", sorted(FIRST_STEP_FILLS))
def test_entries_built_from_the_lr_at_the_first_step_follow_an_lr_changed_after_the_reset(name: str) -> None:
    """Rprop's ``step_size`` and ASGD's ``eta`` start from the group's lr at the first step:
    the reset deletes their entries, and a scheduler's new lr reaches the next step as it
    reaches a fresh optimizer's. Filled in place, they kept the lr of the reset."""
    net = model()
    optimizer = FIRST_STEP_FILLS[name](list(net.parameters()))
    train(net, optimizer, 0, 3)
    twin = clone_model(net)
    fresh = FIRST_STEP_FILLS[name](list(twin.parameters()))

    report = opttree.reset(optimizer)
    for changed in (optimizer, fresh):
        changed.param_groups[0]["lr"] = 0.003  # a warm-up restarting after the reset

    assert report.entries_released == 4 and len(optimizer.state) == 0
    train(net, optimizer, 3, 3)
    train(twin, fresh, 3, 3)
    assert weights_equal(net, twin)


def test_a_partial_reset_of_a_first_step_fill_is_refused_and_one_leaving_it_alone_is_not() -> None:
    net = model()
    optimizer = torch.optim.Rprop(net.parameters(), lr=0.01)
    train(net, optimizer, 0, 2)
    sizes = [entry["step_size"].clone() for entry in optimizer.state.values()]

    with pytest.raises(opttree.PartialResetRefused, match="its step_size start from its group's values at its first step"):
        opttree.reset(optimizer, keys=["step_size"])
    report = opttree.reset(optimizer, keys=["prev"])

    assert report.tensors_zeroed == 4 and all(not entry["prev"].any() for entry in optimizer.state.values())
    assert all(torch.equal(entry["step_size"], size) for entry, size in zip(optimizer.state.values(), sizes, strict=True))


def test_a_partial_reset_by_parameters_of_a_first_step_fill_says_which_keys_to_name() -> None:
    """A reset by ``params`` alone keeps step counters, so it cannot delete Rprop's entries
    whole: refused, naming the keys that can; given them, the selected entries are deleted,
    and the others kept."""
    net = model()
    optimizer = torch.optim.Rprop(net.parameters(), lr=0.01)
    train(net, optimizer, 0, 2)
    first, *others = list(net.parameters())
    kept = {id(p): optimizer.state[p]["step_size"].clone() for p in others}

    with pytest.raises(opttree.PartialResetRefused, match=r"pass keys=\['prev', 'step', 'step_size'\]"):
        opttree.reset(optimizer, params=[first])
    opttree.reset(optimizer, params=[first], keys=["prev", "step", "step_size"])

    assert first not in optimizer.state
    assert all(torch.equal(optimizer.state[p]["step_size"], kept[id(p)]) for p in others)


def differentiable_run(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights and the gradient through two steps after a reset (``how``) or with a fresh
    optimizer, of a differentiable optimizer over a non-leaf parameter, as in meta-learning."""
    torch.manual_seed(0)
    w = torch.randn(4, 3, requires_grad=True)
    first, then = torch.randn(4, 3), torch.randn(4, 3)
    p = w * 1.0
    optimizer = make([p])
    for i in range(2):
        p.grad = w * first * (i + 1)
        optimizer.step()
    if how == "fresh":
        optimizer = make([p])
    else:
        opttree.reset(optimizer, release=how == "release")
    for i in range(2):
        p.grad = w * then * (i + 1)
        optimizer.step()
    torch.autograd.backward((p**2).sum())
    assert w.grad is not None
    return p.detach().clone(), w.grad.clone()


DIFFERENTIABLE: list[tuple[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer], str]] = [
    ("Adam", lambda ps: torch.optim.Adam(ps, lr=0.01, differentiable=True), "release"),
    ("RMSprop", lambda ps: torch.optim.RMSprop(ps, lr=0.01, differentiable=True), "release"),
    ("SGD", lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, differentiable=True), "reset"),
    ("ASGD", lambda ps: torch.optim.ASGD(ps, lr=0.01, t0=1.0, differentiable=True), "reset"),  # entries deleted, as by a release
]


@pytest.mark.parametrize(("make", "exact"), [case[1:] for case in DIFFERENTIABLE], ids=[case[0] for case in DIFFERENTIABLE])
def test_a_differentiable_optimizers_history_is_not_zeroed_in_place(
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], exact: str
) -> None:
    """Zeroed in place, its history keeps its autograd graph: the weights match a fresh
    optimizer's and the gradients through them do not. Refused, with nothing changed;
    released (or dropped, as SGD's buffer is), the gradients match too."""
    w = torch.randn(4, 3, requires_grad=True)
    p = w * 1.0
    optimizer = make([p])
    p.grad = w * 2.0
    optimizer.step()
    if exact == "release":
        before = {key: value.detach().clone() for key, value in optimizer.state[p].items()}
        with pytest.raises(opttree.UnsupportedOptimizerState, match="differentiable=True and its state carries autograd history"):
            opttree.reset(optimizer)
        assert all(torch.equal(optimizer.state[p][key].detach(), value) for key, value in before.items())

    weights, gradient = differentiable_run(make, exact)
    fresh_weights, fresh_gradient = differentiable_run(make, "fresh")
    assert torch.equal(weights, fresh_weights) and torch.equal(gradient, fresh_gradient)


@pytest.mark.parametrize("name", ["Adagrad", "RMSprop", "Adam"])
@pytest.mark.parametrize("change", ["cast", "resized"])
def test_history_unlike_its_cast_or_resized_parameter_is_refused_and_released_exactly(name: str, change: str) -> None:
    """``module.double()`` after a step, or a weight swapped through ``.data``, leaves the
    history as it was built: zeroed in place it would stay float32 or short, where a fresh
    optimizer builds it as the parameter is now (Adagrad and RMSprop then train apart in
    silence; Adam raises at its next step). Refused with nothing changed; where the
    optimizer rebuilds entries, ``release=True`` trains as a fresh one does."""
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] = lambda ps: getattr(torch.optim, name)(ps, lr=0.01)  # noqa: E731
    net = model()
    optimizer = make(list(net.parameters()))
    train(net, optimizer, 0, 2)
    if change == "cast":
        net.double()
    else:
        weight = next(net.parameters())
        weight.data = torch.cat([weight.data, weight.data])
    before = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in net.parameters()}

    with pytest.raises(opttree.UnsupportedOptimizerState, match="the parameter was cast, reshaped or swapped after it was built"):
        opttree.reset(optimizer)
    assert all(torch.equal(optimizer.state[p][k], v) for p in net.parameters() for k, v in before[id(p)].items())

    if name == "Adagrad":  # it builds its state in __init__: no release
        return
    params = list(net.parameters())
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = make(twins)
    opttree.reset(optimizer, release=True)
    for held, stepping in ((params, optimizer), (twins, fresh)):
        for _ in range(2):
            for p in held:
                p.grad = torch.full_like(p, 0.5)
            stepping.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twins, strict=True))


@pytest.mark.parametrize("change", ["transposed", "flattened", "half beside bfloat16"])
def test_history_of_its_parameters_bytes_but_not_its_shape_or_dtype_is_refused(change: str) -> None:
    """A weight reshaped, or cast to another dtype of its width, keeps the bytes of its
    history: compared tensor by tensor with its own parameter, shape and dtype, it is
    still refused, with nothing changed. Zeroed in place, AdamW would raise at its next
    step, where a fresh one steps; released, it trains as a fresh one does."""
    dtype = torch.bfloat16 if change == "half beside bfloat16" else torch.float32
    net = torch.nn.Linear(3, 2).to(dtype)
    params = list(net.parameters())
    optimizer = torch.optim.AdamW(params, lr=0.01)
    for _ in range(2):
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        optimizer.step()
    weight = net.weight
    if change == "transposed":
        weight.data = weight.data.t().contiguous()
    elif change == "flattened":
        weight.data = weight.data.reshape(6)
    else:
        weight.data = weight.data.to(torch.float16)  # the bias stays bfloat16: the dtypes held are the same
    before = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in params}

    with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'exp_avg': history of shape \\(2, 3\\) .* where its parameter is shape"):
        opttree.reset(optimizer)
    assert opttree.validate(optimizer)[0].key == "exp_avg"
    assert all(torch.equal(optimizer.state[p][k], v) for p in params for k, v in before[id(p)].items())

    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = torch.optim.AdamW(twins, lr=0.01)
    opttree.reset(optimizer, release=True)
    for held, stepping in ((params, optimizer), (twins, fresh)):
        for _ in range(2):
            for p in held:
                p.grad = torch.full_like(p, 0.5)
            stepping.step()
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(params, twins, strict=True))


def test_history_swapped_between_parameters_of_other_dtypes_is_refused() -> None:
    """Totals can hide it: float32 and float64 weights swapped through ``.data`` keep the
    bytes and the dtypes of the whole optimizer; each history against its own parameter
    does not."""
    first, second = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    optimizer = torch.optim.Adagrad([first, second], lr=0.1)
    for p in (first, second):
        p.grad = torch.ones_like(p)
    optimizer.step()
    first.data, second.data = second.data, first.data

    with pytest.raises(opttree.UnsupportedOptimizerState, match="the parameter was cast, reshaped or swapped after it was built"):
        opttree.reset(optimizer)


@pytest.mark.parametrize(
    ("mu_product", "what"),
    [
        (torch.ones(3), "it is a float32 tensor of 3 values"),
        (torch.tensor(True), "it is a bool tensor"),
    ],
    ids=["three-values", "bool"],
)
def test_nadams_mu_product_that_is_not_one_real_value_is_refused(mu_product: torch.Tensor, what: str) -> None:
    """NAdam keeps ``mu_product`` as one value beside any parameter: filled with 1 in place,
    three values would stay three, and the next step would broadcast them into the weight."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.NAdam([param])
    param.grad = torch.ones(3)
    optimizer.step()
    optimizer.state[param]["mu_product"] = mu_product
    kept = mu_product.clone()

    with pytest.raises(opttree.UnsupportedOptimizerState, match=f"key 'mu_product': {what}, where its optimizer keeps one real value"):
        opttree.reset(optimizer)

    assert torch.equal(mu_product, kept) and float(optimizer.state[param]["step"]) == 1


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="this torch has no Adafactor")
@pytest.mark.parametrize(
    ("key", "wrong", "built"),
    [("row_var", (2, 4), r"\(2, 4, 1\)"), ("col_var", (2, 3), r"\(2, 1, 3\)"), ("variance", (3,), None)],
    ids=["row_var", "col_var", "variance"],
)
def test_adafactors_factored_history_of_another_shape_than_its_parameter_builds_is_refused(
    key: str, wrong: tuple[int, ...], built: str | None
) -> None:
    """Adafactor reduces a matrix's history to ``row_var`` and ``col_var`` shaped from the
    parameter's shape; a vector keeps a ``variance`` like it. One of another shape would stay
    so through a reset in place, where a fresh Adafactor builds it from the parameter."""
    shape = (5,) if key == "variance" else (2, 4, 3)
    param = torch.nn.Parameter(torch.randn(*shape))
    optimizer: torch.optim.Optimizer = torch.optim.Adafactor([param])
    param.grad = torch.ones_like(param)
    optimizer.step()
    assert opttree.validate(optimizer) == ()
    optimizer.state[param][key] = torch.ones(wrong)

    expected = rf"key '{key}': history of shape {re.escape(str(wrong))} float32 where its parameter is shape {re.escape(str(shape))} float32 \("
    with pytest.raises(opttree.UnsupportedOptimizerState, match=expected + (f"built as shape {built} float32 for it; " if built else "") + "1 of 1 such"):
        opttree.reset(optimizer)

    assert optimizer.state[param][key].eq(1).all()


def test_nadams_mu_product_cast_by_a_load_is_refused_and_released_exactly() -> None:
    """torch's ``load_state_dict`` casts state to a float64 parameter's dtype, ``mu_product``
    included, which NAdam builds in float32: filled in place it would stay float64 and the
    next steps would differ from a fresh NAdam's. Released, NAdam builds it as a fresh one."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    trained = torch.optim.NAdam([param], decoupled_weight_decay=True)
    for _ in range(3):
        param.grad = torch.randn_like(param)
        trained.step()
    optimizer = torch.optim.NAdam([param], decoupled_weight_decay=True)
    optimizer.load_state_dict(trained.state_dict())
    assert optimizer.state[param]["mu_product"].dtype == torch.float64

    with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'mu_product': it is float64, where its optimizer builds it in float32: .*release=True"):
        opttree.reset(optimizer)
    opttree.reset(optimizer, release=True)

    twin = torch.nn.Parameter(param.detach().clone())
    fresh = torch.optim.NAdam([twin], decoupled_weight_decay=True)
    for _ in range(3):
        grad = torch.randn_like(param)
        param.grad, twin.grad = grad, grad.clone()
        optimizer.step()
        fresh.step()
    assert torch.equal(param, twin)


def _lbfgs_steps(weight: torch.nn.Parameter, optimizer: torch.optim.Optimizer) -> None:
    def closure() -> float:
        optimizer.zero_grad()
        loss = weight.pow(2).sum()
        torch.autograd.backward(loss)
        return float(loss)

    optimizer.step(closure)


@pytest.mark.parametrize("release", [False, True])
def test_lbfgs_derives_its_parameters_size_again_after_a_reset(release: bool) -> None:
    """LBFGS caches its parameters' total size (``_numel_cache``) at its first step: kept
    through a reset, a weight resized through ``.data`` since made the next step raise an
    AssertionError where a fresh LBFGS trains. The schema's ``cached`` sets it back to None."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4))
    optimizer = torch.optim.LBFGS([weight], lr=0.1, max_iter=2)
    _lbfgs_steps(weight, optimizer)
    weight.data = torch.randn(6)

    opttree.reset(optimizer, release=release)

    twin = torch.nn.Parameter(weight.detach().clone())
    fresh = torch.optim.LBFGS([twin], lr=0.1, max_iter=2)
    _lbfgs_steps(weight, optimizer)
    _lbfgs_steps(twin, fresh)
    assert torch.equal(weight, twin)


def test_a_cached_attribute_holding_a_tensor_is_named_by_the_schema() -> None:
    """A tensor in an attribute the schema names as ``cached`` is accounted for: it is set
    back to None, not refused as a tensor the schema does not name."""

    class Caching(torch.optim.AdamW):
        pass

    opttree.register_schema(Caching, opttree.StateSchema(zero={"exp_avg", "exp_avg_sq"}, step=opttree.StepLocation.PER_PARAMETER, cached={"_norms"}))
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = Caching([weight])
    weight.grad = torch.ones(3)
    optimizer.step()
    optimizer._norms = torch.ones(1)  # type: ignore[attr-defined]
    assert opttree.validate(optimizer) == ()
    opttree.reset(optimizer)
    assert optimizer._norms is None  # type: ignore[attr-defined]
