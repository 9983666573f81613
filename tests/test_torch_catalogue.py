"""Every torch.optim class, with the flags that change how it keeps or steps its state:
after ``opttree.reset``, 3 steps train bitwise like a fresh optimizer's 3 steps, while the
same optimizer not reset trains differently (so the reset is what makes them equal). The
same holds after ``reset(..., release=True)``, which deletes the state instead, for every
class but Adagrad, which builds its state in ``__init__`` and is refused.

With ``OPTTREE_CONFORMANCE=file`` each case appends a JSON line (class, flags, lane,
result) to ``file``; ``scripts/conformance`` runs this in both lanes and prints the
README's table from those lines.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Callable, Iterator

from importlib.metadata import version

import pytest
import torch

import opttree

Flags = dict[str, object]

CASES: list[tuple[str, Flags]] = [
    ("Adam", {}),
    ("Adam", {"foreach": True, "amsgrad": True}),
    ("Adam", {"fused": True}),
    ("Adam", {"maximize": True, "weight_decay": 0.1}),
    ("Adam", {"capturable": True}),
    ("AdamW", {"foreach": False}),
    ("AdamW", {"amsgrad": True, "fused": True}),
    ("Adamax", {"foreach": True}),
    ("Adamax", {"foreach": False, "maximize": True}),
    ("NAdam", {"momentum_decay": 0.01}),
    ("NAdam", {"decoupled_weight_decay": True, "weight_decay": 0.1, "foreach": False}),
    ("RAdam", {}),
    ("RAdam", {"decoupled_weight_decay": True, "weight_decay": 0.1, "foreach": False}),
    ("Adagrad", {"initial_accumulator_value": 0.3, "lr_decay": 0.01}),
    ("Adagrad", {"initial_accumulator_value": 0.1, "fused": True}),
    ("Adadelta", {}),
    ("Adadelta", {"foreach": False, "maximize": True}),
    ("RMSprop", {}),
    ("RMSprop", {"centered": True, "momentum": 0.9}),
    ("RMSprop", {"centered": True, "momentum": 0.9, "foreach": False}),
    ("Rprop", {}),
    ("Rprop", {"foreach": False, "maximize": True}),
    ("ASGD", {"t0": 1.0}),
    ("ASGD", {"t0": 1.0, "foreach": False}),
    ("SGD", {"momentum": 0.9}),
    ("SGD", {"momentum": 0.9, "nesterov": True, "foreach": False}),
    ("SGD", {"momentum": 0.9, "fused": True}),
    ("LBFGS", {"history_size": 3, "max_iter": 3}),
    ("LBFGS", {"history_size": 3, "max_iter": 3, "line_search_fn": "strong_wolfe"}),
    ("SparseAdam", {}),
    ("Adafactor", {}),
    ("Adafactor", {"maximize": True, "foreach": True}),
    ("Muon", {}),
    ("Muon", {"nesterov": False}),
]

LR = {"Adagrad": 0.1, "LBFGS": 0.1, "Adadelta": 1.0}
NOT_RELEASABLE = {"Adagrad"}


def lane() -> str:
    return f"python {sys.version_info.major}.{sys.version_info.minor}, torch {torch.__version__.split('+')[0]}, megatron-core {version('megatron-core')}"


def model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "SparseAdam":
        return torch.nn.Embedding(10, 3, sparse=True)
    bias = name != "Muon"  # Muon steps matrices only
    return torch.nn.Sequential(torch.nn.Linear(4, 3, bias=bias), torch.nn.Tanh(), torch.nn.Linear(3, 2, bias=bias))


def train(name: str, net: torch.nn.Module, optimizer: torch.optim.Optimizer, start: int, steps: int) -> None:
    for i in range(start, start + steps):
        generator = torch.Generator().manual_seed(i)

        def loss() -> float:
            optimizer.zero_grad()
            if name == "SparseAdam":
                out: torch.Tensor = net(torch.randint(0, 10, (6,), generator=generator))
            else:
                out = net(torch.randn(5, 4, generator=generator))
            value = (out - 0.5).pow(2).mean()
            torch.autograd.backward(value)
            return float(value)

        if name == "LBFGS":
            optimizer.step(loss)
        else:
            loss()
            optimizer.step()


def build(name: str, flags: Flags) -> Callable[[torch.nn.Module], torch.optim.Optimizer]:
    cls = getattr(torch.optim, name)
    return lambda net: cls(net.parameters(), lr=LR.get(name, 0.01), **flags)


Record = Callable[..., None]


@pytest.fixture(scope="module")
def record() -> Iterator[Record]:
    """``record(name, flags, result, mode="reset" | "release")``."""
    path = os.environ.get("OPTTREE_CONFORMANCE")
    lines: list[str] = []

    def add(name: str, flags: Flags, result: str, mode: str = "reset") -> None:
        lines.append(json.dumps({"class": name, "flags": flags, "lane": lane(), "mode": mode, "result": result}))

    yield add
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.writelines(line + "\n" for line in lines)


def case_id(case: tuple[str, Flags]) -> str:
    name, flags = case
    return "-".join([name, *(f"{k}={v}" for k, v in flags.items())])


@pytest.mark.parametrize("release", [False, True], ids=["reset", "release"])
@pytest.mark.parametrize("case", CASES, ids=list(map(case_id, CASES)))
def test_reset_then_train_equals_a_fresh_optimizer(case: tuple[str, Flags], release: bool, record: Record) -> None:
    name, flags = case
    mode = "release" if release else "reset"
    if not hasattr(torch.optim, name):
        record(name, flags, "not in this torch", mode)
        pytest.skip(f"torch {torch.__version__} has no torch.optim.{name}")
    make = build(name, flags)
    net = model(name)
    try:
        optimizer = make(net)
        train(name, net, optimizer, 0, 3)
    except (AssertionError, RuntimeError, ValueError) as error:  # torch asserts capturable devices
        record(name, flags, f"not run: torch refuses it on the CPU ({type(error).__name__})", mode)
        pytest.skip(f"torch cannot run it here: {error}")
    twin = copy.deepcopy(net)
    fresh = make(twin)

    if release and name in NOT_RELEASABLE:
        before = copy.deepcopy(optimizer.state_dict())
        with pytest.raises(opttree.ReleaseRefused, match="builds its state in __init__"):
            opttree.reset(optimizer, release=True)
        after = optimizer.state_dict()
        assert all(torch.equal(v, after["state"][p][k]) for p, e in before["state"].items() for k, v in e.items())
        record(name, flags, "refused: it builds its state in __init__", mode)
        return
    entries = len(optimizer.state)
    report = opttree.reset(optimizer, release=release)
    if release:
        assert not optimizer.state and report.entries_released == entries

    train(name, net, optimizer, 3, 3)
    train(name, twin, fresh, 3, 3)
    kept_net = model(name)  # the same optimizer, never reset
    train(name, kept_net, make(kept_net), 0, 6)
    same = all(torch.equal(a, b) for a, b in zip(net.parameters(), twin.parameters(), strict=True))
    kept_same = all(torch.equal(a, b) for a, b in zip(kept_net.parameters(), twin.parameters(), strict=True))
    record(name, flags, "exact" if same and not kept_same else "NOT EXACT", mode)
    assert same, report
    assert not kept_same  # the state the reset cleared did matter
