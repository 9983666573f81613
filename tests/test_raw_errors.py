"""Inputs that once escaped as a raw Python error, a traceback or a hang: each is now a
one-line CLI error or an :class:`~opttree.OptTreeError` naming what was given."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import opttree
from opttree import testing
from tests.helpers import snapshot, stepped_adamw, unchanged


def one() -> int:
    return 1


@pytest.mark.parametrize("command", ["describe", "validate"])
def test_a_module_getattr_that_raises_is_one_line_and_a_failure(command: str, tmp_path: Path) -> None:
    (tmp_path / "opttree_lazy_factories.py").write_text(
        "def __getattr__(name):\n    raise RuntimeError('lazy import failed')\n"
    )

    done = subprocess.run(
        [sys.executable, "-m", "opttree", command, "opttree_lazy_factories:factory"],
        capture_output=True,
        text=True,
        check=False,
        timeout=180,
        cwd=tmp_path,
    )

    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == "getting factory from opttree_lazy_factories raised RuntimeError: lazy import failed"


@pytest.mark.parametrize("world_size", [0, -1, 2.0, True, "2"])
def test_run_ranks_refuses_a_world_size_that_is_not_a_positive_int(world_size: object) -> None:
    with pytest.raises(opttree.OptTreeError, match=rf"world_size must be a positive int, got {world_size!r}$"):
        testing.run_ranks(one, world_size, timeout=60)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0, 0, True, "60"])
def test_run_ranks_refuses_a_timeout_that_is_not_a_positive_finite_number(timeout: object) -> None:
    with pytest.raises(opttree.OptTreeError, match=rf"timeout must be a positive, finite number of seconds, got {timeout!r}$"):
        testing.run_ranks(one, 2, timeout=timeout)  # type: ignore[arg-type]


@pytest.mark.parametrize(("seed", "kind"), [("a", "a str"), (1.5, "a float"), (True, "a bool")])
def test_build_refuses_a_seed_that_is_not_an_int(seed: object, kind: str) -> None:
    with pytest.raises(opttree.OptTreeError, match=rf"build's seed must be an int, got {kind}$"):
        testing.build("fp32", seed=seed)  # type: ignore[arg-type]


@pytest.mark.parametrize(("lr", "message"), [("0.01", "must be a float or an int, got a str"), (True, "must be a float or an int, got a bool")])
def test_build_refuses_an_lr_that_is_not_a_number(lr: object, message: str) -> None:
    with pytest.raises(opttree.OptTreeError, match=rf"build's lr {message}$"):
        testing.build("fp32", lr=lr)  # type: ignore[arg-type]


@pytest.mark.parametrize("lr", [math.nan, math.inf, -1.0, 0])
def test_build_refuses_an_lr_megatron_cannot_train_with(lr: float) -> None:
    with pytest.raises(opttree.OptTreeError, match=rf"build's lr must be positive and finite, as Megatron's OptimizerConfig.lr .*, got {lr}$"):
        testing.build("fp32", lr=lr)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_build_refuses_a_seed_torch_cannot_take(seed: int) -> None:
    with pytest.raises(opttree.OptTreeError, match=rf"build's seed must be an int from -2\*\*63 to 2\*\*64 - 1, as torch.manual_seed takes, got {seed}$"):
        testing.build("fp32", seed=seed)


def test_a_nested_tensor_no_optimizer_holds_is_named_by_its_class() -> None:
    """A nested tensor has no sizes: naming it by its shape raised torch's RuntimeError."""
    optimizer = stepped_adamw(2)
    before = snapshot(optimizer)
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])

    with pytest.raises(opttree.UnmappedParameter, match=r"^parameter \(a Tensor whose shape cannot be read\) is held by no optimizer under AdamW"):
        opttree.reset(optimizer, params=[nested])

    assert unchanged(optimizer, before)


class OddStep(float):
    """A step counter whose own ``__float__`` refuses."""

    def __float__(self) -> float:
        raise ValueError("OddStep refuses __float__")


class OddKey:
    """A state key whose own ``__repr__`` refuses."""

    def __repr__(self) -> str:
        raise RuntimeError("OddKey refuses __repr__")


def test_a_step_counter_whose_float_raises_is_reported_under_a_megatron_wrapper() -> None:
    """The wrapper's step-unit check read it with ``float()`` and let its error out."""
    stack = testing.build("fp32")
    stack.train(0, 2)
    next(iter(stack.leaves()[0].state.values()))["step"] = OddStep(2.0)
    before = [snapshot(leaf) for leaf in stack.leaves()]

    assert any(problem.key == "step" for problem in opttree.validate(stack.optimizer))
    opttree.describe(stack.optimizer)
    with pytest.raises(opttree.UnsupportedOptimizerState):
        opttree.reset(stack.optimizer)
    assert all(unchanged(leaf, snap) for leaf, snap in zip(stack.leaves(), before, strict=True))


def test_a_hybrid_optimizers_own_entry_with_a_key_that_cannot_print_is_reported() -> None:
    stack = testing.build("offload_1.0")
    stack.train(0, 2)
    sub = stack.leaves()[0]
    param = next(iter(sub.state))
    own = sub.state[param]  # the HybridDeviceOptimizer's own state keeps this dict
    own[OddKey()] = torch.zeros(1)
    sub.state[param] = {key: value for key, value in own.items() if isinstance(key, str)}

    problems = opttree.validate(stack.optimizer)

    assert any("holds state of its own" in problem.message and "<an OddKey>" in problem.message for problem in problems)
    with pytest.raises(opttree.UnsupportedOptimizerState, match="holds state of its own"):
        opttree.reset(stack.optimizer)


MEMORY_GONE = r"""
import sys, warnings
warnings.filterwarnings("ignore")
import torch, opttree
from opttree import testing

def shrunk():  # a tensor of a million values whose storage holds one
    tensor = torch.zeros(1_000_000)
    tensor.untyped_storage().resize_(4)
    return tensor

def one_value_past_its_storage():  # one value, far into a storage shrunk to hold one
    tensor = torch.zeros(1_000_000)
    value = tensor[900_000]
    tensor.untyped_storage().resize_(4)
    return value

def freed_negative():
    tensor = torch.zeros(1)._neg_view()
    tensor.untyped_storage().resize_(0)
    return tensor

how, kind = sys.argv[1:3]
testing.ensure_process_group()
if kind == "megatron":
    stack = testing.build("fp32")
    stack.train(0, 2)
    root, leaf = stack.optimizer, stack.leaves()[0]
else:
    net = torch.nn.Linear(3, 2)
    leaf = (torch.optim.Adagrad if how == "fill" else torch.optim.Adam)(net.parameters())
    net(torch.randn(4, 3)).pow(2).mean().backward()
    leaf.step()
    root = leaf
entry = next(iter(leaf.state.values()))
if how == "step":
    entry["step"] = shrunk()
elif how == "negative-step":
    entry["step"] = freed_negative()
elif how == "group-step":
    leaf.param_groups[0]["step"] = shrunk()
elif how == "one-value-step":
    entry["step"] = one_value_past_its_storage()
else:
    leaf.defaults["initial_accumulator_value"] = one_value_past_its_storage()
problems = opttree.validate(root)
opttree.describe(root)
try:
    opttree.reset(root)
    print("reset", [str(problem) for problem in problems])
except opttree.OptTreeError as error:
    print("refused", type(error).__name__)
"""


@pytest.mark.parametrize(
    ("how", "kind"),
    [
        ("step", "torch"),
        ("step", "megatron"),
        ("one-value-step", "megatron"),
        ("negative-step", "megatron"),
        ("group-step", "torch"),
        ("group-step", "megatron"),
        ("fill", "torch"),
    ],
)
def test_a_counter_whose_storage_was_freed_or_shrunk_is_refused_without_reading_it(how: str, kind: str) -> None:
    """``validate``, ``describe`` and ``reset`` read the value of a step or fill tensor
    (``.item()``) before anything checked that its memory is there: they segfaulted. Run
    in a child, whose death by a signal is its return code."""
    done = subprocess.run([sys.executable, "-c", MEMORY_GONE, how, kind], capture_output=True, text=True, check=False, timeout=300)

    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[:1] == ["refused"], done.stdout


def _hides_its_dict(self: object, name: str) -> object:
    if name == "__dict__":
        raise RuntimeError("no __dict__ here")
    return object.__getattribute__(self, name)


class ProxiedAdam(torch.optim.Adam):
    """A registered Adam whose ``__getattribute__`` refuses ``__dict__`` (an instrumented
    or proxied class): opttree reads instance attributes as ``object`` does."""

    __getattribute__ = _hides_its_dict


class Proxy:
    """A registered wrapper that refuses ``__dict__`` the same way."""

    __getattribute__ = _hides_its_dict

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner


opttree.register_schema(ProxiedAdam, opttree.schema_for(torch.optim.Adam))
opttree.register_wrapper(Proxy, children=lambda proxy: [("inner", proxy.inner)])


def test_an_instance_whose_own_getattribute_refuses_its_dict_is_read_as_object_reads_it() -> None:
    """``__dict__`` was read with ``getattr``, which runs a class's own ``__getattribute__``:
    its RuntimeError escaped from ``validate``, ``describe`` and ``reset``."""
    param = torch.nn.Parameter(torch.ones(3))
    leaf = ProxiedAdam([param])
    param.grad = torch.ones(3)
    leaf.step()
    inner = stepped_adamw(2)
    for optimizer, zeroed in ((leaf, 2), (Proxy(inner), 4)):
        assert opttree.validate(optimizer) == ()
        assert "step=" in opttree.describe(optimizer)
        assert opttree.reset(optimizer).tensors_zeroed == zeroed
    assert torch.count_nonzero(leaf.state[param]["exp_avg"]) == 0


class RefusesReads:
    """An object whose every attribute read raises, as a lazy proxy's may."""

    def __getattr__(self, name: str) -> object:
        raise RuntimeError(f"no {name} here")


class ProxyHoldingAdam(torch.optim.Adam):
    proxy = RefusesReads()


def test_an_attribute_whose_own_reads_raise_is_a_definition_of_its_own_not_a_raw_error() -> None:
    """Telling torch's wrappers from a class's or instance's own code reads ``__func__`` and
    ``__wrapped__``: an object whose ``__getattr__`` raises made validate raise raw."""
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    by_class = ProxyHoldingAdam([param])
    by_instance = torch.optim.Adam([param])
    setattr(by_instance, "zero_grad", RefusesReads())
    for optimizer, name in ((by_class, "defines its own proxy"), (by_instance, "holds its own zero_grad on the instance")):
        optimizer.step()
        (problem,) = opttree.validate(optimizer)
        assert problem.kind is opttree.ProblemKind.UNSUPPORTED_OPTIMIZER and name in problem.message
        assert "step=1" in opttree.describe(optimizer)
        with pytest.raises(opttree.UnsupportedOptimizer):
            opttree.reset(optimizer)


class ListedKeys(dict[str, object]):
    """A param group whose ``keys()`` is a list, as Python 2's was."""

    def keys(self) -> list[str]:  # type: ignore[override]
        return list(super().keys())


class RefusingKeys(dict[str, object]):
    def keys(self) -> list[str]:  # type: ignore[override]
        raise RuntimeError("keys() refused")


class EveryKeyHeld(dict[str, object]):
    """A param group that says it holds every option (defaults filled in elsewhere)."""

    def __contains__(self, key: object) -> bool:
        return True


def adam_over(group_class: type[dict[str, object]]) -> tuple[torch.nn.Parameter, torch.optim.Adam]:
    param = torch.nn.Parameter(torch.randn(3))
    optimizer = torch.optim.Adam([param], lr=0.1)
    for _ in range(2):
        param.grad = torch.ones(3)
        optimizer.step()
    optimizer.param_groups[0] = group_class(optimizer.param_groups[0])
    param.grad = torch.ones(3)
    optimizer.step()  # torch steps with it
    return param, optimizer


@pytest.mark.parametrize("group_class", [ListedKeys, RefusingKeys, EveryKeyHeld])
def test_a_param_group_with_reads_of_its_own_is_reset_as_a_dict_holds_it(group_class: type[dict[str, object]]) -> None:
    """A dict subclass's own ``keys()`` raised a raw TypeError or its own error from the
    check for the factory's options; one whose ``__contains__`` holds every key made the
    reset plan to delete a step the group does not hold, and raise KeyError after zeroing
    the history. Each is read as the dict holds it: validated clean and reset."""
    param, optimizer = adam_over(group_class)

    assert opttree.validate(optimizer) == ()
    assert opttree.describe(optimizer)
    report = opttree.reset(optimizer)

    assert report.steps == 1 and not optimizer.state[param]["exp_avg"].any() and float(optimizer.state[param]["step"]) == 0
    assert not dict.__contains__(optimizer.param_groups[0], "step")


class ClassRaises:
    """An object whose ``__class__`` property raises: ``isinstance`` reads it where the
    object's type does not match."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: PLE0307
        raise RuntimeError("__class__ raised")


def members_of_none(stack: testing.MegatronStack) -> None:
    setattr(stack.optimizer, "chained_optimizers", None)


def member_that_is_itself(stack: testing.MegatronStack) -> None:
    getattr(stack.optimizer, "chained_optimizers").append(stack.optimizer)


def wrapper_holding_class_raises(stack: testing.MegatronStack) -> None:
    getattr(stack.optimizer, "chained_optimizers")[0].optimizer = ClassRaises()


SPOILED_STACKS = {
    "a chain of None": ("fp32", members_of_none, opttree.MalformedWrapper),
    "a chain holding itself": ("fp32", member_that_is_itself, opttree.OptimizerCycle),
    "a wrapper holding an object whose __class__ raises": ("fp32", wrapper_holding_class_raises, opttree.NotAnOptimizer),
}


@pytest.mark.parametrize("name", SPOILED_STACKS)
def test_validate_and_describe_report_a_spoiled_megatron_stack_that_reset_refuses(name: str) -> None:
    """Megatron's ``ChainedOptimizer.optimizer`` property reads its members: where they
    are not a list of optimizers it raises, and validate's stub check, reading it by
    ``getattr``, let that escape raw; an object whose ``__class__`` raises escaped it
    from ``isinstance``."""
    recipe, spoil, refusal = SPOILED_STACKS[name]
    stack = testing.build(recipe)
    stack.train(0, 1)
    spoil(stack)

    problems = opttree.validate(stack.optimizer)
    text = opttree.describe(stack.optimizer)
    with pytest.raises(refusal):
        opttree.reset(stack.optimizer)

    assert problems and "@ <root>" in text


def test_an_object_whose_class_raises_is_not_an_optimizer_everywhere() -> None:
    problems = opttree.validate(ClassRaises())
    assert [p.kind for p in problems] == [opttree.ProblemKind.NOT_AN_OPTIMIZER]
    assert "ClassRaises" in opttree.describe(ClassRaises())
    with pytest.raises(opttree.NotAnOptimizer, match="ClassRaises"):
        opttree.tree(ClassRaises())


@pytest.mark.parametrize("spoil", [lambda group: group.pop("params"), lambda group: group.__setitem__("params", 5)], ids=["no params", "params an int"])
def test_a_distributed_optimizers_inner_group_without_params_is_reported_not_raised(spoil: Callable[[dict[str, object]], object]) -> None:
    """The check of a precision-aware DistributedOptimizer's shards read its inner groups'
    ``params`` unguarded: validate, reset and prune raised a raw ``KeyError`` or ``TypeError``."""
    if "dist_bf16" not in testing.available():
        pytest.skip(testing.missing_feature("dist_bf16") or "")
    stack = testing.build("dist_bf16")
    stack.train(0, 1)
    (leaf,) = stack.leaves()
    spoil(leaf.param_groups[0])
    before = snapshot(leaf)

    problems = opttree.validate(stack.optimizer)
    for act in (opttree.reset, lambda optimizer: opttree.prune(optimizer, 0.5)):
        with pytest.raises(opttree.UnsupportedOptimizerState, match="param group 0 has no 'params' list"):
            act(stack.optimizer)

    assert [p.kind for p in problems] == [opttree.ProblemKind.MALFORMED_STATE]
    assert unchanged(leaf, before)
