"""A class opttree knows, patched in place (``torch.optim.AdamW.step = warmed_step``): the
code it runs is no longer the code whose state its schema or wrapper kind describes."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch

import opttree
from opttree.testing import build, is_available
from tests.helpers import model, snapshot, train, unchanged

_ORIGINAL_STEP = torch.optim.AdamW.step
_calls: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


@functools.wraps(_ORIGINAL_STEP)
def warmed_step(self: torch.optim.AdamW, closure: Callable[[], float] | None = None) -> float | None:
    """A warm-up kept outside the optimizer's state: its first two steps at a tenth of the lr."""
    count = _calls.get(self, 0)
    _calls[self] = count + 1
    scale = 0.1 if count < 2 else 1.0
    for group in self.param_groups:
        group["lr"] *= scale
    try:
        loss: float | None = _ORIGINAL_STEP(self, closure)
        return loss
    finally:
        for group in self.param_groups:
            group["lr"] /= scale


@pytest.fixture
def patched_adamw(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(torch.optim.AdamW, "step", warmed_step)
    yield


def by_hand(optimizer: torch.optim.Optimizer) -> None:
    """What a reset of AdamW's state does, written out: its moments and steps zeroed."""
    with torch.no_grad():
        for entry in optimizer.state.values():
            for value in entry.values():
                value.zero_()


@pytest.mark.usefixtures("patched_adamw")
def test_a_patched_step_of_a_known_class_is_refused_with_nothing_changed() -> None:
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train(net, optimizer, 0, 3)
    before = snapshot(optimizer)

    (problem,) = opttree.validate(optimizer)
    assert problem.kind is opttree.ProblemKind.UNSUPPORTED_OPTIMIZER
    assert "torch.optim.adamw.AdamW.step runs code from" in problem.message and __file__ in problem.message
    with pytest.raises(opttree.UnsupportedOptimizer, match="a patch of a class whose state opttree knows"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)


@pytest.mark.usefixtures("patched_adamw")
def test_the_patch_keeps_state_that_a_reset_of_the_schemas_keys_would_keep() -> None:
    """Why it is refused: the state of the optimizer's own keys reset, a patched optimizer
    still trains unlike a fresh one (its warm-up is spent)."""
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train(net, optimizer, 0, 3)
    by_hand(optimizer)
    twin = model()
    twin.load_state_dict(net.state_dict())
    fresh = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    train(net, optimizer, 3, 2)
    train(twin, fresh, 3, 2)
    assert not all(torch.equal(a, b) for a, b in zip(net.parameters(), twin.parameters(), strict=True))


def test_a_patched_method_of_a_base_refuses_every_class_below_it(monkeypatch: pytest.MonkeyPatch) -> None:
    original = torch.optim.Optimizer.zero_grad

    def counted_zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        original(self, set_to_none)

    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", counted_zero_grad)
    for cls in (torch.optim.SGD, torch.optim.Adam):
        optimizer = cls(model().parameters(), lr=1e-2)
        (problem,) = opttree.validate(optimizer)
        assert "torch.optim.optimizer.Optimizer.zero_grad runs code from" in problem.message


@pytest.mark.skipif(not is_available("fp32"), reason="no Megatron optimizer in this lane")
def test_a_patched_method_of_a_megatron_wrapper_kind_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    stack = build("fp32")
    stack.train(0, 2)
    wrapper = type(stack.optimizer)
    original = wrapper.step

    def step(self: object) -> object:
        return original(self)  # type: ignore[arg-type]

    monkeypatch.setattr(wrapper, "step", step)
    problems = opttree.validate(stack.optimizer)
    assert [p.kind for p in problems] == [opttree.ProblemKind.UNKNOWN_WRAPPER]
    assert f"{wrapper.__module__}.{wrapper.__qualname__}.step runs code from" in problems[0].message
    with pytest.raises(opttree.UnknownWrapper, match="a patch of a wrapper kind opttree knows"):
        opttree.reset(stack.optimizer)


def test_torchs_own_deprecation_wrapper_is_not_a_patch() -> None:
    """``Optimizer._cuda_graph_capture_health_check`` is wrapped by
    ``typing_extensions.deprecated``, whose code lies outside torch: it warns, then runs
    torch's function."""
    method = vars(torch.optim.Optimizer).get("_cuda_graph_capture_health_check")
    wrapped = getattr(method, "__wrapped__", None)
    if wrapped is None:
        pytest.skip("this torch does not wrap it")
    assert "typing_extensions" in method.__code__.co_filename  # type: ignore[union-attr]
    assert opttree.validate(torch.optim.Adam(model().parameters())) == ()


_PATCHED_ADAMW = """
import functools, torch, opttree
original = torch.optim.AdamW.step

@functools.wraps(original)
def logged_step(self, closure=None):
    return original(self, closure)

torch.optim.AdamW.step = logged_step
"""
"""AdamW's step patched from outside torch: the start of each script run apart."""


def run_apart(script: str, oks: int) -> None:
    """Run ``script`` after :data:`_PATCHED_ADAMW` in a process of its own (registrations
    last the process), and check that it printed ``ok`` ``oks`` times."""
    done = subprocess.run([sys.executable, "-c", _PATCHED_ADAMW + textwrap.dedent(script)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok"] * oks


def test_a_patched_class_registered_by_the_user_is_reset_exactly() -> None:
    """The refusal names the way out: the user's registration of the class's schema (or,
    for a wrapper, of its kind), their word that the patch keeps no state. That word is
    for the class: a subclass with a method of its own stays refused, a leaf's or a
    wrapper's (it was accepted, and an AdamW subclass's reset trained unlike a fresh one).
    Registrations last the process, so it runs apart."""
    run_apart(
        """
        from tests.helpers import model, train, trains_as_fresh
        net = model()
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
        train(net, optimizer, 0, 3)
        assert opttree.validate(optimizer)
        opttree.register_schema(torch.optim.AdamW, opttree.schema_for(torch.optim.AdamW))
        assert opttree.validate(optimizer) == ()
        opttree.reset(optimizer)
        assert trains_as_fresh(net, optimizer, lambda twin: torch.optim.AdamW(twin.parameters(), lr=1e-2), 3, 3)
        print("ok")

        class FloorAdamW(torch.optim.AdamW):  # its second moment starts at a floor, not at zero
            def _init_group(self, group, *args):
                new = [p for p in group["params"] if p.grad is not None and len(self.state[p]) == 0]
                built = super()._init_group(group, *args)
                for p in new:
                    self.state[p]["exp_avg_sq"].fill_(1e-4)
                return built

        floor_net = model()
        floored = FloorAdamW(floor_net.parameters(), lr=1e-2)
        train(floor_net, floored, 0, 3)
        problems = opttree.validate(floored)  # AdamW's registration vouches for AdamW, not for this
        assert [p.kind.value for p in problems] == ["unsupported-optimizer"], problems
        assert "FloorAdamW defines its own _init_group" in problems[0].message, problems[0].message
        opttree.register_schema(FloorAdamW, opttree.schema_for(torch.optim.AdamW))  # the user's word, wrong here
        opttree.reset(floored)
        assert not trains_as_fresh(floor_net, floored, lambda twin: FloorAdamW(twin.parameters(), lr=1e-2), 3, 3)
        print("ok")

        from opttree.testing import build
        stack = build("dist_fp32")
        stack.train(0, 2)
        member = type(stack.optimizer.chained_optimizers[0])
        member_step = member.step
        member.step = lambda self: member_step(self)
        assert [p.kind.value for p in opttree.validate(stack.optimizer)] == ["unknown-wrapper"]
        opttree.register_wrapper(member, children=lambda w: [("optimizer", w.optimizer)])
        assert opttree.validate(stack.optimizer) == ()
        opttree.reset(stack.optimizer)
        fresh = build("dist_fp32")
        fresh.copy_weights_from(stack)
        stack.train(2, 2)
        fresh.train(2, 2)
        assert all(torch.equal(a, b) for a, b in zip(stack.main_params(), fresh.main_params(), strict=True))
        print("ok")

        class Counting(member):  # a method of its own, which the registration of its base does not vouch for
            def count(self):
                return None

        counted = build("dist_fp32")
        counted.train(0, 2)
        counted.optimizer.chained_optimizers[0].__class__ = Counting
        problems = opttree.validate(counted.optimizer)
        assert problems[0].kind.value == "unknown-wrapper", problems
        assert "Counting defines its own count" in problems[0].message, problems[0].message
        print("ok")
        """,
        oks=4,
    )


def test_a_registration_vouches_for_its_own_class_not_a_patched_subclass_nor_an_instance() -> None:
    """A registration is the user's word for the class it names: Adam's is not for a patch
    of AdamW (a subclass), MegatronOptimizer's not for a patch of
    Float16OptimizerWithFloat16Params, and AdamW's not for a step set on one AdamW.
    Each was accepted, and trained unlike a fresh optimizer. Registrations last the
    process, so it runs apart."""
    run_apart(
        """
        import types
        from megatron.core.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params, MegatronOptimizer
        from opttree import testing
        from tests.helpers import model, train
        opttree.register_schema(torch.optim.Adam, opttree.schema_for(torch.optim.Adam))
        problems = opttree.validate(torch.optim.AdamW(model().parameters()))
        assert [p.kind.value for p in problems] == ["unsupported-optimizer"] and "AdamW.step runs code from" in problems[0].message, problems
        torch.optim.AdamW.step = original
        print("ok")

        opttree.register_schema(torch.optim.AdamW, opttree.schema_for(torch.optim.AdamW))
        net = model()
        optimizer = torch.optim.AdamW(net.parameters())
        train(net, optimizer, 0, 2)
        optimizer.step = types.MethodType(lambda self, closure=None: original(self, closure), optimizer)
        problems = opttree.validate(optimizer)
        assert [p.kind.value for p in problems] == ["unsupported-optimizer"] and "holds its own step on the instance" in problems[0].message, problems
        print("ok")

        member_step = Float16OptimizerWithFloat16Params.step_with_ready_grads
        Float16OptimizerWithFloat16Params.step_with_ready_grads = lambda self: member_step(self)
        opttree.register_wrapper(
            MegatronOptimizer,
            children=lambda w: [(f"chained[{i}]", m) for i, m in enumerate(w.chained_optimizers)] if isinstance(w, ChainedOptimizer) else [("optimizer", w.optimizer)],
        )
        stack = testing.build("bf16")
        stack.train(0, 2)
        problems = opttree.validate(stack.optimizer)
        assert "unknown-wrapper" in [p.kind.value for p in problems], problems
        print("ok")
        """,
        oks=3,
    )


def _function_from(path: str, name: str) -> Callable[..., object]:
    """A function whose code says it lies in ``path``, as one defined in that file would."""
    namespace: dict[str, object] = {}
    exec(compile(f"def {name}(self, *args, **kwargs):\n    return None\n", path, "exec"), namespace)  # noqa: S102
    function = namespace[name]
    assert callable(function)
    return function


@pytest.mark.skipif(not is_available("fp32"), reason="no Megatron optimizer in this lane")
def test_a_patch_from_another_distribution_under_the_megatron_namespace_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """``megatron`` is a namespace: megatron-core ships ``megatron.core``, and other
    distributions (Megatron-Bridge's ``megatron.bridge``) install beside it. Their code is
    not megatron-core's."""
    import megatron.core

    stack = build("fp32")
    stack.train(0, 2)
    member = type(getattr(stack.optimizer, "chained_optimizers")[0])
    beside = os.path.join(os.path.dirname(os.path.dirname(megatron.core.__file__ or "")), "bridge", "patches.py")
    monkeypatch.setattr(member, "step_with_ready_grads", _function_from(beside, "step_with_ready_grads"))
    (problem,) = opttree.validate(stack.optimizer)
    assert problem.kind is opttree.ProblemKind.UNKNOWN_WRAPPER and beside in problem.message


@pytest.mark.skipif(not is_available("fp32"), reason="no Megatron optimizer in this lane")
def test_megatron_installed_editable_is_megatrons_own_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """An editable install (``pip install -e`` of a Megatron-LM checkout) gives the
    ``megatron`` namespace a placeholder ``__path__`` naming no directory: Megatron's own
    methods were taken for patches, and every Megatron stack refused."""
    import megatron

    from opttree import _overrides

    monkeypatch.setattr(megatron, "__path__", ["__editable___megatron_core_finder.__path_hook__"])
    monkeypatch.setattr(_overrides, "_places", {})
    stack = build("fp32")
    stack.train(0, 2)
    assert opttree.validate(stack.optimizer) == ()


class _SealedProperty(property):
    """A property whose accessors cannot be read: what it runs cannot be told."""

    def __getattribute__(self, name: str) -> object:
        if name in ("fget", "fset", "fdel"):
            raise RuntimeError("sealed")
        return super().__getattribute__(name)


def test_a_descriptor_whose_accessors_cannot_be_read_is_a_patch_not_a_raw_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.optim.Optimizer, "lr_of_first_group", _SealedProperty(lambda self: 0.1), raising=False)
    optimizer = torch.optim.AdamW(model().parameters())
    (problem,) = opttree.validate(optimizer)
    assert "Optimizer.lr_of_first_group runs code from a descriptor whose attributes cannot be read" in problem.message
    with pytest.raises(opttree.UnsupportedOptimizer):
        opttree.reset(optimizer)


class _StepObject:
    """A callable object set as ``step``: binds as a method would, and runs the warm-up."""

    def __get__(self, optimizer: torch.optim.AdamW | None, owner: type | None = None) -> object:
        return self if optimizer is None else functools.partial(warmed_step, optimizer)

    def __call__(self, optimizer: torch.optim.AdamW, closure: Callable[[], float] | None = None) -> float | None:
        return warmed_step(optimizer, closure)


@pytest.mark.parametrize("patch", [functools.partialmethod(warmed_step), _StepObject()], ids=["partialmethod", "callable-object"])
def test_a_patch_set_as_another_kind_of_callable_is_found(patch: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Set as a ``functools.partialmethod`` (whose binding is the standard library's code,
    holding the warm-up in its closure) or as a callable object of a class of its own,
    the warm-up patch passed, and the reset trained unlike a fresh optimizer."""
    monkeypatch.setattr(torch.optim.AdamW, "step", patch)
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train(net, optimizer, 0, 3)
    (problem,) = opttree.validate(optimizer)
    assert "torch.optim.adamw.AdamW.step runs code from" in problem.message and __file__ in problem.message


class _Hop:
    """A wrapper without code of its own, as ``functools.lru_cache``'s is: it names what it
    wraps as ``__wrapped__``."""

    def __init__(self, inner: object) -> None:
        self.__wrapped__ = inner


class _CallingHop(_Hop):
    """A wrapper that names torch's step as ``__wrapped__`` but runs code of its own first."""

    def __call__(self, *args: object) -> object:
        return None


def test_a_chain_of_wrappers_longer_than_opttree_follows_counts_as_a_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty wrappers around torch's own step: past the sixteen opttree follows, what the
    chain runs is not known, so it is refused, not taken for torch's code."""
    chained: object = torch.optim.AdamW.step
    for _ in range(20):
        chained = _Hop(chained)
    monkeypatch.setattr(torch.optim.AdamW, "step", chained)
    optimizer = torch.optim.AdamW(model().parameters())

    (problem,) = opttree.validate(optimizer)

    assert "torch.optim.adamw.AdamW.step runs code from <a chain of more than 16 wrappers>" in problem.message
    with pytest.raises(opttree.UnsupportedOptimizer):
        opttree.reset(optimizer)


def test_a_wrapper_with_a_call_of_its_own_is_its_own_code_whatever_it_wraps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.optim.AdamW, "step", _CallingHop(torch.optim.AdamW.step))
    optimizer = torch.optim.AdamW(model().parameters())

    (problem,) = opttree.validate(optimizer)

    assert "torch.optim.adamw.AdamW.step runs code from" in problem.message and __file__ in problem.message
