"""Runs of alike sibling leaves are planned in one pooled pass; the outcome must be exactly
that of planning them one by one: the same tensors in the same zero lists, the same
counts, and the same problems at the same paths.

Runs are chains of real torch optimizers under a real Megatron ``ChainedOptimizer`` (as
``LayerWiseDistributedOptimizer`` builds them), and real ``HybridDeviceOptimizer`` s with
one CPU optimizer per parameter.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opttree
from opttree._plan import ResetPlan
from opttree._problems import Problem
from opttree._selection import tree_leaves
from opttree._validate import ValidateVisitor
from tests.helpers import snapshot, unchanged
from tests.megatron_parts import Hybrid, chained, hybrid, train_hybrid

pytestmark = pytest.mark.usefixtures("process_group")


PlanView = tuple[object, ...]


def view(plan: ResetPlan) -> PlanView:
    """A plan by the identity of what it touches, and its counts."""
    s = plan.state
    return (
        {key: [id(t) for t in tensors] for key, tensors in s.lists.items()},
        [(id(entry), key) for entry, key, _ in s.number_writes],
        [(id(entry), key) for entry, key in s.drop],
        s.zeroed,
        s.steps,
        s.kept_tensors,
        s.bytes_reset,
        (s.kept_state.starts, s.kept_state.ends),
        s.kept_keys,
        plan.leaves,
        plan.shared_leaves,
    )


def planned(root: object, visitor: ValidateVisitor) -> tuple[PlanView, list[Problem]]:
    opttree.tree(root).accept(visitor)
    return view(visitor._plan), visitor.problems


def stepped_leaf(kind: str, sizes: list[int], steps: int, grads: list[bool], dtype: torch.dtype) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.linspace(-1, 1, n, dtype=dtype)) for n in sizes]
    optimizer: torch.optim.Optimizer
    if kind == "adamw":
        optimizer = torch.optim.AdamW(params, lr=0.1)
    elif kind == "amsgrad":
        optimizer = torch.optim.Adam(params, lr=0.1, amsgrad=True)
    else:
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for _ in range(steps):
        for param, has_grad in zip(params, grads, strict=True):
            param.grad = torch.ones_like(param) if has_grad else None
        optimizer.step()
    return optimizer


Corruption = Callable[[torch.optim.Optimizer, torch.optim.Optimizer], None]
"""Spoils the state of its first argument; the second is its neighbour in the run."""


def unknown_key(target: torch.optim.Optimizer, _: torch.optim.Optimizer) -> None:
    for entry in target.state.values():
        entry["my_ema"] = torch.ones(1)


def float_history(target: torch.optim.Optimizer, _: torch.optim.Optimizer) -> None:
    for entry in target.state.values():
        key = next(k for k, v in entry.items() if k != "step" and isinstance(v, torch.Tensor))
        entry[key] = 0.5


def stepless_entry(target: torch.optim.Optimizer, _: torch.optim.Optimizer) -> None:
    """History without its step, where AdamW builds both (SGD has no step to lose)."""
    entry = next(iter(target.state.values()))
    entry.pop("step", None)


def amsgrad_switched_on(target: torch.optim.Optimizer, _: torch.optim.Optimizer) -> None:
    """Entries built without ``max_exp_avg_sq``, which Adam reads once amsgrad is on."""
    target.param_groups[0]["amsgrad"] = True


def cross_leaf_orphan(target: torch.optim.Optimizer, neighbour: torch.optim.Optimizer) -> None:
    """State, well formed, for a parameter of the neighbour."""
    theirs = neighbour.param_groups[0]["params"][0]
    ours = next(iter(target.state.values()))
    target.state[theirs] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in ours.items()}


@st.composite
def runs(draw: st.DrawFn) -> list[torch.optim.Optimizer]:
    """Leaves forming runs of one class or several, their states perhaps spoilt."""
    kinds = draw(st.lists(st.sampled_from(["adamw", "amsgrad", "sgd"]), min_size=1, max_size=3))
    leaves: list[torch.optim.Optimizer] = []
    for kind in kinds:
        for _ in range(draw(st.integers(2, 6))):
            n_params = draw(st.integers(1, 3))
            leaves.append(
                stepped_leaf(
                    kind,
                    draw(st.lists(st.integers(1, 5), min_size=n_params, max_size=n_params)),
                    draw(st.integers(0, 2)),
                    draw(st.lists(st.booleans(), min_size=n_params, max_size=n_params)),
                    draw(st.sampled_from([torch.float32] * 5 + [torch.float64])),
                )
            )
    corruption = draw(st.sampled_from([None, unknown_key, float_history, stepless_entry, amsgrad_switched_on, cross_leaf_orphan]))
    stepped = [i for i, leaf in enumerate(leaves) if leaf.state]
    if corruption is not None and stepped:
        target = draw(st.sampled_from(stepped))
        corruption(leaves[target], leaves[(target + 1) % len(leaves)])
    return leaves


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs())
def test_pooled_planning_equals_planning_leaf_by_leaf(leaves: list[torch.optim.Optimizer]) -> None:
    root = chained(leaves)  # type: ignore[arg-type]  # Megatron chains raw torch optimizers too

    pooled_plan, pooled_problems = planned(root, ValidateVisitor())
    reference_plan, reference_problems = planned(root, ValidateVisitor(pooling=False))

    assert pooled_plan == reference_plan
    assert pooled_problems == reference_problems


def trained_hybrid() -> Hybrid:
    stack = hybrid([1 + i % 7 for i in range(40)])
    train_hybrid(stack, 0, 2)
    return stack


def test_a_pooled_reset_trains_like_a_fresh_hybrid_optimizer() -> None:
    stack = trained_hybrid()
    optimizer, params, _ = stack

    report = opttree.reset(optimizer)

    assert (report.leaves, report.tensors_zeroed, report.steps) == (40, 2 * 40, 40)
    fresh = hybrid([p.numel() for p in params], like=params)
    train_hybrid(stack, 2, 3)
    train_hybrid(fresh, 2, 3)
    assert all(torch.equal(a, b) for a, b in zip(params, fresh[1], strict=True))


@pytest.mark.parametrize(
    ("corrupt", "kind", "key"),
    [
        (unknown_key, opttree.ProblemKind.UNSUPPORTED_STATE, "my_ema"),
        (float_history, opttree.ProblemKind.UNSUPPORTED_STATE, "exp_avg"),
        (amsgrad_switched_on, opttree.ProblemKind.UNSUPPORTED_STATE, "max_exp_avg_sq"),
    ],
)
def test_an_error_in_one_of_many_sub_optimizers_names_it_and_changes_nothing(
    corrupt: Corruption, kind: opttree.ProblemKind, key: str
) -> None:
    optimizer, _, _ = trained_hybrid()
    subs: list[torch.optim.Optimizer] = optimizer.cpu_optimizers
    corrupt(subs[17], subs[18])
    before = [snapshot(sub) for sub in subs]

    problems = opttree.validate(optimizer)

    assert [(p.kind, p.path, p.key) for p in problems] == [(kind, "sub_optimizers[17]", key)]
    with pytest.raises(opttree.OptTreeError, match=rf"sub_optimizers\[17\]: key '{key}'"):
        opttree.reset(optimizer)
    assert all(unchanged(sub, snap) for sub, snap in zip(subs, before, strict=True))


def test_state_held_for_a_neighbours_parameter_is_a_warning_at_the_holder() -> None:
    optimizer, _, _ = trained_hybrid()
    subs: list[torch.optim.Optimizer] = optimizer.cpu_optimizers
    cross_leaf_orphan(subs[17], subs[24])  # a neighbour's parameter of its size: seven sizes in turn

    problems = opttree.validate(optimizer)

    assert [(p.kind, p.severity, p.path) for p in problems] == [
        (opttree.ProblemKind.ORPHAN_STATE, opttree.Severity.WARNING, "sub_optimizers[17]")
    ]
    assert opttree.reset(optimizer).leaves == 40


def test_a_key_wrong_in_every_entry_is_reported_once_per_leaf() -> None:
    net = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(40)])
    optimizer = torch.optim.AdamW(net.parameters())
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    for entry in optimizer.state.values():
        entry["my_ema"] = torch.ones(1)

    problems = opttree.validate(optimizer)

    assert [(p.kind, p.key) for p in problems] == [(opttree.ProblemKind.UNSUPPORTED_STATE, "my_ema")]


def test_repeated_resets_of_a_large_run_stay_exact_and_see_a_replaced_tensor() -> None:
    sizes = [1 + i % 7 for i in range(128)]
    stack = hybrid(sizes)
    optimizer, params, _ = stack
    subs: list[torch.optim.Optimizer] = optimizer.cpu_optimizers
    train_hybrid(stack, 0, 2)
    opttree.reset(optimizer)
    train_hybrid(stack, 2, 2)

    opttree.reset(optimizer)

    fresh = hybrid(sizes, like=params)
    train_hybrid(stack, 4, 2)
    train_hybrid(fresh, 4, 2)
    assert all(torch.equal(a, b) for a, b in zip(params, fresh[1], strict=True))

    entry = next(iter(subs[50].state.values()))
    stale = entry["exp_avg"]
    entry["exp_avg"] = torch.ones_like(stale)
    opttree.reset(optimizer)
    assert not entry["exp_avg"].any() and stale.any()


def shared_step(subs: list[torch.optim.Optimizer]) -> None:
    next(iter(subs[17].state.values()))["step"] = next(iter(subs[16].state.values()))["step"]


def history_in_its_parameter(subs: list[torch.optim.Optimizer]) -> None:
    next(iter(subs[17].state.values()))["exp_avg"] = subs[17].param_groups[0]["params"][0].detach()


@pytest.mark.parametrize(
    ("corrupt", "kind", "key"),
    [(shared_step, opttree.ProblemKind.SHARED_STEP, "step"), (history_in_its_parameter, opttree.ProblemKind.ALIASED_STATE, "exp_avg")],
)
def test_a_memory_problem_in_a_pooled_run_names_its_leaf(
    corrupt: Callable[[list[torch.optim.Optimizer]], None], kind: opttree.ProblemKind, key: str
) -> None:
    """The tree-wide memory check sees the run's pooled ranges: where it finds a problem,
    the tree is checked again leaf by leaf, so the problem names the sub-optimizer."""
    optimizer, _, _ = trained_hybrid()
    corrupt(optimizer.cpu_optimizers)

    assert [(p.kind, p.path, p.key) for p in opttree.validate(optimizer)] == [(kind, "sub_optimizers[17]", key)]


def test_an_entry_without_its_step_in_a_pooled_run_is_refused_naming_its_leaf() -> None:
    """Not only in the run's first leaf: every entry of the run counts."""
    optimizer, _, _ = trained_hybrid()
    del next(iter(optimizer.cpu_optimizers[17].state.values()))["step"]

    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"sub_optimizers\[17\]: key 'step': 1 of its 1 state entries hold history but no step"):
        opttree.reset(optimizer)
    assert [(p.path, p.key) for p in opttree.validate(optimizer)] == [("sub_optimizers[17]", "step")]


def test_a_partial_reset_of_a_pooled_run_over_a_reordered_state_resets_the_selected_parameter() -> None:
    """``OrderedDict.move_to_end`` orders a state's keys apart from its values: such a
    state is inspected on its own, never pooled, where keys and values would be paired by position."""
    members = [stepped_leaf("adamw", [3, 3], 2, [True, True], torch.float32) for _ in range(4)]
    target = members[2]
    first, second = target.param_groups[0]["params"]
    reordered = collections.OrderedDict(target.state)
    reordered.move_to_end(first)
    target.state = reordered  # type: ignore[assignment]  # an OrderedDict, where torch keeps a defaultdict

    opttree.reset(chained(members), params=[first])  # type: ignore[arg-type]  # Megatron chains raw optimizers too

    assert not reordered[first]["exp_avg"].any() and reordered[second]["exp_avg"].any()


def test_leaves_read_under_a_wrapper_are_those_with_readable_containers_checked_at_once_or_one_by_one() -> None:
    """The leaves a check reads under a wrapper (the copies a HybridDeviceOptimizer steps,
    kept by their leaves) are found for all sub-optimizers at once where their containers
    are plain, and one by one otherwise: a malformed one among them is left to its own
    visit, which reports it, whichever way the others were read."""
    optimizer, _, _ = trained_hybrid()
    subs: list[torch.optim.Optimizer] = optimizer.cpu_optimizers
    root = opttree.tree(optimizer)
    assert [id(leaf) for leaf in tree_leaves(root)] == list(map(id, subs))

    subs[17].state = []  # type: ignore[assignment]  # a malformed state among plain ones

    assert [id(leaf) for leaf in tree_leaves(root)] == [id(sub) for i, sub in enumerate(subs) if i != 17]
    assert (opttree.ProblemKind.MALFORMED_STATE, "sub_optimizers[17]") in [(p.kind, p.path) for p in opttree.validate(optimizer)]
