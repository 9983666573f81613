"""A refused reset raises an OptTreeError naming class, key and path, and changes nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import opttree
from tests.helpers import clone_model, model, refused_in_place, snapshot, train, unchanged, weights_equal
from tests.megatron_parts import chained, config, fp32

pytestmark = pytest.mark.usefixtures("process_group")


class HomemadeLion(torch.optim.Optimizer):
    """A real optimizer opttree has no schema for."""

    def __init__(self, params: object) -> None:
        super().__init__(params, {"lr": 1e-3})  # type: ignore[arg-type]

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state.setdefault("exp_avg", torch.zeros_like(p)).lerp_(p.grad, 0.1)
                p.sub_(state["exp_avg"].sign(), alpha=group["lr"])


def trained(
    optimizer_cls: Callable[[Iterator[torch.nn.Parameter]], torch.optim.Optimizer] = torch.optim.AdamW, seed: int = 0
) -> torch.optim.Optimizer:
    net = model(seed)
    optimizer = optimizer_cls(net.parameters())
    train(net, optimizer, 0, 2)
    return optimizer


def test_unknown_leaf_class_is_refused_and_nothing_changes() -> None:
    shared = config()
    first, second = trained(), trained(HomemadeLion)
    root = chained([fp32(first, shared), fp32(second, shared)])
    before = snapshot(first)

    with pytest.raises(opttree.UnsupportedOptimizer) as caught:
        opttree.reset(root)

    message = str(caught.value)
    assert "HomemadeLion at chained[1].optimizer" in message
    assert f"{__name__}.HomemadeLion" in message
    assert unchanged(first, before)


def test_unknown_state_key_on_the_last_leaf_leaves_earlier_leaves_unchanged() -> None:
    shared = config()
    leaves = [trained(seed=i) for i in range(3)]
    root = chained([fp32(leaf, shared) for leaf in leaves])
    param = next(iter(leaves[2].state))
    leaves[2].state[param]["my_ema"] = torch.ones(3)
    before = [snapshot(leaf) for leaf in leaves]

    with pytest.raises(opttree.UnsupportedOptimizerState) as caught:
        opttree.reset(root)

    assert "AdamW at chained[2].optimizer: key 'my_ema'" in str(caught.value)
    assert all(unchanged(leaf, snap) for leaf, snap in zip(leaves, before, strict=True))


def test_validate_reports_every_problem_without_raising() -> None:
    shared = config()
    odd = trained()
    param = next(iter(odd.state))
    odd.state[param]["my_ema"] = torch.ones(1)
    odd.state[param]["exp_avg"] = 3.0  # history that is not a tensor
    root = chained([fp32(trained(HomemadeLion), shared), fp32(odd, shared)])

    problems = opttree.validate(root)

    kinds = sorted((p.kind.value, p.path, p.key) for p in problems)
    assert kinds == [
        ("unsupported-optimizer", "chained[0].optimizer", None),
        ("unsupported-state", "chained[1].optimizer", "exp_avg"),
        ("unsupported-state", "chained[1].optimizer", "my_ema"),
    ]
    assert all(p.severity is opttree.Severity.ERROR for p in problems)
    with pytest.raises(opttree.UnsupportedOptimizer, match=r"and 2 more: see the error's problems") as caught:
        opttree.reset(root)
    assert sorted(caught.value.problems, key=str) == sorted(problems, key=str) and caught.value.problem == caught.value.problems[0]


def test_silently_empty_state_is_a_warning_and_reset_still_runs() -> None:
    optimizer = trained()
    optimizer.param_groups[0]["step"] = 5  # a group that says it has stepped ...
    optimizer.state.clear()  # ... over no state at all

    problems = opttree.validate(optimizer)

    assert [(p.kind, p.severity) for p in problems] == [(opttree.ProblemKind.EMPTY_STATE, opttree.Severity.WARNING)]
    assert "says step 5" in str(problems[0])
    assert opttree.reset(optimizer).tensors_zeroed == 0


def test_state_for_a_tensor_in_no_group_is_reported() -> None:
    """Such state (a parameter replaced, as a merge does) keeps torch's state_dict() from
    saving, before a reset as after one in place: the warning says so, and release=True
    deletes it, as a fresh optimizer holds none."""
    optimizer = trained()
    stray = torch.zeros(2)
    optimizer.state[stray] = {"exp_avg": torch.ones(2)}

    problems = opttree.validate(optimizer)

    assert [p.kind for p in problems] == [opttree.ProblemKind.ORPHAN_STATE]
    assert "torch's state_dict() cannot save it" in problems[0].message and "release=True deletes it" in problems[0].message
    with pytest.raises(KeyError):
        optimizer.state_dict()
    opttree.reset(optimizer, release=True)
    assert stray not in optimizer.state
    assert optimizer.state_dict()["state"] == {}


def test_a_step_counter_where_the_schema_has_none_is_refused() -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    train(net, optimizer, 0, 1)
    param = next(iter(optimizer.state))
    optimizer.state[param]["step"] = torch.tensor(3.0)
    before = snapshot(optimizer)

    with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'step'"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)


OPTIONS_SWITCHED_ON = [
    pytest.param(torch.optim.Adam, "amsgrad", True, "max_exp_avg_sq", id="Adam-amsgrad"),
    pytest.param(torch.optim.AdamW, "amsgrad", True, "max_exp_avg_sq", id="AdamW-amsgrad"),
    pytest.param(torch.optim.RMSprop, "centered", True, "grad_avg", id="RMSprop-centered"),
    pytest.param(torch.optim.RMSprop, "momentum", 0.9, "momentum_buffer", id="RMSprop-momentum"),
]


@pytest.mark.parametrize(("optimizer_cls", "option", "value", "key"), OPTIONS_SWITCHED_ON)
def test_history_an_option_switched_on_after_the_first_step_needs_is_refused_in_place(
    optimizer_cls: Callable[..., torch.optim.Optimizer], option: str, value: object, key: str
) -> None:
    """Entries built with the option off lack a key the optimizer builds only with an entry
    and reads at every step once the option is on: kept through a reset in place, the next
    step raises KeyError; the whole entries released, it is built as a fresh optimizer's."""
    net = model()
    optimizer = optimizer_cls(net.parameters(), lr=0.01)
    train(net, optimizer, 0, 2)
    optimizer.param_groups[0][option] = value

    problem = refused_in_place(optimizer, key, rf"{optimizer_cls.__name__} at <root>: key '{key}'.*'{option}' is on")

    assert "4 of its 4 state entries lack it" in problem.message
    with pytest.raises(KeyError):  # what the refusal spares: torch's own next step
        train(net, optimizer, 2, 1)

    opttree.reset(optimizer, release=True)
    twin = clone_model(net)
    fresh = optimizer_cls(twin.parameters(), lr=0.01, **{option: value})
    train(net, optimizer, 2, 3)
    train(twin, fresh, 2, 3)
    assert weights_equal(net, twin)


def test_entries_built_with_the_option_on_reset_in_place_as_before() -> None:
    """The check looks at entries, not at the option: an AdamW built with amsgrad resets
    in place, and one whose amsgrad was switched off keeps resetting its extra history."""
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), amsgrad=True)
    train(net, optimizer, 0, 2)
    assert opttree.reset(optimizer).tensors_zeroed == 3 * 4
    optimizer.param_groups[0]["amsgrad"] = False
    assert opttree.validate(optimizer) == ()
    assert opttree.reset(optimizer).tensors_zeroed == 3 * 4
