"""State an optimizer derives from its step count, a second counter (NAdam's
``mu_product``, ASGD's ``eta`` and ``mu``): a partial reset takes it with the step, or is
refused for naming it without the step."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import opttree
from tests.helpers import model, snapshot, train, trains_as_fresh, unchanged

Build = Callable[[torch.nn.Module], torch.optim.Optimizer]

BUILDS: dict[str, Build] = {
    "NAdam": lambda net: torch.optim.NAdam(net.parameters(), lr=2e-3),
    "ASGD": lambda net: torch.optim.ASGD(net.parameters(), lr=1e-2, t0=1),
}
HISTORY = {"NAdam": ["exp_avg", "exp_avg_sq"], "ASGD": ["ax"]}


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_naming_the_step_takes_what_is_counted_with_it(name: str) -> None:
    net = model()
    optimizer = BUILDS[name](net)
    train(net, optimizer, 0, 5)

    opttree.reset(optimizer, keys=[*HISTORY[name], "step"])

    assert trains_as_fresh(net, optimizer, BUILDS[name], 5, 4)


def test_nadam_s_mu_product_starts_again_with_its_step() -> None:
    net = model()
    optimizer = BUILDS["NAdam"](net)
    train(net, optimizer, 0, 5)

    report = opttree.reset(optimizer, keys=["exp_avg", "exp_avg_sq", "step"])

    assert report.kept_keys == ()
    assert all(float(entry["mu_product"]) == 1.0 and float(entry["step"]) == 0 for entry in optimizer.state.values())


@pytest.mark.parametrize(("name", "key"), [("NAdam", "mu_product"), ("ASGD", "eta"), ("ASGD", "mu")])
def test_naming_what_is_counted_with_the_step_without_it_is_refused(name: str, key: str) -> None:
    net = model()
    optimizer = BUILDS[name](net)
    train(net, optimizer, 0, 5)
    before = snapshot(optimizer)

    with pytest.raises(opttree.PartialResetRefused, match=f"its .*{key}.* count with its step, and keys names them without 'step'"):
        opttree.reset(optimizer, keys=[key])

    assert unchanged(optimizer, before)


def test_a_partial_reset_without_the_step_or_what_counts_with_it_keeps_both() -> None:
    net = model()
    optimizer = BUILDS["NAdam"](net)
    train(net, optimizer, 0, 5)
    counters = [(float(entry["step"]), float(entry["mu_product"])) for entry in optimizer.state.values()]

    opttree.reset(optimizer, keys=["exp_avg", "exp_avg_sq"])

    assert [(float(entry["step"]), float(entry["mu_product"])) for entry in optimizer.state.values()] == counters


def test_counted_with_step_names_keys_a_reset_writes_under_a_step() -> None:
    with pytest.raises(opttree.RegistrationError, match="counted_with_step names keys counted with a step"):
        opttree.StateSchema(zero={"m"}, counted_with_step={"m"})
    with pytest.raises(opttree.RegistrationError, match=r"counted_with_step names \['w'\], which a reset neither"):
        opttree.StateSchema(zero={"m"}, keep={"w"}, step=opttree.StepLocation.PER_PARAMETER, counted_with_step={"w"})


def test_a_partial_reset_by_parameters_keeps_the_step_and_what_counts_with_it() -> None:
    """``params`` without ``keys`` resets history and keeps step counters, NAdam's
    ``mu_product`` with its step: never one without the other."""
    net = model()
    optimizer = BUILDS["NAdam"](net)
    train(net, optimizer, 0, 5)
    first = next(iter(net.parameters()))
    entry = optimizer.state[first]
    counters = (float(entry["step"]), float(entry["mu_product"]))

    opttree.reset(optimizer, params=[first])

    assert not entry["exp_avg"].any() and (float(entry["step"]), float(entry["mu_product"])) == counters
