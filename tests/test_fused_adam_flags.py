"""TransformerEngine's and apex's ``FusedAdam`` beyond their ``state``: the overflow flag a
capturable step counts by, and apex's (and TE 1.x's) master copies in ``param_groups_master``,
through the stand-ins that mirror both (``tests/standins.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import opttree
from tests.helpers import clone_model, model, refused_in_place, snapshot, unchanged, weights_equal
from tests.standins import ApexFusedAdam, TEFusedAdam

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]

CAPTURABLE: dict[str, Factory] = {
    "te": lambda p: TEFusedAdam(p, lr=1e-2, capturable=True),
    "apex": lambda p: ApexFusedAdam(p, lr=1e-2, capturable=True),
    "apex_master_weights": lambda p: ApexFusedAdam(p, lr=1e-2, capturable=True, master_weights=True),
}


def scaled_train(net: torch.nn.Module, optimizer: torch.optim.Optimizer, start: int, steps: int, *, overflow_last: bool = False) -> None:
    """Steps through torch's GradScaler, which hands itself to a capturable step; with
    ``overflow_last`` the last step's gradients hold an inf, as an fp16 step's may."""
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    for i in range(start, start + steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
        optimizer.zero_grad()
        scaler.scale(net(x).pow(2).mean()).backward()
        if overflow_last and i == start + steps - 1:
            first = next(net.parameters())
            assert first.grad is not None
            first.grad.view(-1)[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()


def held_masters(optimizer: ApexFusedAdam) -> list[torch.Tensor]:
    """The copies apex keeps in ``param_groups_master``, in parameter order."""
    return [copy for group in optimizer.param_groups_master for copy in group["params"] if copy is not None]


def flag(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    found = vars(optimizer)["_dummy_overflow_buf"]
    assert isinstance(found, torch.Tensor)
    return found


@pytest.mark.parametrize("name", sorted(CAPTURABLE))
def test_a_reset_after_an_overflowed_step_trains_as_a_fresh_optimizer(name: str) -> None:
    net = model()
    optimizer = CAPTURABLE[name](list(net.parameters()))
    scaled_train(net, optimizer, 0, 3, overflow_last=True)
    overflow = flag(optimizer)
    assert int(overflow) == 1  # the next capturable step would not count

    report = opttree.reset(optimizer)

    assert flag(optimizer) is overflow and int(overflow) == 0  # zeroed in place: a CUDA graph keeps its address
    assert report.tensors_zeroed == 2 * len(list(net.parameters())) + 1
    twin = clone_model(net)
    fresh = CAPTURABLE[name](list(twin.parameters()))
    scaled_train(net, optimizer, 3, 3)
    scaled_train(twin, fresh, 3, 3)
    assert all(bool(torch.isfinite(p).all()) for p in net.parameters())
    assert weights_equal(net, twin)


def test_without_the_flag_zeroed_the_next_step_divides_by_zero() -> None:
    """The stand-in's side: a step counter zeroed with the flag left at 1 stays 0 through
    the next step, whose bias correction divides by zero, as the real kernels' does."""
    net = model()
    optimizer = TEFusedAdam(list(net.parameters()), lr=1e-2, capturable=True)
    scaled_train(net, optimizer, 0, 3, overflow_last=True)
    step = optimizer.param_groups[0]["step"]
    assert isinstance(step, torch.Tensor)
    step.zero_()
    for entry in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            entry[key].zero_()

    scaled_train(net, optimizer, 3, 1)

    assert int(step) == 0
    assert not all(bool(torch.isfinite(p).all()) for p in net.parameters())


def test_a_partial_reset_that_keeps_the_steps_keeps_the_flag() -> None:
    net = model()
    optimizer = CAPTURABLE["te"](list(net.parameters()))
    scaled_train(net, optimizer, 0, 3, overflow_last=True)
    step = optimizer.param_groups[0]["step"]

    opttree.reset(optimizer, keys=["exp_avg", "exp_avg_sq"])

    assert int(flag(optimizer)) == 1 and int(step) == 3  # the step that overflowed counted: the next one will not
    assert all(not entry["exp_avg"].any() for entry in optimizer.state.values())


def test_the_steps_of_part_of_its_parameters_are_refused_with_nothing_changed() -> None:
    net = model()
    params = list(net.parameters())
    optimizer = TEFusedAdam([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2, capturable=True)
    scaled_train(net, optimizer, 0, 3, overflow_last=True)
    before = snapshot(optimizer)
    steps = [int(group["step"]) for group in optimizer.param_groups]

    with pytest.raises(opttree.PartialResetRefused, match="_dummy_overflow_buf takes part in counting the steps of all its 4"):
        opttree.reset(optimizer, params=params[:2], keys=["exp_avg", "exp_avg_sq", "step"])

    assert unchanged(optimizer, before) and int(flag(optimizer)) == 1
    assert [int(group["step"]) for group in optimizer.param_groups] == steps
    opttree.reset(optimizer, params=params[:2])  # a partial reset keeps the steps, and so the flag
    assert int(flag(optimizer)) == 1 and [int(group["step"]) for group in optimizer.param_groups] == steps


def test_a_flag_that_is_not_a_tensor_is_refused_by_name() -> None:
    net = model()
    optimizer = CAPTURABLE["apex"](list(net.parameters()))
    scaled_train(net, optimizer, 0, 2)
    vars(optimizer)["_dummy_overflow_buf"] = 1

    problem = refused_in_place(optimizer, "_dummy_overflow_buf", "_dummy_overflow_buf")

    assert "is an int, expected a tensor" in problem.message


def test_a_flag_sharing_memory_with_kept_state_is_refused() -> None:
    net = model()
    optimizer = CAPTURABLE["te"](list(net.parameters()))
    scaled_train(net, optimizer, 0, 2)
    lr = optimizer.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor)  # a capturable group's lr: a tensor option a reset keeps
    vars(optimizer)["_dummy_overflow_buf"] = lr.view(torch.int32).reshape(1)

    refused_in_place(optimizer, "_dummy_overflow_buf", "shares memory", opttree.ProblemKind.ALIASED_STATE)

    assert torch.equal(lr, torch.tensor(1e-2))


def test_master_copies_beside_the_groups_are_compared_and_synced() -> None:
    """apex's ``param_groups_master``: after weights are loaded into the model out of band,
    ``validate(model=...)`` names each stale copy and ``sync_masters`` writes them, so the
    next step starts from the loaded weights, not the copies' old ones."""
    net = model()
    optimizer = ApexFusedAdam(list(net.parameters()), lr=1e-2, capturable=True, master_weights=True)
    scaled_train(net, optimizer, 0, 2)
    assert not opttree.validate(optimizer, model=net)
    loaded = model(seed=1)
    with torch.no_grad():
        for param, new in zip(net.parameters(), loaded.parameters(), strict=True):
            param.copy_(new)

    stale = opttree.validate(optimizer, model=net)
    assert [p.kind for p in stale] == [opttree.ProblemKind.STALE_MASTER] * len(list(net.parameters()))
    report = opttree.sync_masters(optimizer, model=net)

    assert (report.copies, report.stale) == (4, 4) and len(report.written) == 4
    assert not opttree.validate(optimizer, model=net)
    assert all(torch.equal(copy, param) for copy, param in zip(held_masters(optimizer), net.parameters(), strict=True))


def test_master_copies_beside_the_groups_are_kept_by_a_reset() -> None:
    net = model()
    optimizer = ApexFusedAdam(list(net.parameters()), lr=1e-2, capturable=True, master_weights=True)
    scaled_train(net, optimizer, 0, 3)
    masters = [copy.clone() for copy in held_masters(optimizer)]

    report = opttree.reset(optimizer)

    assert report.tensors_kept == 0  # kept memory beside state, not state: counted by neither
    assert all(torch.equal(a, b) for a, b in zip(masters, held_masters(optimizer), strict=True))


def test_history_sharing_memory_with_a_master_beside_the_groups_is_refused() -> None:
    net = model()
    optimizer = ApexFusedAdam(list(net.parameters()), lr=1e-2, capturable=True, master_weights=True)
    scaled_train(net, optimizer, 0, 2)
    first = next(iter(net.parameters()))
    optimizer.state[first]["exp_avg"] = optimizer.param_groups_master[0]["params"][0]

    refused_in_place(optimizer, "exp_avg", "param_groups_master", opttree.ProblemKind.ALIASED_STATE)


def test_master_groups_of_another_layout_are_reported_never_guessed() -> None:
    """A group added after construction has no place in ``param_groups_master`` (apex's step
    zips the two and passes it over): refused, and its copies reported as not compared."""
    net = model()
    params = list(net.parameters())
    optimizer = ApexFusedAdam(params[:2], lr=1e-2, capturable=True, master_weights=True)
    optimizer.add_param_group({"params": params[2:]})

    problem = refused_in_place(optimizer, "param_groups_master", "param_groups_master", opttree.ProblemKind.MALFORMED_STATE)

    assert "expected a list of 2 groups beside its param_groups" in problem.message
    unchecked = [p for p in opttree.validate(optimizer, model=net) if p.kind is opttree.ProblemKind.UNCHECKED_MASTER]
    assert len(unchecked) == 1 and "param_groups_master" in unchecked[0].message


def test_schemas_name_step_attributes_and_master_groups_as_they_must() -> None:
    with pytest.raises(opttree.RegistrationError, match="step_attributes take part in counting steps"):
        opttree.StateSchema(zero={"m"}, step_attributes={"flag"})
    with pytest.raises(opttree.RegistrationError, match="master_groups names an instance attribute"):
        opttree.StateSchema(zero={"m"}, master_groups=3)  # type: ignore[arg-type]
    with pytest.raises(opttree.RegistrationError, match="state keys are given as a set of names"):
        opttree.StateSchema(zero={"m"}, step=opttree.StepLocation.PER_GROUP, step_attributes="flag")  # type: ignore[arg-type]


class Pair:
    """A wrapper of two optimizers, stepped in turn."""

    def __init__(self, first: torch.optim.Optimizer, second: torch.optim.Optimizer) -> None:
        self.first, self.second = first, second


opttree.register_wrapper(Pair, children=lambda pair: [("first", pair.first), ("second", pair.second)])


def _two_trained(share: Callable[[TEFusedAdam, TEFusedAdam], None]) -> tuple[Pair, list[torch.nn.Parameter], TEFusedAdam]:
    net = model()
    params = list(net.parameters())
    first = TEFusedAdam(params[:2], lr=1e-2, capturable=True)
    second = TEFusedAdam(params[2:], lr=1e-2, capturable=True)
    share(first, second)
    pair = Pair(first, second)
    for i in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
        first.zero_grad()
        second.zero_grad()
        net(x).pow(2).mean().backward()
        first.step()
        second.step()
    return pair, params, second


def _share_flag(first: TEFusedAdam, second: TEFusedAdam) -> None:
    first._dummy_overflow_buf = second._dummy_overflow_buf


def _flag_on_its_step(first: TEFusedAdam, second: TEFusedAdam) -> None:
    second.step()  # builds its step tensor, which the first takes as its flag
    step = second.param_groups[0]["step"]
    assert isinstance(step, torch.Tensor)
    first._dummy_overflow_buf = step


@pytest.mark.parametrize("share", [_share_flag, _flag_on_its_step])
def test_a_partial_reset_never_writes_the_counters_of_an_optimizer_it_leaves_alone(share: Callable[[TEFusedAdam, TEFusedAdam], None]) -> None:
    pair, params, second = _two_trained(share)
    before = snapshot(second)
    flag = second._dummy_overflow_buf.clone()

    with pytest.raises(opttree.UnsupportedOptimizerState, match="shares memory"):
        opttree.reset(pair, params=params[:2], keys=["exp_avg", "exp_avg_sq", "step"])

    assert unchanged(second, before) and torch.equal(second._dummy_overflow_buf, flag)
    assert all(isinstance(g["step"], torch.Tensor) and int(g["step"]) > 0 for g in second.param_groups)


def test_master_groups_holding_one_copy_at_two_places_are_refused() -> None:
    net = model()
    optimizer = ApexFusedAdam(list(net.parameters()), lr=1e-2, capturable=True, master_weights=True)
    copies = optimizer.param_groups_master[0]["params"]
    copies[1] = copies[0]

    problem = refused_in_place(optimizer, "param_groups_master", "one copy at two places", opttree.ProblemKind.MALFORMED_STATE)

    assert "cannot stand for both parameters" in problem.message
