"""Everything that would make zeroing fail half-way is found before the first write:
the reset refuses, names the leaf and key, and changes nothing; validate reports it."""

from __future__ import annotations

import copy
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy as np

import pytest
import torch

import opttree
from opttree import testing
from tests.helpers import HomeMade, model, snapshot, stepped_adamw, train, unchanged
from tests.megatron_parts import chained, config, fp32

N_PARAMS = 10  # 30 state tensors: the bad one is the last


def big_adamw() -> torch.optim.AdamW:
    return stepped_adamw(N_PARAMS, 4)


def last_entry(optimizer: torch.optim.Optimizer) -> dict[str, object]:
    entry = list(optimizer.state.values())[-1]
    assert isinstance(entry, dict)
    return entry


def inference_tensor(like: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return torch.ones_like(like)


def freed(like: torch.Tensor) -> torch.Tensor:
    tensor = torch.ones_like(like)
    tensor.untyped_storage().resize_(0)
    return tensor


def shrunk(like: torch.Tensor) -> torch.Tensor:
    """A storage shrunk in place to one element: zeroing the tensor would write past it."""
    tensor = torch.ones_like(like)
    tensor.untyped_storage().resize_(tensor.element_size())
    return tensor


def freed_view(like: torch.Tensor) -> torch.Tensor:
    buffer = torch.ones(2 * like.numel())
    view = buffer[like.numel() :]
    buffer.untyped_storage().resize_(0)
    return view


def leaked_from_grad(like: torch.Tensor) -> torch.Tensor:
    """A functorch wrapper kept past the ``torch.func.grad`` call that made it."""
    leaked: list[torch.Tensor] = []

    def loss(x: torch.Tensor) -> torch.Tensor:
        leaked.append(x * 1)
        return x.sum()

    torch.func.grad(loss)(torch.ones_like(like))
    return leaked[0]


def read_only_map(like: torch.Tensor) -> torch.Tensor:
    """History loaded through a read-only memory map, as ``np.load(..., mmap_mode="r")``
    gives: zeroing it killed the process with SIGSEGV."""
    fd, path = tempfile.mkstemp()
    os.close(fd)
    np.ones(like.numel(), dtype=np.float32).tofile(path)
    mapped = np.memmap(path, mode="r", dtype=np.float32, shape=tuple(like.shape))
    os.unlink(path)  # the mapping outlives the name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the array is not writable
        return torch.from_numpy(mapped)


class Traced(torch.Tensor):
    """A tensor subclass with its own dispatch, which opttree cannot vouch for."""

    @classmethod
    def __torch_function__(cls, func: object, types: object, args: object = (), kwargs: object = None) -> object:
        return torch.Tensor.__torch_function__.__func__(cls, func, types, args, kwargs)  # type: ignore[attr-defined]


class Strict(torch.Tensor):
    """A subclass that refuses every torch function, even a read of its dtype: opttree
    reads its metadata without calling it, refuses to zero it, and describes it."""

    @classmethod
    def __torch_function__(cls, func: object, types: object, args: object = (), kwargs: object = None) -> object:
        raise ValueError("a Strict tensor refuses every torch function")


BAD: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "inference": inference_tensor,
    "quantized": lambda like: torch.quantize_per_tensor(torch.ones_like(like), 0.1, 0, torch.qint8),
    "sparse": lambda like: torch.ones_like(like).to_sparse(),
    "meta": lambda like: torch.ones_like(like, device="meta"),
    "freed": freed,
    "shrunk": shrunk,
    "freed-view": freed_view,
    "subclass": lambda like: torch.ones_like(like).as_subclass(Traced),
    "strict-subclass": lambda like: torch.ones_like(like).as_subclass(Strict),
    "nested": lambda like: torch.nested.nested_tensor([torch.ones(2), torch.ones(like.numel() - 2)]),
    "conjugate": lambda like: torch.ones(like.numel(), dtype=torch.complex64).conj(),
    "negative": lambda like: torch.ones(like.numel(), dtype=torch.complex64).conj().imag,
    "expanded": lambda like: torch.ones(1).expand(like.numel()),
    "functional": lambda like: torch._to_functional_tensor(torch.ones_like(like)),
    "functorch": leaked_from_grad,
    "read-only-map": read_only_map,
}
REASON = {
    "inference": "an inference tensor",
    "quantized": "a quantized tensor",
    "sparse": "a sparse_coo tensor",
    "meta": "a meta tensor",
    "freed": "storage is freed",
    "shrunk": "storage is freed or smaller than the tensor",
    "freed-view": "storage is freed",
    "subclass": "a Traced",
    "strict-subclass": "a Strict",
    "nested": "a nested tensor",
    "conjugate": "a conjugate or negative view",
    "negative": "a conjugate or negative view",
    "expanded": "elements share or may share memory",
    "functional": "shows no memory of its own",
    "functorch": "memory cannot be read",
    "read-only-map": "memory the process cannot write",
}


@pytest.mark.parametrize("kind", BAD)
def test_an_unwritable_tensor_on_the_last_parameter_is_refused_before_any_write(kind: str) -> None:
    optimizer = big_adamw()
    entry = last_entry(optimizer)
    exp_avg_sq = entry["exp_avg_sq"]
    assert isinstance(exp_avg_sq, torch.Tensor)
    entry["exp_avg_sq"] = BAD[kind](exp_avg_sq)
    before = [(k, v.clone()) for e in list(optimizer.state.values())[:-1] for k, v in e.items()]

    with pytest.raises(opttree.UnsupportedOptimizerState, match=rf"key 'exp_avg_sq': cannot be zeroed in place: .*{REASON[kind]}"):
        opttree.reset(optimizer)

    after = [(k, v) for e in list(optimizer.state.values())[:-1] for k, v in e.items()]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(after, before, strict=True))
    (problem,) = opttree.validate(optimizer)
    assert problem.kind is opttree.ProblemKind.UNWRITABLE_STATE and problem.key == "exp_avg_sq"
    assert "AdamW" in opttree.describe(optimizer)


def test_empty_history_on_the_meta_device_is_refused_and_empty_history_in_memory_is_reset() -> None:
    """Empty meta history shows the address 0 that an empty tensor in memory shows too,
    and was taken as writable: the reset went through, and the next step raised over a
    tensor on the meta device. Refused; empty history beside an empty parameter, as a
    fresh optimizer builds it, is reset and trains on."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(0))]
    optimizer = torch.optim.Adam(params, lr=0.1)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    assert opttree.reset(optimizer).tensors_zeroed == 4
    optimizer.step()  # the empty history reset, as a fresh optimizer builds it, trains on
    meta = optimizer.state[params[1]]["exp_avg"] = torch.empty(0, device="meta")
    before = {key: value.clone() for key, value in optimizer.state[params[0]].items()}

    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'exp_avg': cannot be zeroed in place: 1 of its 2 tensors cannot; the first is a meta tensor"):
        opttree.reset(optimizer)
    assert all(torch.equal(value, before[key]) for key, value in optimizer.state[params[0]].items())
    assert optimizer.state[params[1]]["exp_avg"] is meta


def test_history_in_writable_memory_torch_did_not_allocate_is_reset_exactly(tmp_path: Path) -> None:
    """A checkpoint loaded with ``torch.load(mmap=True)`` leaves history in a private (copy
    on write) file mapping, and ``torch.from_numpy`` in NumPy's memory: storages torch
    cannot resize, in memory the process may write."""
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train(net, optimizer, 0, 3)
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    optimizer.load_state_dict(torch.load(tmp_path / "optimizer.pt", mmap=True))
    entries = list(optimizer.state.values())
    entries[0]["exp_avg"] = torch.from_numpy(entries[0]["exp_avg"].numpy().copy())
    assert not any(v.untyped_storage().resizable() for e in entries for v in e.values())

    assert opttree.validate(optimizer) == ()
    opttree.reset(optimizer)
    twin = model()
    twin.load_state_dict(net.state_dict())
    fresh = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    train(net, optimizer, 3, 3)
    train(twin, fresh, 3, 3)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), twin.parameters(), strict=True))


def test_memory_torch_did_not_allocate_is_refused_where_its_mappings_cannot_be_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``/proc/self/maps`` (not Linux), whether such memory may be written cannot be told."""
    monkeypatch.setattr("opttree._mappings._MAPS", "/nonexistent/maps")
    optimizer = big_adamw()
    assert opttree.validate(optimizer) == ()  # memory torch allocated is not looked up
    entry = last_entry(optimizer)
    exp_avg = entry["exp_avg"]
    assert isinstance(exp_avg, torch.Tensor)
    entry["exp_avg"] = torch.from_numpy(exp_avg.numpy().copy())
    (problem,) = opttree.validate(optimizer)
    assert problem.key == "exp_avg" and "cannot tell it can" in problem.message


class KeepsAux(torch.optim.Optimizer):
    """A momentum ``m`` it builds lazily, and whatever a test keeps under ``aux``."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                entry = self.state[p]
                if "m" not in entry:
                    entry["m"] = torch.zeros_like(p)
                entry["m"].add_(p.grad)


opttree.register_schema(KeepsAux, opttree.StateSchema(zero={"m"}, keep={"aux"}))


def nested(value: object, depth: int) -> object:
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("depth", [1, 9, 2_000])
@pytest.mark.parametrize("where", ["state", "group"])
def test_history_sharing_memory_with_a_tensor_kept_at_any_depth_is_refused(depth: int, where: str) -> None:
    """Kept lists nested deeper than eight were passed over, and the reset zeroed the kept
    tensor inside them."""
    param = torch.nn.Parameter(torch.randn(4))
    optimizer = KeepsAux([param])
    param.grad = torch.ones(4)
    optimizer.step()
    kept = optimizer.state[param]["m"][:2]
    if where == "state":
        optimizer.state[param]["aux"] = nested(kept, depth)
    else:
        optimizer.param_groups[0]["my_option"] = nested(kept, depth)
    (problem,) = opttree.validate(optimizer)
    assert problem.kind is opttree.ProblemKind.ALIASED_STATE and problem.key == "m"
    with pytest.raises(opttree.UnsupportedOptimizerState, match="shares memory with"):
        opttree.reset(optimizer)
    assert kept.tolist() == [1.0, 1.0]


def test_a_kept_list_that_holds_itself_is_read_once() -> None:
    param = torch.nn.Parameter(torch.randn(4))
    optimizer = KeepsAux([param])
    param.grad = torch.ones(4)
    optimizer.step()
    loop: list[object] = [torch.ones(2)]
    loop.append(loop)
    optimizer.state[param]["aux"] = loop
    assert opttree.validate(optimizer) == ()
    report = opttree.reset(optimizer)
    assert report.tensors_zeroed == 1 and torch.equal(loop[0], torch.ones(2))  # type: ignore[arg-type]


def test_inference_state_is_refused_inside_inference_mode_too() -> None:
    """Inside inference mode an inference tensor can be zeroed, but no training step
    outside it can update it: a reset there was accepted, and the next step raised."""
    optimizer = big_adamw()
    entry = last_entry(optimizer)
    entry["exp_avg_sq"] = inference_tensor(torch.ones(4))
    before = snapshot(optimizer)

    with torch.inference_mode():
        (problem,) = opttree.validate(optimizer)
        with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'exp_avg_sq': cannot be zeroed in place.*an inference tensor"):
            opttree.reset(optimizer)

    assert problem.kind is opttree.ProblemKind.UNWRITABLE_STATE
    assert unchanged(optimizer, before)


def test_a_step_counter_that_cannot_be_written_is_refused() -> None:
    optimizer = big_adamw()
    before = snapshot(optimizer)
    last_entry(optimizer)["step"] = torch.tensor(1.0, device="meta")

    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'step': cannot be zeroed in place: 1 of its 10 tensors cannot; the first is a meta tensor"):
        opttree.reset(optimizer)
    last_entry(optimizer)["step"] = torch.tensor(1.0)
    assert unchanged(optimizer, before)


class Accumulating(HomeMade):
    """Keeps a zeroed ``buf``, an ``acc`` that starts at 0.5 (a fill) and an identity
    ``basis``, built at each parameter's first step."""

    def build(self, state: dict[str, torch.Tensor], p: torch.Tensor) -> None:
        state.update(buf=torch.zeros_like(p), acc=torch.full((4,), 0.5), basis=torch.eye(2))

    def update(self, state: dict[str, torch.Tensor], p: torch.Tensor, lr: float) -> None:
        state["buf"].add_(cast(torch.Tensor, p.grad))
        p.sub_(state["buf"], alpha=lr)


opttree.register_schema(Accumulating, opttree.StateSchema(zero={"buf"}, fill={"acc": 0.5}, identity={"basis"}, rebuilds_missing=True))


UNFILLABLE = [getattr(torch, name) for name in ("bcomplex32", "bits8") if hasattr(torch, name)]


@pytest.mark.parametrize("key", ["acc", "basis"])
@pytest.mark.parametrize("dtype", UNFILLABLE, ids=str)
def test_history_of_a_dtype_torch_cannot_fill_is_refused_before_any_write(dtype: torch.dtype, key: str) -> None:
    """A fill or an identity's diagonal is written after all the history is zeroed: a
    dtype torch implements no ``fill_`` for (bcomplex32 on the CPU, bits8, uint4) was
    zeroed with the rest, then raised inside torch; it is refused, naming the key, with
    nothing changed (compared as bytes: torch compares neither dtype)."""
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(N_PARAMS)]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = Accumulating(params)
    optimizer.step()
    shape = (4,) if key == "acc" else (2, 2)
    last_entry(optimizer)[key] = torch.zeros(*shape[:-1], shape[-1] * torch.empty(0, dtype=dtype).element_size(), dtype=torch.uint8).view(dtype)
    before = byte_snapshot(optimizer)

    with pytest.raises(opttree.UnsupportedOptimizerState, match=rf"Accumulating at <root>: key '{key}': .*torch cannot fill {str(dtype).removeprefix('torch.')} tensors on cpu"):
        opttree.reset(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(byte_snapshot(optimizer), before, strict=True))
    assert [(p.kind, p.key) for p in opttree.validate(optimizer)] == [(opttree.ProblemKind.UNSUPPORTED_STATE, key)]


def byte_snapshot(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.view(torch.uint8).clone() for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]


# Aliasing: history that shares memory with something a reset must keep, or with other history.


def test_history_sharing_memory_with_a_parameter_is_refused() -> None:
    optimizer = big_adamw()
    param = optimizer.param_groups[0]["params"][-1]
    last_entry(optimizer)["exp_avg"] = param.detach()  # zeroing it would zero the weight
    weight = param.detach().clone()

    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'exp_avg': shares memory with a parameter of AdamW"):
        opttree.reset(optimizer)
    assert torch.equal(param, weight)
    assert [p.kind for p in opttree.validate(optimizer)] == [opttree.ProblemKind.ALIASED_STATE]


def test_history_sharing_memory_with_a_frozen_weight_of_the_model_given_is_refused() -> None:
    """A frozen weight no optimizer steps is the model's, not the optimizer's: with
    ``model=``, history sharing its memory (or a buffer's) is refused by reset, prune and
    validate, and the weight is left as it was."""
    net = model()
    frozen, trained = (param for name, param in net.named_parameters() if name in ("0.weight", "2.weight"))
    frozen.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=0.1)
    train(net, optimizer, 0, 2)
    optimizer.state[trained]["exp_avg"] = frozen.detach().view(-1)[: trained.numel()].view_as(trained)
    weight, before = frozen.detach().clone(), snapshot(optimizer)

    message = r"key 'exp_avg': shares memory with a parameter of Sequential at model=: zeroing it would change that too"
    with pytest.raises(opttree.UnsupportedOptimizerState, match=message):
        opttree.reset(optimizer, model=net)
    with pytest.raises(opttree.UnsupportedOptimizerState, match=message):
        opttree.prune(optimizer, 0.5, keys=["exp_avg"], model=net)
    assert torch.equal(frozen, weight) and unchanged(optimizer, before)
    assert [(p.kind, p.key) for p in opttree.validate(optimizer, model=net)] == [(opttree.ProblemKind.ALIASED_STATE, "exp_avg")]

    net.register_buffer("running", torch.ones(trained.shape))  # a module's buffer: kept too
    optimizer.state[trained]["exp_avg"] = net.get_buffer("running")
    with pytest.raises(opttree.UnsupportedOptimizerState, match=message.replace("a parameter", "a buffer")):
        opttree.reset(optimizer, model=net)
    assert bool(net.get_buffer("running").all())


@pytest.mark.parametrize("pooled", [False, True], ids=["one leaf", "a chain of leaves pooled"])
def test_history_sharing_memory_with_a_gradient_is_refused(pooled: bool) -> None:
    """A reset between backward and ``optimizer.step()`` (gradient accumulation) leaves the
    gradients to the step: history over one would zero it, which no fresh optimizer's does."""
    optimizers = [big_adamw() for _ in range(3 if pooled else 1)]
    target = optimizers[-1]
    param = target.param_groups[0]["params"][-1]
    param.grad = torch.randn_like(param)
    last_entry(target)["exp_avg"] = param.grad
    gradient = param.grad.clone()
    root = chained(optimizers) if pooled else target  # type: ignore[arg-type]  # Megatron chains raw torch optimizers too

    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'exp_avg': shares memory with a parameter's gradient of AdamW"):
        opttree.reset(root)
    assert torch.equal(param.grad, gradient)
    assert [p.kind for p in opttree.validate(root)] == [opttree.ProblemKind.ALIASED_STATE]
    param.grad = gradient  # its own memory again
    last_entry(target)["exp_avg"] = torch.zeros_like(param)
    assert opttree.reset(root).leaves == len(optimizers)
    assert torch.equal(param.grad, gradient)


WRAPPER_TENSORS: list[tuple[str, Callable[[object], torch.Tensor], str]] = [
    ("fp16", lambda wrapper: getattr(wrapper, "grad_scaler").min_scale, "grad_scaler.min_scale"),
    ("fp16", lambda wrapper: getattr(wrapper, "grad_scaler").growth_factor, "grad_scaler.growth_factor"),
    ("dist_fp16", lambda wrapper: getattr(wrapper, "grad_scaler").backoff_factor, "grad_scaler.backoff_factor"),
    ("bf16", lambda wrapper: getattr(wrapper, "_scale_one"), "_scale_one"),
    ("fp32", lambda wrapper: getattr(wrapper, "_scale"), "_scale"),
]


@pytest.mark.parametrize(("name", "held", "key"), WRAPPER_TENSORS, ids=["min_scale", "growth_factor", "backoff_factor", "_scale_one", "fp32-_scale"])
def test_a_step_sharing_memory_with_a_wrappers_own_tensor_is_refused(name: str, held: Callable[[object], torch.Tensor], key: str) -> None:
    """A Megatron wrapper's own tensors and its loss scaler's are kept memory: a step
    counter over one was zeroed, the scaler's growth factor or the wrapper's scale then 0."""
    if name not in testing.available():
        pytest.skip(f"no {name} recipe in this lane")
    stack = testing.build(name)
    stack.train(0, 2)
    kept = held(getattr(stack.optimizer, "chained_optimizers")[0])
    value = kept.clone()
    next(iter(stack.leaves()[0].state.values()))["step"] = kept.view(())  # 0-d, as a step is

    with pytest.raises(opttree.UnsupportedOptimizerState, match=f"key 'step': shares memory with '{key}' of "):
        opttree.reset(stack.optimizer)
    assert torch.equal(kept, value)


def test_history_sharing_memory_with_a_tensor_group_option_is_refused() -> None:
    """torch takes a tensor ``lr``: history over it zeroed the learning rate."""
    optimizer = stepped_adamw(2)
    history = last_entry(optimizer)["exp_avg"]
    assert isinstance(history, torch.Tensor)
    lr = history.view(-1)[:1]
    optimizer.param_groups[0]["lr"] = lr
    lr.fill_(1e-3)

    with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'exp_avg': shares memory with 'param_groups' of AdamW"):
        opttree.reset(optimizer)
    assert float(lr) == pytest.approx(1e-3)
    optimizer.param_groups[0]["lr"] = torch.tensor(1e-3)
    optimizer.param_groups[0]["betas"] = (torch.tensor(0.9), torch.tensor(0.999))
    assert opttree.reset(optimizer).leaves == 1  # tensor options of their own memory are fine


@pytest.mark.parametrize("name", ["bf16", "fp16", "dist_bf16", "dist_fp32"])
def test_a_step_sharing_memory_with_megatrons_gradient_buffer_is_refused(name: str) -> None:
    """Megatron DDP's backward accumulates into ``main_grad`` (and a DistributedOptimizer's
    main shards' ``.grad`` are views of it), which the next step reads: a reset between
    backward and step zeroed the part history or a step shared."""
    if name not in testing.available():
        pytest.skip(f"no {name} recipe in this lane")
    stack = testing.build(name)
    stack.train(0, 2)
    main_grad = next(grad for grad in (getattr(param, "main_grad", None) for param in stack.model.parameters()) if isinstance(grad, torch.Tensor))
    main_grad.fill_(0.5)
    flat = main_grad.view(-1)
    next(iter(stack.leaves()[0].state.values()))["step"] = flat[0] if flat.dtype == torch.float32 else flat[:2].view(torch.float32)[0]  # 0-d, as a step is

    with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'step': shares memory with a parameter's gradient of "):
        opttree.reset(stack.optimizer)
    assert bool((main_grad == 0.5).all())


@pytest.mark.skipif("dist_fp32" not in testing.available(), reason="no dist_fp32 recipe in this lane")
def test_history_that_is_a_distributed_optimizers_shard_gradient_is_refused() -> None:
    """Its main shards are views, not autograd leaves; their ``.grad``, which Megatron sets,
    is a view of the gradient buffer."""
    stack = testing.build("dist_fp32")
    stack.train(0, 2)
    param, entry = next(iter(stack.leaves()[0].state.items()))
    grad = param.grad
    assert grad is not None
    grad.fill_(0.5)
    entry["exp_avg"] = grad

    assert opttree.ProblemKind.ALIASED_STATE in [problem.kind for problem in opttree.validate(stack.optimizer)]
    with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'exp_avg': shares memory with a parameter's gradient of "):
        opttree.reset(stack.optimizer)
    assert bool((grad == 0.5).all())


@pytest.mark.skipif("dist_fp32" not in testing.available(), reason="no dist_fp32 recipe in this lane")
def test_a_distributed_optimizer_between_backward_and_step_is_checked_without_warnings() -> None:
    """Its main parameters are views of a shard, whose .grad torch warns at reading: the
    gradients looked at are those of leaf tensors, and nothing warns."""
    stack = testing.build("dist_fp32")
    stack.train(0, 1)
    with stack.device:
        stack.model.zero_grad_buffer()
        stack.optimizer.zero_grad()
        torch.autograd.backward(stack.model(torch.ones(8, 16)).float().pow(2).mean())
        stack.model.finish_grad_sync()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert opttree.validate(stack.optimizer) == ()
        assert opttree.reset(stack.optimizer).steps > 0


def test_history_sharing_memory_with_kept_master_weights_is_refused() -> None:
    optimizer = big_adamw()
    entry = last_entry(optimizer)
    master = torch.randn(8)
    entry["master_param"] = master
    entry["exp_avg_sq"] = master[4:]  # a view into the kept fp32 copy
    kept = master.clone()

    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'exp_avg_sq': shares memory with 'master_param'"):
        opttree.reset(optimizer)
    assert torch.equal(master, kept)


def test_history_shared_between_two_entries_is_refused() -> None:
    optimizer = big_adamw()
    entries = list(optimizer.state.values())
    entries[-1]["exp_avg"] = entries[0]["exp_avg"]

    with pytest.raises(opttree.UnsupportedOptimizerState, match="shares memory with 'exp_avg'"):
        opttree.reset(optimizer)


def test_non_overlapping_views_of_one_buffer_are_fine() -> None:
    optimizer = big_adamw()
    entries = list(optimizer.state.values())
    flat = torch.zeros(4 * len(entries))
    for i, entry in enumerate(entries):
        entry["exp_avg"] = flat[4 * i : 4 * (i + 1)]  # as a flat-buffer optimizer would keep it
    flat.fill_(1.0)

    opttree.reset(optimizer)

    assert not flat.any()


def test_two_parameters_sharing_one_state_entry_are_refused_without_a_half_done_drop() -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    train(net, optimizer, 0, 2)
    params = list(optimizer.state)
    optimizer.state[params[-1]] = optimizer.state[params[0]]  # one dict reached twice
    buffers = [entry.get("momentum_buffer") for entry in optimizer.state.values()]

    with pytest.raises(opttree.UnsupportedOptimizerState, match="momentum_buffer"):
        opttree.reset(optimizer)
    assert [entry.get("momentum_buffer") for entry in optimizer.state.values()] == buffers  # none dropped


@pytest.mark.usefixtures("process_group")
def test_an_optimizer_and_its_shallow_copy_in_one_tree_are_refused_not_reset_twice() -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    train(net, optimizer, 0, 2)
    twin = copy.copy(optimizer)  # the same state and param groups
    shared = config()
    root = chained([fp32(optimizer, shared), fp32(twin, shared)])
    count = len(optimizer.state)

    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"SGD at chained\[\d\]\.optimizer: key 'momentum_buffer': shares memory"):
        opttree.reset(root)
    assert sum("momentum_buffer" in entry for entry in optimizer.state.values()) == count


class Unsized(torch.Tensor):
    """A subclass with torch's own dispatch and a Python ``nbytes`` of its own, as one
    reporting a compressed size might have: sizes are read from the tensor, not from it."""

    @property
    def nbytes(self) -> int:  # type: ignore[override]  # the point: it says something else
        return 0


def test_a_subclass_reporting_another_size_cannot_hide_aliasing() -> None:
    optimizer = big_adamw()
    param = optimizer.param_groups[0]["params"][-1]
    last_entry(optimizer)["exp_avg"] = param.detach().as_subclass(Unsized)
    weight = param.detach().clone()

    with pytest.raises(opttree.UnsupportedOptimizerState, match="shares memory with a parameter"):
        opttree.reset(optimizer)
    assert torch.equal(param, weight)


@pytest.mark.usefixtures("process_group")
def test_history_over_a_dtensor_parameters_memory_is_refused() -> None:
    """A DTensor has no memory of its own: it is placed by the local tensor it wraps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (1,))
    local = torch.arange(1.0, 4.0)
    param = torch.nn.Parameter(DTensor.from_local(local, mesh, [Replicate()]))
    optimizer = torch.optim.AdamW([param])
    optimizer.state[param] = {"step": torch.tensor(1.0), "exp_avg": local.view(3), "exp_avg_sq": torch.zeros(3)}

    with pytest.raises(opttree.UnsupportedOptimizerState) as refused:
        opttree.reset(optimizer)
    assert torch.equal(local, torch.arange(1.0, 4.0))
    # plain history of a DTensor parameter is refused on its own too (see test_dtensor.py)
    assert any(p.kind is opttree.ProblemKind.ALIASED_STATE and "shares memory with a parameter" in p.message for p in refused.value.problems)


class Opaque(torch.Tensor):
    """A wrapper subclass that neither has storage nor says what it wraps."""

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> Opaque:
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # torch's own way to turn it off

    @classmethod
    def __torch_dispatch__(cls, func: object, types: object, args: object = (), kwargs: object = None) -> object:  # type: ignore[override]  # torch's stub omits func
        raise AssertionError("an Opaque tensor answers nothing")


def test_a_parameter_whose_memory_cannot_be_read_is_refused() -> None:
    optimizer = big_adamw()
    params = optimizer.param_groups[0]["params"]
    opaque = Opaque(params[-1])
    optimizer.state[opaque] = optimizer.state.pop(params[-1])
    params[-1] = opaque
    before = snapshot(optimizer)

    problems = opttree.validate(optimizer)
    # its plain history, where the optimizer builds its class's, is refused too (see test_dtensor.py)
    assert [(p.kind, p.key) for p in problems] == [(opttree.ProblemKind.UNSUPPORTED_STATE, key) for key in ("exp_avg", "exp_avg_sq", None)]
    assert "memory opttree cannot read" in problems[2].message
    assert "AdamW" in opttree.describe(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizerState) as refused:
        opttree.reset(optimizer)
    assert "memory opttree cannot read" in refused.value.problems[2].message
    assert unchanged(optimizer, before)


def test_one_entry_held_for_two_parameters_is_refused_even_without_tensors() -> None:
    """An old checkpoint's ``momentum_buffer: None``: there is no memory to overlap, and the
    entry reached twice would have the key dropped twice."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    params = list(net.parameters())
    shared: dict[str, object] = {"momentum_buffer": None}
    optimizer.state[params[0]] = optimizer.state[params[1]] = shared

    assert [p.kind for p in opttree.validate(optimizer)] == [opttree.ProblemKind.ALIASED_STATE]
    with pytest.raises(opttree.UnsupportedOptimizerState, match="holds a state entry that the state of another parameter"):
        opttree.reset(optimizer)
    assert shared == {"momentum_buffer": None}


def test_history_whose_elements_torch_cannot_tell_apart_is_refused() -> None:
    """An overlapping strided view whose overlap torch cannot decide: its in-place ops run
    through it, so zeroing succeeds, but the optimizer's next step through it is not a
    fresh one's."""
    param = torch.nn.Parameter(torch.ones(3, 3))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(3, 3)
    optimizer.step()
    entry = optimizer.state[param]
    entry["exp_avg"] = torch.ones(5).as_strided((3, 3), (1, 1))
    assert torch._debug_has_internal_overlap(entry["exp_avg"]) == 2  # torch: too hard to tell

    (problem,) = opttree.validate(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizerState, match="elements share or may share memory"):
        opttree.reset(optimizer)

    assert problem.kind is opttree.ProblemKind.UNWRITABLE_STATE and problem.key == "exp_avg"
    assert entry["exp_avg_sq"].any() and entry["exp_avg"].all()


def test_history_that_is_a_slice_of_columns_is_reset_exactly() -> None:
    """A view that is not dense, and whose elements are apart (each rank's columns of a
    resharded tensor), which torch cannot tell from an overlapping one: reset, it trains
    as a fresh optimizer does."""
    torch.manual_seed(0)
    weights = torch.randn(4, 8)
    param, fresh_param = torch.nn.Parameter(weights.clone()), torch.nn.Parameter(weights.clone())
    optimizer, fresh = torch.optim.AdamW([param]), torch.optim.AdamW([fresh_param])
    param.grad = torch.ones(4, 8)
    optimizer.step()
    with torch.no_grad():
        fresh_param.copy_(param)
    entry = optimizer.state[param]
    for key in ("exp_avg", "exp_avg_sq"):
        wide = torch.randn(4, 16).abs()
        wide[:, :8] = entry[key]
        entry[key] = wide[:, :8]
    assert torch._debug_has_internal_overlap(entry["exp_avg"]) == 2  # torch: too hard to tell

    assert opttree.validate(optimizer) == ()
    opttree.reset(optimizer)

    for p, opt in ((param, optimizer), (fresh_param, fresh)):
        p.grad = torch.full((4, 8), 0.5)
        opt.step()
    assert torch.equal(param, fresh_param)


def test_a_starting_value_the_history_cannot_hold_is_refused_before_any_write() -> None:
    """Adagrad fills ``sum`` with its defaults' ``initial_accumulator_value``: 1e5 is beyond
    fp16, and ``fill_`` would refuse it after ``step`` had been zeroed."""
    param = torch.nn.Parameter(torch.randn(3).half())
    optimizer = torch.optim.Adagrad([param], lr=0.01, initial_accumulator_value=0.1)
    param.grad = torch.ones(3).half()
    optimizer.step()
    optimizer.defaults["initial_accumulator_value"] = 1e5
    entry = optimizer.state[param]
    before = {key: value.clone() for key, value in entry.items()}

    problems = opttree.validate(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"Adagrad at <root>: key 'sum': .*100000 is beyond float16's largest value"):
        opttree.reset(optimizer)

    assert [(problem.kind, problem.key) for problem in problems] == [(opttree.ProblemKind.UNSUPPORTED_STATE, "sum")]
    assert all(torch.equal(entry[key], value) for key, value in before.items())


def test_a_starting_value_beyond_a_float_is_refused_naming_its_key() -> None:
    param = torch.nn.Parameter(torch.randn(3))
    optimizer = torch.optim.Adagrad([param], lr=0.01)
    param.grad = torch.ones(3)
    optimizer.step()
    optimizer.defaults["initial_accumulator_value"] = 10**400  # an int no float holds
    before = snapshot(optimizer)

    (problem,) = opttree.validate(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'sum': its starting value cannot be worked out: TypeError: its fill gave an int beyond a float, expected a real number a float holds"):
        opttree.reset(optimizer)

    assert (problem.kind, problem.key) == (opttree.ProblemKind.UNSUPPORTED_STATE, "sum")
    assert unchanged(optimizer, before)


@pytest.mark.parametrize("name", [n for n in ("bf16", "dist_bf16") if n in testing.available()])
def test_a_step_counter_in_a_model_weight_under_a_mixed_precision_wrapper_is_refused(name: str) -> None:
    """The leaves of a mixed-precision stack step fp32 copies; the bf16 model weights live
    only in the wrapper. A counter placed in one of them is refused, as one in a leaf's own
    parameter is, rather than zeroing part of a weight that no leaf holds."""
    stack = testing.build(name)
    stack.train(0, 2)
    weight = next(p for p in stack.model.parameters() if p.dtype is torch.bfloat16 and p.numel() % 2 == 0)
    entry = next(iter(stack.leaves()[0].state.values()))
    entry["step"] = weight.detach().view(-1).view(torch.float32)[0]  # two bf16 elements read as one fp32 counter
    kept = weight.detach().clone()

    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'step': shares memory with a parameter of (Float16OptimizerWithFloat16Params|DistributedOptimizer) at chained\[0\]"):
        opttree.reset(stack.optimizer)

    assert torch.equal(weight.detach(), kept)
    assert opttree.ProblemKind.ALIASED_STATE in [p.kind for p in opttree.validate(stack.optimizer)]
