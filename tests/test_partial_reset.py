"""Partial reset: chosen parameters and keys, mapped through Megatron's real wrappers."""

from __future__ import annotations

import re
from collections.abc import Callable

import attrs
import pytest
import torch

import opttree
from megatron.core.transformer.module import MegatronModule
from opttree import testing
from tests import megatron_parts
from tests.helpers import model, on_one_step, snapshot, stepped_adamw, stepped_lbfgs, stepped_pair, train, unchanged
from tests.standins import TEFusedAdam

K = 2


def leaf_state(stack: testing.MegatronStack) -> list[tuple[str, torch.Tensor]]:
    return [(k, v) for leaf in stack.leaves() for entry in leaf.state.values() for k, v in entry.items()]


Position = tuple[int, int, str]


def positions(stack: testing.MegatronStack) -> dict[Position, object]:
    """Every state value by (leaf, entry, key); a dropped key is simply absent."""
    return {
        (i, j, key): value
        for i, leaf in enumerate(stack.leaves())
        for j, entry in enumerate(leaf.state.values())
        for key, value in entry.items()
    }


def copied(value: object) -> object:
    """A copy of a state value to compare with later: tensors are written in place."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def as_fresh(key: str, value: object) -> bool:
    """Whether a state value is as a reset leaves it: SOAP's eigenbases the identity, the
    rest zero."""
    if not isinstance(value, torch.Tensor):
        return value == 0
    if key in ("Q_L", "Q_R"):
        return torch.equal(value, torch.eye(len(value), dtype=value.dtype))
    return not value.any()


def up_weight(stack: testing.MegatronStack) -> torch.Tensor:
    return dict(stack.model.named_parameters())["module.up.weight"]


def trained_pair(name: str) -> tuple[testing.MegatronStack, testing.MegatronStack]:
    pair = testing.build(name), testing.build(name)
    for stack in pair:
        stack.train(0, K)
    return pair


@pytest.mark.parametrize("name", [n for n in testing.available() if not testing.RECIPES[n].frozen_dense])  # one layer trains there
def test_complementary_partial_resets_split_the_state_exactly(name: str) -> None:
    """Reset the "up" layer's state in one stack and everything else in its twin: each
    history tensor must be zeroed in exactly one of them and bitwise unchanged in the other;
    step counters and master weights are kept by both."""
    first, second = trained_pair(name)
    before = {where: copied(v) for where, v in positions(first).items()}
    assert all(same(v, before[where]) for where, v in positions(second).items())

    def in_up(param_name: str) -> bool:
        return ".up." in param_name

    opttree.reset(first.optimizer, params=in_up, model=first.model)
    opttree.reset(second.optimizer, params=lambda n: not in_up(n), model=second.model)

    after_first, after_second = positions(first), positions(second)

    def reset_in(after: dict[Position, object], where: Position) -> bool:
        return where not in after or as_fresh(where[2], after[where])  # dropped, or reset in place

    def kept_in(after: dict[Position, object], where: Position) -> bool:
        return where in after and same(after[where], before[where])

    counts = {"first": 0, "second": 0}
    for where, old in before.items():
        if where[2] in ("master_param", "step"):
            assert kept_in(after_first, where) and kept_in(after_second, where)
            continue
        first_only = reset_in(after_first, where) and kept_in(after_second, where)
        second_only = kept_in(after_first, where) and reset_in(after_second, where)
        assert first_only or second_only, where
        counts["first" if first_only else "second"] += 1
    # Each side reset some of the state.
    assert counts["first"] > 0 and counts["second"] > 0


def test_only_the_named_keys_are_reset() -> None:
    stack = testing.build("bf16")
    stack.train(0, K)
    before = [(k, v.clone()) for k, v in leaf_state(stack)]

    report = opttree.reset(stack.optimizer, keys=["exp_avg"])

    for (key, after), (_, old) in zip(leaf_state(stack), before, strict=True):
        assert (not after.any()) if key == "exp_avg" else torch.equal(after, old), key
    assert report.steps == 0 and "exp_avg_sq" in report.kept_keys


def test_parameters_and_keys_combine() -> None:
    stack = testing.build("offload_0.75")
    stack.train(0, K)
    weight = up_weight(stack)
    before = [(k, v.clone()) for k, v in leaf_state(stack)]

    report = opttree.reset(stack.optimizer, params=[weight], keys={"exp_avg"})

    assert report.tensors_zeroed == 1 and report.steps == 0
    changed = [k for (k, v), (_, old) in zip(leaf_state(stack), before, strict=True) if not torch.equal(v, old)]
    assert changed == ["exp_avg"]


@pytest.mark.parametrize("name", ["fp32", "dist_bf16", "offload_0.75"])
def test_steps_of_part_of_a_megatron_optimizer_are_refused_and_megatron_shows_why(name: str) -> None:
    """Megatron saves one step per optimizer: unequal steps inside one cannot be saved."""
    stack = testing.build(name)
    stack.train(0, K)
    before = [(k, v.clone()) for k, v in leaf_state(stack)]

    with pytest.raises(opttree.PartialResetRefused, match=r"Megatron saves one step for all of them") as caught:
        opttree.reset(stack.optimizer, params=[up_weight(stack)], keys={"exp_avg", "step"})
    assert caught.value.problem is not None and caught.value.problem.kind is opttree.ProblemKind.PARTIAL_STEP
    assert all(torch.equal(v, old) for (_, v), (_, old) in zip(leaf_state(stack), before, strict=True))

    everything = list(stack.model.parameters())
    report = opttree.reset(stack.optimizer, params=everything, keys={"exp_avg", "exp_avg_sq", "step"})
    assert report.steps > 0
    with stack.device:
        stack.optimizer.state_dict()  # equal steps: Megatron can save it


def module_state(stack: testing.MegatronStack) -> dict[str, object]:
    module = stack.model.module
    assert isinstance(module, MegatronModule)
    return module.sharded_state_dict()


def test_megatron_cannot_save_unequal_steps() -> None:
    """The other side: what opttree refuses, Megatron's own checkpointing fails on."""
    stack = testing.build("fp32")
    stack.train(0, K)
    leaf = stack.leaves()[0]
    first = next(iter(leaf.state.values()))
    first["step"].zero_()  # by hand, as a per-parameter partial reset would

    with stack.device, pytest.raises(ValueError, match="The optimizer step differs per parameter"):
        stack.optimizer.sharded_state_dict(module_state(stack))


def test_a_parameter_no_optimizer_holds_is_an_error_and_nothing_changes() -> None:
    stack = testing.build("dist_bf16")
    stack.train(0, K)
    before = [v.clone() for _, v in leaf_state(stack)]
    stranger = torch.nn.Parameter(torch.zeros(3, 5))

    with pytest.raises(opttree.UnmappedParameter, match=r"of shape \(3, 5\) is held by no optimizer"):
        opttree.reset(stack.optimizer, params=[up_weight(stack), stranger])

    assert all(torch.equal(v, old) for (_, v), old in zip(leaf_state(stack), before, strict=True))


def test_a_predicate_needs_the_model() -> None:
    stack = testing.build("fp32")
    with pytest.raises(opttree.OptTreeError, match="needs model="):
        opttree.reset(stack.optimizer, params=lambda name: True)


def test_a_key_no_optimizer_has_is_refused() -> None:
    net = model()
    optimizer = torch.optim.AdamW(net.parameters())
    train(net, optimizer, 0, 1)
    before = snapshot(optimizer)

    with pytest.raises(opttree.PartialResetRefused, match=r"no optimizer in the tree has history \['momentum'\]") as caught:
        opttree.reset(optimizer, keys=["momentum"])
    assert unchanged(optimizer, before)
    # the keys it offers are those held, which a reset takes; amsgrad's is built only with amsgrad=True
    assert "(resettable there: exp_avg, exp_avg_sq, step; max_exp_avg_sq only where options build them)" in str(caught.value)


@pytest.mark.parametrize(
    ("call", "where"),
    [
        (lambda o, p: opttree.reset(o, keys=["max_exp_avg_sq"]), "in the tree"),
        (lambda o, p: opttree.reset(o, params=[p], keys=["max_exp_avg_sq"]), "holding the selected parameters"),
        (lambda o, p: opttree.prune(o, 0.5, keys=["max_exp_avg_sq"]), "in the tree"),
        (lambda o, p: opttree.scale(o, 0.5, keys=["max_exp_avg_sq"]), "in the tree"),
    ],
    ids=["reset", "reset params", "prune", "scale"],
)
def test_keys_of_the_schema_that_no_entry_holds_are_refused_not_a_silent_no_op(
    call: Callable[[torch.optim.Optimizer, torch.Tensor], object], where: str
) -> None:
    """Adam builds ``max_exp_avg_sq`` only with amsgrad=True: named alone, where the state
    holds none, the call would change nothing and report success."""
    net = model()
    optimizer = torch.optim.Adam(net.parameters())
    train(net, optimizer, 0, 1)
    before = snapshot(optimizer)

    with pytest.raises(opttree.PartialResetRefused, match=rf"no optimizer {where} holds \['max_exp_avg_sq'\] in its state \(it holds exp_avg, exp_avg_sq, step\)"):
        call(optimizer, next(net.parameters()))
    assert unchanged(optimizer, before)


def test_keys_named_before_any_state_is_built_change_nothing_without_refusal() -> None:
    """Nothing is held yet, so a reset of some keys has nothing to reset, as a full one."""
    optimizer = torch.optim.Adam(model().parameters())

    assert opttree.reset(optimizer, keys=["exp_avg"]).tensors_zeroed == 0


@pytest.mark.parametrize("name", [n for n in ("bf16", "dist_bf16", "fp16", "dist_fp16") if n in testing.available()])
def test_a_subtree_under_a_megatron_wrapper_is_checked_against_the_wrapper_it_is_checkpointed_with(name: str) -> None:
    """The leaf below a Megatron wrapper, taken from the built tree: a release, or a reset
    of some of the steps the wrapper saves as one, would leave a state Megatron cannot
    checkpoint, which the leaf alone cannot see. Refused with nothing changed; the whole
    leaf, which holds every parameter of its step unit, is reset, with the fp16 wrapper's
    loss scale above it (a warmed-up scale kept would not train as a fresh stack), and
    trains as a fresh stack does."""
    stack = testing.build(name)
    stack.train(0, K)
    root = opttree.tree(stack.optimizer)
    leaf = root.children[0].children[0]
    assert isinstance(leaf, opttree.LeafNode) and leaf.under is not None
    assert leaf.under == ("<root>", stack.optimizer) and root.under is None
    main = leaf.optimizer.param_groups[0]["params"][0]
    before = snapshot(leaf.optimizer)

    with pytest.raises(opttree.ReleaseRefused, match=r"AdamW at chained\[0\].optimizer: a subtree under ChainedOptimizer at <root>: Megatron cannot checkpoint an emptied"):
        opttree.reset(leaf, release=True)
    with pytest.raises(opttree.PartialResetRefused, match=r"at (<root>|chained\[0\]) saves one step for \d+ parameters, of which the reset takes 1"):
        opttree.reset(leaf, params=[main], keys=["step"])
    assert unchanged(leaf.optimizer, before)
    assert opttree.validate(leaf) == ()

    report = opttree.reset(leaf)
    assert report.steps > 0
    assert report.loss_scales_reset == (1 if "fp16" in name else 0)
    fresh = testing.build(name)
    fresh.copy_weights_from(stack)
    stack.train(K, K)
    fresh.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(stack.main_params(), fresh.main_params(), strict=True))


@pytest.mark.parametrize("name", [n for n in ("fp32", "fp16", "dist_bf16", "offload_0.75") if n in testing.available()])
def test_an_optimizer_the_factory_built_passed_without_its_wrapper_is_refused(name: str) -> None:
    """Passed as itself, the inner optimizer hides the wrapper above it: its reset kept an
    fp16 stack's warmed-up loss scale (trained unlike a fresh stack), and a release left a
    DistributedOptimizer that cannot save. Refused with nothing changed; its node in the
    stack's tree, which records the wrapper, is reset as the stack's checks say."""
    stack = testing.build(name)
    stack.train(0, K)
    inner = stack.leaves()[0]
    before = snapshot(inner)

    changes: list[Callable[[], object]] = [lambda: opttree.reset(inner), lambda: opttree.reset(inner, release=True)]
    for change in changes:
        with pytest.raises(opttree.UnsupportedOptimizer, match=r"at <root>: its param groups are Megatron's factory's \(they hold is_expert_parallel, max_lr, min_lr\): reached without the Megatron chain the factory built it under"):
            change()
    assert unchanged(inner, before)
    assert [p.kind for p in opttree.validate(inner)] == [opttree.ProblemKind.WITHOUT_ITS_WRAPPER]
    assert opttree.describe(inner)
    assert opttree.scale(inner, 1.0, keys=["exp_avg"]).tensors_zeroed > 0  # history alone is its own: no step, no scale

    pending: list[opttree.Node] = [opttree.tree(stack.optimizer)]
    while pending[-1].optimizer is not inner:
        pending.extend(pending.pop().children)
    if name.startswith("offload"):  # one of four sub-optimizers, whose steps the stack saves as one
        with pytest.raises(opttree.PartialResetRefused, match="saves one step for 4 parameters, of which the reset takes 1"):
            opttree.reset(pending[-1])
    else:
        assert opttree.reset(pending[-1]).steps > 0


class UsersWrapper:
    """A wrapper of the user's, registered with the optimizers it names."""

    def __init__(self, named: list[tuple[str, object]]) -> None:
        self.named = named


opttree.register_wrapper(UsersWrapper, children=lambda wrapper: list(wrapper.named))


@pytest.mark.parametrize("name", [n for n in ("fp16", "dist_bf16") if n in testing.available()])
def test_an_optimizer_the_factory_built_reached_below_no_chain_is_refused_at_any_depth(name: str) -> None:
    """The inner optimizer or the chain's member, held by a user's wrapper (beside an
    optimizer of its own) or standing in a node built by hand, hides the chain above it as
    much as passed alone: its reset was accepted and kept an fp16 stack's loss scale, or
    its release left a DistributedOptimizer that cannot save. Refused at its path, with
    nothing changed."""
    stack = testing.build(name)
    stack.train(0, K)
    (member,) = getattr(stack.optimizer, "chained_optimizers")
    inner = stack.leaves()[0]
    own = stepped_adamw(2)
    before = snapshot(inner), snapshot(own), float(member.get_loss_scale())

    refused: list[tuple[object, str]] = [
        (UsersWrapper([("own", own), ("inner", inner)]), "inner"),
        (UsersWrapper([("own", own), ("member", member)]), "member.optimizer"),
        (opttree.LeafNode("inner", inner), "inner"),
    ]
    for optimizer, path in refused:
        assert [(p.kind, p.path) for p in opttree.validate(optimizer)] == [(opttree.ProblemKind.WITHOUT_ITS_WRAPPER, path)]
        for release in (False, True):
            with pytest.raises(opttree.UnsupportedOptimizer, match=rf"AdamW at {re.escape(path)}: its param groups are Megatron's factory's"):
                opttree.reset(optimizer, release=release)
    assert unchanged(inner, before[0]) and unchanged(own, before[1]) and float(member.get_loss_scale()) == before[2]

    report = opttree.reset(UsersWrapper([("own", own), ("stack", stack.optimizer)]))  # the chain above it: reset as the stack's
    assert report.leaves == 2 and float(member.get_loss_scale()) == float(testing.build(name).optimizer.get_loss_scale())
    for named in ([("inner", inner), ("stack", stack.optimizer)], [("stack", stack.optimizer), ("inner", inner)]):
        assert opttree.validate(UsersWrapper(named)) == ()  # reached below its chain too, whichever path comes first


@pytest.mark.skipif("fp16" not in testing.available(), reason="no fp16 recipe in this lane")
def test_an_fp16_stacks_inner_optimizer_reset_alone_trains_unlike_a_fresh_stack() -> None:
    """The other side: its history and steps zeroed by hand, the wrapper's loss scale kept.
    Scales that differ by a power of two give the same steps until one of them overflows,
    which the kept, grown scale does first, two steps later."""
    stack = testing.build("fp16")
    stack.train(0, K)
    for entry in stack.leaves()[0].state.values():
        for value in entry.values():
            value.zero_()
    fresh = testing.build("fp16")
    fresh.copy_weights_from(stack)
    stack.train(K, 4)
    fresh.train(K, 4)
    assert not all(torch.equal(a, b) for a, b in zip(stack.main_params(), fresh.main_params(), strict=True))


@pytest.mark.parametrize("name", [n for n in ("bf16",) if n in testing.available()])
def test_a_subtree_whose_record_of_the_wrapper_above_it_is_not_opttrees_is_a_foreign_tree(name: str) -> None:
    """``under`` makes a subtree's checks those of the whole stack: a record naming another
    stack, or a place in it where the node is not, would check it as something it is not.
    The record is compared with the tree of the wrapper it names; a record that is not a
    (path, wrapper) pair is refused where the node is made. (A leaf without the record is
    its optimizer passed as itself, which the README says carries none.)"""
    stack, other = testing.build(name), testing.build(name)
    stack.train(0, K)
    leaf = opttree.tree(stack.optimizer).children[0].children[0]
    assert isinstance(leaf, opttree.LeafNode) and leaf.under is not None
    before = snapshot(leaf.optimizer)
    foreign, alone = opttree.ProblemKind.FOREIGN_TREE, opttree.ProblemKind.WITHOUT_ITS_WRAPPER
    forged = [
        (attrs.evolve(leaf, under=("<root>", other.optimizer)), "a node for another AdamW than the one opttree finds there", [foreign]),
        # checked as what it is without the record: the factory's optimizer, without its chain
        (attrs.evolve(leaf, under=("elsewhere", stack.optimizer)), "ChainedOptimizer at 'elsewhere' above it \\(under\\), whose tree has no node", [foreign, alone]),
    ]
    for node, message, kinds in forged:
        problems = opttree.validate(node)
        assert [p.kind for p in problems] == kinds, message
        assert re.search(message, problems[0].message), (message, problems[0].message)
        with pytest.raises(opttree.MalformedWrapper):
            opttree.reset(node)
    assert unchanged(leaf.optimizer, before)
    with pytest.raises(opttree.OptTreeError, match=r"LeafNode.under must be None or the \(path, Megatron wrapper\) pair opttree.tree records, got a str"):
        opttree.LeafNode(leaf.path, leaf.optimizer, under="x")  # type: ignore[arg-type]
    with pytest.raises(opttree.OptTreeError, match="got a pair of a str and an? SGD"):
        opttree.LeafNode(leaf.path, leaf.optimizer, under=("<root>", torch.optim.SGD([torch.nn.Parameter(torch.ones(1))])))
    assert opttree.tree(leaf) is leaf and opttree.validate(leaf) == ()


@pytest.mark.skipif("moe" not in testing.available(), reason="no moe recipe in this lane")
def test_a_subtree_is_checked_without_what_lies_outside_it() -> None:
    """The wrapper a subtree records is built to check the subtree against it: a sibling
    member that opttree refuses is that member's problem, not the subtree's."""
    stack = testing.build("moe")
    stack.train(0, K)
    subtree = opttree.tree(stack.optimizer).children[0]
    sibling: object = getattr(stack.optimizer, "chained_optimizers")[1]
    setattr(sibling, "optimizer", object())

    assert opttree.validate(subtree) == ()
    assert opttree.reset(subtree).leaves == 1
    assert [p.path for p in opttree.validate(stack.optimizer)] == ["chained[1].optimizer"]


@pytest.mark.skipif("offload_0.75" not in testing.available(), reason="no offload recipe in this lane")
def test_steps_a_megatron_wrapper_saves_as_one_made_unequal_outside_opttree_are_warned_of() -> None:
    """An inner optimizer's steps reset by hand, or an inner optimizer reset as itself
    (refused: its param groups are the factory's), leave some steps at 0 and the others
    at 3: Megatron's checkpoint then fails. validate warns, naming the wrapper; a reset of
    the stack sets the steps equal, and the checkpoint saves again."""
    stack = testing.build("offload_0.75")
    stack.train(0, K + 1)
    inner = stack.leaves()[0]
    with pytest.raises(opttree.UnsupportedOptimizer, match=r"AdamW at <root>: its param groups are Megatron's factory's"):
        opttree.reset(inner)
    for entry in inner.state.values():
        entry["step"].zero_()
    with stack.device, pytest.raises(AssertionError):  # Megatron's side
        stack.optimizer.state_dict()

    warned = [p for p in opttree.validate(stack.optimizer) if p.kind is opttree.ProblemKind.UNEQUAL_STEPS]
    opttree.reset(stack.optimizer)

    assert [(p.path, p.cls, p.severity) for p in warned] == [("chained[0]", "DistributedOptimizer", opttree.Severity.WARNING)]
    assert "the steps it saves as one differ (2 values, 0 to 3)" in warned[0].message
    assert opttree.ProblemKind.UNEQUAL_STEPS not in [p.kind for p in opttree.validate(stack.optimizer)]
    with stack.device:
        assert stack.optimizer.state_dict()


@pytest.mark.skipif("moe" not in testing.available(), reason="the moe recipe needs megatron-core's MoE")
def test_a_member_of_a_chain_that_is_its_own_step_unit_is_reset_alone() -> None:
    """A chain's expert member saves its own one step: reset alone, the chain still checkpoints."""
    stack = testing.build("moe")
    stack.train(0, K)
    expert = opttree.tree(stack.optimizer).children[1]

    assert opttree.validate(expert) == ()
    assert opttree.reset(expert).steps > 0
    with stack.device:
        assert stack.optimizer.state_dict()


def muon_stack() -> testing.MegatronStack:
    """Megatron's Muon stack: its matrices under ``TensorParallelMuon``, the rest under AdamW."""
    if "muon" not in testing.available():
        pytest.skip("no muon recipe in this lane")
    stack = testing.build("muon")
    stack.train(0, K)
    return stack


def test_keys_that_the_selected_parameters_optimizer_lacks_are_refused_with_nothing_changed() -> None:
    """``exp_avg`` is AdamW history, and the matrices are Muon's: asked of them alone, the
    reset would change nothing; asked of a matrix and a bias, it would pass the matrix
    over. Both are refused, naming the leaf; the bias alone is reset."""
    stack = muon_stack()
    named = dict(stack.model.named_parameters())
    matrix, bias = named["module.up.weight"], named["module.up.bias"]
    before = [(k, v.clone()) for k, v in leaf_state(stack)]

    with pytest.raises(opttree.PartialResetRefused, match=r"no optimizer holding the selected parameters has history \['exp_avg'\]"):
        opttree.reset(stack.optimizer, params=[matrix], keys=["exp_avg"])
    with pytest.raises(opttree.PartialResetRefused, match="holds selected parameters but none of the keys") as caught:
        opttree.reset(stack.optimizer, params=[matrix, bias], keys=["exp_avg"])
    problems = opttree.validate(stack.optimizer)  # validate takes no selection: nothing to say
    assert all(torch.equal(v, old) for (_, v), (_, old) in zip(leaf_state(stack), before, strict=True))
    assert caught.value.problem is not None and caught.value.problem.cls == "TensorParallelMuon"
    assert problems == ()

    report = opttree.reset(stack.optimizer, params=[bias], keys=["exp_avg"])
    assert report.tensors_zeroed == 1 and report.leaves == 1


def test_keys_alone_reset_them_wherever_they_are() -> None:
    """Without ``params``, ``keys`` names history wherever an optimizer holds it: AdamW's
    ``exp_avg`` is reset and Muon's state, which has none, is left as it is."""
    stack = muon_stack()
    muon, adamw = stack.leaves()
    momenta = [entry["momentum_buffer"].clone() for entry in muon.state.values()]

    report = opttree.reset(stack.optimizer, keys=["exp_avg"])

    assert report.tensors_zeroed == len(adamw.state)
    assert all(torch.equal(entry["momentum_buffer"], m) for entry, m in zip(muon.state.values(), momenta, strict=True))


def test_a_parameter_named_twice_is_selected_once() -> None:
    """A tied weight reached by two names, or a list that repeats one, selects it once."""
    net = model()
    optimizer = torch.optim.AdamW(net.parameters())
    train(net, optimizer, 0, 2)
    first = next(net.parameters())

    report = opttree.reset(optimizer, params=[first, first], keys=["exp_avg"])

    assert report.tensors_zeroed == 1
    assert not optimizer.state[first]["exp_avg"].any()


class _Tied(torch.nn.Module):
    """An embedding whose weight the output layer shares, as language models tie them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(5, 3)
        self.mid = torch.nn.Linear(3, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.mid(self.embed(x)))
        return out


@pytest.mark.parametrize("name", ["embed.weight", "head.weight"])
def test_a_predicate_selects_a_tied_weight_by_either_of_its_names(name: str) -> None:
    """``named_parameters()`` lists a tied weight under its first name only: a predicate
    that named the second (``head.weight``) was refused as accepting nothing, and beside
    another parameter passed the tied weight over, in silence."""
    net = _Tied()
    optimizer = torch.optim.Adam(net.parameters())
    torch.autograd.backward(net(torch.tensor([1, 2])).sum())
    optimizer.step()
    tied = net.embed.weight

    report = opttree.reset(optimizer, params=lambda n: n == name or n.startswith("mid."), model=net, keys=["exp_avg"])

    assert report.tensors_zeroed == 3
    assert not optimizer.state[tied]["exp_avg"].any() and optimizer.state[tied]["exp_avg_sq"].any()
    opttree.reset(optimizer, params=lambda n: n == name, model=net, keys=["exp_avg_sq"])
    assert not optimizer.state[tied]["exp_avg_sq"].any()


def test_per_parameter_steps_reset_for_just_the_selected_parameters() -> None:
    net = model()
    optimizer = torch.optim.AdamW(net.parameters())
    train(net, optimizer, 0, 3)
    first = next(net.parameters())

    opttree.reset(optimizer, params=[first])
    assert {float(optimizer.state[p]["step"]) for p in net.parameters()} == {3.0}  # kept by default

    opttree.reset(optimizer, params=[first], keys=["exp_avg", "exp_avg_sq", "step"])

    steps = {id(p): float(optimizer.state[p]["step"]) for p in net.parameters()}
    assert steps.pop(id(first)) == 0.0
    assert set(steps.values()) == {3.0}


def test_a_per_group_step_is_only_reset_with_its_whole_group() -> None:
    net = model()
    optimizer = TEFusedAdam(net.parameters())
    train(net, optimizer, 0, 3)
    first = next(net.parameters())
    before = snapshot(optimizer)

    with pytest.raises(opttree.PartialResetRefused, match=r"param group 0 counts one step for its 4 parameters"):
        opttree.reset(optimizer, params=[first], keys=["exp_avg", "exp_avg_sq", "step"])
    assert unchanged(optimizer, before) and optimizer.param_groups[0]["step"] == 3

    moments_only = opttree.reset(optimizer, params=[first])
    assert moments_only.tensors_zeroed == 2 and optimizer.param_groups[0]["step"] == 3
    whole = opttree.reset(optimizer, params=list(net.parameters()), keys=["exp_avg", "exp_avg_sq", "step"])
    assert whole.steps == 1 and optimizer.param_groups[0]["step"] == 0


def test_per_group_steps_of_one_chained_member_are_refused_and_megatron_shows_why() -> None:
    """``ChainedOptimizer`` saves one per-group step (TE ``FusedAdam``, here its stand-in)
    across its members: resetting the step of one member's whole group is refused."""
    first, second = (torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3)))
    leaves = [TEFusedAdam([p]) for p in (first, second)]
    stack = megatron_parts.chained([megatron_parts.fp32(leaf) for leaf in leaves])
    for p, leaf in zip((first, second), leaves, strict=True):
        p.grad = torch.ones_like(p)
        leaf.step()

    with pytest.raises(opttree.PartialResetRefused, match=r"1 of the 2 parameters"):
        opttree.reset(stack, params=[first], keys={"exp_avg", "step"})
    assert [leaf.param_groups[0]["step"] for leaf in leaves] == [1, 1]

    opttree.reset(stack, params=[first], keys={"exp_avg"})  # steps kept: nothing to refuse
    leaves[0].param_groups[0]["step"] = 0  # by hand, as the refused reset would
    synchronize = getattr(stack, "_synchronize_steps", None)  # what Megatron's sharded_state_dict runs first
    if synchronize is None:
        pytest.skip("this megatron-core's ChainedOptimizer has no _synchronize_steps(): it does not check its members' steps")
    with pytest.raises(AssertionError, match="steps"):
        synchronize()


def test_a_step_tensor_shared_with_an_unselected_parameter_is_not_reset_for_it() -> None:
    """Megatron's CPU load path leaves several parameters on one step tensor: resetting one
    parameter's step would reset the others' too."""
    optimizer, a, b = stepped_pair()
    optimizer.state[b]["step"] = optimizer.state[a]["step"]

    with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'step': shares memory with 'step' of AdamW"):
        opttree.reset(optimizer, params=[a], keys=["exp_avg", "exp_avg_sq", "step"])
    assert optimizer.state[b]["step"].item() == 1.0


def test_a_step_tensor_several_entries_share_is_kept_once() -> None:
    """``bytes_kept`` counts memory, not the entries holding it: three parameters' ``exp_avg_sq``
    and the one step tensor they share (Megatron's CPU load path)."""
    optimizer = stepped_adamw(3, numel=3)
    on_one_step(optimizer)

    report = opttree.reset(optimizer, keys=["exp_avg"])

    assert report.kept_keys == ("exp_avg_sq", "step") and report.bytes_kept == 3 * 12 + 4
    assert report.tensors_kept == 3 + 1


class SubclassedAdamW(torch.optim.AdamW):
    """An AdamW subclass: its leaves are planned apart from plain AdamW's."""


def test_a_step_tensor_two_leaves_share_is_kept_once() -> None:
    """Two optimizers of different classes, planned apart, on one step tensor: the report
    counts it one tensor of 4 bytes, as it counts one shared inside a leaf."""
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    first, second = torch.optim.AdamW(params[:1]), SubclassedAdamW(params[1:])
    for p in params:
        p.grad = torch.ones(3)
    first.step()
    second.step()
    second.state[params[1]]["step"] = first.state[params[0]]["step"]
    stack = megatron_parts.chained([megatron_parts.fp32(first), megatron_parts.fp32(second)])

    report = opttree.reset(stack, keys=["exp_avg"])

    assert report.leaves == 2 and report.kept_keys == ("exp_avg_sq", "step")
    assert (report.tensors_kept, report.bytes_kept) == (2 + 1, 2 * 12 + 4)


def test_history_shared_with_an_unselected_parameter_is_refused() -> None:
    optimizer, a, b = stepped_pair()
    optimizer.state[b]["exp_avg"] = optimizer.state[a]["exp_avg"]
    kept = optimizer.state[b]["exp_avg"].clone()

    with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'exp_avg': shares memory with 'exp_avg' of AdamW"):
        opttree.reset(optimizer, params=[a])
    assert torch.equal(optimizer.state[b]["exp_avg"], kept)


def test_part_of_an_lbfgs_state_is_refused_and_all_of_it_dropped() -> None:
    """LBFGS keeps one state for all its parameters, under the first: selecting another
    parameter used to reset nothing, selecting the first dropped the state of all, and
    keeping its ``n_iter`` while dropping ``prev_flat_grad`` breaks its next step."""
    net, optimizer = stepped_lbfgs()
    params = list(net.parameters())
    (entry,) = optimizer.state.values()
    before = dict(entry)

    parts: list[Callable[[], opttree.ResetReport]] = [
        lambda: opttree.reset(optimizer, params=params[1:]),
        lambda: opttree.reset(optimizer, params=params[:1]),
        lambda: opttree.reset(optimizer, keys=["d", "old_dirs"]),
    ]
    for part in parts:
        with pytest.raises(opttree.PartialResetRefused, match="LBFGS at <root>: it keeps one state for all its parameters"):
            part()
        assert entry.keys() == before.keys() and all(entry[key] is value for key, value in before.items())

    report = opttree.reset(optimizer, params=params)
    assert entry == {} and report.tensors_dropped > 0


DISTRIBUTED_MOE = testing.Recipe("dist_moe", "adam", distributed=True, experts=True, description="a dense and an expert DistributedOptimizer, chained")


def test_a_step_reset_of_one_distributed_member_of_a_chain_is_refused_as_megatron_cannot_load_it() -> None:
    """A DistributedOptimizer's checkpoint writes its one step into each of its groups, and
    ChainedOptimizer's load asserts its members' group steps equal: the expert member's
    steps reset alone were accepted, and the checkpoint then failed to load."""
    stack = testing.build(DISTRIBUTED_MOE)
    stack.train(0, 3)
    before = [t.clone() for leaf in stack.leaves() for entry in leaf.state.values() for t in entry.values()]

    with pytest.raises(opttree.PartialResetRefused, match=r"ChainedOptimizer at <root>: key 'step': 1 of the 5 parameters whose steps it saves as one"):
        opttree.reset(stack.optimizer, params=lambda name: "expert" in name, model=stack.model, keys=["exp_avg", "exp_avg_sq", "step"])
    after = [t for leaf in stack.leaves() for entry in leaf.state.values() for t in entry.values()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))

    if not hasattr(type(stack.optimizer), "_synchronize_steps"):
        return  # megatron-core 0.13 loads such a chain without the check
    # Megatron's side: the same steps zeroed by hand, then its own in-memory round trip
    expert_leaf = stack.leaves()[1]
    for entry in expert_leaf.state.values():
        entry["step"].zero_()
    with stack.device:
        saved = stack.optimizer.state_dict()
    fresh = testing.build(DISTRIBUTED_MOE)
    with fresh.device, pytest.raises(AssertionError, match=r"steps: \[0\.0, 3\.0\]"):
        fresh.optimizer.load_state_dict(saved)


class FlatMaster:
    """A registered wrapper stepping one flat fp32 master for all its bf16 parameters, as
    flat-buffer mixed-precision optimizers do: ``inner_params`` names the flat master as
    each parameter's copy."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.flat = torch.nn.Parameter(torch.cat([p.detach().float().reshape(-1) for p in params]))
        self.inner = torch.optim.Adam([self.flat], lr=1e-2)

    def step(self) -> None:
        self.flat.grad = torch.cat([p.grad.float().reshape(-1) for p in self.params if p.grad is not None])
        self.inner.step()


opttree.register_wrapper(
    FlatMaster,
    children=lambda wrapper: [("inner", wrapper.inner)],
    inner_params=lambda wrapper, path: [(p, [wrapper.flat]) for p in wrapper.params],
)


def test_a_copy_stepped_for_a_selected_and_an_unselected_parameter_is_refused() -> None:
    """Selecting the weight reset the flat master's whole history, the bias's with it."""
    weight, bias = torch.nn.Parameter(torch.randn(4, 3).bfloat16()), torch.nn.Parameter(torch.randn(3).bfloat16())
    wrapper = FlatMaster([weight, bias])
    for i in range(3):
        generator = torch.Generator().manual_seed(i)
        weight.grad = torch.randn(4, 3, generator=generator).bfloat16()
        bias.grad = torch.randn(3, generator=generator).bfloat16()
        wrapper.step()
    before = snapshot(wrapper.inner)

    with pytest.raises(opttree.PartialResetRefused, match="steps one copy for a selected parameter and one it does not select"):
        opttree.reset(wrapper, params=[weight])
    assert unchanged(wrapper.inner, before)
    opttree.reset(wrapper, params=[weight, bias])  # every parameter of the copy; a partial reset keeps steps
    entry = wrapper.inner.state[wrapper.flat]
    assert not entry["exp_avg"].any() and not entry["exp_avg_sq"].any() and float(entry["step"]) == 3


@pytest.mark.parametrize("name", [n for n in ("fp16", "dist_bf16") if n in testing.available()])
def test_main_copies_selected_from_the_leafs_param_groups_select_their_parameters(name: str) -> None:
    """Code that walks ``optimizer.param_groups`` selects the main copies (or shards) a
    wrapper steps, not its model parameters: passed through as tensors of their own, they
    escaped the wrapper's step unit (one step reset, a checkpoint that then failed) and
    its loss scale (every step reset, the warmed-up scale kept). Each selects its parameter."""
    stack = testing.build(name)
    stack.train(0, K)
    mains = [p for group in stack.leaves()[0].param_groups for p in group["params"]]
    before = snapshot(stack.leaves()[0])

    with pytest.raises(opttree.PartialResetRefused, match="saves one step for|of the 4 parameters whose steps it saves as one"):
        opttree.reset(stack.optimizer, params=mains[:1], keys=["step"])
    assert unchanged(stack.leaves()[0], before)

    report = opttree.reset(stack.optimizer, params=mains, keys=["exp_avg", "exp_avg_sq", "step"])
    assert report.steps == len(mains) and report.loss_scales_reset == (1 if "fp16" in name else 0)
    fresh = testing.build(name)
    fresh.copy_weights_from(stack)
    stack.train(K, K)
    fresh.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(stack.main_params(), fresh.main_params(), strict=True))


@pytest.mark.parametrize("name", [n for n in ("fp16", "dist_bf16") if n in testing.available()])
def test_parameters_selected_beside_their_main_copies_are_selected_once(name: str) -> None:
    """A model's parameters and the main copies a leaf's param groups hold, selected
    together: each copy stands for its parameter, selected already. Its parameter was
    reported as held by no optimizer, the copy's own selection having replaced it."""
    stack = testing.build(name)
    stack.train(0, K)
    mains = [p for group in stack.leaves()[0].param_groups for p in group["params"]]
    weights = list(stack.model.parameters())

    both = opttree.reset(stack.optimizer, params=[*mains, *weights], keys=["exp_avg"])
    again = opttree.reset(stack.optimizer, params=[*weights, *mains], keys=["exp_avg"])

    assert both.tensors_zeroed == again.tensors_zeroed == opttree.reset(stack.optimizer, params=weights, keys=["exp_avg"]).tensors_zeroed > 0
    assert not any(entry["exp_avg"].any() for entry in stack.leaves()[0].state.values())


@pytest.mark.skipif("frozen_fp16" not in testing.available(), reason="no frozen_fp16 recipe in this lane")
def test_selecting_frozen_parameters_is_refused_saying_that_they_are_frozen() -> None:
    """Megatron's factory builds no optimizer for parameters with ``requires_grad=False``:
    a predicate accepting every name selects them, and the refusal says why they are
    held by none, which is what a user filters on."""
    stack = testing.build("frozen_fp16")
    stack.train(0, K)
    frozen = sum(not p.requires_grad for p in stack.model.parameters())

    with pytest.raises(opttree.UnmappedParameter, match=rf"{frozen} of them frozen \(requires_grad=False\), which Megatron's factory builds no optimizer for"):
        opttree.reset(stack.optimizer, params=lambda name: True, model=stack.model)
    trainable = [p for p in stack.model.parameters() if p.requires_grad]
    assert opttree.reset(stack.optimizer, params=trainable, keys=["exp_avg"]).tensors_zeroed > 0


def test_selecting_a_state_dicts_tensors_is_refused_saying_they_are_no_parameters() -> None:
    """A state dict's values (and ``.detach()`` copies) share their parameters' memory but
    are other tensors, trainable parameters all: the refusal says so, where it called them
    frozen and sent the user looking for frozen layers."""
    stack = testing.build("bf16")
    stack.train(0, K)
    for given in (list(stack.model.state_dict().values()), [p.detach() for p in stack.model.parameters()]):
        with pytest.raises(opttree.UnmappedParameter, match=r"unmapped; 4 of them tensors that are no parameter \(a state_dict's values") as refused:
            opttree.reset(stack.optimizer, params=given)
        assert "frozen" not in str(refused.value)


@pytest.mark.skipif("frozen_fp16" not in testing.available(), reason="no frozen_fp16 recipe in this lane")
def test_a_member_of_the_factorys_chain_passed_alone_is_refused_where_it_takes_steps() -> None:
    """The trained member of an fp16 chain, reset alone, reset its loss scale apart from the
    stub's, which the chain scales its loss by; the stub alone reset that one alone. Both
    refused with nothing changed; history alone is reset."""
    stack = testing.build("frozen_fp16")
    stack.train(0, K)
    stub, member = getattr(stack.optimizer, "chained_optimizers")
    before = snapshot(stack.leaves()[0])

    with pytest.raises(opttree.UnsupportedOptimizer, match=r"AdamW at optimizer: its param groups are Megatron's factory's"):
        opttree.reset(member)
    with pytest.raises(opttree.UnsupportedOptimizer, match=r"Float16OptimizerWithFloat16Params at <root>: a Megatron stub"):
        opttree.reset(stub)
    assert unchanged(stack.leaves()[0], before)
    assert [float(m.get_loss_scale()) for m in (stub, member)] == [float(stub.get_loss_scale())] * 2
    assert opttree.reset(member, keys=["exp_avg"]).tensors_zeroed > 0


@pytest.mark.skipif("frozen_fp16" not in testing.available(), reason="no frozen_fp16 recipe in this lane")
def test_a_stubs_loss_scaler_follows_the_stacks_others_in_a_partial_reset() -> None:
    """The stub holds no parameter to select: selecting every trained parameter with its
    step was refused as keeping the stub's scaler, with advice no selection could follow.
    It is reset with the others, and the stack trains as a fresh one."""
    stack = testing.build("frozen_fp16")
    stack.train(0, K)

    report = opttree.reset(stack.optimizer, params=lambda name: "expert" in name, model=stack.model, keys=["exp_avg", "exp_avg_sq", "step"])

    assert report.loss_scales_reset == 2 and report.loss_scales_kept == 0
    fresh = testing.build("frozen_fp16")
    fresh.copy_weights_from(stack)
    stack.train(K, K)
    fresh.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(stack.main_params(), fresh.main_params(), strict=True))
    kept = opttree.reset(stack.optimizer, params=lambda name: "expert" in name, model=stack.model, keys=["exp_avg"])
    assert kept.loss_scales_reset == 0 and kept.loss_scales_kept == 2


def stepped_sgd(flag: str, count: int = 2) -> tuple[list[torch.nn.Parameter], torch.optim.SGD]:
    params = [torch.nn.Parameter(torch.full((3,), float(i + 1))) for i in range(count)]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, **{flag: True})
    for _ in range(2):
        for param in params:
            param.grad = torch.ones_like(param)
        optimizer.step()
    return params, optimizer


class SGDChain:
    def __init__(self, optimizers: list[torch.optim.SGD]) -> None:
        self.optimizers = optimizers


opttree.register_wrapper(SGDChain, children=lambda chain: [(f"sgd{i}", sgd) for i, sgd in enumerate(chain.optimizers)])


def test_a_partial_drop_of_a_fused_sgd_groups_momentum_is_refused_and_a_whole_one_trains_as_fresh() -> None:
    """torch's fused SGD builds a group's momentum buffers at once, at a step that finds
    none, and raises at a step that finds some missing: a reset dropping one parameter's
    buffer (or a release of its entry) was accepted, and the next step raised. Refused
    with nothing changed, alone and in a run of alike optimizers; the whole group is reset
    as a fresh optimizer's; foreach SGD, which builds each buffer apart, resets part of it."""
    params, optimizer = stepped_sgd("fused")
    _, other = stepped_sgd("fused")
    before = snapshot(optimizer)
    for target in (optimizer, SGDChain([optimizer, other])):
        for release in (False, True):
            with pytest.raises(opttree.PartialResetRefused, match=r"param group 0 is fused: SGD builds its momentum_buffer for all of such a group's parameters at once .* 1 of the 2 parameters holding them are selected"):
                opttree.reset(target, params=params[:1], release=release)
    assert unchanged(optimizer, before)

    opttree.reset(optimizer, params=params)
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = torch.optim.SGD(fresh_params, lr=0.1, momentum=0.9, fused=True)
    for trained, model_params in ((optimizer, params), (fresh, fresh_params)):
        for param in model_params:
            param.grad = torch.ones_like(param)
        trained.step()
    assert all(torch.equal(a, b) for a, b in zip(params, fresh_params, strict=True))

    idle = torch.nn.Parameter(torch.ones(2))  # never given a gradient: it holds no buffer to keep
    unused = torch.optim.SGD([params[0], idle], lr=0.1, momentum=0.9, fused=True)
    params[0].grad = torch.ones_like(params[0])
    unused.step()
    assert opttree.reset(unused, params=params[:1]).tensors_dropped == 1

    params, optimizer = stepped_sgd("foreach")
    assert opttree.reset(optimizer, params=params[:1]).tensors_dropped == 1
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
