"""State entries an optimizer builds whole (``if len(state) == 0``) and that lack one of
their keys: torch's next step raises KeyError for the missing key, as emerging-optimizers'
LaProp, SOAP, REKLS and AdaptiveMuon do, whatever a reset did to the rest in place. opttree
refuses them (``StateSchema.always_built``) with nothing changed; an optimizer that builds
each missing key on its own (ObliqueAdam) is reset, and trains as a fresh one."""

from __future__ import annotations

import collections
import copy
import functools
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import attrs
import numpy as np
import pytest
import torch

import opttree
from opttree._registry import schema_for
from tests.helpers import model, refused_in_place, snapshot, train, trains_as_fresh, unchanged
from tests.megatron_parts import GROUP_SETTINGS, fp32, megatron_group

if TYPE_CHECKING:
    from opttree import testing

TORCH_CASES = [
    pytest.param(cls, key, id=f"{cls.__name__}-{key}")
    for cls in (
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.RMSprop,
    )
    for key in sorted((schema_for(cls) or opttree.StateSchema()).always_built)
]


@pytest.mark.parametrize(("optimizer_cls", "key"), TORCH_CASES)
def test_a_torch_entry_lacking_a_key_it_is_built_with_is_refused(optimizer_cls: Callable[..., torch.optim.Optimizer], key: str) -> None:
    net = model()
    optimizer = optimizer_cls(net.parameters(), lr=0.01)
    train(net, optimizer, 0, 2)
    first = next(iter(optimizer.state.values()))
    del first[key]

    problem = refused_in_place(optimizer, key, rf"{optimizer_cls.__name__} at <root>: key '{key}'")

    assert "1 of its 4 state entries lack it, which its optimizer builds with an entry and reads at every step:" in problem.message
    with pytest.raises(KeyError):  # what the refusal spares: torch's own next step
        train(net, optimizer, 2, 1)


def test_every_key_torch_builds_with_an_entry_is_named() -> None:
    """Each torch schema names as always built what its class builds with every entry:
    the keys of a fresh optimizer's entries, but for those an option builds."""
    for cls in (torch.optim.Adam, torch.optim.NAdam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.ASGD):
        net = model()
        optimizer = cls(net.parameters(), lr=0.01)
        train(net, optimizer, 0, 1)
        schema = schema_for(cls)
        assert schema is not None
        built = set().union(*map(set, optimizer.state.values())) - {"step"}
        assert schema.always_built == built, cls.__name__


@pytest.mark.parametrize(("optimizer_cls", "key"), [(torch.optim.Rprop, "prev"), (torch.optim.ASGD, "ax")])
def test_an_entry_a_full_reset_deletes_may_lack_a_key(optimizer_cls: Callable[..., torch.optim.Optimizer], key: str) -> None:
    """Rprop's and ASGD's entries start from the lr at their first step, so a full reset
    deletes them whole, and the optimizer builds them again: one lacking a key is no problem."""
    net = model()
    optimizer = optimizer_cls(net.parameters(), lr=0.01)
    train(net, optimizer, 0, 2)
    del next(iter(optimizer.state.values()))[key]

    assert opttree.validate(optimizer) == ()
    opttree.reset(optimizer)
    assert trains_as_fresh(net, optimizer, lambda twin: optimizer_cls(twin.parameters(), lr=0.01), 2, 3)


def test_an_empty_entry_is_built_whole_and_not_refused() -> None:
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    train(net, optimizer, 0, 2)
    first = next(iter(optimizer.state))
    optimizer.state[first].clear()

    assert opttree.validate(optimizer) == ()
    opttree.reset(optimizer)
    assert trains_as_fresh(net, optimizer, lambda twin: torch.optim.AdamW(twin.parameters(), lr=0.01), 2, 3)


needs_emerging = pytest.mark.skipif(importlib.util.find_spec("emerging_optimizers") is None, reason="no emerging-optimizers in this lane")


@needs_emerging
@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("laprop", "exp_avg_sq"),
        ("soap", "Q_R"),
        ("soap", "exp_avg"),
        ("rekls", "L"),
        ("adaptive_muon", "moment2_buffer"),
    ],
)
def test_an_emerging_entry_lacking_a_key_it_is_built_with_is_refused(name: str, key: str) -> None:
    from tests.test_emerging_catalogue import BUILD, _registry, params
    from tests.test_emerging_catalogue import train as train_emerging

    ps = params()
    optimizer = BUILD[name](_registry()[name], ps)
    train_emerging(optimizer, ps, range(2))
    del optimizer.state[ps[0]][key]
    before = snapshot(optimizer)

    problems = opttree.validate(optimizer)

    assert [(p.kind, p.key) for p in problems] == [(opttree.ProblemKind.UNSUPPORTED_STATE, key)]
    with pytest.raises(opttree.UnsupportedOptimizerState, match=rf"key '{key}': 1 of its 2 state entries lack it"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)
    with pytest.raises(KeyError):
        train_emerging(optimizer, ps, range(2, 3))


@needs_emerging
def test_an_oblique_adam_entry_lacking_a_key_is_reset_and_trains_as_a_fresh_one() -> None:
    """ObliqueAdam builds each missing key on its own, so an entry lacking one is no problem."""
    from tests.test_emerging_catalogue import BUILD, _registry, params
    from tests.test_emerging_catalogue import train as train_emerging

    cls = _registry()["oblique_adam"]
    ps = params()
    optimizer = BUILD["oblique_adam"](cls, ps)
    train_emerging(optimizer, ps, range(2))
    del optimizer.state[ps[0]]["exp_avg_sq"]

    assert opttree.validate(optimizer) == ()
    opttree.reset(optimizer)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    fresh = BUILD["oblique_adam"](cls, twins)
    train_emerging(optimizer, ps, range(2, 5))
    train_emerging(fresh, twins, range(2, 5))
    assert all(torch.equal(a, b) for a, b in zip(ps, twins, strict=True))


def test_always_built_names_history_apart_from_built_if() -> None:
    with pytest.raises(opttree.RegistrationError, match=r"always_built names \['master_param'\], which are neither zeroed, filled nor identity"):
        opttree.StateSchema(zero={"exp_avg"}, keep={"master_param"}, always_built={"master_param"})
    with pytest.raises(opttree.RegistrationError, match=r"state keys \['ema'\] are named in both built_if and always_built"):
        opttree.StateSchema(zero={"exp_avg", "ema"}, built_if={"ema": "use_ema"}, always_built={"exp_avg", "ema"})
    with pytest.raises(opttree.RegistrationError, match="state keys are given as a set of names"):
        opttree.StateSchema(zero={"exp_avg"}, always_built="exp_avg")  # type: ignore[arg-type]
    schema = opttree.StateSchema(zero={"exp_avg", "ema"}, built_if={"ema": "use_ema"}, always_built={"exp_avg"})
    assert schema.built_with_entry == (("exp_avg", None), ("ema", "use_ema"))


def test_a_copy_keeps_the_check() -> None:
    """A deep copy of an optimizer (as a framework's snapshot takes) is checked alike."""
    net = model()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    train(net, optimizer, 0, 2)
    copied = copy.deepcopy(optimizer)
    del next(iter(copied.state.values()))["exp_avg"]
    assert [p.key for p in opttree.validate(copied)] == ["exp_avg"]
    assert opttree.validate(optimizer) == ()


@pytest.mark.parametrize("key", ["row_var", "col_var", "variance"])
def test_an_adafactor_entry_lacking_a_key_built_for_its_parameters_shape_is_refused(key: str) -> None:
    """Adafactor builds ``row_var`` and ``col_var`` with the entry of a parameter of two or
    more dimensions and ``variance`` with one of fewer (``StateSchema.built_for``): an entry
    that lacks the one its parameter needs is refused, in place and at a load, where torch's
    next step raises; what no entry of that shape holds is not asked for."""

    net = model()
    optimizer = torch.optim.Adafactor([megatron_group(net.parameters())], lr=0.01)
    train(net, optimizer, 0, 2)
    assert opttree.validate(optimizer) == ()
    held = next(entry for entry in optimizer.state.values() if key in entry)
    saved = copy.deepcopy(optimizer.state_dict())
    del held[key]

    problem = refused_in_place(optimizer, key, rf"Adafactor at <root>: key '{key}'")
    assert "1 of its 4 state entries lack it, which its optimizer builds with an entry and reads at every step for a parameter of its shape:" in problem.message
    with pytest.raises(AssertionError, match="should be defined when grad is"):  # what the refusal spares: torch's own next step
        train(net, optimizer, 2, 1)

    index = next(i for i, entry in saved["state"].items() if key in entry)
    del saved["state"][index][key]
    fresh = torch.optim.Adafactor([megatron_group(model().parameters())], lr=0.01)
    with pytest.raises(opttree.UnsupportedCheckpoint, match=rf"state entry {index}, of a parameter of shape .* lacks '{key}', which Adafactor builds with the entry of such a parameter"):
        opttree.load_state_dict(fp32(fresh), saved)
    assert fresh.state == {}


def test_adafactor_names_the_keys_it_builds_for_each_shape() -> None:
    """The keys of a fresh Adafactor's entries, for a matrix and for a vector, are those its
    schema's ``built_for`` accepts for their shapes."""
    net = model()
    optimizer = torch.optim.Adafactor(net.parameters(), lr=0.01)
    train(net, optimizer, 0, 1)
    schema = schema_for(torch.optim.Adafactor)
    assert schema is not None and not schema.always_built
    shapes = {len(param.shape) for param in optimizer.state}
    assert shapes == {1, 2}
    for param, entry in optimizer.state.items():
        assert set(entry) - {"step"} == {key for key, applies in schema.built_for if applies(tuple(param.shape))}


def test_built_for_names_history_apart_from_the_other_built_keys() -> None:
    def matrices(shape: tuple[int, ...]) -> bool:
        return len(shape) > 1

    with pytest.raises(opttree.RegistrationError, match=r"built_for names \['master_param'\], which are neither zeroed, filled nor identity"):
        opttree.StateSchema(zero={"exp_avg"}, keep={"master_param"}, built_for={"master_param": matrices})
    with pytest.raises(opttree.RegistrationError, match=r"state keys \['exp_avg'\] are named in both always_built and built_for"):
        opttree.StateSchema(zero={"exp_avg"}, always_built={"exp_avg"}, built_for={"exp_avg": matrices})
    with pytest.raises(opttree.RegistrationError, match=r"the built_for of 'exp_avg' is an int: expected \(param shape\) -> bool"):
        opttree.StateSchema(zero={"exp_avg"}, built_for={"exp_avg": 3})  # type: ignore[dict-item]


def test_a_built_for_function_that_raises_is_the_keys_problem() -> None:
    """A registered ``built_for`` that raises is reported for its key, not raised."""

    class Factored(torch.optim.Adafactor):
        pass

    def broken(shape: tuple[int, ...]) -> bool:
        raise ValueError("no shapes today")

    opttree.register_schema(Factored, attrs.evolve(schema_for(torch.optim.Adafactor) or opttree.StateSchema(), built_for={"row_var": broken, "col_var": broken, "variance": broken}))
    net = model()
    optimizer = Factored(net.parameters(), lr=0.01)
    train(net, optimizer, 0, 1)
    problems = opttree.validate(optimizer)
    assert any(p.key in ("row_var", "col_var", "variance") and "its schema's built_for raised ValueError: no shapes today" in p.message for p in problems)

    class Undecided:
        def __bool__(self) -> bool:
            raise ValueError("neither")

    class Unsure(torch.optim.Adafactor):
        pass

    def undecided(shape: tuple[int, ...]) -> bool:
        return cast(bool, Undecided())

    opttree.register_schema(Unsure, attrs.evolve(schema_for(torch.optim.Adafactor) or opttree.StateSchema(), built_for={"row_var": undecided, "col_var": undecided, "variance": undecided}))
    other = model()
    unsure = Unsure(other.parameters(), lr=0.01)
    train(other, unsure, 0, 1)
    assert any("its schema's built_for raised ValueError: neither" in p.message for p in opttree.validate(unsure))
    saved = copy.deepcopy(unsure.state_dict())
    saved["param_groups"][0].update(GROUP_SETTINGS)
    del saved["state"][0]["row_var"]

    fresh = Unsure([megatron_group(model().parameters())], lr=0.01)
    with pytest.raises(opttree.UnsupportedCheckpoint, match="its schema's built_for raised ValueError: neither"):
        opttree.load_state_dict(fp32(fresh), saved)


def test_an_option_a_hybrid_copies_into_its_sub_optimizers_is_checked_as_the_next_step_uses_it() -> None:
    """HybridDeviceOptimizer copies its own groups' options into its sub-optimizers' at each
    step: amsgrad switched on in its groups (Megatron's param_groups are the hybrid's) finds
    entries without ``max_exp_avg_sq`` at the next step, where a fresh stack builds them. An
    lr a scheduler moved in its groups is copied too, and is nothing to refuse."""
    from opttree import testing

    stack = testing.build("offload_0.75")
    stack.train(0, 2)
    for group in stack.optimizer.param_groups:
        group["lr"] = 0.5 * group["lr"]
    assert opttree.validate(stack.optimizer) == ()
    for group in stack.optimizer.param_groups:
        group["amsgrad"] = True
    before = [v.clone() for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]

    problems = opttree.validate(stack.optimizer)

    assert problems and all((p.kind, p.key) == (opttree.ProblemKind.UNSUPPORTED_STATE, "amsgrad") for p in problems)
    assert "HybridDeviceOptimizer's param group holds True" in problems[0].message
    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'amsgrad': its group option 'amsgrad' is False"):
        opttree.reset(stack.optimizer)
    after = [v for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


@functools.cache
def noted_hybrid() -> type[torch.optim.Optimizer]:
    """A ``HybridDeviceOptimizer`` subclass with a method of its own, registered as a
    wrapper of the user's, as the README tells: its step is HybridDeviceOptimizer's."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    class NotedHybrid(HybridDeviceOptimizer):
        def note(self) -> str:
            return "noted"

    opttree.register_wrapper(NotedHybrid, children=lambda hybrid: [(f"sub_optimizers[{i}]", sub) for i, sub in enumerate(hybrid.sub_optimizers)])
    return NotedHybrid


def offloaded_hybrid(stack: testing.MegatronStack) -> torch.optim.Optimizer:
    """The HybridDeviceOptimizer of an ``offload_*`` recipe, under its chain and wrapper."""
    return cast(torch.optim.Optimizer, stack.optimizer.chained_optimizers[0].optimizer)  # type: ignore[attr-defined]


@pytest.mark.parametrize("variant", ["params in tuples", "groups as UserDicts", "a registered subclass"])
def test_an_option_a_hybrid_copies_is_checked_whatever_its_groups_and_in_a_registered_subclass(variant: str) -> None:
    """The options a HybridDeviceOptimizer copies into its sub-optimizers are checked
    where its groups hold their parameters in tuples (torch's own step takes them) or are
    mappings other than dicts, and where it is a subclass registered as a wrapper of the
    user's, whose step copies them just the same: each reset "done", and the next step
    raised ``KeyError: 'max_exp_avg_sq'``."""
    from opttree import testing

    stack = testing.build("offload_0.75")
    stack.train(0, 2)
    hybrid = offloaded_hybrid(stack)
    if variant == "params in tuples":
        for group in hybrid.param_groups:
            group["params"] = tuple(group["params"])
    elif variant == "groups as UserDicts":
        hybrid.param_groups[:] = [collections.UserDict(group) for group in hybrid.param_groups]  # type: ignore[misc]  # mappings torch does not build, which Megatron steps with
        stack.train(2, 1)  # Megatron steps with them
    else:
        hybrid.__class__ = noted_hybrid()
    for group in hybrid.param_groups:
        group["amsgrad"] = True
    before = [snapshot(leaf) for leaf in stack.leaves()]

    problems = opttree.validate(stack.optimizer)

    assert problems and all((p.kind, p.key) == (opttree.ProblemKind.UNSUPPORTED_STATE, "amsgrad") for p in problems)
    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'amsgrad': its group option 'amsgrad' is False"):
        opttree.reset(stack.optimizer)
    assert all(unchanged(leaf, snap) for leaf, snap in zip(stack.leaves(), before, strict=True))


def test_a_registered_hybrid_subclass_s_group_steps_are_deleted_as_a_fresh_one_has_none() -> None:
    """A Megatron load gives a HybridDeviceOptimizer's groups the step it saved, which
    its step copies into its sub-optimizers' groups: a reset of a registered subclass
    kept it there and called itself done."""
    from opttree import testing

    stack = testing.build("offload_0.75")
    stack.train(0, 2)
    hybrid = offloaded_hybrid(stack)
    hybrid.__class__ = noted_hybrid()
    for group in hybrid.param_groups:
        group["step"] = 2  # as DistributedOptimizer.load_state_dict passes them

    report = opttree.reset(stack.optimizer)

    assert [group.get("step") for group in hybrid.param_groups] == [None] * len(hybrid.param_groups)
    assert report.steps >= len(hybrid.param_groups)
    fresh = testing.build("offload_0.75")
    fresh.copy_weights_from(stack)
    stack.train(2, 2)
    fresh.train(2, 2)
    assert all(torch.equal(a, b) for a, b in zip(stack.main_params(), fresh.main_params(), strict=True))


@pytest.mark.parametrize("value", [np.array([True, False]), torch.tensor([True, True]), torch.tensor(True, device="meta")], ids=["ndarray", "tensor", "meta"])
def test_a_hybrid_option_that_is_not_one_bool_is_reported_not_raised(value: object) -> None:
    from opttree import testing

    stack = testing.build("offload_0.75")
    stack.train(0, 1)
    for group in stack.optimizer.param_groups:
        group["amsgrad"] = value

    problems = opttree.validate(stack.optimizer)

    assert problems and all(p.key == "amsgrad" for p in problems)
    with pytest.raises(opttree.OptTreeError):
        opttree.reset(stack.optimizer)


def test_a_sub_optimizer_whose_groups_cannot_be_read_is_reported_beside_a_copied_option() -> None:
    from opttree import testing

    stack = testing.build("offload_0.75")
    stack.train(0, 1)
    for group in stack.optimizer.param_groups:
        group["amsgrad"] = True
    stack.leaves()[0].param_groups = None  # type: ignore[assignment]

    problems = opttree.validate(stack.optimizer)

    assert any(p.kind is opttree.ProblemKind.MALFORMED_STATE for p in problems)
    with pytest.raises(opttree.OptTreeError):
        opttree.reset(stack.optimizer)
