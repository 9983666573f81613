"""The hidden-optimizer safety net looks through nested containers: an optimizer that a
real Megatron wrapper keeps in a dict of lists, a list of lists, a dataclass, a set or
another collection (a ``UserDict``), up to four containers deep, is reported and refused,
with nothing changed; a container that holds itself, or whose own code raises, neither
hangs nor raises."""

from __future__ import annotations

import collections
import dataclasses
import functools
import subprocess
import sys
import types
import weakref

import pytest
import torch
from megatron.core.optimizer import FP32Optimizer

import opttree
from tests import megatron_parts
from tests.helpers import model, snapshot, train, unchanged
from opttree.testing import cuda_on_cpu
from tests.megatron_parts import config, fp32

pytestmark = pytest.mark.usefixtures("process_group")


def stepped(seed: int) -> torch.optim.AdamW:
    net = model(seed)
    optimizer = torch.optim.AdamW(net.parameters())
    train(net, optimizer, 0, 3)
    return optimizer


@dataclasses.dataclass
class Ema:
    """An auxiliary record of the kind a subclass might keep: its optimizers in a list."""

    name: str
    optimizers: list[torch.optim.Optimizer]


@dataclasses.dataclass
class Touchy:
    """A record with a field never set and a ``__getattr__`` that raises for it."""

    optimizers: list[torch.optim.Optimizer]
    late: int = dataclasses.field(init=False)

    def __getattr__(self, name: str) -> object:
        raise RuntimeError(f"no {name} here")


class Unlistable(list[object]):
    """A list whose own iteration, length and attribute lookups raise."""

    def __iter__(self) -> object:  # type: ignore[override]
        raise RuntimeError("not iterable today")

    def __len__(self) -> int:
        raise RuntimeError("no length either")

    def __getattr__(self, name: str) -> object:
        raise RuntimeError(f"no {name} here")


def holding(hidden: torch.optim.Optimizer, layout: str) -> object:
    """``hidden`` inside the nested containers ``layout`` names."""
    if layout == "dict of lists":
        return {"ema": [hidden]}
    if layout == "list of lists":
        return [[hidden]]
    if layout == "dataclass with a list":
        return Ema("ema", [hidden])
    if layout == "set in a list":
        return [frozenset({hidden})]
    if layout == "four deep":
        return {"a": [{"b": (hidden,)}]}
    if layout == "list that raises":
        return Unlistable([[hidden]])
    if layout == "deque":
        return collections.deque([hidden])
    if layout == "namespace":
        return types.SimpleNamespace(ema=hidden)
    if layout == "dict key":
        return {hidden: "ema"}
    if layout == "bound method":
        return [hidden.step]
    if layout == "partial":
        return functools.partial(print, hidden)
    if layout == "weak reference":
        return weakref.ref(hidden)
    if layout == "UserList":
        return collections.UserList([hidden])
    if layout == "UserDict":
        return collections.UserDict(ema=hidden)
    if layout == "ChainMap":
        return collections.ChainMap({"ema": hidden})
    if layout == "mappingproxy":
        return types.MappingProxyType({"ema": hidden})
    if layout == "dict values view":
        return {"ema": hidden}.values()
    return Touchy([hidden])


def wrapper_holding(aux: object) -> tuple[FP32Optimizer, torch.optim.AdamW]:
    """A real FP32Optimizer over a trained AdamW, holding ``aux`` in an attribute of its own."""
    leaf = stepped(0)
    wrapper = fp32(leaf)
    setattr(wrapper, "aux", aux)
    return wrapper, leaf


@pytest.mark.parametrize(
    ("layout", "label"),
    [
        ("dict of lists", "aux['ema'][0]"),
        ("list of lists", "aux[0][0]"),
        ("dataclass with a list", "aux.optimizers[0]"),
        ("set in a list", "aux[0]{...}"),
        ("four deep", "aux['a'][0]['b'][0]"),
        ("list that raises", "aux[0][0]"),
        ("record whose __getattr__ raises", "aux.optimizers[0]"),
        ("deque", "aux[0]"),
        ("namespace", "aux.ema"),
        ("dict key", "aux.keys()[0]"),
        ("bound method", "aux[0].__self__"),
        ("partial", "aux.args[0]"),
        ("weak reference", "aux()"),
        ("UserList", "aux.data[0]"),
        ("UserDict", "aux.data['ema']"),
        ("ChainMap", "aux.maps[0]['ema']"),
        ("mappingproxy", "aux['ema']"),
        ("dict values view", "aux['ema']"),
    ],
)
def test_an_optimizer_nested_in_a_wrappers_attribute_is_reported_and_refused(layout: str, label: str) -> None:
    hidden = stepped(1)
    wrapper, leaf = wrapper_holding(holding(hidden, layout))
    before = [snapshot(leaf), snapshot(hidden)]

    problems = opttree.validate(wrapper)
    with pytest.raises(opttree.HiddenOptimizer, match=r"FP32Optimizer at <root>: holds an AdamW in (\S+) ") as caught:
        opttree.reset(wrapper)

    assert [p.kind for p in problems] == [opttree.ProblemKind.HIDDEN_OPTIMIZER]
    assert caught.value.problem is not None and f"in {label} that" in caught.value.problem.message
    assert unchanged(leaf, before[0]) and unchanged(hidden, before[1])
    assert all(int(entry["step"]) == 3 for entry in hidden.state.values())


def test_a_list_that_holds_itself_ends_the_search() -> None:
    hidden = stepped(1)
    loop: list[object] = []
    loop.append(loop)
    loop.append({"again": loop, "ema": [hidden]})
    wrapper, leaf = wrapper_holding([loop])
    before = snapshot(leaf)

    problems = opttree.validate(wrapper)
    assert [p.kind for p in problems] == [opttree.ProblemKind.HIDDEN_OPTIMIZER]
    assert "in aux[0][1]['ema'][0] that" in problems[0].message
    with pytest.raises(opttree.HiddenOptimizer):
        opttree.reset(wrapper)
    assert unchanged(leaf, before)


def test_a_container_that_holds_itself_and_no_optimizer_is_fine() -> None:
    loop: dict[str, object] = {}
    loop["self"] = [loop, (loop,), {frozenset({1, 2})}]
    wrapper, _ = wrapper_holding(loop)

    assert opttree.validate(wrapper) == ()
    assert opttree.reset(wrapper).leaves == 1


def test_a_container_held_many_times_over_is_read_once() -> None:
    """Two thousand references to one list of two thousand lists: the screen's budget
    runs out, and the search goes on container by container, each read once."""
    hidden = stepped(1)
    row = [0.5] * 2000
    shared: list[object] = [row] * 2000
    shared.append([hidden])
    wrapper, _ = wrapper_holding([shared] * 2000)

    problems = opttree.validate(wrapper)
    assert [p.kind for p in problems] == [opttree.ProblemKind.HIDDEN_OPTIMIZER]
    assert "in aux[0][2000][0] that" in problems[0].message


def test_the_tree_s_own_optimizer_nested_in_an_attribute_is_not_hidden() -> None:
    leaf = stepped(0)
    wrapper = fp32(leaf)
    setattr(wrapper, "aux", {"ema": [[leaf]], "record": Ema("same", [leaf])})

    assert opttree.validate(wrapper) == ()
    report = opttree.reset(wrapper)
    assert report.leaves == 1
    assert all(int(entry["step"]) == 0 for entry in leaf.state.values())


def test_tensors_and_modules_are_not_looked_into() -> None:
    """A module's own attributes are its business, not the wrapper's containers'."""
    net = torch.nn.Linear(2, 2)
    setattr(net, "tracker", [stepped(1)])
    wrapper, _ = wrapper_holding({"modules": [net], "grads": [torch.zeros(3)]})

    assert opttree.validate(wrapper) == ()


class SlottedFP32(FP32Optimizer):
    """An FP32Optimizer subclass that keeps an extra optimizer in a slot (and a
    private one, name-mangled), where ``__dict__`` does not show it. Registered, as a
    subclass defining anything of its own must be, as an ``.optimizer`` wrapper."""

    __slots__ = ("ema", "__shadow", "unset")


def _inner_optimizer(wrapper: FP32Optimizer) -> list[tuple[str, object]]:
    return [("optimizer", wrapper.optimizer)]


opttree.register_wrapper(SlottedFP32, children=_inner_optimizer)


@pytest.mark.parametrize(("slot", "label"), [("ema", "ema"), ("_SlottedFP32__shadow", "_SlottedFP32__shadow")])
def test_an_optimizer_held_in_a_slot_is_reported_and_refused(slot: str, label: str) -> None:
    leaf = stepped(0)
    with cuda_on_cpu():
        wrapper = SlottedFP32(leaf, config(), None)
    hidden = stepped(1)
    setattr(wrapper, slot, [hidden])  # the slot "unset" is never set, and passed over
    before = [snapshot(leaf), snapshot(hidden)]

    problems = opttree.validate(wrapper)
    with pytest.raises(opttree.HiddenOptimizer, match=r"SlottedFP32 at <root>: holds an AdamW"):
        opttree.reset(wrapper)

    assert [p.kind for p in problems] == [opttree.ProblemKind.HIDDEN_OPTIMIZER]
    assert f"in {label}[0] that" in problems[0].message
    assert unchanged(leaf, before[0]) and unchanged(hidden, before[1])


def test_a_slot_descriptor_borrowed_from_another_class_is_passed_over() -> None:
    """A class attribute that is another class's slot descriptor reads as a TypeError on
    this class's instances: no optimizer is there, and the search goes on without raising."""

    class Other:
        __slots__ = ("x",)

    leaf = stepped(0)
    wrapper = fp32(leaf)
    borrowing = type("Borrowing", (FP32Optimizer,), {"alias": Other.__dict__["x"]})
    opttree.register_wrapper(borrowing, children=_inner_optimizer)
    wrapper.__class__ = borrowing

    assert opttree.validate(wrapper) == ()
    assert opttree.reset(wrapper).leaves == 1


class WithAux(torch.optim.AdamW):
    """An AdamW registered with AdamW's schema that also steps an auxiliary optimizer of
    its own, which no schema names: the registration vouches for its state, not for that."""

    def __init__(self, params: list[torch.nn.Parameter], aux: torch.optim.Optimizer) -> None:
        super().__init__(params)
        self.aux = aux


opttree.register_schema(WithAux, opttree.schema_for(torch.optim.AdamW))


@pytest.mark.parametrize("how", ["registered class", "set on an instance"])
def test_an_optimizer_a_leaf_holds_beside_its_state_is_reported_and_refused(how: str) -> None:
    """A leaf's attributes other than torch's bookkeeping are searched as a wrapper's are:
    a reset of the leaf kept the auxiliary optimizer's steps, in silence."""
    hidden = stepped(1)
    net = model(0)
    if how == "registered class":
        leaf: torch.optim.AdamW = WithAux(list(net.parameters()), hidden)
    else:
        leaf = torch.optim.AdamW(net.parameters())
        setattr(leaf, "ema", {"slow": hidden})
    train(net, leaf, 0, 3)
    before = [snapshot(leaf), snapshot(hidden)]

    problems = opttree.validate(leaf)
    with pytest.raises(opttree.HiddenOptimizer, match=r"(WithAux|AdamW) at <root>: holds an AdamW in (aux|ema\['slow'\]) that the tree does not contain"):
        opttree.reset(leaf)

    assert [p.kind for p in problems] == [opttree.ProblemKind.HIDDEN_OPTIMIZER]
    assert unchanged(leaf, before[0]) and unchanged(hidden, before[1])


def test_a_leafs_own_bookkeeping_holds_no_optimizer_to_find() -> None:
    """torch's own attributes (state, groups, hooks) are what a schema covers, and a leaf
    holding an LR scheduler's patched step is no leaf holding an optimizer."""
    net = model(0)
    leaf = torch.optim.AdamW(net.parameters())
    torch.optim.lr_scheduler.StepLR(leaf, 1)
    train(net, leaf, 0, 2)
    assert opttree.validate(leaf) == ()
    assert opttree.reset(leaf).leaves == 1


def test_an_optimizer_one_of_a_thousand_alike_leaves_holds_is_found() -> None:
    """A HybridDeviceOptimizer's sub-optimizers are checked as one pooled run where none
    holds anything beyond torch's bookkeeping; one that does is checked on its own."""
    optimizer, params, device = megatron_parts.hybrid([4] * 1000)
    with device:
        for param in params:
            param.grad = torch.ones_like(param)
        optimizer.step()
    assert opttree.validate(optimizer) == ()
    hidden = stepped(1)
    setattr(optimizer.cpu_optimizers[617], "ema", [hidden])
    before = snapshot(hidden)

    problems = opttree.validate(optimizer)
    with pytest.raises(opttree.HiddenOptimizer, match=r"AdamW at sub_optimizers\[617\]: holds an AdamW in ema\[0\]"):
        opttree.reset(optimizer)

    assert [p.kind for p in problems] == [opttree.ProblemKind.HIDDEN_OPTIMIZER]
    assert unchanged(hidden, before)


STRICT_ABC = """
import collections.abc, warnings
warnings.filterwarnings("ignore")
import opttree
from opttree import testing

class Strict(collections.abc.Sequence):
    # a library's ABC whose hook refuses to judge classes it does not know
    @classmethod
    def __subclasshook__(cls, other):
        raise TypeError(f"cannot judge {other.__name__}")

    def __getitem__(self, index):
        raise IndexError(index)

    def __len__(self):
        return 0

testing.ensure_process_group()
stack = testing.build("fp32")
stack.train(0, 2)
stack.optimizer.aux = type("Note", (), {})()  # an attribute of a class no check has met
assert opttree.validate(stack.optimizer) == (), opttree.validate(stack.optimizer)
opttree.reset(stack.optimizer)
print("ok")
"""


def test_the_search_asks_no_abc_whether_a_class_is_a_collection() -> None:
    """Whether a held object is a collection is read from its class's namespaces: asking
    ``collections.abc`` ran every ``__subclasshook__`` below it, and a library's that
    raised made validate and reset raise it. In a process of its own: such an ABC
    changes every later ``issubclass`` check against ``Sequence``."""
    done = subprocess.run([sys.executable, "-c", STRICT_ABC], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
