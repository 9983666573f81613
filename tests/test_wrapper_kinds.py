"""Wrapper kinds: only known Megatron kinds are walked; any other wrapper, and any
optimizer a wrapper hides outside its known children, is refused, never skipped."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.optimizer import ChainedOptimizer, FP32Optimizer, MegatronOptimizer

import opttree
from tests.helpers import clone_model, model, snapshot, train, trains_as_fresh_stack, unchanged, weights_equal
from opttree import testing
from tests.megatron_parts import chained, config, fp32, mimo_over

pytestmark = pytest.mark.usefixtures("process_group")


def trained_adamw(seed: int) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    net = model(seed)
    optimizer = torch.optim.AdamW(net.parameters())
    train(net, optimizer, 0, 3)
    return net, optimizer


@pytest.mark.parametrize("name", [n for n in ("fp32", "fp16", "dist_bf16") if n in testing.available()])
def test_a_mimo_optimizer_over_the_factorys_chain_is_reset_exactly(name: str) -> None:
    """As megatron-core 0.19's ``get_mimo_optimizer`` builds it: each module's optimizer is
    the chain the factory returns. Its leaves' param groups are the factory's, and the
    chain above them is in the tree: reset (a check for the factory's optimizers passed
    without their chain once refused every such stack), training on as a fresh stack."""
    stack = testing.build(name)
    mimo_optimizer = mimo_over(stack)
    stack.train(0, 2)

    assert opttree.validate(mimo_optimizer) == ()
    report = opttree.reset(mimo_optimizer)

    assert report.leaves == 1 and report.steps > 0
    assert trains_as_fresh_stack(stack, testing.build(name), 2, 2)


def test_mimo_optimizer_is_a_wrapper_of_its_modules_and_is_reset_exactly() -> None:
    mimo = pytest.importorskip("megatron.core.models.mimo.optimizer")
    (vision_net, vision), (language_net, language) = trained_adamw(0), trained_adamw(1)
    shared = config()
    infos = {
        "vision": mimo.ModuleOptimizerInfo(fp32(vision, shared), None, None, True),
        "language": mimo.ModuleOptimizerInfo(fp32(language, shared), None, None, True),
        "audio": mimo.ModuleOptimizerInfo(None, None, None, False),  # no part of it on this rank
    }
    optimizer = mimo.MimoOptimizer(infos, shared)
    assert optimizer.optimizer is None  # what made it look like a stub

    node = opttree.tree(optimizer)
    report = opttree.reset(optimizer)

    paths = [leaf.path for wrapper in node.children for leaf in wrapper.children]
    assert paths == ["module_infos['vision'].optimizer.optimizer", "module_infos['language'].optimizer.optimizer"]
    assert report.leaves == 2 and report.tensors_zeroed == 2 * 2 * len(vision.state)
    assert "@ module_infos['vision'].optimizer .. module_infos['language'].optimizer" in opttree.describe(optimizer)
    assert opttree.validate(optimizer) == ()
    for net, leaf, seed in ((vision_net, vision, 0), (language_net, language, 1)):
        twin = clone_model(net) if seed == 0 else _clone(net, seed)
        fresh = torch.optim.AdamW(twin.parameters())
        train(net, leaf, 3, 3)
        train(twin, fresh, 3, 3)
        assert weights_equal(net, twin)


def _clone(net: torch.nn.Module, seed: int) -> torch.nn.Module:
    twin = model(seed)
    twin.load_state_dict(net.state_dict())
    return twin


class HomegrownMegatronOptimizer(MegatronOptimizer):
    """A MegatronOptimizer subclass that keeps its optimizers under a name of its own."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizer = None
        self.per_stage = optimizers


setattr(HomegrownMegatronOptimizer, "__abstractmethods__", frozenset())  # never stepped here
def test_a_megatron_optimizer_of_no_known_kind_is_refused_pointing_to_register_wrapper() -> None:
    _, leaf = trained_adamw(0)
    unknown = HomegrownMegatronOptimizer([leaf])  # type: ignore[abstract]  # cleared above, at runtime only
    before = snapshot(leaf)

    with pytest.raises(opttree.UnknownWrapper, match=r"HomegrownMegatronOptimizer at <root>: .*register_wrapper"):
        opttree.reset(unknown)
    assert unchanged(leaf, before)
    assert isinstance(opttree.UnknownWrapper("x"), opttree.NotAnOptimizer)
    kinds = [p.kind for p in opttree.validate(unknown)]
    assert kinds[0] is opttree.ProblemKind.UNKNOWN_WRAPPER
    assert "(refused: " in opttree.describe(unknown)


class WarmupChain(ChainedOptimizer):
    """A ChainedOptimizer that warms its members' learning rates up by a count of its own."""

    def step(self) -> tuple[bool, float | None, int | None]:
        self.warmed = getattr(self, "warmed", 0) + 1
        for group in self.param_groups:
            group["lr"] = 1e-3 * min(1.0, self.warmed / 4)
        return super().step()


class WarmupFP32(FP32Optimizer):
    """An FP32Optimizer that does the same in the step after gradients are ready."""

    def step_with_ready_grads(self) -> bool:
        self.warmed = getattr(self, "warmed", 0) + 1
        return bool(super().step_with_ready_grads())


class NamedChain(ChainedOptimizer):
    """A ChainedOptimizer subclass whose body defines nothing but this docstring."""


@pytest.mark.parametrize(("outer", "inner", "refused"), [(WarmupChain, FP32Optimizer, "WarmupChain"), (ChainedOptimizer, WarmupFP32, "WarmupFP32")])
def test_a_subclass_of_a_megatron_wrapper_with_methods_of_its_own_is_refused(outer: type, inner: type, refused: str) -> None:
    """A subclass of a wrapper kind opttree knows may keep optimizers or state (a warm-up
    count) where its base keeps none: it is refused until registered, changing nothing."""
    _, leaf = trained_adamw(0)
    root = chained([fp32(leaf)])
    root.chained_optimizers[0].__class__ = inner
    root.__class__ = outer
    before = snapshot(leaf)

    problems = opttree.validate(root)
    with pytest.raises(opttree.UnknownWrapper, match=rf"{refused} at \S+: .*{refused} defines its own .*register_wrapper"):
        opttree.reset(root)

    assert problems[0].kind is opttree.ProblemKind.UNKNOWN_WRAPPER  # the optimizers it holds follow, as hidden ones
    assert "(refused: " in opttree.describe(root)
    assert unchanged(leaf, before)


def test_a_subclass_of_a_megatron_wrapper_defining_nothing_is_its_bases_kind() -> None:
    net, leaf = trained_adamw(0)
    root = chained([fp32(leaf)])
    root.__class__ = NamedChain
    twin = clone_model(net)
    fresh = torch.optim.AdamW(twin.parameters())

    assert opttree.validate(root) == ()
    assert opttree.reset(root).leaves == 1
    train(net, leaf, 3, 2)
    train(twin, fresh, 3, 2)
    assert weights_equal(net, twin)


class RegisteredWarmChain(ChainedOptimizer):
    """A ChainedOptimizer with a method of its own, registered by its user as the README
    says, over the members of the factory's chain."""

    def warm(self) -> None:
        return None


def _members(chain: RegisteredWarmChain) -> list[tuple[str, object]]:
    return [(f"chained[{i}]", member) for i, member in enumerate(chain.chained_optimizers)]


opttree.register_wrapper(RegisteredWarmChain, children=_members)


@pytest.mark.parametrize("name", ["fp32", "fp16", "dist_bf16"])
def test_a_registered_subclass_of_the_chain_is_the_chain_its_members_were_built_under(name: str) -> None:
    """Registered, a subclass of ``ChainedOptimizer`` over the factory's members is the
    chain they were built under: every reset of it was refused as reaching them without
    their chain."""
    stack = testing.build(name)
    stack.train(0, 3)
    chain = stack.optimizer
    assert isinstance(chain, ChainedOptimizer)
    members = [member for member in chain.chained_optimizers if isinstance(member, MegatronOptimizer)]
    assert len(members) == len(chain.chained_optimizers)
    with stack.device:
        warm = RegisteredWarmChain(members)

    assert opttree.validate(warm) == ()
    assert opttree.reset(warm).leaves == len(stack.leaves())
    assert trains_as_fresh_stack(stack, testing.build(name), 3, 3)


class StagedWrapper:
    """A wrapper registered with a children function that names only its first optimizer,
    while it also keeps others: in a list, in a dict and in a dataclass."""

    @dataclasses.dataclass
    class Record:
        optimizer: torch.optim.Optimizer
        name: str

    def __init__(self, first: torch.optim.Optimizer, hidden: torch.optim.Optimizer, where: str) -> None:
        self.first = first
        self.stages: list[object] = [first]
        self.by_name: dict[str, object] = {}
        self.record: object = None
        if where == "list":
            self.stages.append(hidden)
        elif where == "dict":
            self.by_name["late"] = hidden
        elif where == "dataclass":
            self.by_name["late"] = StagedWrapper.Record(hidden, "late")
        else:
            self.record = StagedWrapper.Record(hidden, "late")


opttree.register_wrapper(StagedWrapper, children=lambda w: [("first", w.first)] if isinstance(w, StagedWrapper) else [])


@pytest.mark.parametrize(
    ("where", "label"),
    [
        ("list", "stages[1]"),
        ("dict", "by_name['late']"),
        ("dataclass", "by_name['late'].optimizer"),
        ("field", "record.optimizer"),
    ],
)
def test_an_optimizer_a_wrapper_holds_outside_the_tree_is_refused(where: str, label: str) -> None:
    (_, first), (_, hidden) = trained_adamw(0), trained_adamw(1)
    wrapper = StagedWrapper(first, hidden, where)
    before = [snapshot(first), snapshot(hidden)]

    problems = opttree.validate(wrapper)
    with pytest.raises(opttree.HiddenOptimizer, match=r"StagedWrapper at <root>: holds an AdamW in (\S+) ") as caught:
        opttree.reset(wrapper)

    assert caught.value.problem is not None and f"in {label} that" in caught.value.problem.message

    assert [p.kind for p in problems] == [opttree.ProblemKind.HIDDEN_OPTIMIZER]
    assert unchanged(first, before[0]) and unchanged(hidden, before[1])


def test_an_optimizer_held_twice_inside_the_tree_is_not_hidden() -> None:
    (_, first), _ = trained_adamw(0), None
    wrapper = StagedWrapper(first, first, "list")  # the same optimizer, which is in the tree
    assert opttree.validate(wrapper) == ()
    assert opttree.reset(wrapper).leaves == 1


def test_megatrons_real_wrappers_hide_nothing() -> None:
    shared = config()
    root = chained([fp32(trained_adamw(0)[1], shared), fp32(None, shared)])
    assert isinstance(root.chained_optimizers[0], FP32Optimizer)
    assert opttree.validate(root) == ()


def test_a_method_of_its_own_set_on_a_megatron_wrapper_instance_is_refused() -> None:
    """A ``step`` warming the lr up by a count of its own, set on one ChainedOptimizer: the
    wrapper's kind says nothing of it, and a reset kept the count."""
    _, leaf = trained_adamw(0)
    root = chained([fp32(leaf)])
    warmed = [0]

    def warming_step() -> object:
        warmed[0] += 1
        return ChainedOptimizer.step(root)

    setattr(root, "step", warming_step)
    before = snapshot(leaf)

    problems = opttree.validate(root)
    with pytest.raises(opttree.UnknownWrapper, match=r"ChainedOptimizer at <root>: this ChainedOptimizer holds its own step on the instance"):
        opttree.reset(root)

    assert [p.kind for p in problems] == [opttree.ProblemKind.UNKNOWN_WRAPPER]
    assert unchanged(leaf, before)
