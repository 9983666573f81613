"""Inputs that once escaped as a raw Python error, a traceback or a hang: each is now a
one-line CLI error or an :class:`~opttree.OptTreeError` naming what was given."""

from __future__ import annotations

import math
import subprocess
import sys
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
