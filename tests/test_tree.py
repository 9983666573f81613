"""The adapter: the tree's shape, paths, sharing, and the inputs it refuses."""

from __future__ import annotations

from typing import cast

import attrs
import pytest
import torch
from megatron.core.optimizer.optimizer import FP32Optimizer

import opttree
from opttree.testing import cuda_on_cpu
from tests.helpers import model, train
from tests.megatron_parts import chained, config, fp32, hybrid

pytestmark = pytest.mark.usefixtures("process_group")


def adamw(seed: int = 0) -> torch.optim.AdamW:
    return torch.optim.AdamW(model(seed).parameters())


def test_chained_optimizer_with_several_members_is_walked_without_its_optimizer_property() -> None:
    shared = config()
    root = chained([fp32(adamw(0), shared), fp32(adamw(1), shared)])
    with pytest.raises(AssertionError):
        root.optimizer  # Megatron's own property refuses; opttree never evaluates it

    node = opttree.tree(root)

    assert isinstance(node, opttree.ChainedNode)
    assert [c.path for c in node.children] == ["chained[0]", "chained[1]"]
    leaves = [c.children[0] for c in node.children]
    assert [leaf.path for leaf in leaves] == ["chained[0].optimizer", "chained[1].optimizer"]
    assert all(isinstance(leaf, opttree.LeafNode) for leaf in leaves)
    assert node.optimizer is root


def test_empty_chain_and_stub_optimizer_are_represented() -> None:
    empty = opttree.tree(chained([]))
    stub = opttree.tree(fp32(None))

    assert isinstance(empty, opttree.ChainedNode) and empty.children == ()
    assert isinstance(stub, opttree.WrapperNode) and stub.is_stub
    assert opttree.reset(chained([fp32(None)])).leaves == 0
    assert "stub: no optimizer on this rank" in opttree.describe(stub)


class Holder:
    """A wrapper of a user's kind, holding the optimizers it is given."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers


opttree.register_wrapper(Holder, children=lambda holder: [(f"optimizers[{i}]", o) for i, o in enumerate(holder.optimizers)])


def test_a_users_wrapper_holding_no_optimizer_is_not_called_a_megatron_stub() -> None:
    node = opttree.tree(Holder())

    assert isinstance(node, opttree.WrapperNode) and not node.is_stub and not node.children
    assert opttree.describe(node).splitlines()[0] == "Holder (holds no optimizer)  @ <root>"


def test_a_leaf_reached_twice_is_reset_once_and_described_as_shared() -> None:
    leaf = adamw()
    net_params = [p for g in leaf.param_groups for p in g["params"]]
    for p in net_params:
        p.grad = torch.ones_like(p)
    leaf.step()
    shared = config()
    root = chained([fp32(leaf, shared), fp32(leaf, shared)])

    node = opttree.tree(root)
    report = opttree.reset(root)

    second = node.children[1].children[0]
    assert isinstance(second, opttree.LeafNode) and second.shared_with == "chained[0].optimizer"
    assert report.leaves == 1 and report.shared_leaves == 1 and report.steps == len(net_params)
    assert "(shared with chained[0].optimizer)" in opttree.describe(root)


def test_a_subtree_at_a_second_reach_of_a_leaf_stands_for_that_optimizer() -> None:
    """The node of a leaf reached a second time, or its wrapper's, passed alone, stands for
    that optimizer: it was reset as a shared node, passed over, and the reset said 0
    optimizers in silence."""
    leaf = adamw()
    for p in (p for g in leaf.param_groups for p in g["params"]):
        p.grad = torch.ones_like(p)
    leaf.step()
    shared = config()
    root = chained([fp32(leaf, shared), fp32(leaf, shared)])
    wrapper = opttree.tree(root).children[1]
    second = wrapper.children[0]
    assert isinstance(second, opttree.LeafNode) and second.shared_with == "chained[0].optimizer"

    for subtree in (second, wrapper):
        for p in (p for g in leaf.param_groups for p in g["params"]):
            p.grad = torch.ones_like(p)
        leaf.step()
        assert opttree.validate(subtree) == ()
        report = opttree.reset(subtree)

        assert report.leaves == 1 and report.tensors_zeroed > 0
        assert all(not entry["exp_avg"].any() and not entry["step"] for entry in leaf.state.values())
    assert "(shared with chained[0].optimizer)" in opttree.describe(root)


def test_a_wrapper_that_contains_itself_is_a_cycle() -> None:
    shared = config()
    inner = fp32(adamw(), shared)
    root = chained([inner])
    inner.optimizer = root  # type: ignore[assignment]  # the malformed stack under test

    with pytest.raises(opttree.OptimizerCycle, match=r"ChainedOptimizer at chained\[0\]\.optimizer: contains itself"):
        opttree.tree(root)
    assert [p.kind for p in opttree.validate(root)] == [opttree.ProblemKind.OPTIMIZER_CYCLE]


@pytest.mark.parametrize("bad", [42, "adam", torch.nn.Linear(2, 2), None])
def test_non_optimizer_input_is_refused(bad: object) -> None:
    with pytest.raises(opttree.NotAnOptimizer, match="at <root>: not an optimizer"):
        opttree.reset(bad)
    (problem,) = opttree.validate(bad)
    assert problem.kind is opttree.ProblemKind.NOT_AN_OPTIMIZER and problem.path == "<root>"
    assert "(refused: not an optimizer" in opttree.describe(bad)


def test_an_unknown_object_inside_a_wrapper_names_its_path() -> None:
    shared = config()
    root = chained([fp32(adamw(), shared), fp32(adamw(), shared)])
    root.chained_optimizers[1].optimizer = object()  # type: ignore[union-attr]

    with pytest.raises(opttree.NotAnOptimizer, match=r"object at chained\[1\]\.optimizer: not an optimizer"):
        opttree.reset(root)
    problems = opttree.validate(root)  # reports, and still checks the rest of the tree
    assert [(p.kind, p.path) for p in problems] == [(opttree.ProblemKind.NOT_AN_OPTIMIZER, "chained[1].optimizer")]
    text = opttree.describe(root)
    assert "AdamW params=" in text and "object (refused: not an optimizer" in text


def test_deep_nesting_is_a_clear_error_not_a_recursion_error() -> None:
    shared = config()
    stack: object = fp32(adamw(), shared)
    for _ in range(200):
        stack = chained([stack])  # type: ignore[list-item]

    with pytest.raises(opttree.OptTreeError, match="nested deeper than 64"):
        opttree.tree(stack)


def test_tree_of_a_tree_is_itself() -> None:
    node = opttree.tree(adamw())
    assert opttree.tree(node) is node
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    train(net, optimizer, 0, 1)
    assert opttree.reset(opttree.tree(optimizer)).tensors_dropped == 4


class ComparableSGD(torch.optim.SGD):
    """An optimizer that compares by its hyper-parameters, which makes it unhashable;
    registered, as a subclass defining anything of its own must be, with SGD's schema."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ComparableSGD) and self.defaults == other.defaults


opttree.register_schema(ComparableSGD, opttree.schema_for(torch.optim.SGD))


def test_optimizers_that_are_unhashable_or_equal_to_each_other_are_still_told_apart() -> None:
    nets = [torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(40)]) for _ in range(3)]
    leaves = [ComparableSGD(net.parameters(), lr=0.1, momentum=0.9) for net in nets]  # 80 entries each
    for net, leaf in zip(nets, leaves, strict=True):
        train_constant(net, leaf)
    root = chained([*leaves, leaves[0]])  # type: ignore[list-item]  # Megatron chains raw optimizers too

    node = opttree.tree(root)
    report = opttree.reset(root)
    opttree.reset(root)  # a second full reset finds the shared leaf again

    assert [getattr(c, "shared_with", None) for c in node.children] == [None, None, None, "chained[0]"]
    assert (report.leaves, report.shared_leaves, report.tensors_dropped) == (3, 1, 3 * 80)
    assert all(not leaf.state[p] for leaf in leaves for p in leaf.state)


def train_constant(net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()


def test_a_nodes_repr_names_its_class_and_reads_its_path_as_describe_does() -> None:
    stack = chained([fp32(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()), config())])
    root = opttree.tree(stack)
    assert repr(root) == "ChainedNode(ChainedOptimizer @ <root>, 1 children)"
    assert repr(root.children[0].children[0]) == "LeafNode(AdamW @ chained[0].optimizer)"
    assert opttree.describe(stack).splitlines()[0].endswith("@ <root>")


def test_trees_compare_and_hash_without_recursion() -> None:
    """Two hand-built trees deeper than Python recurses compare level by level, and a
    node's hash reads no node below it: equal trees are equal and hash alike, a tree whose
    deepest leaf differs is not equal."""
    first, second = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]), torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    wrapper = object()

    def deep(leaf: torch.optim.Optimizer) -> opttree.Node:
        node: opttree.Node = opttree.LeafNode("x", leaf)
        for _ in range(3000):
            node = opttree.WrapperNode("w", wrapper, (node,))
        return node

    assert deep(first) == deep(first) and hash(deep(first)) == hash(deep(first))
    assert deep(first) != deep(second)
    assert len({deep(first), deep(first), deep(second)}) == 2


def test_a_hybrid_nodes_children_compare_by_where_they_are_held() -> None:
    """The same children held as CPU sub-optimizers or as the GPU one are different trees."""
    leaf = opttree.LeafNode("x", torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]))
    hybrid = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)

    assert opttree.HybridNode("h", hybrid, (leaf,), None) != opttree.HybridNode("h", hybrid, (), leaf)
    assert opttree.HybridNode("h", hybrid, (leaf,), None) == opttree.HybridNode("h", hybrid, (leaf,), None)


def test_leaves_built_in_bulk_are_the_leaves_one_by_one() -> None:
    """A HybridDeviceOptimizer's CPU sub-optimizers, all fresh leaves, are built in one
    batch: each leaf holds what LeafNode(...) gives, field for field, and the batch runs
    the fields' checks, naming a bad one."""
    from opttree._nodes import leaves_in_bulk

    optimizer, _, _ = hybrid([2, 3, 4, 5])
    root = opttree.tree(optimizer)
    members = optimizer.cpu_optimizers
    by_hand = tuple(opttree.LeafNode(f"sub_optimizers[{i}]", member, under=(root.path, optimizer)) for i, member in enumerate(members))

    assert isinstance(root, opttree.HybridNode) and len(root.cpu) == 4
    assert [type(leaf) for leaf in root.cpu] == [opttree.LeafNode] * 4
    assert [attrs.astuple(leaf, recurse=False) for leaf in root.cpu] == [attrs.astuple(leaf, recurse=False) for leaf in by_hand]
    assert root == opttree.HybridNode(root.path, optimizer, by_hand, None)

    with pytest.raises(opttree.OptTreeError, match=r"LeafNode.optimizer must be a torch.optim.Optimizer, got an int"):
        leaves_in_bulk(["a", "b"], [members[0], cast(torch.optim.Optimizer, 3)], None)
    with pytest.raises(opttree.OptTreeError, match=r"LeafNode.path must be a str, got an int"):
        leaves_in_bulk(["a", cast(str, 1)], members[:2], None)
    with pytest.raises(opttree.OptTreeError, match=r"LeafNode.under must be None or the \(path, Megatron wrapper\) pair"):
        leaves_in_bulk(["a", "b"], members[:2], ("a", 3))
    assert leaves_in_bulk([], [], None) == []


class HidingFP32(FP32Optimizer):
    """A Megatron wrapper whose registered kind finds none of the optimizer it holds."""


opttree.register_wrapper(HidingFP32, children=lambda wrapper: [])


def test_a_megatron_wrapper_whose_kind_finds_nothing_where_it_holds_an_optimizer_is_no_stub() -> None:
    """describe called it a stub of a rank without an optimizer, while validate found the
    optimizer it hides."""
    leaf = adamw()
    with cuda_on_cpu():
        node = opttree.tree(HidingFP32(leaf, config(), None))

    assert isinstance(node, opttree.WrapperNode) and not node.is_stub
    assert "stub" not in opttree.describe(node)
    assert [p.kind for p in opttree.validate(node)] == [opttree.ProblemKind.HIDDEN_OPTIMIZER]


class LeafOnly:
    def visit_leaf(self, node: opttree.Node) -> None:
        pass


class NotCallable:
    visit_leaf = None


@pytest.mark.parametrize("visitor", [None, "visitor", opttree.TraverserVisitor, NotCallable()], ids=["none", "str", "class", "not-callable"])
def test_accept_refuses_what_is_not_a_visitor_instance(visitor: object) -> None:
    with pytest.raises(opttree.OptTreeError, match="accept takes a NodeVisitor instance .*, whose visit_leaf it calls"):
        opttree.tree(adamw()).accept(visitor)  # type: ignore[arg-type]


def test_accept_refuses_a_visitor_without_the_method_of_the_nodes_kind() -> None:
    with pytest.raises(opttree.OptTreeError, match="whose visit_wrapper it calls; got a LeafOnly"):
        opttree.tree(Holder(adamw())).accept(LeafOnly())  # type: ignore[arg-type]


def test_a_visitor_that_overrides_visit_leaf_is_called_for_every_leaf_whatever_the_classes_of_its_siblings() -> None:
    """Runs of alike sibling leaves are taken in bulk, which the library's own
    ``visit_leaf`` stands for: a subclass's override was skipped for them, so a
    ResetVisitor told to pass a leaf over reset it where its neighbour was of its class,
    and a DescribeVisitor's own lines were replaced by the run's totals past twelve."""
    skipped: list[str] = []

    class PassOverLast(opttree.ResetVisitor):
        def visit_leaf(self, node: opttree.LeafNode) -> None:
            if node.path == "optimizers[1]":
                skipped.append(node.path)
                return
            super().visit_leaf(node)

    class Named(opttree.DescribeVisitor):
        def visit_leaf(self, node: opttree.LeafNode) -> opttree.Summary:
            return self.summarise(node, f"mine: {type(node.optimizer).__qualname__}")

    for second in (torch.optim.AdamW, torch.optim.Adam):
        first_net, second_net = model(0), model(1)
        first, other = torch.optim.AdamW(first_net.parameters()), second(second_net.parameters())
        train(first_net, first, 0, 2)
        train(second_net, other, 0, 2)
        skipped.clear()

        report = PassOverLast().reset(opttree.tree(Holder(first, other)))

        assert skipped == ["optimizers[1]"] and report.leaves == 1
        assert all(int(entry["step"]) == 0 for entry in first.state.values())
        assert all(int(entry["step"]) == 2 for entry in other.state.values())

    many = []
    for seed in range(13):
        net = model(seed)
        optimizer = torch.optim.AdamW(net.parameters())
        train(net, optimizer, 0, 1)
        many.append(optimizer)
    assert "13 x mine: AdamW" in Named().render(opttree.tree(Holder(*many)))
