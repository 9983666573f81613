"""Users' schemas and wrappers: registration, precedence and its errors."""

from __future__ import annotations

import abc
import functools
import math
import re
import types
import subprocess
import sys
from collections.abc import Callable, Iterator
import typing
from typing import Any, Generic, TypeVar, cast

import pytest
import torch
from torch.utils._contextlib import _DecoratorContextManager

import opttree
from tests.copying import CopyingWrapper
from tests.helpers import HomeMade, clone_model, model, snapshot, train, trains_as_fresh, unchanged, weights_equal


class Lion(torch.optim.Optimizer):
    """A home-made Lion: one ``exp_avg`` per parameter, created as zeros, no step counter."""

    def __init__(self, params: object, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr, "beta": 0.9})  # type: ignore[arg-type]

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.sub_(torch.lerp(m, p.grad, 1 - group["beta"]).sign(), alpha=group["lr"])
                m.lerp_(p.grad, 0.01)


class LoraChain:
    """A third-party wrapper: one optimizer per adapter."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers


def lora_children(chain: object) -> Iterator[tuple[str, object]]:
    assert isinstance(chain, LoraChain)
    for name, optimizer in chain.optimizers.items():
        yield f"adapters[{name!r}]", optimizer


opttree.register_schema(Lion, opttree.StateSchema(zero={"exp_avg"}))
opttree.register_wrapper(LoraChain, children=lora_children)


def test_a_registered_schema_resets_a_users_optimizer_exactly() -> None:
    net = model()
    optimizer = Lion(net.parameters(), lr=1e-2)
    train(net, optimizer, 0, 3)
    twin = clone_model(net)
    fresh = Lion(twin.parameters(), lr=1e-2)

    assert opttree.reset(optimizer).tensors_zeroed == 4
    train(net, optimizer, 3, 3)
    train(twin, fresh, 3, 3)
    assert weights_equal(net, twin)


def test_a_registered_wrapper_becomes_a_node_with_labelled_children() -> None:
    chain = LoraChain({"en": torch.optim.AdamW(model(0).parameters()), "de": Lion(model(1).parameters())})

    node = opttree.tree(chain)

    assert isinstance(node, opttree.WrapperNode)
    assert [c.path for c in node.children] == ["adapters['en']", "adapters['de']"]
    assert "Lion" in opttree.describe(chain)


def test_a_failing_children_function_is_a_clear_error() -> None:
    class Broken:
        pass

    def explode(_: object) -> Iterator[tuple[str, object]]:
        raise KeyError("adapters")

    opttree.register_wrapper(Broken, children=explode)
    with pytest.raises(opttree.MalformedWrapper, match=r"Broken at <root>: its children function failed: KeyError"):
        opttree.tree(Broken())


class NestingWrapper:
    """Its children function calls opttree itself, which refuses what it holds."""

    def __init__(self, inner: object) -> None:
        self.inner = inner


class CheckingWrapper:
    """Its children function raises an ``OptTreeError`` of its own, with no problem attached."""


def nested_tree_children(wrapper: object) -> list[tuple[str, object]]:
    assert isinstance(wrapper, NestingWrapper)
    return [("inner", opttree.tree(wrapper.inner).optimizer)]  # NotAnOptimizer, a problem at its own <root>


def own_check_children(wrapper: object) -> list[tuple[str, object]]:
    raise opttree.OptTreeError("the wrapper's own check failed")


opttree.register_wrapper(NestingWrapper, children=nested_tree_children)
opttree.register_wrapper(CheckingWrapper, children=own_check_children)


@pytest.mark.parametrize(
    ("failing", "reason"),
    [(NestingWrapper(None), "NotAnOptimizer: error: NoneType at <root>"), (CheckingWrapper(), "OptTreeError: the wrapper's own check failed")],
    ids=["nested-opttree-call", "own-opttree-error"],
)
def test_an_opttree_error_from_a_children_function_is_its_wrappers_problem(failing: object, reason: str) -> None:
    """Not raised from ``validate`` or ``describe``, nor pinned on the node a nested call's
    problem names: the failing wrapper is refused at its own path, the rest still checked."""
    net = model()
    adamw = torch.optim.AdamW(net.parameters())
    train(net, adamw, 0, 1)
    chain = LoraChain({"bad": cast(torch.optim.Optimizer, failing), "ok": adamw})  # a wrapper holds any registered kind
    cls = type(failing).__qualname__

    (problem,) = opttree.validate(chain)
    assert (problem.kind, problem.path, problem.cls) == (opttree.ProblemKind.MALFORMED_WRAPPER, "adapters['bad']", cls)
    assert f"its children function failed: {reason}" in problem.message
    lines = opttree.describe(chain).splitlines()
    assert [line.split("@")[-1].strip() for line in lines if "(refused" in line] == ["adapters['bad']"]
    assert any("AdamW" in line for line in lines)
    before = snapshot(adamw)
    with pytest.raises(opttree.MalformedWrapper, match=rf"{cls} at adapters\['bad'\]: its children function failed"):
        opttree.reset(chain)
    assert unchanged(adamw, before)


def test_registering_twice_is_refused() -> None:
    with pytest.raises(opttree.RegistrationError, match="registered already"):
        opttree.register_schema(Lion, opttree.StateSchema(zero={"exp_avg"}))
    with pytest.raises(opttree.RegistrationError, match="registered already"):
        opttree.register_wrapper(LoraChain, children=lora_children)


def test_a_class_is_registered_as_a_leaf_or_a_wrapper_not_both() -> None:
    with pytest.raises(opttree.RegistrationError, match="a schema for .*Lion is registered already: a class is a leaf with a schema or a wrapper, not both"):
        opttree.register_wrapper(Lion, children=lambda wrapper: [])
    with pytest.raises(opttree.RegistrationError, match="a wrapper kind for .*LoraChain is registered already"):
        opttree.register_schema(LoraChain, opttree.StateSchema(zero={"exp_avg"}))


class Lookahead(torch.optim.Optimizer):
    """A wrapper that is an optimizer itself: it steps the optimizer it wraps and keeps slow
    weights and a counter of its own in its ``state``, as Lookahead does."""

    def __init__(self, base: torch.optim.Optimizer, *, share_state: bool = False) -> None:
        self.base = base
        super().__init__([p for group in base.param_groups for p in group["params"]], {"alpha": 0.5})
        self.param_groups = base.param_groups
        if share_state:
            self.state = base.state

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        self.base.step()
        if self.state is self.base.state:
            return
        for group in self.param_groups:
            for p in group["params"]:
                own = self.state[p]
                slow = own.setdefault("slow", p.detach().clone())
                own["count"] = own.get("count", 0) + 1
                slow.lerp_(p.detach(), 0.5)


opttree.register_wrapper(Lookahead, children=lambda wrapper: [("base", wrapper.base)] if isinstance(wrapper, Lookahead) else [])


def test_a_registered_wrapper_with_state_of_its_own_is_refused_with_nothing_changed() -> None:
    """Its kind names the optimizer it steps, whose state a reset covers; its own slow
    weights and counter would be kept, and training would not be a fresh one's."""
    net = model()
    wrapper = Lookahead(torch.optim.AdamW(net.parameters(), lr=1e-2))
    train(net, wrapper, 0, 2)
    before = {id(p): ({k: v.clone() for k, v in wrapper.base.state[p].items()}, dict(wrapper.state[p])) for p in net.parameters()}

    problems = opttree.validate(wrapper)
    assert [(p.kind, p.path, p.cls) for p in problems] == [(opttree.ProblemKind.UNSUPPORTED_STATE, "<root>", "Lookahead")]
    assert "holds state of its own (4 of its 4 entries are none of its optimizers', with keys count, slow)" in problems[0].message
    with pytest.raises(opttree.UnsupportedOptimizerState, match="holds state of its own"):
        opttree.reset(wrapper)

    for p in net.parameters():
        history, own = before[id(p)]
        assert all(torch.equal(wrapper.base.state[p][k], v) for k, v in history.items())
        assert wrapper.state[p]["count"] == own["count"] == 2 and wrapper.state[p]["slow"] is own["slow"]


def test_a_registered_wrapper_whose_state_is_its_optimizers_resets_exactly() -> None:
    net, twin = model(), model()
    twin.load_state_dict(net.state_dict())
    wrapper = Lookahead(torch.optim.AdamW(net.parameters(), lr=1e-2), share_state=True)
    train(net, wrapper, 0, 2)
    assert opttree.validate(wrapper) == ()
    opttree.reset(wrapper)
    fresh = Lookahead(torch.optim.AdamW(twin.parameters(), lr=1e-2), share_state=True)
    twin.load_state_dict(net.state_dict())
    train(net, wrapper, 2, 2)
    train(twin, fresh, 2, 2)
    assert weights_equal(net, twin)


def test_a_class_that_two_unrelated_registrations_apply_to_is_refused_not_guessed() -> None:
    """Schemas registered for two abstract classes that an optimizer class is registered
    under: neither is its own, and neither is the built-in schema of its base, SGD."""

    class Momentum(abc.ABC):
        pass

    class Adaptive(abc.ABC):
        pass

    class Both(torch.optim.SGD):
        pass

    opttree.register_schema(Momentum, opttree.StateSchema(drop={"momentum_buffer"}))
    opttree.register_schema(Adaptive, opttree.StateSchema(zero={"exp_avg"}))
    Momentum.register(Both)
    Adaptive.register(Both)
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = Both([param], lr=0.1, momentum=0.9)
    param.grad = torch.ones(3)
    optimizer.step()
    buffer = optimizer.state[param]["momentum_buffer"].clone()

    reason = "registered through both .*Adaptive and .*Momentum, neither a subclass of the other: register .*Both itself"
    (problem,) = opttree.validate(optimizer)
    assert problem.kind is opttree.ProblemKind.UNSUPPORTED_OPTIMIZER and re.search(reason, problem.message)
    assert "Both" in opttree.describe(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizer, match=reason):
        opttree.reset(optimizer)
    assert torch.equal(optimizer.state[param]["momentum_buffer"], buffer)

    opttree.register_schema(Both, opttree.StateSchema(drop={"momentum_buffer"}))
    opttree.reset(optimizer)
    assert "momentum_buffer" not in optimizer.state[param]


def test_a_class_registered_under_an_abc_after_it_was_looked_up_takes_the_abcs_schema() -> None:
    """``ABC.register`` after opttree met the class: the answer kept for it is dropped, as
    singledispatch drops its own, and the schema of the ABC applies."""

    class Buffered(abc.ABC):
        pass

    class Mine(torch.optim.Optimizer):
        def __init__(self, params: list[torch.nn.Parameter]) -> None:
            super().__init__(params, {})

    opttree.register_schema(Buffered, opttree.StateSchema(zero={"buf"}))
    optimizer = Mine([torch.nn.Parameter(torch.ones(2))])
    optimizer.state[optimizer.param_groups[0]["params"][0]]["buf"] = torch.ones(2)
    assert [p.kind for p in opttree.validate(optimizer)] == [opttree.ProblemKind.UNSUPPORTED_OPTIMIZER]

    Buffered.register(Mine)

    assert opttree.validate(optimizer) == ()
    assert opttree.reset(optimizer).tensors_zeroed == 1


def test_a_key_named_history_and_kept_is_refused() -> None:
    with pytest.raises(opttree.RegistrationError, match=r"\['exp_avg'\] are named in both 'zero' and 'keep'"):
        opttree.StateSchema(zero={"exp_avg"}, keep={"exp_avg"})


def test_a_lazily_registered_schema_applies_once_the_class_is_met() -> None:
    opttree.register_schema("tests.test_registration.ShadowSGD", opttree.StateSchema(keep={"momentum_buffer"}))
    net = model()
    optimizer = ShadowSGD(net.parameters(), lr=0.1, momentum=0.9)
    train(net, optimizer, 0, 1)

    report = opttree.reset(optimizer)

    assert report.tensors_dropped == 0 and report.tensors_kept == 4


class ShadowSGD(torch.optim.SGD):
    """Registered by dotted path in the test above, before the class is looked up."""


def test_a_users_schema_wins_over_a_more_specific_builtin_one() -> None:
    # torch's AdamW subclasses Adam; the built-in table registers both. A user's schema for
    # Adam must still govern AdamW. Run apart: the registration is process-wide.
    script = """
import torch, opttree
opttree.register_schema(torch.optim.Adam, opttree.StateSchema(zero={"exp_avg"}, keep={"exp_avg_sq"},
                        step=opttree.StepLocation.PER_PARAMETER))
net = torch.nn.Linear(2, 2)
optimizer = torch.optim.AdamW(net.parameters())
net(torch.ones(1, 2)).sum().backward()
optimizer.step()
report = opttree.reset(optimizer)
print(report.tensors_zeroed, report.tensors_kept)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.split() == ["2", "2"]


def test_a_partial_reset_follows_a_registered_wrappers_inner_params() -> None:
    params = list(model().parameters())
    wrapper = CopyingWrapper(params)
    for copy in wrapper.copies:
        copy.grad = torch.ones_like(copy)
    wrapper.optimizer.step()

    report = opttree.reset(wrapper, params=params[:1], keys=["exp_avg", "exp_avg_sq", "step"])

    assert report.tensors_zeroed == 2 and report.steps == 1
    assert not wrapper.optimizer.state[wrapper.copies[0]]["exp_avg"].any()
    assert wrapper.optimizer.state[wrapper.copies[1]]["exp_avg"].any()


def test_a_parameter_whose_named_copies_no_optimizer_holds_is_unmapped() -> None:
    """``inner_params`` that names copies other than those the wrapper's optimizer steps
    (clones made again): a partial reset of that parameter would reset nothing."""
    params = list(model().parameters())
    wrapper = CopyingWrapper(params)
    for copy in wrapper.copies:
        copy.grad = torch.ones_like(copy)
    wrapper.optimizer.step()
    wrapper.copies = [copy.detach().clone() for copy in wrapper.copies]  # what inner_params now names
    before = [entry["exp_avg"].clone() for entry in wrapper.optimizer.state.values()]

    with pytest.raises(opttree.UnmappedParameter, match=r"is held by no optimizer under CopyingWrapper at <root> \(1 of 1"):
        opttree.reset(wrapper, params=params[:1])

    assert all(torch.equal(e["exp_avg"], b) for e, b in zip(wrapper.optimizer.state.values(), before, strict=True))


def test_a_fill_must_be_a_number_or_a_function_and_not_also_a_zero() -> None:
    with pytest.raises(opttree.RegistrationError, match="the fill of 'sum' is a str"):
        opttree.StateSchema(fill={"sum": "0.1"})  # type: ignore[dict-item]
    with pytest.raises(opttree.RegistrationError, match="named in both 'zero' and 'fill'"):
        opttree.StateSchema(zero={"sum"}, fill={"sum": 0.1})
    with pytest.raises(opttree.RegistrationError, match="the fill of 'sum' is an int beyond a float"):
        opttree.StateSchema(fill={"sum": 10**400})  # accepted before, then every reset refused it
    with pytest.raises(opttree.RegistrationError, match="the fill of 'sum' is nan"):
        opttree.StateSchema(fill={"sum": float("nan")})


def test_a_fill_may_be_numpys_number_as_a_fill_function_may_return() -> None:
    import numpy as np

    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adagrad([param], initial_accumulator_value=0.25)
    param.grad = torch.ones_like(param)
    optimizer.step()
    schema = opttree.StateSchema(fill={"sum": np.float32(0.25)}, step=opttree.StepLocation.PER_PARAMETER)

    class NumpyAdagrad(torch.optim.Adagrad):
        pass

    opttree.register_schema(NumpyAdagrad, schema)
    numpy_filled = NumpyAdagrad([param], initial_accumulator_value=0.25)
    numpy_filled.load_state_dict(optimizer.state_dict())
    opttree.reset(numpy_filled)
    assert torch.equal(numpy_filled.state[param]["sum"], torch.full((3,), 0.25))


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        ({"fill": {"sum"}}, r"fill maps state key names to what they start as, got \{'sum'\}"),
        ({"fill": "sum"}, "fill maps state key names to what they start as, got 'sum'"),
        ({"fill": None}, "fill maps state key names to what they start as, got None"),
        ({"fill": (("a", 1.0), ("a", 2.0))}, r"fill names \['a'\] more than once"),
        ({"fill": {1: 0.0}}, r"got \(1, 0.0\) among its items"),
        ({"zero": None}, "state keys are given as a set of names, got None"),
        ({"zero": 5}, "state keys are given as a set of names, got 5"),
        ({"scale_of": 3.0}, r"scale_of is a function \(optimizer, param, key\) -> scale or None, got a float"),
        ({"rebuilds_missing": "no"}, "rebuilds_missing must be True or False, got 'no'"),
        ({"indivisible": 1}, "indivisible must be True or False, got 1"),
        ({"zero": {"m"}, "one_value": {"n"}}, r"one_value names \['n'\], which are neither zeroed nor filled"),
        ({"zero": {"m"}, "one_value": {"m"}, "like_param": {"m"}}, r"state keys \['m'\] are named in both like_param and one_value"),
        ({"zero": {"m"}, "shape_of": {"m": 3}}, r"the shape_of of 'm' is an int: expected \(param shape\) -> shape"),
        ({"zero": {"m"}, "shape_of": {"n": tuple}}, r"shape_of names \['n'\], which are neither zeroed, filled nor identity"),
    ],
    ids=[
        "fill-set", "fill-str", "fill-none", "fill-twice", "fill-key-int", "zero-none", "zero-int", "scale-of", "rebuilds-str",
        "indivisible-int", "one-value-unknown", "one-value-like-param", "shape-of-int", "shape-of-unknown",
    ],
)
def test_a_schema_given_what_it_cannot_mean_is_a_registration_error(arguments: dict[str, object], reason: str) -> None:
    with pytest.raises(opttree.RegistrationError, match=reason):
        opttree.StateSchema(**arguments)  # type: ignore[arg-type]  # as an untyped config may


def test_a_step_type_describes_a_per_parameter_step() -> None:
    with pytest.raises(opttree.RegistrationError, match="step_type describes a per-parameter step; this schema's step is per-group"):
        opttree.StateSchema(step=opttree.StepLocation.PER_GROUP, step_type=opttree.StepType.INT)
    schema = opttree.StateSchema(zero={"exp_avg"}, step=opttree.StepLocation.PER_PARAMETER, step_type=opttree.StepType.INT)
    assert schema.step_type is opttree.StepType.INT
    assert opttree.StateSchema(step=opttree.StepLocation.PER_PARAMETER).step_type is opttree.StepType.TENSOR


def test_a_users_fill_follows_the_group() -> None:
    class Accumulates(torch.optim.Adagrad):
        pass

    opttree.register_schema(
        Accumulates,
        opttree.StateSchema(fill={"sum": lambda group, defaults: float(str(group["start"]))}, step=opttree.StepLocation.PER_PARAMETER),
    )
    first, second = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    optimizer = Accumulates([{"params": [first], "start": 0.5}, {"params": [second], "start": 2.0}])
    for p in (first, second):
        p.grad = torch.ones_like(p)
    optimizer.step()

    report = opttree.reset(optimizer)

    assert report.tensors_filled == 2
    assert optimizer.state[first]["sum"].tolist() == [0.5, 0.5] and optimizer.state[second]["sum"].tolist() == [2.0] * 3


def _divide_by_zero(group: object, defaults: object) -> float:
    return 1 / 0


def _raising_scale(optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str) -> torch.Tensor | None:
    raise ZeroDivisionError("no scale")


def _raising_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    raise IndexError("no such dimension")


def _number_scale(optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str) -> torch.Tensor | None:
    return 1.0  # type: ignore[return-value]  # as an untyped function may


@pytest.mark.parametrize(
    ("schema", "key", "reason"),
    [
        (opttree.StateSchema(fill={"sum": _divide_by_zero}, step=opttree.StepLocation.PER_PARAMETER), "sum", "its starting value cannot be worked out: ZeroDivisionError"),
        (opttree.StateSchema(zero={"sum"}, scale_of=_raising_scale, step=opttree.StepLocation.PER_PARAMETER), "sum", "its schema's scale_of raised ZeroDivisionError: no scale"),
        (opttree.StateSchema(zero={"sum"}, scale_of=_number_scale, step=opttree.StepLocation.PER_PARAMETER), "sum", "its schema's scale_of gave a float, expected the scale tensor"),
        (opttree.StateSchema(zero={"sum"}, shape_of={"sum": _raising_shape}, step=opttree.StepLocation.PER_PARAMETER), "sum", "its schema's shape_of raised IndexError: no such dimension"),
        (opttree.StateSchema(fill={"sum": lambda group, defaults: "1"}, step=opttree.StepLocation.PER_PARAMETER), "sum", "its starting value cannot be worked out: TypeError: its fill gave a str"),
        (opttree.StateSchema(fill={"sum": lambda group, defaults: math.nan}, step=opttree.StepLocation.PER_PARAMETER), "sum", "its starting value cannot be worked out: TypeError: its fill gave nan, expected a real number a float holds, not NaN"),
    ],
    ids=["fill-raises", "scale-of-raises", "scale-of-gives-a-number", "shape-of-raises", "fill-gives-a-str", "fill-gives-nan"],
)
def test_a_registered_function_that_fails_is_reported_at_its_key(schema: opttree.StateSchema, key: str, reason: str) -> None:
    """A schema's own functions run while planning: what they raise or give that is not
    what a reset can use is that key's problem, not the leaf's containers'."""

    class Accumulates(torch.optim.Adagrad):
        pass

    opttree.register_schema(Accumulates, schema)
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = Accumulates([param])
    param.grad = torch.ones(2)
    optimizer.step()
    before = optimizer.state[param]["sum"].clone()

    (problem,) = opttree.validate(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizerState, match=f"key '{key}': {reason}"):
        opttree.reset(optimizer)

    assert (problem.kind, problem.key) == (opttree.ProblemKind.UNSUPPORTED_STATE, key) and reason in problem.message
    assert torch.equal(optimizer.state[param]["sum"], before)


class Eigenbasis(HomeMade):
    """A home-made SOAP-like optimizer: a rotation ``Q`` per parameter that starts as the
    identity (of the parameter's first dimension), and a moment, both created on the first
    step; the rotation is then changed in place."""

    def build(self, state: dict[str, torch.Tensor], p: torch.Tensor) -> None:
        state["Q"] = torch.eye(p.shape[0])
        state["exp_avg"] = torch.zeros_like(p)

    def update(self, state: dict[str, torch.Tensor], p: torch.Tensor, lr: float) -> None:
        grad = cast(torch.Tensor, p.grad)
        state["exp_avg"].lerp_(grad, 0.1)
        state["Q"].mul_(0.9).add_(torch.outer(grad[:, 0], grad[:, 0]), alpha=0.1)
        p.sub_(state["Q"] @ state["exp_avg"], alpha=lr)


opttree.register_schema(Eigenbasis, opttree.StateSchema(zero={"exp_avg"}, identity={"Q"}))


def stepped_eigenbasis(shape: tuple[int, ...]) -> tuple[Eigenbasis, torch.nn.Parameter]:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.rand(shape))
    optimizer = Eigenbasis([param])
    for _ in range(2):
        param.grad = torch.randn(shape)
        optimizer.step()
    return optimizer, param


def test_history_that_starts_as_the_identity_is_reset_to_it_exactly() -> None:
    optimizer, param = stepped_eigenbasis((3, 2))
    twin = torch.nn.Parameter(param.detach().clone())
    fresh = Eigenbasis([twin])

    report = opttree.reset(optimizer)

    assert report.tensors_zeroed == 1 and report.tensors_filled == 1
    assert torch.equal(optimizer.state[param]["Q"], torch.eye(3))
    for k in range(3):
        grad = torch.randn((3, 2), generator=torch.Generator().manual_seed(k))
        for p, opt in ((param, optimizer), (twin, fresh)):
            p.grad = grad.clone()
            opt.step()
    assert torch.equal(param, twin)


def test_identity_history_that_is_not_square_is_refused_with_nothing_changed() -> None:
    optimizer, param = stepped_eigenbasis((3, 2))
    optimizer.state[param]["Q"] = optimizer.state[param]["Q"][:, :2].clone()
    before = {k: v.clone() for k, v in optimizer.state[param].items()}

    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"identity matrix, but one is of shape \(3, 2\)") as raised:
        opttree.reset(optimizer)

    assert raised.value.problem is not None and raised.value.problem.key == "Q"
    assert all(torch.equal(optimizer.state[param][k], v) for k, v in before.items())
    assert [p.key for p in opttree.validate(optimizer)] == ["Q"]


def test_prune_refuses_identity_history_and_a_schema_names_a_key_once() -> None:
    optimizer, _ = stepped_eigenbasis((3, 2))
    with pytest.raises(opttree.PartialResetRefused, match="key 'Q': prune changes history in place, and it is not zero at the start"):
        opttree.prune(optimizer, 0.5, keys=["Q"])
    with pytest.raises(opttree.RegistrationError, match="named in both 'zero' and 'identity'"):
        opttree.StateSchema(zero={"Q"}, identity={"Q"})


class SnapshotLion(Lion):
    """A Lion that keeps past moments in a list, as LBFGS keeps its directions."""


opttree.register_schema(SnapshotLion, opttree.StateSchema(zero={"exp_avg"}, keep={"snapshots"}))


class SelfHoldingList(list[object]):
    """A list that holds itself and whose own iteration refuses: reading it must neither
    loop nor call it."""

    def __iter__(self) -> Iterator[object]:
        raise RuntimeError("iteration refused")


def _self_holding(moment: torch.Tensor) -> object:
    held = SelfHoldingList([moment])
    held.append(held)
    return held


@pytest.mark.parametrize(
    "hold",
    [
        lambda moment: [torch.ones(1), moment],
        lambda moment: {"first": torch.ones(1), "then": (moment,)},
        lambda moment: [[[{"deep": [moment]}]]],
        _self_holding,
    ],
    ids=["list", "dict-of-tuple", "nested", "holding-itself"],
)
def test_kept_state_in_containers_that_shares_memory_with_history_is_refused(hold: Callable[[torch.Tensor], object]) -> None:
    """Zeroing ``exp_avg`` would zero the snapshot the schema says to keep, which lists,
    tuples or dicts hold: its memory counts as kept as a top-level tensor's does."""
    net = model()
    optimizer = SnapshotLion(net.parameters(), lr=1e-2)
    train(net, optimizer, 0, 2)
    for entry in optimizer.state.values():
        entry["snapshots"] = hold(entry["exp_avg"])
    moments = [entry["exp_avg"].clone() for entry in optimizer.state.values()]

    problems = opttree.validate(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'exp_avg': shares memory with .*'snapshots'"):
        opttree.reset(optimizer)

    assert [problem.key for problem in problems] == ["exp_avg"]
    assert all(torch.equal(entry["exp_avg"], moment) for entry, moment in zip(optimizer.state.values(), moments, strict=True))
    for entry in optimizer.state.values():
        entry["snapshots"] = [entry["exp_avg"].clone()]
    report = opttree.reset(optimizer)
    assert report.bytes_kept == sum(entry["snapshots"][0].nbytes for entry in optimizer.state.values())


def test_like_param_names_only_zeroed_or_filled_keys() -> None:
    with pytest.raises(opttree.RegistrationError, match=r"like_param names \['master_param'\], which are neither zeroed nor filled"):
        opttree.StateSchema(zero={"exp_avg"}, keep={"master_param"}, like_param={"exp_avg", "master_param"})
    assert opttree.StateSchema(zero={"exp_avg"}, like_param={"exp_avg"}).like_param == frozenset({"exp_avg"})


def test_built_if_maps_history_keys_to_option_names() -> None:
    with pytest.raises(opttree.RegistrationError, match=r"built_if names \['master_param'\], which are neither zeroed, filled nor identity"):
        opttree.StateSchema(zero={"exp_avg"}, keep={"master_param"}, built_if={"master_param": "amsgrad"})
    with pytest.raises(opttree.RegistrationError, match="built_if maps 'exp_avg' to a bool, expected the name of a group option"):
        opttree.StateSchema(zero={"exp_avg"}, built_if={"exp_avg": True})  # type: ignore[dict-item]
    with pytest.raises(opttree.RegistrationError, match="built_if maps state key names to the names of group options"):
        opttree.StateSchema(zero={"exp_avg"}, built_if="amsgrad")  # type: ignore[arg-type]
    schema = opttree.StateSchema(zero={"exp_avg", "ema"}, built_if={"ema": "use_ema"})
    assert schema.built_if == (("ema", "use_ema"),)


def test_a_registered_built_if_key_is_checked_against_its_groups_option() -> None:
    """A user's optimizer that builds an ``ema`` only where ``use_ema`` is on: entries built
    with it off, the option then switched on, are refused in place."""

    class EmaAdamW(torch.optim.AdamW):
        @torch.no_grad()
        def step(self, closure: None = None) -> None:  # type: ignore[override]
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    if group.get("use_ema") and len(state) == 0:
                        state["ema"] = torch.zeros_like(p)
            super().step()
            for group in self.param_groups:
                if group.get("use_ema"):
                    for p in group["params"]:
                        self.state[p]["ema"].lerp_(p, 0.1)

    opttree.register_schema(
        EmaAdamW,
        opttree.StateSchema(
            zero={"exp_avg", "exp_avg_sq", "ema"}, step=opttree.StepLocation.PER_PARAMETER, rebuilds_missing=True, built_if={"ema": "use_ema"}
        ),
    )
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    optimizer = EmaAdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert opttree.validate(optimizer) == ()
    optimizer.param_groups[0]["use_ema"] = True

    assert [(p.kind, p.key) for p in opttree.validate(optimizer)] == [(opttree.ProblemKind.UNSUPPORTED_STATE, "ema")]
    with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'ema': 2 of its 2 state entries lack it"):
        opttree.reset(optimizer)
    assert opttree.reset(optimizer, release=True).entries_released == 2


class WarmAdam(torch.optim.Adam):
    """An Adam whose second moments start at 1e-2: it builds its state in an
    ``_init_group`` of its own, unlike the Adam whose built-in schema it would inherit."""

    def _init_group(self, group: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        fresh = [p for p in group["params"] if p.grad is not None and not self.state[p]]
        built = cast(Callable[..., Any], super()._init_group)(group, *args, **kwargs)
        for p in fresh:
            self.state[p]["exp_avg_sq"].fill_(1e-2)
        return built


class DefaultsAdam(torch.optim.Adam):
    """An Adam with other defaults: its own ``__init__``, which opttree does not read."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.01, betas=(0.8, 0.9))


class MethodsAdam(torch.optim.Adam):
    """An Adam with a method of its own that reads and keeps nothing: opttree does not read
    code, so it cannot tell this one from :class:`WarmingAdam`'s."""

    def learning_rates(self) -> list[float]:
        return [group["lr"] for group in self.param_groups]


class StepCodeAdam(torch.optim.Adam):
    """Counts its steps in ``_optimizer_step_code``, which torch's profiling hook calls
    after every step, and warms its learning rate up by that count: a reset that kept
    ``self.steps`` would not train as a fresh one."""

    def _optimizer_step_code(self) -> None:
        self.steps = getattr(self, "steps", 0) + 1
        for group in self.param_groups:
            group["lr"] = 1e-3 * min(1.0, (self.steps + 1) / 4)


class WarmingAdam(torch.optim.Adam):
    """Warms its learning rate up by a count kept in an attribute, each time training code
    calls ``warm()``, a method of its own that ``step`` never calls."""

    def warm(self) -> None:
        self.warmed = getattr(self, "warmed", 0) + 1
        for group in self.param_groups:
            group["lr"] = 1e-3 * min(1.0, self.warmed / 4)


class DocumentedAdam(torch.optim.Adam):
    """A subclass whose body defines nothing but this docstring."""


def _warm_start(step: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator over Adam's step that starts second moments at 1e-2, and copies
    ``__wrapped__`` as ``functools.wraps`` does: the code it runs is its own."""

    @functools.wraps(step)
    def wrapped(self: torch.optim.Optimizer, closure: None = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not self.state[p]:
                    self.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.full_like(p, 1e-2))
        return step(self, closure)

    return wrapped


class WrappedStepAdam(torch.optim.Adam):
    step = _warm_start(torch.optim.Adam.step)


def test_a_subclass_with_its_own_state_building_inherits_no_built_in_schema() -> None:
    net = model()
    optimizer = WarmAdam(net.parameters())
    train(net, optimizer, 0, 2)
    before = snapshot(optimizer)

    problems = opttree.validate(optimizer)

    assert [(p.kind, p.cls) for p in problems] == [(opttree.ProblemKind.UNSUPPORTED_OPTIMIZER, "WarmAdam")]
    assert "WarmAdam defines its own _init_group, where its base torch.optim.adam.Adam" in problems[0].message
    with pytest.raises(opttree.UnsupportedOptimizer, match=r"opttree\.register_schema\(WarmAdam, opttree\.schema_for\(Adam\)\)"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)
    assert opttree.schema_for(WarmAdam) is None


class WarmAdagrad(torch.optim.Adagrad):
    """An Adagrad whose accumulators start at 0.1: Adagrad builds its state in ``__init__``,
    and this one's ``__init__`` fills it otherwise."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.01)
        for entry in self.state.values():
            entry["sum"].fill_(0.1)


class ClippingMixin:
    """A mixin whose ``step`` clips before the optimizer's own."""

    def step(self, closure: None = None) -> None:
        super().step(closure)  # type: ignore[misc]


class ClippedAdam(ClippingMixin, torch.optim.Adam):  # type: ignore[misc]  # the mixin's step is untyped torch's
    pass


def test_a_subclass_building_state_in_init_or_taking_a_step_from_a_mixin_inherits_no_built_in_schema() -> None:
    net = model()
    optimizer = WarmAdagrad(net.parameters())
    train(net, optimizer, 0, 2)
    with pytest.raises(opttree.UnsupportedOptimizer, match=r"WarmAdagrad defines its own __init__, where its base torch\.optim\.adagrad\.Adagrad"):
        opttree.reset(optimizer)
    clipped = ClippedAdam(model().parameters())
    problems = opttree.validate(clipped)
    assert [p.kind for p in problems] == [opttree.ProblemKind.UNSUPPORTED_OPTIMIZER]
    assert "ClippedAdam takes its own step from tests.test_registration.ClippingMixin" in problems[0].message
    with pytest.raises(opttree.OptTreeError, match="schema_for takes an optimizer class, got a ClippedAdam"):
        opttree.schema_for(clipped)  # type: ignore[arg-type]


def test_a_subclass_defining_nothing_of_its_own_inherits_its_schema() -> None:
    """A docstring is no behaviour, and torch's profiling hook, which torch sets as ``step``
    on a subclass's first instance, runs Adam's own step."""
    net = model()
    optimizer = DocumentedAdam(net.parameters())
    train(net, optimizer, 0, 2)
    hooked = type("HookedAdam", (torch.optim.Adam,), {})
    setattr(hooked, "step", torch.optim.Optimizer.profile_hook_step(torch.optim.Adam.step))  # as torch's _patch_step_function does

    assert opttree.schema_for(DocumentedAdam) is opttree.schema_for(torch.optim.Adam) is opttree.schema_for(hooked)
    assert opttree.schema_for(torch.optim.Adam) is not None
    opttree.reset(optimizer)
    assert trains_as_fresh(net, optimizer, lambda twin: DocumentedAdam(twin.parameters()), 2, 3)


@pytest.mark.parametrize(("cls", "name"), [(StepCodeAdam, "_optimizer_step_code"), (WarmingAdam, "warm"), (MethodsAdam, "learning_rates")])
def test_a_subclass_with_any_method_of_its_own_inherits_no_built_in_schema(cls: type[torch.optim.Adam], name: str) -> None:
    """Not only the methods that build state: any method ``step`` calls, or training code
    does, may count or change state in attributes opttree never reads (``steps``,
    ``warmed``), which a reset with Adam's schema would keep. Refused until registered."""
    net = model()
    optimizer = cls(net.parameters(), lr=1e-3)
    for start in range(2):
        if isinstance(optimizer, WarmingAdam):
            optimizer.warm()
        train(net, optimizer, start, 1)
    before = snapshot(optimizer)

    problems = opttree.validate(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizer, match=rf"{cls.__qualname__} defines its own {name}, where its base torch\.optim\.adam\.Adam"):
        opttree.reset(optimizer)

    assert [p.kind for p in problems] == [opttree.ProblemKind.UNSUPPORTED_OPTIMIZER]
    assert f"opttree.register_schema({cls.__qualname__}, opttree.schema_for(Adam))" in problems[0].message
    assert opttree.schema_for(cls) is None
    assert unchanged(optimizer, before)


def test_a_subclass_with_its_own_init_or_a_decorated_step_inherits_no_built_in_schema() -> None:
    """An ``__init__`` may build entries before any step (opttree cannot tell one that
    only sets other defaults), and a decorator that copies ``__wrapped__`` runs code of its
    own: it is only torch's own wrappers that opttree looks through."""
    for cls, method in ((DefaultsAdam, "__init__"), (WrappedStepAdam, "step")):
        optimizer = cls(model().parameters())
        before = snapshot(optimizer)
        with pytest.raises(opttree.UnsupportedOptimizer, match=rf"{cls.__qualname__} defines its own {method}, where its base torch\.optim\.adam\.Adam"):
            opttree.reset(optimizer)
        assert unchanged(optimizer, before)
    assert opttree.schema_for(DefaultsAdam) is opttree.schema_for(WrappedStepAdam) is None

    class RegisteredAdam(DefaultsAdam):
        pass

    with pytest.raises(opttree.RegistrationError, match=r"got None \(schema_for gives None for a class opttree has no schema for\)"):
        opttree.register_schema(RegisteredAdam, opttree.schema_for(WrappedStepAdam))

    opttree.register_schema(RegisteredAdam, opttree.schema_for(torch.optim.Adam))  # as the message says, where it builds Adam's state
    net = model()
    optimizer = RegisteredAdam(net.parameters())
    train(net, optimizer, 0, 2)
    report = opttree.reset(optimizer)
    assert (report.tensors_zeroed, report.steps) == (2 * len(list(net.parameters())), len(list(net.parameters())))


class _WarmStart(_DecoratorContextManager):
    """A user's context decorator on torch's base, as ``torch.no_grad`` is: on entry it
    starts Adam's moments from the gradient where an entry is empty."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def clone(self) -> _WarmStart:
        return _WarmStart(self.optimizer)

    def __enter__(self) -> None:
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None and not self.optimizer.state[param]:
                    self.optimizer.state[param].update(step=torch.tensor(0.0), exp_avg=param.grad.clone(), exp_avg_sq=param.grad.square())

    def __exit__(self, *exc: object) -> None:
        return None


def test_torchs_context_decorator_counts_as_torchs_only_around_torchs_own_context() -> None:
    """``torch.no_grad()(step)`` and ``torch.compile(step)`` wrap the class's own step in
    torch's code alone; torch's context decorator around a user's context manager runs the
    user's ``__enter__``, which may build state: refused."""
    compiled, guarded, warmed = (torch.optim.Adam(model().parameters()) for _ in range(3))
    torch.optim.lr_scheduler.StepLR(compiled, step_size=1)
    setattr(compiled, "step", torch.compile(compiled.step, backend="eager"))
    setattr(guarded, "step", torch.no_grad()(guarded.step))
    setattr(warmed, "step", _WarmStart(warmed)(warmed.step))
    assert opttree.validate(compiled) == () and opttree.validate(guarded) == ()
    (problem,) = opttree.validate(warmed)
    assert "this Adam holds its own step on the instance" in problem.message
    with pytest.raises(opttree.UnsupportedOptimizer):
        opttree.reset(warmed)


def test_a_step_set_on_the_instance_is_refused_unless_torch_wrapped_the_classs_own() -> None:
    """A ``step`` of its own on one Adam may build other state, as a subclass's may; the
    wrapper ``LRScheduler`` sets there over the class's own ``step`` is torch's."""
    net = model()
    optimizer = torch.optim.Adam(net.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    assert "step" in vars(optimizer)  # LRScheduler's wrapper
    train(net, optimizer, 0, 2)
    scheduler.step()
    twin = clone_model(net)
    fresh = torch.optim.Adam(twin.parameters(), lr=optimizer.param_groups[0]["lr"])
    opttree.reset(optimizer)
    train(net, optimizer, 2, 3)
    train(twin, fresh, 2, 3)
    assert weights_equal(net, twin)

    patched = [torch.optim.Adam(model().parameters()) for _ in range(3)]
    setattr(patched[1], "step", types.MethodType(_warm_start(torch.optim.Adam.step), patched[1]))
    chain = LoraChain(dict(zip("abc", patched, strict=True)))  # a run of three Adams, planned as one where it can be
    problems = opttree.validate(chain)
    assert [(p.kind, p.path) for p in problems] == [(opttree.ProblemKind.UNSUPPORTED_OPTIMIZER, "adapters['b']")]
    assert "this Adam holds its own step on the instance" in problems[0].message
    with pytest.raises(opttree.UnsupportedOptimizer, match="holds its own step on the instance"):
        opttree.reset(patched[1])


def test_a_users_registration_applies_to_its_subclasses_whatever_they_define() -> None:
    """A user's schema for a class says what its subclasses build: theirs to register."""

    class Base(torch.optim.Optimizer):
        def __init__(self, params: Any) -> None:
            super().__init__(params, {"lr": 0.1})

    class Child(Base):
        @torch.no_grad()
        def step(self, closure: None = None) -> None:  # type: ignore[override]
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p].setdefault("buf", torch.zeros_like(p)).add_(p.grad)
                    p.sub_(self.state[p]["buf"], alpha=group["lr"])

    schema = opttree.StateSchema(zero={"buf"}, rebuilds_missing=True)
    opttree.register_schema(Base, schema)
    assert opttree.schema_for(Child) is schema


def test_registrations_no_leaf_or_wrapper_could_use_are_refused() -> None:
    """A schema for a class that is no optimizer, or for a wrapper kind opttree knows (its
    leaves carry the schemas), would never apply; a wrapper kind for a base of torch's
    optimizers would make every optimizer, and None, a childless wrapper."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    with pytest.raises(opttree.RegistrationError, match="register_schema registers an optimizer class .*got builtins.int"):
        opttree.register_schema(int, opttree.StateSchema())
    with pytest.raises(opttree.RegistrationError, match="HybridDeviceOptimizer is a wrapper kind opttree knows"):
        opttree.register_schema(HybridDeviceOptimizer, opttree.StateSchema())
    for base in (object, torch.optim.Optimizer):
        with pytest.raises(opttree.RegistrationError, match="a base of every torch optimizer"):
            opttree.register_wrapper(base, children=lambda wrapper: [])
    with pytest.raises(opttree.RegistrationError, match="got abc.ABC, a base of every abstract class"):
        opttree.register_schema(abc.ABC, opttree.StateSchema())
    with pytest.raises(opttree.RegistrationError, match="got abc.ABC, one of Python's own"):
        opttree.register_schema("abc.ABC", opttree.StateSchema())
    for own in (int, abc.ABC):
        with pytest.raises(opttree.RegistrationError, match=f"register_wrapper registers an optimizer or wrapper class, got {own.__module__}.{own.__qualname__}, one of Python's own"):
            opttree.register_wrapper(own, children=lambda wrapper: [])
    with pytest.raises(opttree.RegistrationError, match="got builtins.object, one of Python's own"):
        opttree.register_wrapper("builtins.object", children=lambda wrapper: [])
    with pytest.raises(opttree.RegistrationError, match="got builtins.int, one of Python's own"):
        opttree.register_schema("builtins.int", opttree.StateSchema())
    with pytest.raises(opttree.RegistrationError, match="megatron.core.optimizer.optimizer.ChainedOptimizer is a wrapper kind opttree knows"):
        opttree.register_schema("megatron.core.optimizer.optimizer.ChainedOptimizer", opttree.StateSchema())
    for reexported in ("torch.optim.optimizer.Optimizer", "torch.optim.Optimizer"):  # the second once let every optimizer be a wrapper
        with pytest.raises(opttree.RegistrationError, match="torch.optim.optimizer.Optimizer, a base of every torch optimizer"):
            opttree.register_wrapper(reexported, children=lambda wrapper: [])
    with pytest.raises(opttree.RegistrationError, match="megatron.core.optimizer.optimizer.ChainedOptimizer is a wrapper kind opttree knows"):
        opttree.register_schema("megatron.core.optimizer.ChainedOptimizer", opttree.StateSchema())
    # paths that name no class in a module imported already: never a leaf's or a wrapper's
    with pytest.raises(opttree.RegistrationError, match=r"got 'torch.optim.adamw', which names a module"):
        opttree.register_schema("torch.optim.adamw", opttree.StateSchema())
    with pytest.raises(opttree.RegistrationError, match=r"got 'torch.optim.adamw.adamw', which names a function in torch.optim.adamw"):
        opttree.register_wrapper("torch.optim.adamw.adamw", children=lambda wrapper: [])
    param = torch.nn.Parameter(torch.ones(2))
    assert opttree.validate(torch.optim.Adam([param])) == ()
    assert [p.kind for p in opttree.validate(None)] == [opttree.ProblemKind.NOT_AN_OPTIMIZER]


def test_a_dotted_path_through_a_re_export_applies_once_its_module_is_imported() -> None:
    """``package.Optimizer`` re-exported from ``package._impl``: the class's own path is
    ``package._impl.Optimizer``, and the registration by the path users import it from
    applies once that module is imported (read from its namespace; opttree imports nothing)."""
    import sys
    import types

    package, impl = types.ModuleType("opttree_reexport_pkg"), types.ModuleType("opttree_reexport_pkg._impl")

    class StepOwn(torch.optim.SGD):
        def step(self, closure: None = None) -> None:  # type: ignore[override]
            super().step()

    StepOwn.__module__, StepOwn.__qualname__ = impl.__name__, "StepOwn"
    setattr(impl, "StepOwn", StepOwn)
    setattr(package, "StepOwn", StepOwn)
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = StepOwn([param], lr=0.1, momentum=0.9)
    param.grad = torch.ones(2)
    optimizer.step()
    opttree.register_schema("opttree_reexport_pkg.StepOwn", opttree.StateSchema(drop={"momentum_buffer"}))
    assert [p.kind for p in opttree.validate(optimizer)] == [opttree.ProblemKind.UNSUPPORTED_OPTIMIZER]  # not imported: not applied

    sys.modules[package.__name__], sys.modules[impl.__name__] = package, impl
    try:
        assert opttree.validate(StepOwn([torch.nn.Parameter(torch.ones(2))], lr=0.1)) == ()
        assert opttree.reset(optimizer).tensors_dropped == 1
    finally:
        del sys.modules[package.__name__], sys.modules[impl.__name__]


def test_a_class_made_by_exec_is_not_taken_for_one_of_pythons_own() -> None:
    """``exec`` without a ``__name__`` gives a class the module ``builtins``: it is a user's
    class all the same, registered as any other."""
    namespace: dict[str, object] = {"torch": torch}
    exec("class ExecWrapper:\n    def __init__(self, inner):\n        self.inner = inner\n", namespace)  # noqa: S102
    made = namespace["ExecWrapper"]
    assert isinstance(made, type) and made.__module__ == "builtins"

    opttree.register_wrapper(made, children=lambda wrapper: [("inner", wrapper.inner)])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    assert opttree.tree(made(optimizer)).children[0].optimizer is optimizer


def test_a_class_registered_again_through_a_path_that_re_exports_it_is_refused() -> None:
    """Registered once as a class, a second registration by the path a package re-exports
    it under would wait for ever and never apply: refused as registered already."""
    import sys
    import types

    package, impl = types.ModuleType("opttree_twice_pkg"), types.ModuleType("opttree_twice_pkg._impl")
    twice = type("Twice", (torch.optim.SGD,), {"__module__": impl.__name__})
    setattr(impl, "Twice", twice)
    setattr(package, "Twice", twice)
    sys.modules[package.__name__], sys.modules[impl.__name__] = package, impl
    try:
        opttree.register_schema(twice, opttree.StateSchema(drop={"momentum_buffer"}))
        with pytest.raises(opttree.RegistrationError, match="a schema for opttree_twice_pkg.Twice is registered already"):
            opttree.register_schema("opttree_twice_pkg.Twice", opttree.StateSchema(drop={"momentum_buffer"}))
    finally:
        del sys.modules[package.__name__], sys.modules[impl.__name__]


def test_a_lazily_loaded_module_is_not_imported_by_a_lookup() -> None:
    """A module ``importlib.util.LazyLoader`` put in ``sys.modules`` runs its import when
    read: a lookup while a dotted path waits leaves it unread (its import may fail, and
    validate never raises)."""
    import importlib.util
    import sys
    import types

    class FailingLoader(importlib.abc.Loader):
        def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
            return None

        def exec_module(self, module: types.ModuleType) -> None:
            raise RuntimeError("this package fails to import")

    spec = importlib.util.spec_from_loader("opttree_lazy_pkg", importlib.util.LazyLoader(FailingLoader()))
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    sys.modules["opttree_lazy_pkg"] = module
    try:
        opttree.register_schema("opttree_lazy_pkg.Opt", opttree.StateSchema(drop={"momentum_buffer"}))
        param = torch.nn.Parameter(torch.ones(2))
        assert opttree.validate(torch.optim.Adam([param])) == ()
    finally:
        del sys.modules["opttree_lazy_pkg"]


_REAL_DICT = vars(torch.optim.Optimizer)["__dict__"]


class FilteredDictAdam(torch.optim.Adam):
    """A ``__dict__`` property that hides what the instance holds: opttree read it, and saw
    neither a step set on the instance nor an optimizer kept beside the state."""

    __dict__ = property(lambda self: {k: v for k, v in _REAL_DICT.__get__(self).items() if k not in ("step", "ema")})


def _warming_step(self: torch.optim.Adam, closure: None = None) -> None:
    self.__dict__["warmed"] = self.__dict__.get("warmed", 0) + 1
    torch.optim.Adam.step(self, closure)


HidingNamespace = type("HidingNamespace", (type,), {"__dict__": property(lambda cls: {"__module__": __name__, "__doc__": None})})
"""A metaclass whose ``__dict__`` shows none of its classes' methods."""

HiddenStepAdam: type[torch.optim.Adam] = HidingNamespace("HiddenStepAdam", (torch.optim.Adam,), {"step": _warming_step})


@pytest.mark.parametrize(("cls", "name"), [(FilteredDictAdam, "__dict__"), (HiddenStepAdam, "__class__ (its metaclass")])
def test_a_class_that_hides_its_namespace_or_its_instances_attributes_defines_its_own(cls: type[torch.optim.Adam], name: str) -> None:
    """opttree reads namespaces and instance dicts through the descriptors Python makes,
    and a ``__dict__`` property, or a metaclass of the class's own, is code of its own."""
    net = model()
    optimizer = cls(net.parameters(), lr=1e-3)
    train(net, optimizer, 0, 2)
    assert opttree.schema_for(cls) is None
    with pytest.raises(opttree.UnsupportedOptimizer, match=re.escape(f"{cls.__qualname__} defines its own {name}")):
        opttree.reset(optimizer)


_Wrapped = TypeVar("_Wrapped")


class GenericAdam(torch.optim.Adam, Generic[_Wrapped]):
    """Typing machinery only: typing's and abc's bases hold no optimizer behaviour."""


class AbstractAdam(torch.optim.Adam, abc.ABC):
    pass


class SlotlessAdam(torch.optim.Adam):
    __slots__ = ()


def test_typed_abstract_and_slotless_subclasses_inherit_their_schema() -> None:
    for cls in (GenericAdam, AbstractAdam, SlotlessAdam, typing.final(type("FinalAdam", (torch.optim.Adam,), {}))):
        assert opttree.schema_for(cls) is opttree.schema_for(torch.optim.Adam), cls


class _SlotsThatCannotBeCompared:
    """An iterable of no slot names (Python accepts it as ``__slots__``) whose ``==`` raises."""

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("not comparable")

    __hash__ = None  # type: ignore[assignment]


class HostileSlotsAdam(torch.optim.Adam):
    __slots__ = _SlotsThatCannotBeCompared()


def test_slots_of_a_kind_other_than_an_empty_tuple_or_list_are_its_own_and_never_compared() -> None:
    """``__slots__`` adding no slot is a record only as an empty tuple or list; anything else
    is the class's own, found without calling its ``==``."""
    optimizer = HostileSlotsAdam(model().parameters())
    (problem,) = opttree.validate(optimizer)
    assert problem.kind is opttree.ProblemKind.UNSUPPORTED_OPTIMIZER and "defines its own __slots__" in problem.message
    with pytest.raises(opttree.UnsupportedOptimizer, match="defines its own __slots__"):
        opttree.reset(optimizer)


@pytest.mark.parametrize("how", ["scheduler", "compiled"])
def test_a_step_copied_from_another_optimizer_onto_an_instance_is_its_own(how: str) -> None:
    """``b.step = a.step`` where ``a``'s step is LRScheduler's wrapper (whose weak reference
    names ``a``) or a compiled one: torch's wrapper, but of another optimizer's step, which
    ``b.step()`` steps; a reset of ``b`` then trained unlike a fresh one."""
    source, copy = torch.optim.Adam(model().parameters()), torch.optim.Adam(model().parameters())
    if how == "scheduler":
        torch.optim.lr_scheduler.StepLR(source, 1)
        setattr(copy, "step", source.step)
    else:
        setattr(copy, "step", torch.compile(source.step))
    (problem,) = opttree.validate(copy)
    assert problem.kind is opttree.ProblemKind.UNSUPPORTED_OPTIMIZER and "holds its own step on the instance" in problem.message


class JudgedSGD(torch.optim.SGD):
    """The class the hooks below refuse to judge."""


class JudgedByWrapperHook(torch.optim.SGD):
    pass


def _hook_raising(error: type[Exception], target: type) -> type:
    class Hooked(abc.ABC):
        @classmethod
        def __subclasshook__(cls, other: type) -> bool:
            if other is target:
                raise error("this hook cannot judge it")
            return cast(bool, NotImplemented)

    return Hooked


opttree.register_schema(_hook_raising(ValueError, JudgedSGD), opttree.StateSchema(drop={"momentum_buffer"}))
opttree.register_schema(_hook_raising(RuntimeError, JudgedSGD), opttree.StateSchema(drop={"momentum_buffer"}))
opttree.register_wrapper(_hook_raising(ValueError, JudgedByWrapperHook), children=lambda wrapper: [])


@pytest.mark.parametrize(("cls", "kind"), [(JudgedSGD, "UNSUPPORTED_OPTIMIZER"), (JudgedByWrapperHook, "UNKNOWN_WRAPPER")])
def test_a_registered_abc_whose_subclass_hook_raises_is_reported_not_raised(cls: type[torch.optim.SGD], kind: str) -> None:
    """singledispatch asks each registered ABC's ``__subclasshook__``; one that raised
    (a RuntimeError too, which singledispatch's own "Ambiguous dispatch" is) escaped
    validate, describe and reset raw."""
    optimizer = cls(model().parameters(), lr=0.1, momentum=0.9)
    (problem,) = opttree.validate(optimizer)
    assert problem.kind is getattr(opttree.ProblemKind, kind)
    assert "cannot be told: its subclass check raised" in problem.message and "this hook cannot judge it" in problem.message
    assert cls.__qualname__ in opttree.describe(optimizer)
    with pytest.raises(opttree.OptTreeError, match="cannot be told"):
        opttree.reset(optimizer)


class DoublyTagged(torch.optim.SGD):
    """Registered under two ABCs, one of whose hooks raises when asked about the other."""


class _Judging(abc.ABC):
    @classmethod
    def __subclasshook__(cls, other: type) -> bool:
        if other is DoublyTagged:
            return True
        if other is _Tagged:
            raise TypeError("asked about another registration")
        return cast(bool, NotImplemented)


class _Tagged(abc.ABC):
    pass


_Tagged.register(DoublyTagged)
opttree.register_schema(_Judging, opttree.StateSchema(drop={"momentum_buffer"}))
opttree.register_schema(_Tagged, opttree.StateSchema(drop={"momentum_buffer"}))


def test_a_hook_raising_while_two_registrations_are_weighed_is_reported_not_raised() -> None:
    optimizer = DoublyTagged(model().parameters(), lr=0.1, momentum=0.9)
    (problem,) = opttree.validate(optimizer)
    assert problem.kind is opttree.ProblemKind.UNSUPPORTED_OPTIMIZER and "asked about another registration" in problem.message
    with pytest.raises(opttree.UnsupportedOptimizer, match="cannot be told"):
        opttree.reset(optimizer)


def test_a_wrapper_kind_registered_for_a_base_leaves_a_subclass_with_a_schema_a_leaf() -> None:
    """The nearer registration applies: a subclass with a schema of its own stays a leaf
    under a wrapper kind registered later for its base, where it became a wrapper holding
    nothing and a reset kept its group step in silence."""

    class CountingBase(torch.optim.Optimizer):
        @torch.no_grad()
        def step(self, closure: None = None) -> None:  # type: ignore[override]
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1
                for p in group["params"]:
                    p.sub_(p.grad, alpha=group["lr"] / group["step"])

    class Counting(CountingBase):
        def __init__(self, params: list[torch.nn.Parameter]) -> None:
            super().__init__(params, {"lr": 0.1})

    opttree.register_schema(Counting, opttree.StateSchema(step=opttree.StepLocation.PER_GROUP))
    opttree.register_wrapper(CountingBase, children=lambda wrapper: [])
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = Counting([param])
    for _ in range(3):
        param.grad = torch.ones(3)
        optimizer.step()

    assert isinstance(opttree.tree(optimizer), opttree.LeafNode)
    report = opttree.reset(optimizer)

    assert report.leaves == 1 and report.steps == 1 and optimizer.param_groups[0]["step"] == 0


def buffered_classes() -> tuple[type[torch.optim.Optimizer], type[torch.optim.Optimizer]]:
    """A base that a wrapper kind is registered for, and a subclass that keeps history:
    new classes for each test, since registrations are kept for a class's lifetime."""

    class BufferedBase(torch.optim.Optimizer):
        def __init__(self, params: list[torch.nn.Parameter]) -> None:
            super().__init__(params, {"lr": 0.1})

    class Buffered(BufferedBase):
        @torch.no_grad()
        def step(self, closure: None = None) -> None:  # type: ignore[override]
            for group in self.param_groups:
                for p in group["params"]:
                    buffer = self.state[p].setdefault("buf", torch.zeros_like(p))
                    buffer.mul_(0.9).add_(p.grad)
                    p.sub_(buffer, alpha=group["lr"])

    return BufferedBase, Buffered


def stepped(cls: type[torch.optim.Optimizer]) -> tuple[torch.optim.Optimizer, torch.nn.Parameter]:
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = cast(Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], cls)([param])
    for _ in range(3):
        param.grad = torch.ones(3)
        optimizer.step()
    return optimizer, param


def test_a_schema_through_a_registered_abc_and_a_wrapper_kind_for_a_base_are_refused_as_neither_nearer() -> None:
    """An ABC the class is registered under is not one of its bases: against a wrapper
    kind for a base, neither registration is nearer, and the class was taken for a wrapper
    holding nothing. It is refused, changing nothing, until the class itself is registered."""

    class Momentum(abc.ABC):
        pass

    BufferedBase, Buffered = buffered_classes()
    Momentum.register(Buffered)
    opttree.register_wrapper(BufferedBase, children=lambda wrapper: [])
    opttree.register_schema(Momentum, opttree.StateSchema(zero={"buf"}, step=opttree.StepLocation.NONE))
    optimizer, param = stepped(Buffered)
    before = snapshot(optimizer)

    (problem, *_) = opttree.validate(optimizer)
    assert problem.kind is opttree.ProblemKind.UNKNOWN_WRAPPER and "neither is nearer" in problem.message
    with pytest.raises(opttree.UnknownWrapper, match=r"a schema, for .*Momentum, and a wrapper kind, for .*BufferedBase"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)

    opttree.register_schema(Buffered, opttree.StateSchema(zero={"buf"}, step=opttree.StepLocation.NONE))
    assert isinstance(opttree.tree(optimizer), opttree.LeafNode)
    assert opttree.reset(optimizer).tensors_zeroed == 1 and not optimizer.state[param]["buf"].any()


def test_a_wrapper_kind_for_the_class_itself_is_nearer_than_a_schema_through_an_abc() -> None:
    class Stepping(abc.ABC):
        pass

    _, Buffered = buffered_classes()
    Stepping.register(Buffered)
    opttree.register_schema(Stepping, opttree.StateSchema(zero={"buf"}, step=opttree.StepLocation.NONE))
    inner = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    opttree.register_wrapper(Buffered, children=lambda wrapper: [("inner", inner)])
    optimizer, _ = stepped(Buffered)
    node = opttree.tree(optimizer)
    assert isinstance(node, opttree.WrapperNode) and [child.path for child in node.children] == ["inner"]


def test_a_class_with_a_built_in_schema_cannot_be_registered_as_a_wrapper() -> None:
    with pytest.raises(opttree.RegistrationError, match=r"torch\.optim\.adam\.Adam has a schema: a class is a leaf with a schema or a wrapper, not both"):
        opttree.register_wrapper(torch.optim.Adam, children=lambda wrapper: [])
    with pytest.raises(opttree.RegistrationError, match=r"has a schema"):
        opttree.register_wrapper("torch.optim.adam.Adam", children=lambda wrapper: [])
    assert isinstance(opttree.tree(torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])), opttree.LeafNode)


def test_a_class_given_a_schema_by_its_path_and_a_wrapper_kind_as_a_class_is_refused_not_a_wrapper() -> None:
    """A schema registered by dotted path before its module is imported, then a wrapper
    kind for the class itself: refused, the class staying a leaf."""
    module = types.ModuleType("opttree_both_kinds")
    exec("import torch\nclass Both(torch.optim.SGD):\n    pass\n", module.__dict__)
    opttree.register_schema("opttree_both_kinds.Both", opttree.StateSchema(zero={"momentum_buffer"}))
    sys.modules["opttree_both_kinds"] = module
    try:
        optimizer = module.Both([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        with pytest.raises(opttree.RegistrationError, match="a schema for opttree_both_kinds.Both is registered already"):
            opttree.register_wrapper(module.Both, children=lambda wrapper: [])
        assert isinstance(opttree.tree(optimizer), opttree.LeafNode)
    finally:
        del sys.modules["opttree_both_kinds"]


def test_a_class_registered_under_two_of_its_paths_before_either_is_imported_is_refused() -> None:
    """Its defining path and a re-export, both registered while neither module was
    imported: which schema applied depended on import order (the other passed over in
    silence). Both met, the class is refused, naming both paths."""
    impl = types.ModuleType("opttree_twice_impl")
    exec("import torch\nclass Twice(torch.optim.SGD):\n    pass\n", impl.__dict__)
    reexport = types.ModuleType("opttree_twice")
    reexport.__dict__["Twice"] = impl.__dict__["Twice"]
    opttree.register_schema("opttree_twice.Twice", opttree.StateSchema(zero={"momentum_buffer"}))
    opttree.register_schema("opttree_twice_impl.Twice", opttree.StateSchema(drop={"momentum_buffer"}))
    sys.modules.update(opttree_twice_impl=impl, opttree_twice=reexport)
    try:
        param = torch.nn.Parameter(torch.ones(2))
        optimizer = impl.__dict__["Twice"]([param], lr=0.1, momentum=0.9)
        param.grad = torch.ones(2)
        optimizer.step()
        before = snapshot(optimizer)
        with pytest.raises(opttree.UnsupportedOptimizer, match=r"opttree_twice_impl\.Twice is registered under two of its paths \(opttree_twice\.Twice too\)"):
            opttree.reset(optimizer)
        assert unchanged(optimizer, before)
    finally:
        del sys.modules["opttree_twice_impl"], sys.modules["opttree_twice"]


def test_a_class_of_a_module_several_packages_deep_and_a_path_of_many_parts_are_found_as_registered() -> None:
    """The module a dotted path names is its longest prefix in ``sys.modules``, looked for
    among the first 32 parts (every prefix joined again took about 20 seconds to register a
    path of 20,000 parts here, 100,000 more than five minutes), there without its parent
    packages too, as a stand-in for an optional package may be."""
    import sys
    import types

    names = ["opttree_deep_pkg.a.b"]  # its parents are not in sys.modules
    modules = [types.ModuleType(name) for name in names]

    class Deep(torch.optim.SGD):
        def step(self, closure: None = None) -> None:  # type: ignore[override]
            super().step()

    Deep.__module__, Deep.__qualname__ = "opttree_deep_pkg.a.b._impl", "Deep"  # re-exported: found through its module
    setattr(modules[-1], "Deep", Deep)
    sys.modules.update(zip(names, modules, strict=True))
    try:
        opttree.register_schema("opttree_deep_pkg.a.b.Deep", opttree.StateSchema(drop={"momentum_buffer"}))
        opttree.register_schema("opttree_deep_pkg." + "x." * 2_000 + "Missing", opttree.StateSchema())
        param = torch.nn.Parameter(torch.ones(2))
        optimizer = Deep([param], lr=0.1, momentum=0.9)
        param.grad = torch.ones(2)
        optimizer.step()
        assert opttree.validate(optimizer) == ()
        assert opttree.reset(optimizer).tensors_dropped == 1
    finally:
        for name in names:
            del sys.modules[name]
