"""Every step counter a leaf holds is reset, wherever it lives, or the reset is refused."""

from __future__ import annotations

import enum
import re
from collections.abc import Callable

import attrs
import numpy as np
import pytest
import torch

import opttree
from tests.helpers import clone_model, model, snapshot, stepped_pair, train, trains_as_fresh, unchanged, weights_equal
from tests.standins import TEFusedAdam


class GroupClockAdamW(torch.optim.AdamW):
    """An AdamW that also counts its steps in each param group, as TE's FusedAdam does."""

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        super().step()
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1


def trained(optimizer_cls: type[torch.optim.AdamW] = torch.optim.AdamW, steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    net = model()
    optimizer = optimizer_cls(net.parameters())
    train(net, optimizer, 0, steps)
    return net, optimizer


def test_a_group_clock_on_an_adamw_subclass_is_reset_and_training_matches_a_fresh_one() -> None:
    """A subclass with its own step may build other state than its base: refused until
    registered. Registered with AdamW's schema, its group clock is reset with the rest."""
    net, optimizer = trained(GroupClockAdamW)
    before = snapshot(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizer, match=r"GroupClockAdamW defines its own step, where its base torch\.optim\.adamw\.AdamW"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before) and optimizer.param_groups[0]["step"] == 3
    adamw = opttree.schema_for(torch.optim.AdamW)
    assert adamw is not None
    opttree.register_schema(GroupClockAdamW, adamw)
    twin = model()
    twin.load_state_dict(net.state_dict())
    fresh = GroupClockAdamW(twin.parameters())

    report = opttree.reset(optimizer)

    assert optimizer.param_groups[0]["step"] == 0
    assert report.steps == 1 + len(optimizer.state)  # the group's and each parameter's
    train(net, optimizer, 3, 3)
    train(twin, fresh, 3, 3)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), twin.parameters(), strict=True))
    assert optimizer.param_groups[0]["step"] == fresh.param_groups[0]["step"] == 3


@pytest.mark.parametrize(
    "counter",
    [torch.tensor(50.0), torch.tensor([50], dtype=torch.int32), 50, 50.0],
    ids=["float-tensor", "int32-tensor", "int", "float"],
)
def test_a_step_counter_placed_in_a_group_of_a_plain_adamw_is_reset(counter: object) -> None:
    _, optimizer = trained()
    optimizer.param_groups[0]["step"] = counter

    opttree.reset(optimizer)

    value = optimizer.param_groups[0]["step"]
    if isinstance(counter, torch.Tensor):
        assert value is counter and not counter.any()  # zeroed in place
    else:
        assert value == 0 and type(value) is type(counter)
    assert opttree.validate(optimizer) == ()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["TE FusedAdam", "AdamW"])
def test_a_group_step_tensor_that_cannot_count_on_is_refused(dtype: torch.dtype, kind: str) -> None:
    """A group step tensor is zeroed in place: one of a narrow dtype stayed so, and TE's
    FusedAdam, counting in it, wrapped to 0 at step 256 (uint8: weights NaN) or stopped
    counting (bfloat16: weights unlike a fresh optimizer's), where a fresh one counts in
    an int. Refused with nothing changed, as a narrow per-parameter step is."""
    net = model()
    optimizer = TEFusedAdam(net.parameters(), lr=1e-3) if kind == "TE FusedAdam" else torch.optim.AdamW(net.parameters())
    train(net, optimizer, 0, 3)
    optimizer.param_groups[0]["step"] = torch.tensor(3, dtype=dtype)
    before = snapshot(optimizer)

    problems = opttree.validate(optimizer)

    assert [(p.kind, p.key) for p in problems] == [(opttree.ProblemKind.UNSUPPORTED_STATE, "step")]
    assert re.search(rf"param group 0's step counter is an? {str(dtype).removeprefix('torch.')} tensor", problems[0].message)
    with pytest.raises(opttree.UnsupportedOptimizerState, match="counts steps exactly only so far"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before) and int(optimizer.param_groups[0]["step"]) == 3


def test_a_group_step_on_a_schema_without_steps_is_reset_too() -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    train(net, optimizer, 0, 2)
    optimizer.param_groups[0]["step"] = 7

    report = opttree.reset(optimizer)

    assert optimizer.param_groups[0]["step"] == 0 and report.steps == 1


GROUP_STEP_BUILDERS: dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer]] = {
    "adamw": lambda net: torch.optim.AdamW(net.parameters()),
    "te": lambda net: TEFusedAdam(net.parameters(), lr=1e-2),
}


@pytest.mark.parametrize(("kind", "trained_steps"), [("adamw", 3), ("te", 0)])
def test_a_group_step_of_none_is_deleted_as_a_fresh_optimizer_has_none(kind: str, trained_steps: int) -> None:
    """megatron-core 0.14's ``ChainedOptimizer`` writes ``step: None`` into every param group
    of its members, at each save and load, where none holds a step: torch's optimizers,
    which count per parameter, and TE's ``FusedAdam`` before its first step. torch's step
    ignores it; TE's adds one to it and raises. A reset deletes it, counting no step."""
    build = GROUP_STEP_BUILDERS[kind]
    net = model()
    optimizer = build(net)
    train(net, optimizer, 0, trained_steps)
    for group in optimizer.param_groups:
        group["step"] = None
    if kind == "te":
        with pytest.raises(TypeError):
            train(clone_model(net), _with_none_steps(build), 0, 1)  # what Megatron's own load leaves

    report = opttree.reset(optimizer)

    assert all("step" not in group for group in optimizer.param_groups)
    assert report.steps == len(optimizer.state)
    assert trains_as_fresh(net, optimizer, build, trained_steps, 3)


def _with_none_steps(build: Callable[[torch.nn.Module], torch.optim.Optimizer]) -> torch.optim.Optimizer:
    optimizer = build(model())
    for group in optimizer.param_groups:
        group["step"] = None
    return optimizer


def test_a_partial_reset_leaves_a_group_step_of_none_where_it_leaves_steps() -> None:
    net = model()
    optimizer = torch.optim.AdamW([{"params": [p]} for p in net.parameters()])
    train(net, optimizer, 0, 2)
    for group in optimizer.param_groups:
        group["step"] = None
    first = optimizer.param_groups[0]["params"][0]

    opttree.reset(optimizer, params=[first], keys=["exp_avg", "exp_avg_sq", "step"])
    assert ["step" in group for group in optimizer.param_groups] == [False, True, True, True]

    opttree.reset(optimizer, keys=["exp_avg"])  # steps kept: so is what stands for one
    assert ["step" in group for group in optimizer.param_groups] == [False, True, True, True]


def refused_with_one_step_problem(optimizer: torch.optim.Optimizer, message: str) -> None:
    """validate reports one problem with the step counters, and reset refuses, changing nothing."""
    before = snapshot(optimizer)

    problems = opttree.validate(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizerState, match=message):
        opttree.reset(optimizer)

    assert unchanged(optimizer, before)
    assert [(p.kind, p.key) for p in problems] == [(opttree.ProblemKind.UNSUPPORTED_STATE, "step")]


@pytest.mark.parametrize("number", [3, 3.0], ids=["int", "float"])
def test_a_python_number_step_where_the_optimizer_counts_in_tensors_is_refused(number: float) -> None:
    """AdamW starts its steps as tensors and adds to them in place; torch's own step raises
    for a number. A reset to the number 0 would leave that state, not a fresh one's."""
    net, optimizer = trained()
    entry = next(iter(optimizer.state.values()))
    entry["step"] = number
    before = snapshot(optimizer)

    with pytest.raises(opttree.UnsupportedOptimizerState, match=rf"key 'step': step counter is an? {type(number).__name__} \(1 of 4 entries\) where AdamW starts it as a tensor"):
        opttree.reset(optimizer)

    assert unchanged(optimizer, before) and entry["step"] == number
    with pytest.raises(RuntimeError, match="singleton tensors"):  # torch's side: the state could not step either
        train(net, optimizer, 3, 1)


@pytest.mark.parametrize(
    ("counter", "what"),
    [
        (torch.tensor([3.0, 3.0]), "a float32 tensor of 2 values"),
        (torch.tensor([], dtype=torch.float32), "a float32 tensor of 0 values"),
        (torch.tensor(True), "a bool tensor"),
        (torch.tensor(3 + 0j), "a complex64 tensor"),
    ],
    ids=["two-values", "no-value", "bool", "complex"],
)
@pytest.mark.parametrize("where", ["state", "group"])
def test_a_step_tensor_that_does_not_hold_one_real_count_is_refused(counter: torch.Tensor, what: str, where: str) -> None:
    """Every optimizer counts steps in one real number: zeroed in place, a step of two
    values, none, a bool or a complex one would stay so, where a fresh optimizer's counts."""
    _, optimizer = trained()
    if where == "group":
        optimizer.param_groups[0]["step"] = counter
    else:
        list(optimizer.state.values())[-1]["step"] = counter

    refused_with_one_step_problem(optimizer, rf"key 'step': .*step counter.* {what}, where its optimizer counts steps in one real number")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64, torch.float64])
def test_a_per_parameter_step_tensor_of_a_dtype_no_fresh_optimizer_counts_in_is_refused(dtype: torch.dtype) -> None:
    """torch counts a tensor step in float32 (float64 where that is the default dtype):
    zeroed in place, a bfloat16 one stops counting exactly after 256 steps, an int64 one
    fails foreach's arithmetic, and a float64 one (loaded from a checkpoint of a run whose
    default dtype was float64: torch's load keeps a step's dtype) computes a compiled or
    differentiable step's bias correction in float64, where a fresh optimizer's does none of these."""
    _, optimizer = trained()
    list(optimizer.state.values())[-1]["step"] = torch.tensor(3, dtype=dtype)

    refused_with_one_step_problem(
        optimizer, rf"key 'step': step counter: 1 of its 4 are; the first is {str(dtype).removeprefix('torch.')}, where a fresh AdamW counts in a float32 tensor"
    )


@pytest.mark.parametrize(("default", "step_dtype"), [(torch.float32, torch.float64), (torch.float64, torch.float32)])
def test_a_step_loaded_from_a_run_of_another_default_dtype_trains_unlike_a_fresh_optimizer(default: torch.dtype, step_dtype: torch.dtype) -> None:
    """The other side: a step of the other float dtype zeroed in place (float64 loaded from
    a run of a float64 default; float32 under a float64 default, as Megatron's loads make
    it), and a differentiable step (bias correction computed with the step tensor) differs."""
    def train_on(optimizer: torch.optim.Optimizer, ps: list[torch.Tensor]) -> None:
        for k in range(5):
            ps[0].grad = torch.sin(ps[0].detach() * 3 + k)
            with torch.no_grad():
                optimizer.step()

    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(default)
        ps = [torch.randn(64, generator=torch.Generator().manual_seed(0)).requires_grad_() * 1.0]
        optimizer = torch.optim.Adam(ps, differentiable=True)
        train_on(optimizer, ps)
        with torch.no_grad():
            for entry in optimizer.state.values():
                for value in entry.values():
                    value.zero_()
            entry["step"] = entry["step"].to(step_dtype)
        fresh_ps = [ps[0].detach().clone().requires_grad_() * 1.0]
        fresh = torch.optim.Adam(fresh_ps, differentiable=True)
        train_on(optimizer, ps)
        train_on(fresh, fresh_ps)
        assert not torch.equal(ps[0], fresh_ps[0])
    finally:
        torch.set_default_dtype(previous)


def test_a_step_counts_in_float64_under_that_default_dtype_and_in_float32_when_fused() -> None:
    """No false refusal: what torch builds under a float64 default dtype, fused or not, in
    groups of one optimizer too."""
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        for fused in (False, True):
            net = model()
            optimizer = torch.optim.AdamW(net.parameters(), fused=fused)
            train(net, optimizer, 0, 2)
            assert {entry["step"].dtype for entry in optimizer.state.values()} == {torch.float32 if fused else torch.float64}
            assert opttree.validate(optimizer) == ()
            opttree.reset(optimizer)
        net = model()
        weights, biases = [p for p in net.parameters() if p.dim() == 2], [p for p in net.parameters() if p.dim() == 1]
        optimizer = torch.optim.AdamW([{"params": weights, "fused": True}, {"params": biases, "fused": False}])
        train(net, optimizer, 0, 2)
        assert [optimizer.state[p]["step"].dtype for p in (weights[0], biases[0])] == [torch.float32, torch.float64]
        assert opttree.validate(optimizer) == ()
        opttree.reset(optimizer)
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_of_the_other_groups_dtype_under_a_float64_default_is_refused(fused: bool) -> None:
    """Under a float64 default dtype a fresh AdamW counts in float64, and in float32 where
    fused: a float32 step in an unfused group (as Megatron's loads make one whatever the
    default) or a float64 one in a fused group stays so when zeroed."""
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        net = model()
        weights, biases = [p for p in net.parameters() if p.dim() == 2], [p for p in net.parameters() if p.dim() == 1]
        optimizer = torch.optim.AdamW([{"params": weights, "fused": True}, {"params": biases, "fused": False}])
        train(net, optimizer, 0, 2)
        moved = (weights if fused else biases)[0]
        optimizer.state[moved]["step"] = optimizer.state[moved]["step"].to(torch.float64 if fused else torch.float32)
        wrong, fresh = ("float64", "float32") if fused else ("float32", "float64")
        refused_with_one_step_problem(
            optimizer, rf"key 'step': step counter: 1 of its 4 are; the first is {wrong}, where a fresh AdamW counts in a {fresh} tensor"
        )
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_a_step_tensor_of_one_value_but_not_0_d_is_refused(shape: tuple[int, ...]) -> None:
    """torch builds a step as a 0-d tensor, and so do Megatron's loads; one of shape (1,),
    saved by other code and kept so by torch's load, would stay so when zeroed."""
    _, optimizer = trained()
    list(optimizer.state.values())[-1]["step"] = torch.full(shape, 3.0)

    refused_with_one_step_problem(
        optimizer, rf"key 'step': step counter: 1 of its 4 are; the first is of shape {re.escape(str(shape))}, where a fresh AdamW counts in a 0-d tensor"
    )


def test_a_step_of_shape_1_fails_a_differentiable_step_over_a_0_d_parameter() -> None:
    """torch's side: an Adam whose steps are of shape (1,) cannot step a 0-d parameter
    where computing with its step as a tensor, as a fresh one does."""
    temperature = torch.tensor(0.5, requires_grad=True) * 1.0
    fresh = torch.optim.Adam([temperature], differentiable=True)
    temperature.grad = torch.tensor(1.0)
    with torch.no_grad():
        fresh.step()
    fresh.state[temperature]["step"] = torch.zeros(1)
    temperature.grad = torch.tensor(1.0)
    with torch.no_grad(), pytest.raises(RuntimeError, match="shape"):
        fresh.step()


def test_a_single_value_step_tensor_of_any_real_dtype_is_zeroed_in_place() -> None:
    """A one-element int32 group step (TE's capturable FusedAdam keeps its group step so)
    counts, and a 0-d float32 step in state."""
    _, optimizer = trained()
    optimizer.param_groups[0]["step"] = counter = torch.tensor([7], dtype=torch.int32)
    entry = list(optimizer.state.values())[-1]
    entry["step"] = step = torch.tensor(7.0)

    opttree.reset(optimizer)

    assert optimizer.param_groups[0]["step"] is counter and not counter.any()
    assert entry["step"] is step and not step.any()


@pytest.mark.parametrize("missing", [1, 3])
def test_state_entries_holding_history_without_their_step_are_refused(missing: int) -> None:
    """AdamW builds an entry's step with its moments; one without it raises KeyError at
    the next step, and a reset that zeroed its moments would not be a fresh optimizer's."""
    net, optimizer = trained()
    for entry in list(optimizer.state.values())[:missing]:
        del entry["step"]

    refused_with_one_step_problem(optimizer, rf"key 'step': {missing} of its 4 state entries hold history but no step counter")
    with pytest.raises(KeyError, match="step"):  # torch's side
        train(net, optimizer, 3, 1)


def test_an_entry_holding_only_kept_state_is_not_missing_its_step() -> None:
    """A master copy set up before the first step is kept state, not history built
    without its step."""
    net, optimizer = trained()
    param = next(iter(net.parameters()))
    optimizer.state[param] = {"master_param": param.detach().double()}

    report = opttree.reset(optimizer)

    assert report.steps == len(optimizer.state) - 1 and "master_param" in optimizer.state[param]


@pytest.mark.parametrize("where", ["group", "state"])
def test_a_step_counter_that_is_not_a_number_is_refused_and_nothing_changes(where: str) -> None:
    _, optimizer = trained()
    if where == "group":
        optimizer.param_groups[0]["step"] = "3"
    else:
        next(iter(optimizer.state.values()))["step"] = [3]
    before = snapshot(optimizer)

    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'step': .*step counter is a (str|list)"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)
    assert [p.key for p in opttree.validate(optimizer)] == ["step"]


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_a_step_tensor_shared_by_several_parameters_is_counted_once_with_a_warning_and_unshared(inference: bool) -> None:
    """Megatron's CPU load path leaves parameters on one step tensor: torch's Adam then
    advances it once per parameter and step. A reset gives each parameter a step of its
    own, and training then matches a fresh optimizer's; zeroing the one in place would not.
    Those steps are normal tensors even where the reset runs in inference mode (as an RL
    rollout does): an inference tensor cannot be stepped outside it."""
    net, optimizer = trained()
    entries = list(optimizer.state.values())
    shared = entries[0]["step"]
    for entry in entries[1:]:
        entry["step"] = shared
    twin = clone_model(net)
    fresh = torch.optim.AdamW(twin.parameters())

    problems = opttree.validate(optimizer)
    with torch.inference_mode(inference):
        report = opttree.reset(optimizer)

    assert [(p.kind, p.severity) for p in problems] == [(opttree.ProblemKind.SHARED_STEP, opttree.Severity.WARNING)]
    assert f"({len(entries) - 1} repeats)" in problems[0].message
    assert not any(entry["step"].is_inference() for entry in entries)
    assert report.steps == 1 and not shared.any()
    assert entries[0]["step"] is shared and len({id(entry["step"]) for entry in entries}) == len(entries)
    assert all(not entry["exp_avg"].any() for entry in entries)
    train(net, optimizer, 3, 3)
    train(twin, fresh, 3, 3)
    assert weights_equal(net, twin)


def sparse_adam_trained(seed_steps: range) -> tuple[torch.nn.Embedding, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Embedding(10, 3, sparse=True)
    optimizer = torch.optim.SparseAdam(net.parameters(), lr=0.1)
    sparse_adam_train(net, optimizer, seed_steps)
    return net, optimizer


def sparse_adam_train(net: torch.nn.Embedding, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for i in steps:
        optimizer.zero_grad()
        generator = torch.Generator().manual_seed(i)
        (net(torch.randint(0, 10, (6,), generator=generator)) - 0.5).pow(2).mean().backward()
        optimizer.step()


@pytest.mark.parametrize("held", [np.int64(3), np.float64(3.0), 3.0], ids=["numpy-int", "numpy-float", "float"])
def test_a_number_step_of_any_real_kind_is_reset_to_the_int_the_optimizer_starts_from(held: float) -> None:
    """A NumPy integer step (as a loader may leave it) was refused as "an int64, expected
    a number", where a float was reset: every real number is one."""
    net, optimizer = sparse_adam_trained(range(3))
    for entry in optimizer.state.values():
        entry["step"] = held
    fresh_net = torch.nn.Embedding(10, 3, sparse=True)
    fresh_net.load_state_dict(net.state_dict())

    assert opttree.validate(optimizer) == ()
    assert opttree.reset(optimizer).steps == 1
    assert all(type(entry["step"]) is int and entry["step"] == 0 for entry in optimizer.state.values())
    fresh = torch.optim.SparseAdam(fresh_net.parameters(), lr=0.1)
    sparse_adam_train(net, optimizer, range(3, 5))
    sparse_adam_train(fresh_net, fresh, range(3, 5))
    assert torch.equal(net.weight, fresh_net.weight)


@pytest.mark.parametrize("in_place", [False, True], ids=["opttree", "zeroed-in-place"])
def test_a_tensor_step_where_the_optimizer_counts_in_ints_is_reset_to_the_int_it_starts_from(in_place: bool) -> None:
    """SparseAdam starts ``step`` as the int 0; a tensor step (as a loader may leave it)
    makes its bias correction compute in float32. A reset gives back the int, and training
    matches a fresh SparseAdam's; zeroing the tensor in place would not."""
    net, optimizer = sparse_adam_trained(range(3))
    for entry in optimizer.state.values():
        entry["step"] = torch.tensor(float(entry["step"]))
    fresh_net = torch.nn.Embedding(10, 3, sparse=True)
    fresh_net.load_state_dict(net.state_dict())
    fresh = torch.optim.SparseAdam(fresh_net.parameters(), lr=0.1)

    if in_place:
        for entry in optimizer.state.values():
            for value in entry.values():
                value.zero_()
    else:
        report = opttree.reset(optimizer)
        assert report.steps == 1
        assert all(type(entry["step"]) is int and entry["step"] == 0 for entry in optimizer.state.values())

    sparse_adam_train(net, optimizer, range(3, 6))
    sparse_adam_train(fresh_net, fresh, range(3, 6))
    assert torch.equal(net.weight, fresh_net.weight) is not in_place


def test_a_step_tensor_shared_where_the_optimizer_counts_in_ints_is_warned_of_and_reset_to_ints() -> None:
    """SparseAdam's ``state["step"] += 1`` advances a shared step tensor once per parameter."""
    torch.manual_seed(0)
    nets = torch.nn.ModuleList([torch.nn.Embedding(10, 3, sparse=True), torch.nn.Embedding(10, 3, sparse=True)])
    optimizer: torch.optim.Optimizer = torch.optim.SparseAdam(nets.parameters(), lr=0.1)
    for net in nets:
        net(torch.arange(4)).sum().backward()
    optimizer.step()
    shared = torch.tensor(1.0)
    for entry in optimizer.state.values():
        entry["step"] = shared

    problems = opttree.validate(optimizer)
    report = opttree.reset(optimizer)

    assert [(p.kind, p.severity) for p in problems] == [(opttree.ProblemKind.SHARED_STEP, opttree.Severity.WARNING)]
    assert report.steps == 1
    assert [entry["step"] for entry in optimizer.state.values()] == [0, 0]
    assert all(type(entry["step"]) is int for entry in optimizer.state.values())


class Stage(enum.IntEnum):
    """An int subclass with no member 0."""

    WARMUP = 1
    MAIN = 2


class Refusing(torch.Tensor):
    """A subclass whose own dispatch refuses every operation."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # torch's own way to turn it off

    @classmethod
    def __torch_dispatch__(cls, func: object, types: object, args: object = (), kwargs: object = None) -> object:  # type: ignore[override]  # torch's stub omits func
        raise AssertionError("a Refusing tensor refuses every operation")


ODD_STEPS: dict[str, Callable[[torch.optim.AdamW, torch.nn.Parameter], None]] = {
    "complex per-parameter steps": lambda o, a: o.state[a].update(step=torch.tensor(1 + 0j)),
    "a complex group step": lambda o, a: o.param_groups[0].update(step=torch.tensor(1 + 1j)),
    "an int group step beyond a float": lambda o, a: o.param_groups[0].update(step=10**400),
    "an int step beyond a float": lambda o, a: o.state[a].update(step=10**400),
    "an IntEnum step": lambda o, a: o.state[a].update(step=Stage.MAIN),
    "a group step that refuses every operation": lambda o, a: o.param_groups[0].update(
        step=torch.Tensor._make_subclass(Refusing, torch.tensor(1.0))
    ),
}


@pytest.mark.parametrize("odd", ODD_STEPS)
def test_odd_step_counters_are_reported_or_reset_never_raised_raw(odd: str) -> None:
    optimizer, a, _ = stepped_pair(3, 2)
    ODD_STEPS[odd](optimizer, a)

    opttree.validate(optimizer)
    assert "AdamW" in opttree.describe(optimizer)
    try:
        opttree.reset(optimizer)
    except opttree.OptTreeError:
        return
    steps = [entry["step"] for entry in optimizer.state.values()]
    assert all(not step.any() if isinstance(step, torch.Tensor) else step == 0 for step in steps)
    assert all(type(step) in (int, float, torch.Tensor) for step in steps)  # an int subclass becomes the int 0


class SharedAdam(torch.optim.Adam):
    """The A3C "SharedAdam": builds its state in __init__, the step of shape (1,), to share
    it across processes; registered with Adam's schema, as the README says to."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, lr=1e-2)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].update(step=torch.zeros(1), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))


adam_schema = opttree.schema_for(torch.optim.Adam)
assert adam_schema is not None
opttree.register_schema(SharedAdam, adam_schema)


def test_a_class_registered_with_a_schema_builds_its_steps_as_it_does() -> None:
    """The 0-d shape and exact dtype of a fresh step are torch's classes' own: a user's
    class, registered with their schema, may build its step otherwise (SharedAdam's is of
    shape (1,)); its steps are still counted in a float dtype torch counts in."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = SharedAdam([param])
    for _ in range(3):
        param.grad = torch.ones(3)
        optimizer.step()

    assert opttree.reset(optimizer).steps == 1 and optimizer.state[param]["step"].shape == (1,)
    optimizer.state[param]["step"] = torch.zeros(1, dtype=torch.bfloat16)
    refused_with_one_step_problem(optimizer, r"key 'step': step counter: it is bfloat16, where a fresh SharedAdam counts in a float32 tensor")


class ScheduleFreeSGD(torch.optim.Optimizer):
    """A schedule-free SGD in the shape of facebookresearch's: each param group counts its
    steps ``k`` and the weight of its average ``weight_sum``, made there by ``setdefault``
    at the first step; each parameter's ``z`` is built as a copy of it, and the weights
    average toward it, by a share that shrinks as ``weight_sum`` grows."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            group["k"] = group.setdefault("k", 0) + 1
            group["weight_sum"] = group.setdefault("weight_sum", 0.0) + group["lr"] * group["k"]
            share = group["lr"] * group["k"] / group["weight_sum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                z = self.state[p].setdefault("z", p.detach().clone())
                z.sub_(p.grad, alpha=group["lr"])
                p.lerp_(z, share)


class CountersLeftOut(ScheduleFreeSGD):
    """The same, registered with a schema that leaves its group counters out."""


class CountersFromInit(ScheduleFreeSGD):
    """The same, with its counters put in each group by ``__init__``, not by the first step."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 0.1) -> None:
        super().__init__(params, lr)
        for group in self.param_groups:
            group["k"], group["weight_sum"] = 0, 0.0


opttree.register_schema(CountersLeftOut, opttree.StateSchema(drop={"z"}, rebuilds_missing=True))
opttree.register_schema(ScheduleFreeSGD, opttree.StateSchema(drop={"z"}, rebuilds_missing=True, group_counters={"k": None, "weight_sum": None}))
opttree.register_schema(CountersFromInit, opttree.StateSchema(drop={"z"}, rebuilds_missing=True, group_counters={"k": 0, "weight_sum": 0.0}))


def schedule_free(cls: type[ScheduleFreeSGD], net: torch.nn.Module) -> ScheduleFreeSGD:
    return cls([p for p in net.parameters() if isinstance(p, torch.nn.Parameter)])


@pytest.mark.parametrize(("cls", "exact"), [(ScheduleFreeSGD, True), (CountersFromInit, True), (CountersLeftOut, False)])
def test_counters_a_schema_names_in_param_groups_are_set_back_as_a_fresh_group_holds_them(cls: type[ScheduleFreeSGD], exact: bool) -> None:
    """A group's counters other than ``step`` (``group_counters``) are set back to what
    they start as in a fresh group, or deleted where it has none until its first step:
    the reset trains as a fresh optimizer (deleting one that ``__init__`` makes made the
    next step raise). A schema that leaves them out keeps them, and trained unlike a fresh
    one: opttree cannot tell them from settings a user gave the group."""
    net = model()
    optimizer = schedule_free(cls, net)
    train(net, optimizer, 0, 3)
    assert optimizer.param_groups[0]["k"] == 3

    assert opttree.validate(optimizer) == ()
    opttree.reset(optimizer)

    assert optimizer.param_groups[0].get("k") == {ScheduleFreeSGD: None, CountersFromInit: 0, CountersLeftOut: 3}[cls]
    assert trains_as_fresh(net, optimizer, lambda twin: schedule_free(cls, twin), 3, 3) is exact


def test_group_counters_go_with_the_steps() -> None:
    """``keys`` naming ``"step"`` takes a group's counters, though its schema has no step
    counter of its own (it was refused as naming no key the optimizer has); a reset that
    keeps steps keeps them; one that takes part of a group with its steps is refused,
    naming them; a counter that is no number is refused, changing nothing."""
    net = model()
    optimizer = schedule_free(ScheduleFreeSGD, net)
    train(net, optimizer, 0, 3)
    first = next(iter(optimizer.state))

    opttree.reset(optimizer, keys=["z"])
    assert (optimizer.param_groups[0]["k"], "z" in optimizer.state[first]) == (3, False)
    train(net, optimizer, 3, 1)
    with pytest.raises(opttree.PartialResetRefused, match=r"param group 0 counts 'k' and 'weight_sum' for its 4 parameters and 1 are selected"):
        opttree.reset(optimizer, params=[first], keys=["z", "step"])
    report = opttree.reset(optimizer, keys=["step"])
    assert "k" not in optimizer.param_groups[0] and "z" in optimizer.state[first]
    assert report.steps == 2  # k and weight_sum, counted as the counters they are

    train(net, optimizer, 4, 1)
    optimizer.param_groups[0]["k"] = torch.tensor(1)
    before = snapshot(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'k': param group 0's counter 'k' is a Tensor, expected a number"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before) and optimizer.param_groups[0]["weight_sum"] > 0


class CountersInDefaults(ScheduleFreeSGD):
    """The same, with its counters among its defaults, so that a HybridDeviceOptimizer's
    constructor takes them as keyword arguments and its param groups hold them."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 0.1, k: int = 0, weight_sum: float = 0.0) -> None:
        torch.optim.Optimizer.__init__(self, params, {"lr": lr, "k": k, "weight_sum": weight_sum})


opttree.register_schema(CountersInDefaults, opttree.StateSchema(drop={"z"}, rebuilds_missing=True, group_counters={"k": 0, "weight_sum": 0.0}))


@pytest.mark.parametrize(("cls", "options"), [(ScheduleFreeSGD, {}), (CountersInDefaults, {"k": 0, "weight_sum": 0.0})], ids=["counters-in-sub-groups", "counters-in-defaults"])
def test_a_hybrid_whose_groups_hold_a_counter_it_copies_over_a_reset_one_is_refused(cls: type[ScheduleFreeSGD], options: dict[str, object]) -> None:
    """HybridDeviceOptimizer copies its own groups' options over its sub-optimizers' at
    every step. Where they lack a sub-optimizer's group counters, or hold them as its
    defaults do (from its constructor's keyword arguments, as a fresh one's do), a reset
    trains as a fresh hybrid. One holding a counter otherwise (put there by hand, or by a
    load of groups that held it) would copy it over the counter a reset sets back: a
    reset of the sub-optimizers alone trains unlike a fresh hybrid, and a reset of the
    hybrid is refused, naming the counter, with nothing changed."""
    from tests.megatron_parts import Hybrid, hybrid, train_hybrid

    def fresh_trains_as(stack: Hybrid) -> bool:
        twin = hybrid([4, 3], cpu_optimizer_cls=cls, like=stack[1], options=options)
        train_hybrid(stack, 3, 2)
        train_hybrid(twin, 3, 2)
        return all(torch.equal(a, b) for a, b in zip(stack[1], twin[1], strict=True))

    stack = hybrid([4, 3], cpu_optimizer_cls=cls, options=options)
    train_hybrid(stack, 0, 3)
    assert opttree.validate(stack[0]) == ()
    opttree.reset(stack[0])
    assert fresh_trains_as(stack)

    stack = hybrid([4, 3], cpu_optimizer_cls=cls, options=options)
    train_hybrid(stack, 0, 3)
    for group in stack[0].param_groups:
        group.update(k=3, weight_sum=0.6)
    problems = opttree.validate(stack[0])
    assert [p.key for p in problems] == ["k", "weight_sum"] * len(stack[0].sub_optimizers)
    assert "HybridDeviceOptimizer's param group holds its counter 'k' (3), which it copies into this group at every step" in problems[0].message
    before = [snapshot(sub) for sub in stack[0].sub_optimizers]
    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'k': HybridDeviceOptimizer's param group holds its counter 'k' \(3\)"):
        opttree.reset(stack[0])
    assert all(unchanged(sub, kept) for sub, kept in zip(stack[0].sub_optimizers, before, strict=True))
    counted = [group["k"] for sub in stack[0].sub_optimizers for group in sub.param_groups]
    assert opttree.reset(stack[0], keys=["z"]).steps == 0  # keeps the counters, as the hybrid's copies are kept
    assert [group["k"] for sub in stack[0].sub_optimizers for group in sub.param_groups] == counted

    for sub in stack[0].sub_optimizers:
        opttree.reset(sub)
    assert not fresh_trains_as(stack)


def test_a_hybrids_copied_counters_are_read_only_where_the_reset_takes_their_steps_and_reported_whatever_they_hold() -> None:
    """A hybrid's group holding a counter spoils only a reset of the steps of the
    sub-optimizer groups it is copied into: a reset of another group's parameters (and
    steps) is not refused, and they train as a fresh hybrid's. A counter too large to
    print, or defaults whose own ``get`` raises, are reported, not raised."""
    from opttree.testing import cuda_on_cpu
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
    from tests.megatron_parts import Hybrid, train_hybrid

    def two_groups(like: list[torch.nn.Parameter] | None = None) -> Hybrid:
        device = cuda_on_cpu()
        values = [torch.linspace(-1, 1, n) for n in (4, 3)] if like is None else [weight.detach().clone() for weight in like]
        params = [torch.nn.Parameter(value) for value in values]
        device.mark_on_gpu(*params)
        with device:
            groups: list[dict[str, object]] = [{"params": params[:1]}, {"params": params[1:]}]
            hybrid = HybridDeviceOptimizer(groups, offload_fraction=1.0, cpu_optimizer_cls=CountersFromInit, gpu_optimizer_cls=CountersFromInit, lr=0.1)
        return hybrid, params, device

    stack = two_groups()
    train_hybrid(stack, 0, 3)
    stack[0].param_groups[0].update(k=3, weight_sum=0.6)
    second = stack[1][1]
    assert opttree.reset(stack[0], params=[second], keys=["step", "z"]).steps == 2  # the second group's k and weight_sum: CountersFromInit counts in its groups alone
    fresh = two_groups(like=stack[1])
    train_hybrid(stack, 3, 3)
    train_hybrid(fresh, 3, 3)
    assert torch.equal(second, fresh[1][1])

    stack[0].param_groups[0]["k"] = 10**5000
    problems = opttree.validate(stack[0])
    assert [p.key for p in problems] == ["k", "weight_sum"] and "holds its counter 'k' (an int beyond a float's range)" in problems[0].message

    class Raising(dict[str, object]):
        def get(self, key: str, default: object = None) -> object:
            raise RuntimeError(key)

    stack[0].defaults = Raising(stack[0].defaults)
    stack[0].param_groups[0]["k"] = 0
    assert [p.key for p in opttree.validate(stack[0])] == ["k", "weight_sum"]
    with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'k'"):
        opttree.reset(stack[0])


class IterationAdam(torch.optim.Optimizer):
    """An Adam that counts its steps in one number, ``self.iteration``, for all its
    parameters (as some research optimizers do), and builds each parameter's moments at
    its first step."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})
        self.iteration = 0

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        self.iteration = self.next_iteration()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["exp_avg"].lerp_(p.grad, 0.1)
                state["exp_avg_sq"].mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                corrected = state["exp_avg_sq"] / (1 - 0.999**self.iteration)
                p.addcdiv_(state["exp_avg"], corrected.sqrt().add_(1e-8), value=-group["lr"] / (1 - 0.9**self.iteration))

    def next_iteration(self) -> int:
        return self.iteration + 1


class IterationFromFirstStep(IterationAdam):
    """The same, with no ``iteration`` until its first step makes it."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 0.01) -> None:
        torch.optim.Optimizer.__init__(self, params, {"lr": lr})

    def next_iteration(self) -> int:
        return int(getattr(self, "iteration", 0)) + 1


class IterationLeftOut(IterationAdam):
    """The same, registered with a schema that leaves its counter out."""


_moments = opttree.StateSchema(zero={"exp_avg", "exp_avg_sq"}, rebuilds_missing=True)
opttree.register_schema(IterationAdam, attrs.evolve(_moments, attribute_counters={"iteration": 0}))
opttree.register_schema(IterationFromFirstStep, attrs.evolve(_moments, attribute_counters={"iteration": None}))
opttree.register_schema(IterationLeftOut, _moments)


@pytest.mark.parametrize(("cls", "exact"), [(IterationAdam, True), (IterationFromFirstStep, True), (IterationLeftOut, False)])
def test_counters_a_schema_names_in_attributes_are_set_back_as_a_fresh_optimizer_holds_them(cls: type[IterationAdam], exact: bool) -> None:
    """A number an optimizer counts its steps in, held in an instance attribute
    (``attribute_counters``), is set back to what it starts as, or deleted where a fresh
    optimizer has none until its first step: the reset trains as a fresh optimizer. A
    schema that leaves it out keeps it, and trained unlike a fresh one (its bias
    correction no longer that of a first step)."""
    net = model()
    optimizer = cls([p for p in net.parameters() if isinstance(p, torch.nn.Parameter)])
    train(net, optimizer, 0, 3)
    assert optimizer.iteration == 3

    assert opttree.validate(optimizer) == ()
    opttree.reset(optimizer)

    assert getattr(optimizer, "iteration", None) == {IterationAdam: 0, IterationFromFirstStep: None, IterationLeftOut: 3}[cls]
    assert trains_as_fresh(net, optimizer, lambda twin: cls([p for p in twin.parameters() if isinstance(p, torch.nn.Parameter)]), 3, 3) is exact


def test_attribute_counters_go_with_the_steps_of_all_the_parameters() -> None:
    """A reset that keeps steps keeps the counter; ``keys=["step"]`` takes it; one taking
    the steps of some of the parameters is refused, naming it, since it counts for all;
    a counter that is no number is refused, changing nothing; a schema may not name one
    attribute as a counter and in another attribute field."""
    net = model()
    params = [p for p in net.parameters() if isinstance(p, torch.nn.Parameter)]
    optimizer = IterationAdam(params)
    train(net, optimizer, 0, 3)

    opttree.reset(optimizer, keys=["exp_avg"])
    assert optimizer.iteration == 3
    with pytest.raises(opttree.PartialResetRefused, match=r"its iteration takes part in counting the steps of all its 4 parameters and 1 are selected"):
        opttree.reset(optimizer, params=params[:1], keys=["exp_avg", "step"])
    assert opttree.reset(optimizer, params=params[:1], keys=["exp_avg"]).tensors_zeroed == 1 and optimizer.iteration == 3
    report = opttree.reset(optimizer, keys=["step"])
    assert optimizer.iteration == 0 and all(entry["exp_avg_sq"].any() for entry in optimizer.state.values())
    assert report.steps == 1  # the counter, though the optimizer keeps no per-parameter step

    train(net, optimizer, 3, 1)
    optimizer.iteration = torch.tensor(1)  # type: ignore[assignment]
    before = snapshot(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'iteration': its counter 'iteration' is a Tensor, expected a number"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)

    with pytest.raises(opttree.RegistrationError, match=r"attributes \['iteration'\] are named in both cached and attribute_counters"):
        opttree.StateSchema(cached={"iteration"}, attribute_counters={"iteration": 0})
    with pytest.raises(opttree.RegistrationError, match="attribute_counters maps 'iteration' to a str"):
        opttree.StateSchema(attribute_counters={"iteration": "zero"})  # type: ignore[dict-item]


class IterationProperty(IterationFromFirstStep):
    """Counts in ``_iteration`` behind a property ``iteration``, which reads 0 without it."""

    @property
    def iteration(self) -> int:
        return int(getattr(self, "_iteration", 0))

    @iteration.setter
    def iteration(self, value: int) -> None:
        self._iteration = value


class IterationGuarded(IterationAdam):
    """Sets its attributes through a ``__setattr__`` of its own, which refuses a counter set back."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "iteration" and isinstance(value, int) and value < getattr(self, "iteration", 0):
            raise RuntimeError("iteration goes forward only")
        super().__setattr__(name, value)


class StepNamed(IterationAdam):
    """Registered with a counter named as its own method."""


opttree.register_schema(IterationProperty, attrs.evolve(_moments, attribute_counters={"iteration": None}))
opttree.register_schema(IterationGuarded, attrs.evolve(_moments, attribute_counters={"iteration": 0}))
opttree.register_schema(StepNamed, attrs.evolve(_moments, attribute_counters={"step": 0}))


@pytest.mark.parametrize(
    ("cls", "said"),
    [
        (IterationProperty, "IterationProperty declares 'iteration' (a property)"),
        (IterationGuarded, "IterationGuarded sets attributes by code of its own"),
        (StepNamed, "StepNamed declares 'step' (a function)"),
    ],
)
def test_an_attribute_counter_the_class_declares_or_writes_by_its_own_code_is_refused(cls: type[IterationAdam], said: str) -> None:
    """opttree sets a counter back in the instance's own attributes: one behind a
    property was kept (the reset trained unlike a fresh optimizer, validate silent), and
    one whose write the class refuses, or a name the class gives a method, broke the reset
    or the optimizer after the history was zeroed. Refused, with nothing changed."""
    net = model()
    optimizer = cls([p for p in net.parameters() if isinstance(p, torch.nn.Parameter)])
    train(net, optimizer, 0, 3)
    before = snapshot(optimizer)

    with pytest.raises(opttree.UnsupportedOptimizerState, match=re.escape(said) + ": opttree sets a counter back in the instance's own attributes only"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before) and optimizer.iteration == 3
    with pytest.raises(opttree.RegistrationError, match=r"attribute_counters names \[''\], which are no attribute names"):
        opttree.StateSchema(attribute_counters={"": 0})


def test_a_full_reset_sets_back_the_attribute_counter_of_an_optimizer_without_parameters() -> None:
    """A rank may hold no parameter of such a leaf: its counter counted on all the same,
    and a full reset sets it back (it kept it, as it took no parameter's steps)."""
    optimizer = IterationAdam([{"params": []}])  # type: ignore[list-item]  # an empty group, which torch's Optimizer takes
    for _ in range(3):
        optimizer.step()

    opttree.reset(optimizer)

    assert optimizer.iteration == 0


@pytest.mark.parametrize(
    ("counters", "message"),
    [({"step": None}, "'step'"), ({"params": None}, "'params'"), ({"k": "zero"}, "group_counters maps 'k' to a str"), ({"k": True}, "group_counters maps 'k' to a bool")],
)
def test_group_counters_name_neither_the_step_nor_the_parameters_and_start_as_numbers(counters: dict[str, object], message: str) -> None:
    with pytest.raises(opttree.RegistrationError, match=re.escape(message)):
        opttree.StateSchema(group_counters=counters)  # type: ignore[arg-type]
