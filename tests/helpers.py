"""Small real models and training loops shared by the tests."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import version

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import opttree
from opttree import testing
from opttree._held import OPTIMIZER_BOOKKEEPING

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def train(net: torch.nn.Module, optimizer: torch.optim.Optimizer, start: int, steps: int) -> None:
    """Deterministic steps: batch ``i`` is the same for every caller."""
    for i in range(start, start + steps):
        generator = torch.Generator().manual_seed(i)
        x = torch.randn(4, 6, generator=generator)
        optimizer.zero_grad()
        out: torch.Tensor = net(x)
        torch.autograd.backward(out.pow(2).mean())
        optimizer.step()


def clone_model(net: torch.nn.Module) -> torch.nn.Module:
    twin = model()
    twin.load_state_dict(net.state_dict())
    return twin


def weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def trains_as_fresh(
    net: torch.nn.Module, optimizer: torch.optim.Optimizer, build: Callable[[torch.nn.Module], torch.optim.Optimizer], start: int, steps: int
) -> bool:
    """Whether ``optimizer`` trains ``net`` as ``build`` builds a fresh one over a copy of it."""
    twin = clone_model(net)
    fresh = build(twin)
    train(net, optimizer, start, steps)
    train(twin, fresh, start, steps)
    return weights_equal(net, twin)


def trains_as_fresh_stack(stack: testing.MegatronStack, fresh: testing.MegatronStack, start: int, steps: int) -> bool:
    """Whether ``stack`` trains ``steps`` steps from batch ``start`` bitwise as ``fresh``, a
    stack built as it was, given its weights first."""
    fresh.copy_weights_from(stack)
    stack.train(start, steps)
    fresh.train(start, steps)
    return all(torch.equal(a, b) for a, b in zip(stack.main_params(), fresh.main_params(), strict=True))


def state_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    return [(k, v) for entry in optimizer.state.values() for k, v in entry.items() if isinstance(v, torch.Tensor)]


def snapshot(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    return [(k, v.clone()) for k, v in state_tensors(optimizer)]


def unchanged(optimizer: torch.optim.Optimizer, before: list[tuple[str, torch.Tensor]]) -> bool:
    after = state_tensors(optimizer)
    return len(after) == len(before) and all(
        k1 == k2 and torch.equal(v1, v2) for (k1, v1), (k2, v2) in zip(after, before, strict=True)
    )


def stepped_adamw(count: int, numel: int = 3) -> torch.optim.AdamW:
    """An AdamW over ``count`` new parameters of ``numel`` elements, after one step."""
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(count)]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.AdamW(params)
    optimizer.step()
    return optimizer


def stepped_pair(first: int = 3, second: int = 3) -> tuple[torch.optim.AdamW, torch.nn.Parameter, torch.nn.Parameter]:
    """An AdamW over two parameters of ones, of these sizes, stepped once with gradients of ones."""
    a, b = torch.nn.Parameter(torch.ones(first)), torch.nn.Parameter(torch.ones(second))
    optimizer = torch.optim.AdamW([a, b])
    a.grad, b.grad = torch.ones(first), torch.ones(second)
    optimizer.step()
    return optimizer, a, b


class RefuseCalls(TorchFunctionMode):
    """A torch function mode that refuses every torch call on the thread that enters it,
    ``torch.no_grad()``'s own included."""

    def __torch_function__(self, func: object, types: object, args: object = (), kwargs: object = None) -> object:
        raise AssertionError(f"this mode refuses {func}")


class Refuse(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode is unannotated
    """A dispatch mode that refuses every operation on the thread that enters it."""

    def __torch_dispatch__(self, func: object, types: object, args: object = (), kwargs: object = None) -> object:
        raise AssertionError(f"this mode refuses {func}")


def stepped_lbfgs() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An LBFGS over :func:`model` after two steps, its past directions in lists."""
    net = model()
    optimizer: torch.optim.Optimizer = torch.optim.LBFGS(net.parameters(), history_size=3, max_iter=4)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))

    def closure() -> float:
        optimizer.zero_grad()
        loss: torch.Tensor = net(x).pow(2).mean()
        torch.autograd.backward(loss)
        return float(loss)

    for _ in range(2):
        optimizer.step(closure)
    return net, optimizer


def refused_in_place(
    optimizer: torch.optim.Optimizer, key: str, match: str, kind: opttree.ProblemKind = opttree.ProblemKind.UNSUPPORTED_STATE
) -> opttree.Problem:
    """The one problem ``validate`` finds, of ``kind`` (an unsupported state) under ``key``,
    after checking that ``reset`` refuses it (``match``) with the state unchanged."""
    before = snapshot(optimizer)
    problems = opttree.validate(optimizer)
    assert [(p.kind, p.key) for p in problems] == [(kind, key)]
    with pytest.raises(opttree.UnsupportedOptimizerState, match=match):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)
    return problems[0]


def on_one_step(optimizer: torch.optim.Optimizer, share: Callable[[torch.Tensor], torch.Tensor] = lambda step: step) -> None:
    """Put every state entry of ``optimizer`` on its first entry's step tensor, as Megatron's
    CPU load path leaves them, or on what ``share`` makes of it (a view of its memory)."""
    entries = list(optimizer.state.values())
    for entry in entries[1:]:
        entry["step"] = share(entries[0]["step"])


def megatron_release() -> tuple[int, int]:
    """The installed megatron-core's (major, minor) release."""
    major, minor = version("megatron-core").split(".")[:2]
    return int(major), int(minor)


needs_dp_reshardable = pytest.mark.skipif(megatron_release() < (0, 16), reason="megatron-core before 0.16 has no dp_reshardable format")


def outside_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, str], list[dict[str, str]]]:
    """What an optimizer holds outside its state, as text: its instance attributes beyond
    torch's bookkeeping, and each param group's options but its parameters. A step that
    changes either keeps a count where a reset does not look (see the catalogue tests)."""
    attributes = {name: repr(value) for name, value in vars(optimizer).items() if name not in OPTIMIZER_BOOKKEEPING}
    groups = [{key: repr(value) for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    return attributes, groups


class HomeMade(torch.optim.Optimizer):
    """A home-made optimizer of the tests: each parameter's entry built at its first step
    (:meth:`build`), then updated with the parameter (:meth:`update`)."""

    def __init__(self, params: object, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})  # type: ignore[arg-type]

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    self.build(state, p)
                self.update(state, p, group["lr"])

    def build(self, state: dict[str, torch.Tensor], p: torch.Tensor) -> None:
        raise NotImplementedError

    def update(self, state: dict[str, torch.Tensor], p: torch.Tensor, lr: float) -> None:
        raise NotImplementedError
