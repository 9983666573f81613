"""Step hooks run inside ``step()``: an optimizer holding one opttree does not know (its
own or torch's global ones) is refused with nothing changed, as an instance's own ``step``
is; Megatron's own hooks and those a user declares are reset as any other."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterator
from typing import cast

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import opttree
from opttree import _hooks, testing
from tests.helpers import snapshot, unchanged


@pytest.fixture(autouse=True)
def no_registered_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_hooks, "_registered", set())


def warm_start(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    """Starts Adam's moments from the first gradient where an entry is still empty."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None and not optimizer.state[param]:
                optimizer.state[param].update(
                    step=torch.tensor(0.0), exp_avg=param.grad.clone(), exp_avg_sq=param.grad.square()
                )


def logged(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    """Touches no state."""


def trained(seed: int = 0, *hooks: Callable[[torch.optim.Optimizer, object, object], None]) -> torch.optim.Adam:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=generator)) for _ in range(2)]
    optimizer = torch.optim.Adam(params, lr=0.1)
    for hook in hooks:
        optimizer.register_step_pre_hook(hook)
    train(optimizer, 3)
    return optimizer


def train(optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        for index, param in enumerate(optimizer.param_groups[0]["params"]):
            param.grad = torch.full_like(param, 0.1 * (step + 1 + index))
        optimizer.step()


def fresh_like(optimizer: torch.optim.Optimizer, *hooks: Callable[[torch.optim.Optimizer, object, object], None]) -> torch.optim.Adam:
    params = [torch.nn.Parameter(p.detach().clone()) for p in optimizer.param_groups[0]["params"]]
    fresh = torch.optim.Adam(params, lr=0.1)
    for hook in hooks:
        fresh.register_step_pre_hook(hook)
    return fresh


def same_params(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.param_groups[0]["params"], b.param_groups[0]["params"], strict=True))


def test_a_hook_that_builds_state_is_refused_and_a_reset_by_hand_is_not_exact() -> None:
    optimizer = trained(0, warm_start)
    before = snapshot(optimizer)

    (problem,) = opttree.validate(optimizer)
    assert problem.kind is opttree.ProblemKind.UNSUPPORTED_OPTIMIZER and problem.cls == "Adam"
    assert "its step pre-hook tests.test_step_hooks.warm_start runs inside its step" in problem.message
    with pytest.raises(opttree.UnsupportedOptimizer, match="register_step_hook"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)

    fresh = fresh_like(optimizer, warm_start)
    for entry in optimizer.state.values():  # what opttree would do, were the hook not there
        for value in entry.values():
            value.zero_()
    train(optimizer, 2)
    train(fresh, 2)
    assert not same_params(optimizer, fresh)  # the hook warm-started the fresh one only


def test_a_declared_hook_is_reset_as_any_other_and_trains_as_a_fresh_optimizer() -> None:
    optimizer = trained(0, logged)
    with pytest.raises(opttree.UnsupportedOptimizer, match="its step pre-hook tests.test_step_hooks.logged"):
        opttree.reset(optimizer)

    opttree.register_step_hook(logged)
    assert opttree.validate(optimizer) == ()
    opttree.reset(optimizer)
    fresh = fresh_like(optimizer, logged)
    train(optimizer, 2)
    train(fresh, 2)
    assert same_params(optimizer, fresh)


def test_a_hook_defined_again_under_a_declared_ones_name_is_a_hook_of_its_own() -> None:
    """A notebook cell run again with a counting body defines a new function under the
    declared one's module and qualified name: it was taken as declared, and the reset kept
    its count. Declared hooks are known by their code, which every closure of one def
    shares and a new def does not."""
    opttree.register_step_hook(logged)
    namespace: dict[str, object] = {"__name__": __name__}
    exec("def logged(optimizer, args, kwargs):\n    optimizer.warm_steps = getattr(optimizer, 'warm_steps', 0) + 1\n", namespace)
    again = cast(Callable[[torch.optim.Optimizer, object, object], None], namespace["logged"])
    assert (again.__module__, again.__qualname__) == (logged.__module__, logged.__qualname__)
    optimizer = trained(0, again)
    before = snapshot(optimizer)

    with pytest.raises(opttree.UnsupportedOptimizer, match="its step pre-hook tests.test_step_hooks.logged runs inside its step"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)
    assert opttree.validate(trained(0, logged)) == ()


class Counter:
    def __init__(self) -> None:
        self.steps = 0

    def count(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        self.steps += 1


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: Counter().count, "tests.test_step_hooks.Counter.count"),
        (lambda: functools.partial(Counter.count, Counter()), "tests.test_step_hooks.Counter.count"),
    ],
    ids=["bound-method", "partial"],
)
def test_post_hooks_bound_methods_and_partials_are_known_by_their_function(
    make: Callable[[], Callable[[torch.optim.Optimizer, object, object], None]], name: str
) -> None:
    optimizer = trained()
    optimizer.register_step_post_hook(make())
    with pytest.raises(opttree.UnsupportedOptimizer, match=f"its step post-hook {name} runs"):
        opttree.reset(optimizer)
    opttree.register_step_hook(make())  # another instance's: the same function
    opttree.reset(optimizer)


@pytest.fixture
def global_hooks() -> Iterator[list[torch.utils.hooks.RemovableHandle]]:
    handles: list[torch.utils.hooks.RemovableHandle] = []
    yield handles
    for handle in handles:
        handle.remove()


def test_a_global_hook_refuses_every_optimizer_until_it_is_removed_or_declared(global_hooks: list[torch.utils.hooks.RemovableHandle]) -> None:
    optimizer = trained()
    handle = register_optimizer_step_pre_hook(warm_start)
    global_hooks.append(handle)

    (problem,) = opttree.validate(optimizer)
    assert "torch's global step pre-hook tests.test_step_hooks.warm_start runs inside every optimizer's step" in problem.message
    before = snapshot(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizer):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)

    handle.remove()
    assert opttree.validate(optimizer) == ()


def test_torchs_profiler_hook_is_known(global_hooks: list[torch.utils.hooks.RemovableHandle]) -> None:
    """torch.profiler registers it where Kineto's daemon runs: it counts steps for it."""
    import torch.profiler

    global_hooks.append(register_optimizer_step_post_hook(torch.profiler._optimizer_post_hook))
    optimizer = trained()
    assert opttree.validate(optimizer) == ()
    opttree.reset(optimizer)


def test_hooks_torch_cannot_hold_as_it_does_are_refused_and_never_raise() -> None:
    optimizer = trained()
    optimizer._optimizer_step_pre_hooks = ["not", "a", "dict"]  # type: ignore[assignment]
    (problem,) = opttree.validate(optimizer)
    assert "its step pre-hooks, held in a list where torch holds a dict, run inside its step" in problem.message
    assert "Adam" in opttree.describe(optimizer)


def test_register_step_hook_refuses_what_it_cannot_know() -> None:
    """A callable object of a class written in C runs a ``__call__`` that has no module."""
    with pytest.raises(opttree.RegistrationError, match="takes the hook function, got an int"):
        opttree.register_step_hook(3)  # type: ignore[arg-type]
    with pytest.raises(opttree.RegistrationError, match="runs a function that has no module and qualified name"):
        opttree.register_step_hook(operator.attrgetter("state"))


class Timed:
    """A step pre-hook written as a class: it times steps, building, changing and counting no state."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        self.calls += 1


class TimedToo(Timed):
    """Inherits ``Timed.__call__``: its instances run that function."""


@pytest.mark.parametrize("declared", [Timed.__call__, Timed()], ids=["its-class-call", "another-instance"])
def test_a_callable_object_hook_is_known_by_its_classs_call(declared: Callable[..., None]) -> None:
    """A callable object runs its class's ``__call__``, as its bound ``__call__`` would: the
    refusal names that function, and declaring it, or any instance, declares every instance."""
    optimizer = trained(0, Timed(), TimedToo())
    before = snapshot(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizer, match="its step pre-hook tests.test_step_hooks.Timed.__call__ runs"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)

    opttree.register_step_hook(declared)
    assert opttree.validate(optimizer) == ()
    opttree.reset(optimizer)
    fresh = fresh_like(optimizer, Timed(), TimedToo())
    train(optimizer, 2)
    train(fresh, 2)
    assert same_params(optimizer, fresh)


def test_a_callable_objects_own_attributes_do_not_name_it() -> None:
    """What an object runs is its class's ``__call__``: an attribute it holds under
    ``__func__`` (or ``__call__``) is not what it runs, and declares nothing."""
    hook = Timed()
    hook.__func__ = logged  # type: ignore[attr-defined]
    hook.__call__ = logged  # type: ignore[method-assign]
    opttree.register_step_hook(logged)
    optimizer = trained(0, hook)
    with pytest.raises(opttree.UnsupportedOptimizer, match="its step pre-hook tests.test_step_hooks.Timed.__call__ runs"):
        opttree.reset(optimizer)


Hook = Callable[[torch.optim.Optimizer, object, object], None]


def warming(hook: Hook) -> Hook:
    """A decorator that copies ``hook``'s names onto a wrapper that builds state first."""

    @functools.wraps(hook)
    def wrapper(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        warm_start(optimizer, args, kwargs)
        hook(optimizer, args, kwargs)

    return wrapper


def test_a_wrapper_that_functools_wraps_a_declared_hook_is_a_hook_of_its_own() -> None:
    """``functools.wraps`` gives the wrapper the declared hook's ``__module__`` and
    ``__qualname__``: known by those, it passed as the declared hook, and the state it
    builds made training after a reset unlike a fresh optimizer's with the same hook."""
    opttree.register_step_hook(logged)
    hook = warming(logged)
    assert (hook.__module__, hook.__qualname__) == (logged.__module__, logged.__qualname__)
    optimizer = trained(0, hook)
    before = snapshot(optimizer)

    with pytest.raises(opttree.UnsupportedOptimizer, match=r"its step pre-hook tests.test_step_hooks.warming.<locals>.wrapper around tests.test_step_hooks.logged runs"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)

    with torch.no_grad():  # the other side: what that reset would have done, in place
        for entry in optimizer.state.values():
            for value in entry.values():
                value.zero_()
    fresh = fresh_like(optimizer, hook)
    train(optimizer, 2)
    train(fresh, 2)
    assert not same_params(optimizer, fresh)


@pytest.mark.parametrize("decorate", [warming, torch.no_grad()], ids=["functools.wraps", "torch.no_grad"])
def test_one_decorators_wrappers_of_two_hooks_are_two_hooks(decorate: Callable[[Hook], Hook]) -> None:
    """A wrapper is known by its own code and by the function it wraps: declaring one
    hook under a decorator declares neither that decorator's other wrappers (which were
    all one, by its code alone) nor the hook unwrapped."""
    declared, other = decorate(logged), decorate(warm_start)
    opttree.register_step_hook(declared)
    assert opttree.validate(trained(0, declared)) == ()
    with pytest.raises(opttree.UnsupportedOptimizer, match=r"around tests.test_step_hooks.warm_start runs"):
        opttree.reset(trained(0, other))
    with pytest.raises(opttree.UnsupportedOptimizer, match=r"its step pre-hook tests.test_step_hooks.logged runs"):
        opttree.reset(trained(0, logged))


@pytest.mark.parametrize("name", [n for n in ("offload_0.75", "offload_1.0") if n in testing.available()])
def test_megatrons_hybrid_optimizer_hooks_are_known(name: str) -> None:
    """A HybridDeviceOptimizer registers a post-hook on each sub-optimizer that copies its
    parameters back: it touches no optimizer state."""
    stack = testing.build(name)
    stack.train(0, 2)
    assert any(leaf._optimizer_step_post_hooks for leaf in stack.leaves())
    assert not opttree.validate(stack.optimizer)
    opttree.reset(stack.optimizer)


def test_a_hook_on_a_hybrid_optimizer_itself_is_refused() -> None:
    """A HybridDeviceOptimizer is a torch optimizer too: its own ``step()`` runs its hooks
    around its sub-optimizers' steps."""
    if "offload_1.0" not in testing.available():
        pytest.skip("no HybridDeviceOptimizer recipe in this lane")
    stack = testing.build("offload_1.0")
    stack.train(0, 2)
    (node,) = _hybrid_nodes(opttree.tree(stack.optimizer))
    node.optimizer.register_step_pre_hook(warm_start)
    before = [snapshot(leaf) for leaf in stack.leaves()]

    (problem,) = opttree.validate(stack.optimizer)
    assert problem.cls == "HybridDeviceOptimizer" and "its step pre-hook tests.test_step_hooks.warm_start" in problem.message
    with pytest.raises(opttree.UnsupportedOptimizer):
        opttree.reset(stack.optimizer)
    assert all(unchanged(leaf, snap) for leaf, snap in zip(stack.leaves(), before, strict=True))


def _hybrid_nodes(node: opttree.Node) -> Iterator[opttree.HybridNode]:
    if isinstance(node, opttree.HybridNode):
        yield node
    for child in node.children:
        yield from _hybrid_nodes(child)


def test_a_hook_on_one_of_many_alike_sub_optimizers_is_named_at_its_path() -> None:
    """Sibling leaves of one class are checked as a run at once: a hook on one of them
    sends the run leaf by leaf, which names that leaf."""
    if "offload_1.0" not in testing.available():
        pytest.skip("no HybridDeviceOptimizer recipe in this lane")
    stack = testing.build("offload_1.0")
    stack.train(0, 2)
    leaves = stack.leaves()
    assert len(leaves) > 2
    leaves[2].register_step_post_hook(logged)

    (problem,) = opttree.validate(stack.optimizer)
    assert problem.path.endswith("sub_optimizers[2]") and "its step post-hook tests.test_step_hooks.logged" in problem.message
    opttree.register_step_hook(logged)
    assert not opttree.validate(stack.optimizer)


def test_a_lambda_cannot_be_declared_every_lambda_of_its_module_shares_its_name() -> None:
    harmless = lambda optimizer, args, kwargs: None  # noqa: E731
    with pytest.raises(opttree.RegistrationError, match=r"<locals>.<lambda> is known by a name that every <lambda> defined there shares"):
        opttree.register_step_hook(harmless)
    optimizer = trained()
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: warm_start(opt, args, kwargs))
    with pytest.raises(opttree.UnsupportedOptimizer, match=r"its step pre-hook tests.test_step_hooks.test_a_lambda\w+.<locals>.<lambda> runs"):
        opttree.reset(optimizer)


class Stepping(torch.optim.Optimizer):
    """A user's wrapper that is a torch optimizer too: its ``step()`` runs its own hooks
    around its inner optimizer's step."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        super().__init__([p for group in inner.param_groups for p in group["params"]], {})

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        self.inner.step()


opttree.register_wrapper(Stepping, children=lambda wrapper: [("inner", wrapper.inner)])


def test_a_registered_wrapper_that_is_a_torch_optimizer_has_its_own_hooks_checked() -> None:
    wrapper = Stepping(trained())

    def warm_inner(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        warm_start(wrapper.inner, args, kwargs)

    wrapper.register_step_pre_hook(warm_inner)
    before = snapshot(wrapper.inner)
    (problem,) = opttree.validate(wrapper)
    assert problem.cls == "Stepping" and "its step pre-hook tests.test_step_hooks." in problem.message
    with pytest.raises(opttree.UnsupportedOptimizer):
        opttree.reset(wrapper)
    assert unchanged(wrapper.inner, before)


def test_the_refusal_of_a_lambda_hook_says_how_to_declare_it() -> None:
    """register_step_hook refuses a lambda (every lambda there shares its name): the reset's
    advice to declare it said what could not be done."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(3)
    optimizer.step()
    handle = optimizer.register_step_pre_hook(lambda opt, args, kwargs: None)
    try:
        with pytest.raises(opttree.UnsupportedOptimizer, match=r"it cannot be declared as it is \(.*<lambda> is known by a name that every <lambda> defined there shares.*give the hook a def of its own\), then declare that with opttree\.register_step_hook"):
            opttree.reset(optimizer)
    finally:
        handle.remove()
