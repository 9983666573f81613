"""Stale master copies: weights written into the model out of band leave the copies a
wrapper steps behind; ``validate(model=...)`` names each one, ``sync_masters`` makes them
equal again (through Megatron's ``reload_model_params()`` where the stack has it), and then
a reset trains like a stack freshly built over the new weights."""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping

import pytest
import torch

import opttree
from opttree import testing
from tests import megatron_parts
from tests.copying import CopyingWrapper
from tests.helpers import Refuse, RefuseCalls

K = 3


def write_new_weights(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.25)


@pytest.mark.parametrize("name", ["bf16", "dist_bf16", "offload_0.75"])
def test_stale_masters_are_named_synced_and_then_reset_trains_like_a_fresh_stack(name: str) -> None:
    stack = testing.build(name)
    stack.train(0, K)
    assert opttree.validate(stack.optimizer, model=stack.model) == ()

    write_new_weights(stack.model)

    stale = opttree.validate(stack.optimizer, model=stack.model)
    assert stale and all(p.kind is opttree.ProblemKind.STALE_MASTER for p in stale)
    names = {n for n, _ in stack.model.named_parameters()}
    assert all(any(n in p.message for n in names) for p in stale)
    assert opttree.validate(stack.optimizer) == ()  # without the model, nothing to compare

    with stack.device:
        report = opttree.sync_masters(stack.optimizer, model=stack.model)

    assert report.stale == len(stale) and report.reloaded and report.written == ()
    assert opttree.validate(stack.optimizer, model=stack.model) == ()
    opttree.reset(stack.optimizer)
    fresh = testing.build(name)
    with torch.no_grad():
        for a, b in zip(fresh.model.parameters(), stack.model.parameters(), strict=True):
            a.copy_(b)
    with fresh.device:
        fresh.optimizer.reload_model_params()
    stack.train(K, K)
    fresh.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(stack.main_params(), fresh.main_params(), strict=True))


def test_without_a_reload_opttree_writes_the_copies_and_says_which() -> None:
    """A bare HybridDeviceOptimizer has no reload_model_params(): opttree copies its CPU
    copies from the parameters itself."""
    optimizer, params, device = megatron_parts.hybrid([8, 5])
    megatron_parts.train_hybrid((optimizer, params, device), 0, 2)
    with torch.no_grad():
        for p in params:
            p.mul_(2.0)
    assert len(opttree.validate(optimizer, model=torch.nn.ParameterList(params))) == 2

    report = opttree.sync_masters(optimizer, model=torch.nn.ParameterList(params))

    assert not report.reloaded and len(report.written) == 2 and "differs from the model's weights" in report.written[0]
    assert not report.written[0].startswith("error") and ": before it was written, its copy of" in report.written[0]  # what was wrong, not an error now
    assert opttree.validate(optimizer, model=torch.nn.ParameterList(params)) == ()


def test_a_hybrid_sub_optimizers_master_param_is_checked_too() -> None:
    """With param_update_in_fp32, HybridDeviceOptimizer keeps three copies per parameter:
    param_to_fp32_param, the sub-optimizer's parameter, and its state's master_param."""
    stack = testing.build("offload_0.75")
    stack.train(0, K)
    masters = [entry["master_param"] for leaf in stack.leaves() for entry in leaf.state.values() if "master_param" in entry]
    assert masters
    with torch.no_grad():
        masters[0].add_(1.0)

    (problem,) = opttree.validate(stack.optimizer, model=stack.model)

    assert problem.kind is opttree.ProblemKind.STALE_MASTER and problem.cls == "HybridDeviceOptimizer"
    with stack.device:
        report = opttree.sync_masters(stack.optimizer, model=stack.model)
    assert report.stale == 1 and opttree.validate(stack.optimizer, model=stack.model) == ()


@pytest.mark.parametrize("mode", [Refuse, RefuseCalls], ids=["dispatch", "function"])
def test_validate_and_sync_masters_run_under_none_of_the_callers_modes(mode: type[Refuse] | type[RefuseCalls]) -> None:
    """A dispatch or torch function mode active where training code calls opttree (one
    that refuses every operation, here) sees none of the comparisons and writes: they run
    as plain torch calls, as a reset's do, so validate reports and sync writes as without
    the mode."""
    optimizer, params, device = megatron_parts.hybrid([8, 5])
    megatron_parts.train_hybrid((optimizer, params, device), 0, 2)
    with torch.no_grad():
        for p in params:
            p.mul_(2.0)
    model = torch.nn.ParameterList(params)
    outside = opttree.validate(optimizer, model=model)

    with mode():
        inside = opttree.validate(optimizer, model=model)
        report = opttree.sync_masters(optimizer, model=model)

    assert [p.kind for p in inside] == [opttree.ProblemKind.STALE_MASTER] * 2 and inside == outside
    assert len(report.written) == 2 and opttree.validate(optimizer, model=model) == ()


def _holder(second: torch.Tensor) -> CopyingWrapper:
    """Two parameters whose copies are both stale: the first a plain tensor, the second ``second``."""
    params = [torch.nn.Parameter(torch.full((4,), 2.0)), torch.nn.Parameter(torch.full((3,), 2.0))]
    return CopyingWrapper(params, [torch.ones(4), second])


def test_a_sync_that_cannot_write_a_stale_copy_writes_none() -> None:
    """An inference tensor cannot be written outside inference mode, nor stepped: had sync
    copied the first stale copy before reaching it, it would have left the stack half
    synced. Inside inference mode too, where it could be written, no step outside could
    update it."""
    with torch.inference_mode():
        frozen = torch.ones(3)
    holder = _holder(frozen)
    model = torch.nn.ParameterList(holder.params)
    assert [p.kind for p in opttree.validate(holder, model=model)] == [opttree.ProblemKind.STALE_MASTER] * 2

    with pytest.raises(opttree.StaleMaster, match=r"CopyingWrapper at <root>: its copy of 1 is stale and cannot be written: it is an inference tensor"):
        opttree.sync_masters(holder, model=model)

    assert holder.copies[0].tolist() == [1.0] * 4 and frozen.tolist() == [1.0] * 3
    with torch.inference_mode(), pytest.raises(opttree.StaleMaster, match="it is an inference tensor"):
        opttree.sync_masters(holder, model=model)
    assert holder.copies[0].tolist() == [1.0] * 4 and frozen.tolist() == [1.0] * 3


def test_a_copy_that_cannot_be_compared_is_reported_and_refused_not_raised_from() -> None:
    """A meta copy has no values to compare: validate warns about it (torch itself would
    raise from the comparison), and sync refuses, having written nothing."""
    holder = _holder(torch.empty(3, device="meta"))
    model = torch.nn.ParameterList(holder.params)

    problems = opttree.validate(holder, model=model)

    kinds = sorted(p.kind.value for p in problems)
    assert kinds == ["stale-master", "unchecked-master"]
    unchecked = next(p for p in problems if p.kind is opttree.ProblemKind.UNCHECKED_MASTER)
    assert unchecked.severity is opttree.Severity.WARNING and "copy of 1 cannot be compared with the model's weights" in unchecked.message
    with pytest.raises(opttree.StaleMaster, match="cannot be compared"):
        opttree.sync_masters(holder, model=model)
    assert holder.copies[0].tolist() == [1.0] * 4


@pytest.mark.skipif("offload_1.0" not in testing.available(), reason="no offload_1.0 recipe in this lane")
def test_a_copy_whose_storage_was_freed_is_reported_not_read() -> None:
    """A master copy whose storage was given back (``untyped_storage().resize_(0)``, as
    offloading does): comparing it read freed memory, and ``validate(model=)`` and
    ``sync_masters`` ended the process with a segfault. It is reported as not compared,
    and a sync refuses it, writing nothing."""
    stack = testing.build("offload_1.0")
    stack.train(0, 2)
    leaf = stack.leaves()[0]
    entry = next(entry for entry in leaf.state.values() if "master_param" in entry)
    entry["master_param"].untyped_storage().resize_(0)
    weights = [param.detach().clone() for param in stack.model.parameters()]

    problems = opttree.validate(stack.optimizer, model=stack.model)

    unchecked = [p for p in problems if p.kind is opttree.ProblemKind.UNCHECKED_MASTER]
    assert unchecked and "its memory cannot be read: a tensor whose storage is freed" in unchecked[0].message
    with pytest.raises(opttree.StaleMaster, match="its memory cannot be read"):
        opttree.sync_masters(stack.optimizer, model=stack.model)
    assert all(torch.equal(a, b) for a, b in zip(stack.model.parameters(), weights, strict=True))


def _expanded() -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    return [torch.nn.Parameter(torch.full((4,), 2.0)), torch.nn.Parameter(torch.arange(3.0))], [torch.ones(4), torch.ones(1).expand(3)]


def _over_another_parameter() -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    first, second = torch.nn.Parameter(torch.full((3,), 5.0)), torch.nn.Parameter(torch.full((3,), 7.0))
    return [first, second], [second.detach(), torch.full((3,), 7.0)]


def _over_each_other() -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    buffer = torch.zeros(4)
    return [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.full((3,), 2.0))], [buffer[0:3], buffer[1:4]]


def _too_narrow() -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    return [torch.nn.Parameter(torch.full((4,), 2.0)), torch.nn.Parameter(torch.tensor([1.0001, 2.0003]))], [
        torch.ones(4),
        torch.ones(2, dtype=torch.bfloat16),
    ]


UNSYNCABLE = {
    "expanded": (_expanded, "elements share or may share memory"),
    "over-another-parameter": (_over_another_parameter, "shares memory with the parameter 1"),
    "over-each-other": (_over_each_other, "shares memory with the copy of"),
    "too-narrow": (_too_narrow, "a torch.bfloat16 tensor, which cannot hold the model's torch.float32 values"),
}


@pytest.mark.parametrize("kind", UNSYNCABLE)
def test_a_sync_whose_writes_would_fail_or_go_wrong_writes_nothing(kind: str) -> None:
    """Each of these, written, raised half-way (an expanded copy), wrote into a model
    weight or another copy, or stayed stale while sync reported it written."""
    build, reason = UNSYNCABLE[kind]
    params, copies = build()
    holder = CopyingWrapper(params, copies)
    model = torch.nn.ParameterList(params)
    before = [t.detach().clone() for t in (*params, *copies)]
    assert any(p.kind is opttree.ProblemKind.STALE_MASTER for p in opttree.validate(holder, model=model))

    with pytest.raises(opttree.StaleMaster, match=reason):
        opttree.sync_masters(holder, model=model)

    assert all(torch.equal(a, b) for a, b in zip((*params, *copies), before, strict=True))


def test_nan_weights_held_by_their_copies_are_not_stale() -> None:
    params = [torch.nn.Parameter(torch.tensor([float("nan"), 1.0]))]
    holder = CopyingWrapper(params)
    assert opttree.validate(holder, model=torch.nn.ParameterList(params)) == ()
    holder.copies[0][1] = 2.0
    (problem,) = opttree.validate(holder, model=torch.nn.ParameterList(params))
    assert problem.kind is opttree.ProblemKind.STALE_MASTER and "in 1 of 2 elements" in problem.message


def test_a_wrapper_naming_something_else_as_a_parameter_is_reported() -> None:
    holder = CopyingWrapper([torch.nn.Parameter(torch.ones(2))])
    holder.params = [None]  # type: ignore[list-item]  # what a faulty inner_params may yield

    (problem,) = opttree.validate(holder, model=torch.nn.Linear(1, 1))

    assert problem.kind is opttree.ProblemKind.UNCHECKED_MASTER and "names a NoneType as a parameter" in problem.message
    with pytest.raises(opttree.StaleMaster, match="names a NoneType"):
        opttree.sync_masters(holder)


def test_a_sync_never_writes_over_a_copy_left_alone_or_a_parameter_the_wrappers_do_not_hold() -> None:
    """The memory a sync must leave alone is every model parameter, held by a wrapper or
    not (a frozen one), and every copy that is not stale."""
    shared = torch.full((3,), 2.0)
    first, second = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.full((3,), 2.0))
    holder = CopyingWrapper([first, second], [shared[:], shared.view(3)])  # the second is not stale
    with pytest.raises(opttree.StaleMaster, match="its copy of 0 shares memory with the copy of 1"):
        opttree.sync_masters(holder, model=torch.nn.ParameterList([first, second]))
    assert shared.tolist() == [2.0] * 3

    trained_weight, frozen = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.full((3,), 9.0), requires_grad=False)
    holder = CopyingWrapper([trained_weight], [frozen.detach()])
    model = torch.nn.ParameterDict({"trained": trained_weight, "frozen": frozen})
    with pytest.raises(opttree.StaleMaster, match="shares memory with the parameter frozen"):
        opttree.sync_masters(holder, model=model)
    assert frozen.tolist() == [9.0] * 3


class FailingCopies(CopyingWrapper):
    """A wrapper whose registered inner_params fails: it has more copies than parameters,
    which CopyingWrapper's pairs strictly."""


def test_a_failing_inner_params_function_is_a_malformed_wrapper_everywhere_it_is_read() -> None:
    params = [torch.nn.Parameter(torch.ones(2))]
    holder = FailingCopies(params, [torch.ones(2), torch.ones(2)])
    model = torch.nn.ParameterList(params)

    (problem,) = opttree.validate(holder, model=model)

    assert problem.kind is opttree.ProblemKind.MALFORMED_WRAPPER and "its inner_params function failed: ValueError" in problem.message
    with pytest.raises(opttree.MalformedWrapper, match="inner_params function failed"):
        opttree.sync_masters(holder, model=model)
    with pytest.raises(opttree.MalformedWrapper, match="inner_params function failed"):
        opttree.reset(holder, params=params)


class Sharded(CopyingWrapper):
    """A wrapper keeping a shard of each parameter, which says where in a range map, as
    DistributedOptimizer's ``_get_model_param_range_map`` does."""

    def _get_model_param_range_map(self, param: torch.Tensor) -> dict[str, object]:
        return {"param": types.SimpleNamespace(start=-4, end=-1)}


def test_a_shard_outside_its_parameter_is_not_known() -> None:
    params = [torch.nn.Parameter(torch.ones(8))]
    holder = Sharded(params, [torch.zeros(3)])
    (problem,) = opttree.validate(holder, model=torch.nn.ParameterList(params))
    assert problem.kind is opttree.ProblemKind.UNCHECKED_MASTER and "cannot tell which part of 0" in problem.message


def test_a_chain_of_copies_is_synced_link_by_link() -> None:
    """An inner wrapper stepping copies of an outer wrapper's copies: the outer copy is
    stale, and the inner one, equal to it until it is written, must follow it."""
    param = torch.nn.Parameter(torch.ones(3))
    outer = CopyingWrapper([param])
    inner = CopyingWrapper([torch.nn.Parameter(outer.copies[0])])
    inner.params = [outer.copies[0]]  # type: ignore[list-item]  # the inner wrapper's parameter is the outer's copy
    outer.optimizer = inner  # type: ignore[assignment]  # the outer steps through the inner
    model = torch.nn.ParameterList([param])
    with torch.no_grad():
        param.fill_(2.0)
    (problem,) = opttree.validate(outer, model=model)
    assert problem.kind is opttree.ProblemKind.STALE_MASTER and problem.path == "<root>"

    report = opttree.sync_masters(outer, model=model)

    assert outer.copies[0].tolist() == inner.copies[0].tolist() == [2.0] * 3
    assert len(report.written) == 2 and "stands for a copy written before it" in report.written[1]
    assert opttree.validate(outer, model=model) == ()


def test_a_hybrid_whose_sub_optimizer_state_raises_is_reported_by_the_master_check() -> None:
    optimizer, params, device = megatron_parts.hybrid([4, 3])
    megatron_parts.train_hybrid((optimizer, params, device), 0, 1)

    class Refusing(dict[torch.Tensor, object]):
        def items(self) -> object:  # type: ignore[override]  # the point: it raises
            raise RuntimeError("items refused")

    sub = optimizer.cpu_optimizers[0]
    sub.state = Refusing(sub.state)  # type: ignore[assignment]
    model = torch.nn.ParameterList(params)

    problems = opttree.validate(optimizer, model=model)

    assert any(p.kind is opttree.ProblemKind.MALFORMED_WRAPPER and "reading the copies it keeps raised RuntimeError" in p.message for p in problems)
    with pytest.raises(opttree.MalformedWrapper, match="items refused"):
        opttree.sync_masters(optimizer, model=model)


@pytest.mark.parametrize("name", [n for n in ("bf16", "fp32") if n in testing.available()])
def test_a_model_whose_parameters_the_stack_does_not_step_is_reported_and_not_synced(name: str) -> None:
    """Megatron's side: ``load_state_dict(..., assign=True)`` puts new tensors in the
    model, and the stack keeps stepping the old ones, whose copies still match them. opttree
    reports a model none of whose trainable parameters the stack steps, and refuses to
    sync copies that cannot be told to stand for them; an unrelated model alike. A model
    part of which another optimizer steps is no problem."""
    stack = testing.build(name)
    stack.train(0, K)
    module = stack.model.module
    before = [param.detach().clone() for param in stack.main_params()]
    new = {key: torch.randn_like(value) for key, value in module.state_dict().items()}
    module.load_state_dict(new, assign=True)

    stack.train(K, 1)  # Megatron steps the tensors it was built over, not the model's
    stepped = [not torch.equal(a, b) for a, b in zip(stack.main_params(), before, strict=True)]
    problems = opttree.validate(stack.optimizer, model=stack.model)
    unrelated = opttree.validate(stack.optimizer, model=torch.nn.Linear(3, 3))

    assert all(stepped) and all(not (p is q) for p, q in zip(module.parameters(), stack.main_params()))
    for found in (problems, unrelated):
        assert [p.kind for p in found] == [opttree.ProblemKind.UNCHECKED_MASTER]
        assert "the stack steps none of the model's" in found[0].message
    with pytest.raises(opttree.StaleMaster, match="the stack steps none of the model's"):
        opttree.sync_masters(stack.optimizer, model=stack.model)
    assert opttree.validate(stack.optimizer, model=testing.build(name).model) != ()

    other = torch.nn.Linear(2, 2)  # its own optimizer steps it
    fresh = testing.build(name)
    assert opttree.validate(fresh.optimizer, model=torch.nn.ModuleList([fresh.model, other])) == ()


def test_a_whole_copy_shaped_otherwise_than_its_parameter_is_not_known() -> None:
    """A copy of as many elements as its parameter but another shape (masters swapped in a
    Float16 wrapper's list, a transposed one) was compared element by element at the same
    flat places, and a sync wrote it reshaped, or Megatron's reload raised half-way. Which
    element stands for which is not known: it is reported, and a sync refuses, writing
    nothing. A flat copy (a DistributedOptimizer's shard of a whole parameter) is compared."""
    params = [torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(6))]
    transposed, flat = torch.zeros(3, 2), torch.zeros(6)
    holder = CopyingWrapper(params, [transposed, flat])
    model = torch.nn.ParameterList(params)

    problems = opttree.validate(holder, model=model)
    with pytest.raises(opttree.OptTreeError, match=r"cannot tell which part of 0 its copy of 6 elements shaped \(3, 2\) stands for"):
        opttree.sync_masters(holder, model=model)

    assert [p.kind for p in problems] == [opttree.ProblemKind.UNCHECKED_MASTER, opttree.ProblemKind.STALE_MASTER]
    assert not transposed.any() and not flat.any()
    flat_only = CopyingWrapper(params[1:], [flat])
    assert opttree.sync_masters(flat_only, model=torch.nn.ParameterList(params[1:])).stale == 1
    assert flat.tolist() == [1.0] * 6


class MasterInState(torch.optim.Optimizer):
    """Steps an fp32 master it keeps in its state under ``master`` and copies it into the bf16 parameter."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                entry = self.state[p]
                if not entry:
                    entry["master"] = p.detach().float().clone()
                    entry["momentum"] = torch.zeros_like(entry["master"])
                entry["momentum"].mul_(0.9).add_(p.grad.float())
                entry["master"].add_(entry["momentum"], alpha=-group["lr"])
                p.copy_(entry["master"])


def _master(optimizer: torch.optim.Optimizer, param: torch.Tensor, entry: Mapping[str, object]) -> torch.Tensor | None:
    master = entry.get("master")
    return master if isinstance(master, torch.Tensor) else None


opttree.register_schema(MasterInState, opttree.StateSchema(zero={"momentum", "master"}, master_of=_master))


def test_a_master_copy_its_schema_also_zeroes_is_refused_with_nothing_changed() -> None:
    """A schema listing its master among the keys it zeroes: the reset zeroed the master,
    and the next step wrote zeros into the model."""
    param = torch.nn.Parameter(torch.full((4,), 3.0, dtype=torch.bfloat16))
    optimizer = MasterInState([param])
    param.grad = torch.ones_like(param)
    optimizer.step()
    master = optimizer.state[param]["master"].clone()

    (problem,) = opttree.validate(optimizer)
    assert problem.kind is opttree.ProblemKind.ALIASED_STATE and problem.key == "master" and "master_of" in problem.message
    with pytest.raises(opttree.UnsupportedOptimizerState, match="shares memory with 'master_of'"):
        opttree.reset(optimizer)
    assert torch.equal(optimizer.state[param]["master"], master)


def _master_of_bf16(optimizer: torch.optim.Optimizer, param: torch.Tensor, entry: Mapping[str, object]) -> torch.Tensor | None:
    """Says, as opttree's own TE schema does for an FP8 weight, that one copy cannot be compared."""
    if param.dtype != torch.bfloat16:
        raise opttree.UnsupportedOptimizerState("its master is kept otherwise")
    return _master(optimizer, param, entry)


class MasterInStateSomeUncompared(MasterInState):
    pass


opttree.register_schema(MasterInStateSomeUncompared, opttree.StateSchema(zero={"momentum", "master"}, master_of=_master_of_bf16))


def test_a_copy_master_of_cannot_compare_leaves_the_others_kept() -> None:
    """master_of refusing one copy (an fp16 weight's) dropped the check for every other:
    the bf16 weight's master was zeroed, and the next step wrote zeros into the model."""
    params = [torch.nn.Parameter(torch.full((4,), 3.0, dtype=dtype)) for dtype in (torch.float16, torch.bfloat16)]
    optimizer = MasterInStateSomeUncompared(params)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    (problem,) = opttree.validate(optimizer)
    assert problem.kind is opttree.ProblemKind.ALIASED_STATE and problem.key == "master"


class _HistoryAsMaster(torch.optim.Adam):
    """An Adam whose registered ``master_of`` names a view of its history, or its
    parameter's gradient, as the master: a wrong registration."""


def _history_as_master(optimizer: torch.optim.Optimizer, param: torch.Tensor, entry: Mapping[str, object]) -> torch.Tensor | None:
    master = entry["exp_avg"] if getattr(optimizer, "names_history", True) else param.grad
    assert isinstance(master, torch.Tensor)
    return master.view(-1).view_as(param) if getattr(optimizer, "as_view", True) else master


opttree.register_schema(_HistoryAsMaster, opttree.StateSchema(zero={"exp_avg", "exp_avg_sq"}, step=opttree.StepLocation.PER_PARAMETER, master_of=_history_as_master))


@pytest.mark.parametrize("as_view", [True, False], ids=["a view of it", "itself"])
@pytest.mark.parametrize("names_history", [True, False], ids=["exp_avg", "grad"])
def test_a_sync_never_writes_the_weights_into_optimizer_state_or_gradients(names_history: bool, as_view: bool) -> None:
    """A copy that is also history (or a gradient) was written with the weights by
    ``sync_masters``, where ``validate`` called it aliased and ``reset`` refused it: a
    view of it, and then the tensor itself (state a sync writes as a copy was passed over
    as kept memory, which only a key the schema keeps, a master copy, may be)."""
    net = torch.nn.Linear(3, 2, bias=False)
    optimizer = _HistoryAsMaster(net.parameters())
    vars(optimizer).update(names_history=names_history, as_view=as_view)
    torch.autograd.backward(net(torch.randn(4, 3)).sum())
    optimizer.step()
    state = {key: value.clone() for key, value in optimizer.state[net.weight].items()}
    grad = net.weight.grad
    assert grad is not None
    grad_before = grad.clone()

    with pytest.raises(opttree.StaleMaster, match="its copy of weight shares memory with the optimizer state of _HistoryAsMaster at <root>: " + ("exp_avg" if names_history else "gradients")):
        opttree.sync_masters(optimizer, model=net)
    assert all(torch.equal(value, state[key]) for key, value in optimizer.state[net.weight].items())
    assert torch.equal(grad, grad_before)


class HistoryAsCopies(CopyingWrapper):
    """Its registration names its optimizer's ``exp_avg`` as the copies it steps: a wrong one."""


def _history_copies(wrapper: HistoryAsCopies, path: str) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    state = wrapper.optimizer.state
    return [(param, [state[copy]["exp_avg"]]) for param, copy in zip(wrapper.params, wrapper.copies, strict=True) if copy in state]


opttree.register_wrapper(HistoryAsCopies, children=lambda wrapper: [("optimizer", wrapper.optimizer)], inner_params=_history_copies)


def test_copies_a_registered_wrapper_names_are_written_by_neither_a_sync_nor_a_reset() -> None:
    """Where a wrapper's ``inner_params`` names its optimizer's history as the copies of
    its parameters, a sync wrote the weights into that history, and a reset zeroed what
    the wrapper calls its master copies. Both refused, with nothing changed."""
    net = torch.nn.Linear(3, 2)
    wrapper = HistoryAsCopies(list(net.parameters()))
    for copy in wrapper.copies:
        copy.grad = torch.ones_like(copy)
    wrapper.optimizer.step()
    before = [(key, value.clone()) for entry in wrapper.optimizer.state.values() for key, value in entry.items()]

    with pytest.raises(opttree.StaleMaster, match="its copy of weight shares memory with the optimizer state of AdamW at optimizer: exp_avg"):
        opttree.sync_masters(wrapper, model=net)
    with pytest.raises(opttree.UnsupportedOptimizerState, match="AdamW at optimizer: key 'exp_avg': shares memory with a parameter of HistoryAsCopies at <root>"):
        opttree.reset(wrapper)
    after = [(key, value) for entry in wrapper.optimizer.state.values() for key, value in entry.items()]
    assert len(after) == len(before) and all(k == j and torch.equal(a, b) for (k, a), (j, b) in zip(after, before, strict=True))


@pytest.mark.parametrize(("name", "copies"), [("bf16", "fp32_from_float16_groups"), ("dist_bf16", "shard_fp32_from_float16_groups")])
def test_one_copy_listed_for_two_parameters_is_reported_and_not_synced(name: str, copies: str) -> None:
    """A copy reached again was taken for the same copy of the same parameter (a GPU
    sub-optimizer's) and passed over: listed for a second parameter, validate said nothing
    of it, and a sync over a Float16OptimizerWithFloat16Params wrote some copies before
    Megatron's reload raised; over a DistributedOptimizer it wrote one weight into the
    copy and reported the stack synced."""
    if name not in testing.available():
        pytest.skip(testing.missing_feature(name) or "")
    stack = testing.build(name)
    stack.train(0, K)
    (wrapper,) = getattr(stack.optimizer, "chained_optimizers")
    groups = getattr(wrapper, copies)
    groups[0][1] = groups[0][0]
    write_new_weights(stack.model)
    before = [copy.detach().clone() for group in groups for copy in group]

    problems = opttree.validate(stack.optimizer, model=stack.model)
    with stack.device, pytest.raises(opttree.StaleMaster, match="is also listed as the copy of"):
        opttree.sync_masters(stack.optimizer, model=stack.model)

    assert [p.kind for p in problems].count(opttree.ProblemKind.UNCHECKED_MASTER) == 1
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, [copy for group in groups for copy in group], strict=True))


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (lambda o: o.state.__setitem__(next(iter(o.state)), None), "a state entry is a NoneType, expected a dict"),
        (lambda o: setattr(o, "state", [1]), "state is a list, expected a mapping"),
    ],
    ids=["none-entry", "state-a-list"],
)
def test_a_leaf_with_malformed_state_is_named_as_such_by_the_master_check(corrupt: Callable[[torch.optim.Optimizer], None], reason: str) -> None:
    """The master check read a malformed leaf's parameters as none, and said that the
    stack steps none of the model's parameters: it names the state, and ``sync_masters``
    refuses it as a reset does."""
    net = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(net.parameters())
    torch.autograd.backward(net(torch.randn(4, 3)).sum())
    optimizer.step()
    corrupt(optimizer)

    problems = opttree.validate(optimizer, model=net)

    assert [(p.kind, p.message) for p in problems] == [(opttree.ProblemKind.MALFORMED_STATE, reason)]
    with pytest.raises(opttree.UnsupportedOptimizerState, match=f"Adam at <root>: {reason}"):
        opttree.sync_masters(optimizer, model=net)


class FlatMasterAdam(torch.optim.Optimizer):
    """Steps bf16 weights through an fp32 master it keeps flat in state, under ``master``,
    beside a flat first moment."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                assert param.grad is not None
                entry = self.state[param]
                if not entry:
                    entry["exp_avg"] = torch.zeros(param.numel())
                    entry["master"] = param.detach().float().reshape(-1).clone()
                entry["exp_avg"].mul_(0.9).add_(param.grad.float().reshape(-1), alpha=0.1)
                entry["master"].add_(entry["exp_avg"], alpha=-group["lr"])
                param.copy_(entry["master"].view_as(param))


def _flat_master(optimizer: torch.optim.Optimizer, param: torch.Tensor, entry: Mapping[str, object]) -> torch.Tensor | None:
    master = entry.get("master")
    return master.view_as(param) if isinstance(master, torch.Tensor) else None


opttree.register_schema(FlatMasterAdam, opttree.StateSchema(zero={"exp_avg"}, keep={"master"}, rebuilds_missing=True, master_of=_flat_master))


def test_a_master_kept_in_state_is_synced_through_the_view_master_of_names() -> None:
    """A kept master copy a schema's ``master_of`` names as a view (of a flat one) is the
    copy a sync writes, not state it must leave alone: such a sync was refused as sharing
    memory with the optimizer's state, where the same master shaped as its parameter synced."""
    net = torch.nn.Linear(4, 3).to(torch.bfloat16)
    optimizer = FlatMasterAdam(list(net.parameters()))
    torch.autograd.backward(net(torch.randn(2, 4, dtype=torch.bfloat16)).float().pow(2).sum())
    optimizer.step()
    with torch.no_grad():
        for param in net.parameters():
            param.add_(0.25)  # as a load of other weights leaves them
    moments = [entry["exp_avg"].clone() for entry in optimizer.state.values()]

    report = opttree.sync_masters(optimizer, model=net)

    assert (report.copies, report.stale) == (2, 2)
    assert all(torch.equal(entry["master"].view_as(param), param.float()) for param, entry in optimizer.state.items())
    assert all(map(torch.equal, (entry["exp_avg"] for entry in optimizer.state.values()), moments))
    assert opttree.validate(optimizer, model=net) == ()
