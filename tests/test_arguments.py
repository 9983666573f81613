"""Arguments of the wrong kind, to the public functions: a clear opttree error saying what
was expected (a report from ``validate`` and ``describe``), and nothing changed."""

from __future__ import annotations

import re

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

import opttree
from opttree._fields import article
from tests.copying import CopyingWrapper
from tests.helpers import snapshot, stepped_adamw, stepped_pair, unchanged


class UnreadableModel(torch.nn.Module):
    """A module whose parameters cannot be read."""

    def named_parameters(self, *args: object, **kwargs: object) -> Iterator[tuple[str, torch.nn.Parameter]]:
        raise RuntimeError("named_parameters refused")


def refusing_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """A generator of parameters that fails half-way, as a lazily computed selection may."""
    yield optimizer.param_groups[0]["params"][0]
    raise RuntimeError("selection failed")


def refusing_keys() -> Iterator[str]:
    yield "exp_avg"
    raise RuntimeError("keys failed")


class NotATensorModel(torch.nn.Module):
    """A module whose ``_parameters`` hold a number, which named_parameters() yields."""

    def __init__(self) -> None:
        super().__init__()
        self._parameters["w"] = 0.5  # type: ignore[assignment]  # what a hand-edited module may hold


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda o: opttree.reset(o, params=5), "params must be a list of parameters or a predicate on their names, got an int"),  # type: ignore[arg-type]
        (lambda o: opttree.reset(o, keys=5), "keys must be a state key or a list of them, got an int"),  # type: ignore[arg-type]
        (lambda o: opttree.reset(o, keys=[["exp_avg"]]), "keys must be names of state keys, got a list"),  # type: ignore[list-item]
        (lambda o: opttree.reset(o, params=o.param_groups[0]["params"][0]), "params is one Parameter: pass a list of parameters"),
        (lambda o: opttree.reset(o, params=torch.nn.Linear(3, 3)), "params is one Linear: pass a list of parameters"),
        (lambda o: opttree.reset(o, params=lambda name: True, model={}), "model must be a torch.nn.Module, got a dict"),  # type: ignore[arg-type]
        (
            lambda o: opttree.reset(o, params=lambda name: True, model=UnreadableModel()),
            "named_parameters\\(\\) raised RuntimeError: named_parameters refused",
        ),
        (lambda o: opttree.reset(o, params=[]), "params is empty: nothing would change"),
        (
            lambda o: opttree.reset(o, params=lambda name: name == "typo", model=torch.nn.ParameterList(o.param_groups[0]["params"])),
            "the params predicate accepts none of the model's parameters: nothing would change",
        ),
        (lambda o: opttree.reset(o, keys=[]), "keys names no state key: nothing would change"),
        (
            lambda o: opttree.reset(o, params=lambda name: True, model=NotATensorModel()),
            r"named_parameters\(\) gave a pair of a str and a float, expected \(name, tensor\) pairs",
        ),
        (lambda o: opttree.reset(o, model="junk"), "model must be a torch.nn.Module, got a str"),  # type: ignore[arg-type]
        (
            lambda o: opttree.reset(o, model=[torch.nn.Linear(1, 1)]),  # type: ignore[arg-type]
            r"got a list \(for Megatron's list of model chunks, pass torch.nn.ModuleList\(chunks\)\)",
        ),
        (lambda o: opttree.reset(o, params=refusing_params(o)), "the parameters params gives cannot be read: iterating it raised RuntimeError: selection failed"),
        (lambda o: opttree.reset(o, keys=refusing_keys()), "the state keys keys gives cannot be read: iterating it raised RuntimeError: keys failed"),
        (lambda o: opttree.prune(o, 0.5, model=[1, 2]), "model must be a torch.nn.Module, got a list"),  # type: ignore[arg-type]
        (lambda o: opttree.prune(o, 0.5, keys=5), "keys must be a state key or a list of them, got an int"),  # type: ignore[arg-type]
        (
            lambda o: opttree.prune(o, 0.5, by=np.array(["magnitude", "random"])),  # type: ignore[arg-type]  # an array's == gives no bool
            r"by must be 'magnitude' or 'random', got array\(\['magnitude', 'random'\]",
        ),
        (lambda o: opttree.validate(o, group="world"), "group must be a process group of an initialised torch.distributed, got a str"),  # type: ignore[arg-type]
        (lambda o: opttree.describe(o, group=5), "group must be a process group"),  # type: ignore[arg-type]
        (lambda o: opttree.reset(o, group="world"), "group must be a process group"),  # type: ignore[arg-type]
    ],
    ids=[
        "params int", "keys int", "keys unhashable", "params one tensor", "params one module", "model dict", "model unreadable",
        "params empty", "predicate matches none", "keys empty", "model yields a number", "model str", "model chunks list", "params generator raises", "keys iterator raises", "prune model list", "prune keys int", "prune by ndarray", "validate group str", "describe group int",
        "reset group str",
    ],
)
def test_a_reset_refuses_arguments_of_the_wrong_kind(call: Callable[[torch.optim.Optimizer], object], message: str) -> None:
    optimizer = stepped_adamw(2, numel=4)
    before = snapshot(optimizer)

    with pytest.raises(opttree.OptTreeError, match=message):
        call(optimizer)

    assert unchanged(optimizer, before)


def test_a_params_predicate_answers_with_a_bool() -> None:
    """An answer other than a bool was read by its truth: a predicate returning "no" for
    every name selected every parameter, and the reset zeroed them all. Refused, naming
    the answer, with nothing changed."""
    optimizer, _, _ = stepped_pair()
    net = torch.nn.ParameterList(optimizer.param_groups[0]["params"])
    before = snapshot(optimizer)
    with pytest.raises(opttree.OptTreeError, match=r"the params predicate returned a str for the parameter '0', expected a bool \(True selects it\)"):
        opttree.reset(optimizer, params=lambda name: "no", model=net)  # type: ignore[arg-type,return-value]
    assert unchanged(optimizer, before)
    assert opttree.reset(optimizer, params=lambda name: name == "0", model=net, keys=["exp_avg"]).tensors_zeroed == 1


def test_a_failing_params_predicate_is_named() -> None:
    optimizer = stepped_adamw(2)
    before = snapshot(optimizer)
    model = torch.nn.ParameterList(optimizer.param_groups[0]["params"])

    def explode(name: str) -> bool:
        raise ValueError(f"no rule for {name}")

    with pytest.raises(opttree.OptTreeError, match="the params predicate raised ValueError for the parameter '0': no rule for 0"):
        opttree.reset(optimizer, params=explode, model=model)
    assert unchanged(optimizer, before)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({}, "model must be a torch.nn.Module, got a dict"),
        (UnreadableModel(), "named_parameters() raised RuntimeError"),
        (NotATensorModel(), "named_parameters() gave a pair of a str and a float"),
    ],
    ids=["dict", "unreadable", "not a tensor"],
)
def test_a_model_whose_parameters_cannot_be_read_is_reported_by_validate_and_refused_by_a_sync(
    model: object, message: str
) -> None:
    params = [torch.nn.Parameter(torch.ones(2))]
    wrapper = CopyingWrapper(params, [torch.zeros(2)])  # stale

    problems = opttree.validate(wrapper, model=model)  # type: ignore[arg-type]
    with pytest.raises(opttree.StaleMaster, match="the parameters of the copies cannot be named"):
        opttree.sync_masters(wrapper, model=model)  # type: ignore[arg-type]

    unreadable, stale = problems
    assert (unreadable.kind, unreadable.path) == (opttree.ProblemKind.UNCHECKED_MASTER, "<root>") and message in unreadable.message
    assert stale.kind is opttree.ProblemKind.STALE_MASTER and "its copy of a parameter of shape (2,)" in stale.message
    assert wrapper.copies[0].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("path", ["", "Lion", " my_pkg.optim.Lion", "my_pkg..Lion", "my_pkg.optim.Lion\n", "my_pkg.optim.Lion()"])
def test_a_dotted_path_no_class_can_have_is_refused(path: str) -> None:
    """It would never apply: opttree compares it with ``module.QualName`` of the classes it meets."""
    with pytest.raises(opttree.RegistrationError, match="register_schema registers a class or its dotted path, module and class name"):
        opttree.register_schema(path, opttree.StateSchema())
    with pytest.raises(opttree.RegistrationError, match="register_wrapper registers a class or its dotted path"):
        opttree.register_wrapper(path, children=lambda w: [])


def test_a_dotted_path_of_identifiers_python_allows_is_registered() -> None:
    """Python's identifiers are not only ASCII; a class nested in a function shows ``<locals>``."""
    opttree.register_schema("my_pkg.optim.Оптимизатор", opttree.StateSchema())
    opttree.register_schema("my_pkg.optim.build.<locals>.Lion", opttree.StateSchema())


def test_registering_what_is_neither_a_class_nor_a_dotted_path_is_refused() -> None:
    with pytest.raises(opttree.RegistrationError, match="register_schema registers a class or a dotted path, got an int"):
        opttree.register_schema(5, opttree.StateSchema())  # type: ignore[arg-type]
    with pytest.raises(opttree.RegistrationError, match="register_wrapper registers a class or a dotted path, got a NoneType"):
        opttree.register_wrapper(None, children=lambda w: [])  # type: ignore[call-overload]


def nested_wrappers(depth: int) -> opttree.Node:
    """A tree built by hand: ``depth`` wrappers, each holding the next, around one leaf."""
    node: opttree.Node = opttree.LeafNode("leaf", stepped_adamw(1))
    for i in range(depth):
        node = opttree.WrapperNode(f"w{i}", object(), (node,))
    return node


def test_a_tree_built_by_hand_nested_too_deep_is_refused_as_a_built_one_is() -> None:
    deepest = nested_wrappers(64)
    too_deep = nested_wrappers(2000)
    leaf = too_deep
    while leaf.children:
        leaf = leaf.children[0]
    before = snapshot(leaf.optimizer)  # type: ignore[arg-type]

    with pytest.raises(opttree.NotAnOptimizer, match="object at w63"):  # its depth passes; what it holds does not
        opttree.tree(deepest)
    for call in (opttree.tree, opttree.reset, opttree.sync_masters):
        with pytest.raises(opttree.OptimizerCycle, match="object at w1935: the stack is nested deeper than 64"):
            call(too_deep)
    (problem,) = opttree.validate(too_deep)
    text = opttree.describe(too_deep)

    assert unchanged(leaf.optimizer, before)  # type: ignore[arg-type]
    assert (problem.kind, problem.path) == (opttree.ProblemKind.OPTIMIZER_CYCLE, "w1935")
    assert text.splitlines()[-1].strip() == "object (refused: the stack is nested deeper than 64)  @ w1935"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"zero": "exp_avg"}, "^zero: state keys are given as a set of names, got 'exp_avg'"),
        ({"keep": {1}}, "^keep: state keys are given as a set of names, got {1}"),
        ({"always_built": "step"}, "^always_built: state keys are given as a set of names, got 'step'"),
        ({"expressed_in": {"exp_avg": "Q"}}, r"^expressed_in\['exp_avg'\]: state keys are given as a set of names, got 'Q'"),
        ({"step": "per-parameter"}, "step is a StepLocation, got 'per-parameter'"),
        ({"zero": {"exp_avg"}, "dropped_by_group_if": {"fused"}}, r"dropped_by_group_if names \['fused'\], group options under which dropped keys are built together; this schema drops none"),
    ],
    ids=["one string", "not a name", "a keyword field", "a basis", "step a string", "built by group with no drop"],
)
def test_a_schema_of_the_wrong_kinds_is_refused(fields: dict[str, object], message: str) -> None:
    """One string as a key set would be taken apart into its letters, each a key; the
    error names the field it was given for."""
    with pytest.raises(opttree.RegistrationError, match=message):
        opttree.StateSchema(**fields)  # type: ignore[arg-type]


class BadRepr:
    def __repr__(self) -> str:
        raise ValueError("no repr")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: opttree.LeafNode("<root>", None), "LeafNode.optimizer must be a torch.optim.Optimizer, got a NoneType"),  # type: ignore[arg-type]
        (lambda: opttree.WrapperNode("<root>", object(), (None,)), "WrapperNode.inner must be a tuple of nodes"),  # type: ignore[arg-type]
        (lambda: opttree.ChainedNode("<root>", object(), [stepped_adamw(1)]), "ChainedNode.members must be a tuple of nodes"),  # type: ignore[arg-type]
        (lambda: opttree.HybridNode("<root>", stepped_adamw(1), (), "gpu"), "HybridNode.gpu must be a node or None"),  # type: ignore[arg-type]
        (lambda: opttree.WrapperNode("<root>", object(), (BadRepr(),)), "WrapperNode.inner must be a tuple of nodes, got a tuple holding a BadRepr"),  # type: ignore[arg-type]
        (lambda: opttree.LeafNode(BadRepr(), stepped_adamw(1)), "LeafNode.path must be a str, got a BadRepr"),  # type: ignore[arg-type]
    ],
    ids=["leaf of None", "wrapper of None", "chain of optimizers", "hybrid gpu a str", "wrapper of an unprintable", "path unprintable"],
)
def test_a_node_built_by_hand_of_what_is_no_node_is_refused_where_it_is_made(build: Callable[[], object], message: str) -> None:
    with pytest.raises(opttree.OptTreeError, match=message):
        build()


def trained_adam() -> tuple[torch.nn.Parameter, torch.optim.Adam]:
    param = torch.nn.Parameter(torch.randn(4, 3))
    optimizer = torch.optim.Adam([param])
    for _ in range(3):
        optimizer.zero_grad()
        torch.autograd.backward((param**2).sum())
        optimizer.step()
    return param, optimizer


HAND_BUILT: list[tuple[str, Callable[[torch.optim.Adam], opttree.Node], str | None]] = [
    ("a leaf marked shared", lambda o: opttree.LeafNode("<root>", o, shared_with="nowhere"), "shared with 'nowhere'"),
    ("a hybrid over a plain Adam", lambda o: opttree.HybridNode("<root>", o, (), None), "a HybridNode where opttree builds a LeafNode"),
    ("a wrapper hiding its leaf", lambda o: opttree.WrapperNode("<root>", o, ()), "a WrapperNode where opttree builds a LeafNode"),
    ("a leaf for another optimizer", lambda o: opttree.LeafNode("<root>", trained_adam()[1]), None),
]


@pytest.mark.parametrize(("node", "message"), [case[1:] for case in HAND_BUILT], ids=[case[0] for case in HAND_BUILT])
def test_a_tree_built_by_hand_unlike_the_built_one_is_refused_and_reported(
    node: Callable[[torch.optim.Adam], opttree.Node], message: str | None
) -> None:
    """Each would make a reset pass the Adam over while reporting success: a leaf marked as
    reached before, a wrapper kind with no children. The last is its own tree: passed in
    for another optimizer's, it resets that one, as asked."""
    param, optimizer = trained_adam()
    given = node(optimizer)
    before = snapshot(optimizer)
    if message is None:
        assert opttree.validate(given) == () and opttree.tree(given) is given
        return

    with pytest.raises(opttree.MalformedWrapper, match=message):
        opttree.reset(given)
    problems = opttree.validate(given)

    assert unchanged(optimizer, before) and float(optimizer.state[param]["step"]) == 3
    assert [p.kind for p in problems] == [opttree.ProblemKind.FOREIGN_TREE]
    assert "<root>" in opttree.describe(given)
    assert opttree.reset(opttree.tree(optimizer)).tensors_zeroed == 2  # the tree opttree builds resets it


@pytest.mark.parametrize(("node", "message"), [case[1:] for case in HAND_BUILT if case[2]], ids=[case[0] for case in HAND_BUILT if case[2]])
def test_the_public_visitors_refuse_a_tree_built_by_hand_unlike_the_built_one(
    node: Callable[[torch.optim.Adam], opttree.Node], message: str
) -> None:
    """``ResetVisitor().reset`` and ``ValidateVisitor().check`` take a tree as the functions
    do: one that is not the tree opttree builds is reported and refused, not walked."""
    param, optimizer = trained_adam()
    given = node(optimizer)
    before = snapshot(optimizer)

    with pytest.raises(opttree.MalformedWrapper, match=message):
        opttree.ResetVisitor().reset(given)
    checker = opttree.ValidateVisitor()
    checker.check(given)

    assert unchanged(optimizer, before) and float(optimizer.state[param]["step"]) == 3
    assert [p.kind for p in checker.problems] == [opttree.ProblemKind.FOREIGN_TREE]


@pytest.mark.parametrize(("node", "message"), [case[1:] for case in HAND_BUILT if case[2]], ids=[case[0] for case in HAND_BUILT if case[2]])
def test_the_describe_visitor_renders_a_tree_built_by_hand_as_describe_does(
    node: Callable[[torch.optim.Adam], opttree.Node], message: str
) -> None:
    """``DescribeVisitor().render`` describes what ``opttree.describe`` does: the tree
    opttree builds, its root's line saying why the one given is not it."""
    _, optimizer = trained_adam()
    given = node(optimizer)

    text = opttree.DescribeVisitor().render(given)

    assert text == opttree.describe(given)
    assert re.search(message, text.splitlines()[-1])


def test_the_describe_visitor_cuts_a_tree_built_by_hand_too_deep_as_describe_does() -> None:
    _, optimizer = trained_adam()
    deep: opttree.Node = opttree.LeafNode("x", optimizer)
    for _ in range(3000):  # deeper than Python's recursion limit
        deep = opttree.WrapperNode("w", object(), (deep,))

    text = opttree.DescribeVisitor().render(deep)

    assert text == opttree.describe(deep) and "the stack is nested deeper than 64" in text


@pytest.mark.parametrize("visitor", [opttree.ValidateVisitor, opttree.ResetVisitor])
def test_a_walk_by_accept_of_a_hand_built_tree_deeper_than_python_recurses_reports_it(visitor: type[opttree.ValidateVisitor]) -> None:
    """``accept`` walks without the tree-wide checks that ``check`` runs first, the depth
    limit among them: the walk stops at that depth with a problem, not a RecursionError."""
    _, optimizer = trained_adam()
    deep: opttree.Node = opttree.LeafNode("x", optimizer)
    for _ in range(3000):
        deep = opttree.WrapperNode("w", object(), (deep,))
    walker = visitor()

    deep.accept(walker)

    assert [(p.kind, p.message) for p in walker.problems] == [(opttree.ProblemKind.OPTIMIZER_CYCLE, "the stack is nested deeper than 64")]


def test_a_hand_built_tree_deeper_than_python_recurses_is_refused_by_a_users_traverser_and_described() -> None:
    """A user's ``TraverserVisitor`` raises the error a build raises at that depth, and a
    ``DescribeVisitor`` accepted directly cuts the tree there, as ``render`` does."""
    _, optimizer = trained_adam()
    deep: opttree.Node = opttree.LeafNode("x", optimizer)
    for _ in range(3000):
        deep = opttree.WrapperNode("w", object(), (deep,))

    class Counting(opttree.TraverserVisitor):
        leaves = 0

        def visit_leaf(self, node: opttree.LeafNode) -> None:
            self.leaves += 1

    with pytest.raises(opttree.OptimizerCycle, match="object at w: the stack is nested deeper than 64"):
        deep.accept(Counting())
    summary = deep.accept(opttree.DescribeVisitor())
    for _ in range(64):
        (summary,) = summary.children
    assert summary.text == "object (refused: the stack is nested deeper than 64)" and summary.children == ()
    shallow = opttree.WrapperNode("w", object(), (opttree.LeafNode("x", optimizer),))
    counting = Counting()
    shallow.accept(counting)
    assert counting.leaves == 1


def test_a_visitor_checks_afresh_each_time_it_is_used() -> None:
    """A visitor used twice reports what the second tree holds: nothing of the first walk
    (its optimizers counted as met before, its plan) carries over."""
    _, first = trained_adam()
    _, second = trained_adam()
    checker = opttree.ValidateVisitor()
    resetter = opttree.ResetVisitor()

    checker.check(opttree.tree(first))
    checker.check(opttree.tree(first))
    again = resetter.reset(opttree.tree(first))
    other = resetter.reset(opttree.tree(second))

    assert checker.problems == []
    assert again.tensors_zeroed == other.tensors_zeroed == 2 and again.steps == other.steps == 1


def test_a_visitor_used_again_after_a_registration_sees_it() -> None:
    """A wrapper holding, beside its children, an object of a class registered as a wrapper
    kind between two uses of one visitor: the second walk finds the optimizer it hides, as
    a new visitor does. The first walk's answer for that class was kept, and the second
    reset went through, leaving the hidden optimizer's state."""

    class Holder:
        def __init__(self, shown: torch.optim.Optimizer, aside: object) -> None:
            self.shown, self.aside = shown, aside

    class Teacher:
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

    opttree.register_wrapper(Holder, children=lambda holder: [("shown", holder.shown)])
    _, shown = trained_adam()
    _, hidden = trained_adam()
    holder = Holder(shown, Teacher(hidden))
    resetter = opttree.ResetVisitor()
    resetter.reset(opttree.tree(holder))

    opttree.register_wrapper(Teacher, children=lambda teacher: [("optimizer", teacher.optimizer)])
    before = snapshot(shown), snapshot(hidden)
    with pytest.raises(opttree.HiddenOptimizer):
        resetter.reset(opttree.tree(holder))
    assert unchanged(shown, before[0]) and unchanged(hidden, before[1])


def test_carry_out_needs_a_whole_check_that_passed_and_carries_it_out_once() -> None:
    """A walk by ``accept`` plans without the tree-wide checks (history aliasing a weight
    passes them), and a plan carried out once has deleted what it deleted: neither is
    carried out, with nothing changed."""
    param, optimizer = trained_adam()
    optimizer.state[param]["exp_avg"] = param.data  # zeroing it would zero the weight
    weight = param.detach().clone()
    walked = opttree.ResetVisitor()
    opttree.tree(optimizer).accept(walked)

    with pytest.raises(opttree.OptTreeError, match=r"carry_out carries out the plan of a tree that refusal\(\) has just checked whole"):
        walked.carry_out()
    assert torch.equal(param.detach(), weight)

    momentum = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    param.grad = torch.ones_like(param)
    momentum.step()
    once = opttree.ResetVisitor()
    assert once.reset(opttree.tree(momentum)).tensors_dropped == 1
    with pytest.raises(opttree.OptTreeError, match="once: call reset"):
        once.carry_out()


def test_a_walk_after_a_passed_check_is_not_carried_out() -> None:
    """A plan that ``refusal`` passed and a later ``accept`` of another tree added to (its
    history aliasing a weight, which only the tree-wide checks catch) is not carried out:
    neither tree changes."""
    checked_param, checked = trained_adam()
    param, aliased = trained_adam()
    aliased.state[param]["exp_avg"] = param.data
    weight = param.detach().clone()
    moments = checked.state[checked_param]["exp_avg"].clone()
    visitor = opttree.ResetVisitor()

    assert visitor.refusal(opttree.tree(checked)) is None
    opttree.tree(aliased).accept(visitor)

    with pytest.raises(opttree.OptTreeError, match=r"carry_out carries out the plan of a tree that refusal\(\) has just checked whole"):
        visitor.carry_out()
    assert torch.equal(param.detach(), weight)
    assert torch.equal(checked.state[checked_param]["exp_avg"], moments)


def test_a_walk_by_visit_children_after_a_passed_check_is_not_carried_out() -> None:
    """``visit_children``, called on its own over a wrapper of alike leaves (planned in one
    pooled pass), adds to the plan as ``accept`` does: that plan is not carried out."""
    from tests.test_registered_outputs import registered_holder

    _, checked = trained_adam()
    first_param, first = trained_adam()
    _, second = trained_adam()
    first.state[first_param]["exp_avg"] = first_param.data  # zeroing it would zero the weight
    weight = first_param.detach().clone()
    visitor = opttree.ResetVisitor()

    assert visitor.refusal(opttree.tree(checked)) is None
    visitor.visit_children(opttree.tree(registered_holder(lambda w: [("a", w.optimizer), ("b", second)])(first)))

    with pytest.raises(opttree.OptTreeError, match=r"carry_out carries out the plan of a tree that refusal\(\) has just checked whole"):
        visitor.carry_out()
    assert torch.equal(first_param.detach(), weight)


@pytest.mark.parametrize("visitor", [opttree.ResetVisitor, opttree.ValidateVisitor])
def test_a_visitor_flag_that_is_not_a_bool_is_refused(visitor: type[opttree.ValidateVisitor]) -> None:
    with pytest.raises(opttree.OptTreeError, match="keep_loss_scale must be True or False, got a str"):
        visitor(keep_loss_scale="False")  # type: ignore[arg-type]  # read from a config as a string


def test_a_describe_visitor_refused_that_is_not_a_mapping_is_refused_where_it_is_made() -> None:
    """Kept as given, ``refused=5`` raised ``TypeError`` only at render."""
    with pytest.raises(opttree.OptTreeError, match="refused must be a mapping of paths to reasons, or None, got an int$"):
        opttree.DescribeVisitor(refused=5)  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", ["release", "keep_loss_scale"])
def test_a_flag_that_is_not_a_bool_is_refused_with_nothing_changed(flag: str) -> None:
    """``release="False"``, read from a config as a string, is true: it would delete every
    state entry."""
    optimizer = stepped_adamw(2)
    before = snapshot(optimizer)
    with pytest.raises(opttree.OptTreeError, match=f"{flag} must be True or False, got a str"):
        opttree.reset(optimizer, **{flag: "False"})  # type: ignore[arg-type]
    with pytest.raises(opttree.OptTreeError, match=rf"{flag} must be True or False, got a (numpy\.bool|bool_)$"):  # NumPy 2's, NumPy 1's name
        opttree.reset(optimizer, **{flag: np.bool_(True)})  # type: ignore[arg-type]  # NumPy's bool, named as such
    assert unchanged(optimizer, before) and len(optimizer.state) == 2


def test_the_public_values_built_by_hand_refuse_fields_of_the_wrong_type() -> None:
    """A problem or report made by hand with a wrong field is refused where it is made, not
    met as an AttributeError or KeyError when it is printed."""
    with pytest.raises(opttree.OptTreeError, match="Problem.kind must be a ProblemKind, got a str"):
        opttree.Problem("x", "<root>", "AdamW", "a message")  # type: ignore[arg-type]
    with pytest.raises(opttree.OptTreeError, match="Problem.key must be a str or None, got an int"):
        opttree.Problem(opttree.ProblemKind.EMPTY_STATE, "<root>", "AdamW", "a message", 3)  # type: ignore[arg-type]
    problem = opttree.Problem(opttree.ProblemKind.EMPTY_STATE, "<root>", "AdamW", "a message")
    with pytest.raises(opttree.OptTreeError, match="Problem.rank must be an int or None, got a str"):
        problem.on_rank("a")  # type: ignore[arg-type]
    with pytest.raises(opttree.OptTreeError, match="Problem.rank must be an int or None, got a bool"):
        problem.on_rank(True)
    assert str(problem.on_rank(1)) == "rank 1: warning: AdamW at <root>: a message"
    with pytest.raises(opttree.OptTreeError, match="ResetReport.action must be one of 'reset', 'prune', 'scale', got 'bogus'"):
        opttree.ResetReport(1, 0, 0, 0, 0, 0, 0, (), action="bogus")  # type: ignore[arg-type]
    with pytest.raises(opttree.OptTreeError, match="ResetReport.bytes_reset must be an int, got a str"):
        opttree.ResetReport(1, 0, 0, "x", 0, 0, 0, ())  # type: ignore[arg-type]
    with pytest.raises(opttree.OptTreeError, match="ResetReport.kept_keys must be a tuple of key names, got a tuple holding an int"):
        opttree.ResetReport(1, 0, 0, 0, 0, 0, 0, (1, 2))  # type: ignore[arg-type]
    with pytest.raises(opttree.OptTreeError, match="to_error takes others as a sequence of problems, got a str"):
        problem.to_error(others="ab")  # type: ignore[arg-type]
    with pytest.raises(opttree.OptTreeError, match="to_error takes others as a sequence of problems, got a list"):
        problem.to_error(others=[problem, "b"])  # type: ignore[list-item]
    assert problem.to_error(others=[problem]).problems == (problem, problem)


def test_messages_name_a_class_with_the_article_it_is_said_with() -> None:
    """A class name opening on two capitals is spelt out: an SGD, a LaProp."""
    said_as = {torch.optim.SGD: "an SGD", torch.optim.NAdam: "an NAdam", torch.optim.LBFGS: "an LBFGS", torch.optim.Adam: "an Adam"}
    for cls, said in said_as.items():
        optimizer = cls([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        with pytest.raises(opttree.OptTreeError, match=f"ChainedNode.path must be a str, got {said}$"):
            opttree.ChainedNode(path=optimizer, optimizer=None, members=())
    assert [article(name) for name in ("uint8", "int8", "float16")] == ["a uint8", "an int8", "a float16"]


class UnhashableName(str):
    """A state key name whose own ``__hash__`` raises."""

    def __hash__(self) -> int:
        raise RuntimeError("no hash")


@pytest.mark.parametrize("change", ["reset", "prune"])
def test_key_names_of_a_str_subclass_are_read_as_plain_strings(change: str) -> None:
    """Their own ``__hash__`` once escaped raw from building the set of selected keys."""
    optimizer = stepped_adamw(2)
    keys = [UnhashableName("exp_avg")]
    report = opttree.reset(optimizer, keys=keys) if change == "reset" else opttree.prune(optimizer, 1.0, keys=keys)
    assert report.tensors_zeroed == 2 and report.kept_keys == ("exp_avg_sq", "step")


@pytest.mark.usefixtures("process_group")
def test_a_destroyed_process_group_is_an_opttree_error_and_a_reset_changes_nothing() -> None:
    """torch's own ValueError ("Group ... is not registered") escaped validate and describe."""
    import torch.distributed as dist

    group = dist.new_group([0])
    assert isinstance(group, dist.ProcessGroup)
    dist.destroy_process_group(group)
    optimizer = stepped_adamw(2)
    before = snapshot(optimizer)
    for call in (opttree.validate, opttree.describe, opttree.reset):
        with pytest.raises(opttree.OptTreeError, match="group cannot be used: ValueError"):
            call(optimizer, group=group)
    assert unchanged(optimizer, before)


@pytest.mark.parametrize("keys", [b"exp_avg", bytearray(b"exp_avg")], ids=["bytes", "bytearray"])
def test_keys_as_bytes_are_refused_as_what_they_are(keys: object) -> None:
    """Iterated, bytes gave ints: the refusal said "got an int"."""
    with pytest.raises(opttree.OptTreeError, match=rf"keys must be a state key or a list of them, got an? {type(keys).__name__}"):
        opttree.reset(stepped_adamw(2), keys=keys)  # type: ignore[arg-type]
