"""What users' registered ``children`` and ``inner_params`` functions yield: anything but
the pairs they promise is a malformed wrapper, refused by a reset and reported by
``validate`` and ``describe``, never a raw error or a silent no-op."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import pytest
import torch

import opttree
from tests.copying import CopyingWrapper
from tests.helpers import snapshot, stepped_adamw, unchanged


class Holder:
    """A wrapper of one optimizer, registered anew, with its own children function, by each test."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer


def registered_holder(children: Callable[[Holder], object]) -> type[Holder]:
    kind = type("Holder", (Holder,), {})
    opttree.register_wrapper(kind, children=lambda wrapper: children(wrapper))  # type: ignore[arg-type, return-value]
    return kind


@pytest.mark.parametrize(
    ("children", "yielded"),
    [
        (lambda w: [w.optimizer], "an AdamW"),
        (lambda w: [("optimizer", w.optimizer, "extra")], "a tuple of 3"),
        (lambda w: [(0, w.optimizer)], "a pair of an int and an AdamW"),
        (lambda w: {"optimizer": w.optimizer}, "a str"),
    ],
    ids=["bare optimizer", "triple", "int label", "dict"],
)
def test_children_that_are_not_labelled_pairs_are_a_malformed_wrapper(children: Callable[[Holder], object], yielded: str) -> None:
    optimizer = stepped_adamw(2)
    wrapper = registered_holder(children)(optimizer)
    before = snapshot(optimizer)
    message = f"its children function yielded {yielded}, expected (label, inner) pairs with a str label"

    with pytest.raises(opttree.MalformedWrapper, match=re.escape(f"Holder at <root>: {message}")) as raised:
        opttree.reset(wrapper)
    problem = opttree.validate(wrapper)[0]  # the refusal first; the optimizer it holds is hidden too

    assert unchanged(optimizer, before)
    assert raised.value.problem == problem
    assert problem.kind is opttree.ProblemKind.MALFORMED_WRAPPER and problem.message == message
    assert opttree.describe(wrapper) == f"Holder (refused: {message})  @ <root>"


def test_children_sharing_a_label_are_a_malformed_wrapper_and_under_two_labels_one_leaf() -> None:
    """Two children at one path are one node to every check: an optimizer given twice under
    one label was reported as sharing memory with itself. Under two labels it is one leaf
    reached twice, reset once."""
    optimizer = stepped_adamw(2)
    before = snapshot(optimizer)
    same = registered_holder(lambda w: [("a", w.optimizer), ("a", w.optimizer)])(optimizer)
    apart = registered_holder(lambda w: [("a", w.optimizer), ("b", w.optimizer)])(optimizer)
    message = "its children function gave the label 'a' to more than one child: give each its own label"

    with pytest.raises(opttree.MalformedWrapper, match=re.escape(f"Holder at <root>: {message}")):
        opttree.reset(same)
    assert unchanged(optimizer, before)
    assert opttree.validate(same)[0].message == message
    assert opttree.validate(apart) == ()
    assert opttree.reset(apart).tensors_zeroed == 4


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (("a", "a.optimizer"), "gave the labels 'a' and 'a.optimizer': the second's path lies below the first's"),
        (("a", "a[0]"), "gave the labels 'a' and 'a[0]': the second's path lies below the first's"),
        (("", "b"), "gave a child the label '', which names no path below it"),
        (("<root>", "b"), "gave a child the label '<root>', which names no path below it"),
        (("a", "."), "gave a child the label '.', which names no path below it"),
        (("a", "b..c"), "gave a child the label 'b..c', which names no path below it"),
    ],
    ids=["dotted", "indexed", "empty", "root", "dot", "empty-part"],
)
def test_children_whose_labels_would_give_two_nodes_one_path_are_a_malformed_wrapper(labels: tuple[str, str], message: str) -> None:
    """A label ``a.optimizer`` beside a child ``a`` that holds a child ``optimizer`` names two
    nodes ``a.optimizer``: every check that finds a node by its path would find either."""
    optimizer, other = stepped_adamw(2), stepped_adamw(2)
    before = snapshot(optimizer)
    inner = registered_holder(lambda w: [("optimizer", w.optimizer)])(optimizer)
    clashing = registered_holder(lambda w: [(labels[0], inner), (labels[1], other)])(optimizer)

    with pytest.raises(opttree.MalformedWrapper, match=re.escape(message)):
        opttree.reset(clashing)
    assert unchanged(optimizer, before)
    assert [p.kind for p in opttree.validate(clashing)][0] is opttree.ProblemKind.MALFORMED_WRAPPER


def test_labels_that_are_paths_of_their_own_are_taken() -> None:
    """Labels may be paths (``optimizers[0]``), and one below a sibling leaf's (a
    submodule's name, ``encoder.attn`` beside ``encoder``): no node below a leaf has its path."""
    optimizer, other = stepped_adamw(2), stepped_adamw(2)
    indexed = registered_holder(lambda w: [("optimizers[0]", w.optimizer), ("optimizers[1]", other)])(optimizer)
    modules = registered_holder(lambda w: [("encoder", w.optimizer), ("encoder.attn", other)])(optimizer)

    assert [node.path for node in opttree.tree(indexed).children] == ["optimizers[0]", "optimizers[1]"]
    assert opttree.validate(modules) == ()
    assert opttree.reset(modules).leaves == 2


class UnhashableLabel(str):
    """A label whose own ``__hash__`` and ``__eq__`` raise."""

    def __hash__(self) -> int:
        raise RuntimeError("label hash")

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("label eq")


def test_a_label_of_a_str_subclass_is_taken_as_the_str_it_holds() -> None:
    """Its own ``__hash__``, run by the check that labels differ, escaped validate,
    describe and reset raw. A label is read as the plain str it holds."""
    optimizer, other = stepped_adamw(2), stepped_adamw(2)
    holder = registered_holder(lambda w: [(UnhashableLabel("first"), w.optimizer), (UnhashableLabel("second"), other)])(optimizer)

    assert opttree.validate(holder) == ()
    assert "@ first" in opttree.describe(holder)
    assert [type(node.path) for node in opttree.tree(holder).children] == [str, str]
    assert opttree.reset(holder).leaves == 2


def test_children_from_an_iterator_the_wrapper_keeps_are_a_malformed_wrapper_and_a_fresh_generator_is_not() -> None:
    """A kept iterator is used up by the first build: every later reset would find no
    children and reset nothing, reporting success."""
    optimizer = stepped_adamw(2)
    before = snapshot(optimizer)

    class KeepsIterator(Holder):
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            super().__init__(optimizer)
            self.pairs = iter([("optimizer", optimizer)])

    class SlotsIterator:
        __slots__ = ("pairs",)

        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.pairs = iter([("optimizer", optimizer)])

    opttree.register_wrapper(KeepsIterator, children=lambda w: w.pairs)
    opttree.register_wrapper(SlotsIterator, children=lambda w: w.pairs)
    for kept in (KeepsIterator(optimizer), SlotsIterator(optimizer)):
        for _ in range(2):
            with pytest.raises(opttree.MalformedWrapper, match="returned an iterator the wrapper keeps"):
                opttree.reset(kept)
            assert opttree.validate(kept)[0].kind is opttree.ProblemKind.MALFORMED_WRAPPER  # the optimizer it holds is hidden too
    assert unchanged(optimizer, before)

    def pairs(wrapper: Holder) -> Iterable[tuple[str, object]]:
        yield "optimizer", wrapper.optimizer

    fresh = registered_holder(pairs)(optimizer)
    assert opttree.reset(fresh).tensors_zeroed == 4
    assert opttree.reset(fresh).tensors_zeroed == 4


class Copies(CopyingWrapper):
    """A copying wrapper registered with an ``inner_params`` function that a test sets."""

    yields: Callable[[CopyingWrapper], Iterable[object]] = staticmethod(lambda w: ())


def _copies_inner(wrapper: object, path: str) -> Iterable[object]:
    assert isinstance(wrapper, Copies)
    return wrapper.yields(wrapper)


opttree.register_wrapper(
    Copies,
    children=lambda w: [("optimizer", w.optimizer)] if isinstance(w, Copies) else [],
    inner_params=_copies_inner,  # type: ignore[arg-type]  # yields what each test makes it
)


def stepped_copies(yields: Callable[[CopyingWrapper], Iterable[object]]) -> Copies:
    wrapper = Copies([torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)])
    wrapper.yields = yields
    for copy in wrapper.copies:
        copy.grad = torch.ones_like(copy)
    wrapper.optimizer.step()
    return wrapper


@pytest.mark.parametrize(
    ("yields", "yielded"),
    [
        (lambda w: zip(w.params, w.copies), "a pair of a Parameter and a Tensor"),
        (lambda w: w.params, "a Parameter"),
        (lambda w: [(p, [c], None) for p, c in zip(w.params, w.copies)], "a tuple of 3"),
    ],
    ids=["one copy, not a list", "bare parameters", "triple"],
)
def test_inner_params_that_are_not_param_copies_pairs_are_a_malformed_wrapper_everywhere(
    yields: Callable[[CopyingWrapper], Iterable[object]], yielded: str
) -> None:
    wrapper = stepped_copies(yields)
    before = snapshot(wrapper.optimizer)
    message = rf"Copies at <root>: its inner_params function yielded {yielded}, expected \(param, copies\) pairs"

    with pytest.raises(opttree.MalformedWrapper, match=message):
        opttree.reset(wrapper, params=wrapper.params[:1])
    with pytest.raises(opttree.MalformedWrapper, match=message):
        opttree.sync_masters(wrapper)
    (problem,) = opttree.validate(wrapper, model=torch.nn.ParameterList(wrapper.params))

    assert unchanged(wrapper.optimizer, before)
    assert problem.kind is opttree.ProblemKind.MALFORMED_WRAPPER
    assert problem.message.startswith(f"its inner_params function yielded {yielded}")
    wrapper.yields = lambda w: [(p, (c,)) for p, c in zip(w.params, w.copies)]  # pairs, copies a tuple
    assert opttree.reset(wrapper, params=wrapper.params[:1]).tensors_zeroed == 2
    assert not wrapper.optimizer.state[wrapper.copies[0]]["exp_avg"].any()
    assert wrapper.optimizer.state[wrapper.copies[1]]["exp_avg"].any()


def test_register_wrapper_refuses_an_inner_params_that_is_not_callable() -> None:
    class Uncallable(Holder):
        pass

    with pytest.raises(opttree.RegistrationError, match="needs a callable inner_params function, got an int"):
        opttree.register_wrapper(Uncallable, children=lambda w: [], inner_params=5)  # type: ignore[call-overload]
    opttree.register_wrapper(Uncallable, children=lambda w: [])  # the refused registration left nothing behind


def test_an_opttree_error_from_inner_params_is_its_wrappers_problem() -> None:
    """A nested opttree call failing inside ``inner_params`` names its own object; the
    problem is this wrapper's, as one from a ``children`` function is."""
    wrapper = stepped_copies(lambda w: [(opttree.tree(None), [])])
    before = snapshot(wrapper.optimizer)

    (problem,) = opttree.validate(wrapper, model=torch.nn.ParameterList(wrapper.params))

    assert (problem.kind, problem.cls) == (opttree.ProblemKind.MALFORMED_WRAPPER, "Copies")
    assert problem.message.startswith("its inner_params function failed: NotAnOptimizer")
    with pytest.raises(opttree.MalformedWrapper, match=r"Copies at <root>: its inner_params function failed"):
        opttree.reset(wrapper, params=wrapper.params[:1])
    assert unchanged(wrapper.optimizer, before)
