"""Random wrapper trees over real torch leaves: a reset either succeeds with every history
tensor zero and every kept tensor unchanged, or raises an OptTreeError having changed nothing.

Trees nest real Megatron ``ChainedOptimizer`` and ``FP32Optimizer`` instances (stub ones
included), share leaves, and plant unknown state keys anywhere. (An empty chain cannot be
a member of another: Megatron's constructor asserts equal configs; it is tested alone.)
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opttree
from tests.helpers import model, snapshot, train, unchanged
from tests.megatron_parts import chained, config, fp32

pytestmark = pytest.mark.usefixtures("process_group")

LEAF_KINDS = ("adamw", "adam_amsgrad", "sgd")
HISTORY = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"}


def make_leaf(kind: str, seed: int, planted: bool) -> torch.optim.Optimizer:
    net = model(seed)
    optimizer: torch.optim.Optimizer
    if kind == "adamw":
        optimizer = torch.optim.AdamW(net.parameters())
    elif kind == "adam_amsgrad":
        optimizer = torch.optim.Adam(net.parameters(), amsgrad=True)
    else:
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    train(net, optimizer, 0, 1)
    if planted:
        optimizer.state[next(iter(optimizer.state))]["unknown_ema"] = torch.ones(2)
    master = next(iter(optimizer.state))
    optimizer.state[master]["master_param"] = master.detach().clone()
    return optimizer


@st.composite
def trees(draw: st.DrawFn) -> tuple[object, list[torch.optim.Optimizer], bool]:
    """(root, leaves, whether an unknown key was planted)."""
    n_leaves = draw(st.integers(1, 4))
    plant_at = draw(st.one_of(st.none(), st.integers(0, n_leaves - 1)))
    leaves = [
        make_leaf(draw(st.sampled_from(LEAF_KINDS)), draw(st.integers(0, 3)), i == plant_at) for i in range(n_leaves)
    ]
    shared = config()

    def wrap(leaf: torch.optim.Optimizer, depth: int) -> object:
        node: object = fp32(leaf, shared)
        for _ in range(depth):
            node = chained([node])  # type: ignore[list-item]
        return node

    members: list[object] = []
    for leaf in leaves:
        members.append(wrap(leaf, draw(st.integers(0, 2))))
        if draw(st.booleans()):
            members.append(fp32(None, shared))  # a stub optimizer
        if draw(st.integers(0, 4)) == 0:
            members.append(fp32(leaf, shared))  # the same leaf reached again
    order = draw(st.permutations(range(len(members))))
    return chained([members[i] for i in order]), leaves, plant_at is not None  # type: ignore[misc]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees())
def test_reset_is_all_or_nothing(case: tuple[object, list[torch.optim.Optimizer], bool]) -> None:
    root, leaves, planted = case
    before = [snapshot(leaf) for leaf in leaves]

    if planted:
        with pytest.raises(opttree.UnsupportedOptimizerState, match="unknown_ema"):
            opttree.reset(root)
        assert all(unchanged(leaf, snap) for leaf, snap in zip(leaves, before, strict=True))
        return

    opttree.reset(root)

    for leaf, snap in zip(leaves, before, strict=True):
        kept = [t for k, t in snap if k == "master_param"]
        for entry in leaf.state.values():
            for key, value in entry.items():
                if key in HISTORY or key == "step":
                    assert not value.any(), key
        after_kept = [v for entry in leaf.state.values() for k, v in entry.items() if k == "master_param"]
        assert len(after_kept) == len(kept) == 1
        assert all(torch.equal(a, b) for a, b in zip(after_kept, kept, strict=True))
