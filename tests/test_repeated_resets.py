"""Frameworks reset after every rollout, and between two resets anything may happen to the
state: tensors replaced, moved, freed, resized or rebound in place, entries replaced,
parameters re-pointed. Each reset plans afresh from the state as it is, so each is exact
or refused with nothing changed, and opttree keeps nothing of the state between calls."""

from __future__ import annotations

import copy
import gc
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Iterator

import pytest
import torch

import opttree


def many_params(count: int = 128) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3)) for _ in range(count)]


def step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step()


def reset_between_steps() -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    """An AdamW over 128 parameters, stepped, reset and stepped again."""
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    opttree.reset(optimizer)
    step(optimizer, params, 1)
    return params, optimizer


def test_repeated_resets_match_a_fresh_optimizer_each_time() -> None:
    params = many_params()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    for rollout in range(3):
        for i in range(3):
            step(optimizer, params, 10 * rollout + i)
        opttree.reset(optimizer)
        with torch.no_grad():
            for twin, p in zip(twins, params, strict=True):
                twin.copy_(p)
        fresh = torch.optim.AdamW(twins, lr=0.1)
        step(optimizer, params, 99 + rollout)
        step(fresh, twins, 99 + rollout)
        assert all(torch.equal(a, b) for a, b in zip(params, twins, strict=True))


def test_a_replaced_state_tensor_is_the_one_zeroed() -> None:
    params, optimizer = reset_between_steps()
    entry = optimizer.state[params[-1]]
    stale = entry["exp_avg"]
    entry["exp_avg"] = torch.ones(3)

    opttree.reset(optimizer)

    assert not entry["exp_avg"].any() and stale.any()


def test_a_key_added_after_a_reset_is_still_refused() -> None:
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    opttree.reset(optimizer)
    optimizer.state[params[5]]["ema"] = torch.ones(3)

    with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'ema'"):
        opttree.reset(optimizer)


def test_a_loaded_state_dict_is_what_the_next_reset_zeroes() -> None:
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    saved = copy.deepcopy(optimizer.state_dict())  # state_dict() shares the tensors
    opttree.reset(optimizer)

    optimizer.load_state_dict(saved)

    assert all(optimizer.state[p]["exp_avg"].any() for p in params)
    opttree.reset(optimizer)
    assert not any(optimizer.state[p]["exp_avg"].any() for p in params)


def test_a_parameter_moved_out_of_its_group_is_seen() -> None:
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    opttree.reset(optimizer)
    optimizer.param_groups[0]["params"] = params[:-1]

    problems = opttree.validate(optimizer)

    assert [p.kind for p in problems] == [opttree.ProblemKind.ORPHAN_STATE]


def test_a_forked_child_resets_with_its_own_threads() -> None:
    import multiprocessing

    params = many_params(2048)  # enough small tensors for the threaded path
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    opttree.reset(optimizer)  # the parent's pool now has threads
    step(optimizer, params, 1)

    context = multiprocessing.get_context("fork")
    child = context.Process(target=opttree.reset, args=(optimizer,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():  # hung on the parent's threads
        child.kill()

    assert child.exitcode == 0


def test_a_key_moving_to_the_next_entry_is_seen() -> None:
    """A key moves from the end of one entry to the start of the next: the keys and values
    flattened over all entries stay identical, the entry sizes do not."""
    params = many_params()
    optimizer = torch.optim.AdamW(params, amsgrad=True)
    step(optimizer, params, 0)
    optimizer.param_groups[0]["amsgrad"] = False  # entries may then lack max_exp_avg_sq
    first, second = optimizer.state[params[0]], optimizer.state[params[1]]
    del second["max_exp_avg_sq"]
    opttree.reset(optimizer)
    moved = {"max_exp_avg_sq": first.pop("max_exp_avg_sq"), **second}
    moved["max_exp_avg_sq"].fill_(1.0)
    second.clear()
    second.update(moved)

    opttree.reset(optimizer)

    assert "max_exp_avg_sq" not in first and not second["max_exp_avg_sq"].any()


def test_a_storage_freed_in_place_after_a_reset_is_refused_not_written() -> None:
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    opttree.reset(optimizer)
    last = optimizer.state[params[-1]]["exp_avg_sq"]
    last.untyped_storage().resize_(0)  # the same tensor object, its memory gone

    with pytest.raises(opttree.UnsupportedOptimizerState, match="storage is freed"):
        opttree.reset(optimizer)


def test_a_reset_keeps_no_tensor_alive() -> None:
    """Megatron's offload_to_cpu() replaces every state tensor with a copy: the old ones
    must be freed at once, not kept by anything of the last reset's."""
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    opttree.reset(optimizer)
    old = [weakref.ref(v) for entry in optimizer.state.values() for v in entry.values()]

    for entry in optimizer.state.values():
        entry.update({key: value.clone() for key, value in entry.items()})  # offload_to_cpu() uses .cpu()
    gc.collect()

    assert all(ref() is None for ref in old)
    step(optimizer, params, 1)
    report = opttree.reset(optimizer)  # the copies are the ones zeroed
    assert report.tensors_zeroed == 2 * len(params)
    assert all(not v.any() for entry in optimizer.state.values() for v in entry.values())


def test_cleared_state_is_freed() -> None:
    """``state.clear()`` after a reset lets every tensor go: nothing of the reset holds
    the tensors or the entry dicts that hold them."""
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    opttree.reset(optimizer)
    old = [weakref.ref(v) for entry in optimizer.state.values() for v in entry.values()]

    optimizer.state.clear()
    gc.collect()

    assert all(ref() is None for ref in old)


def test_a_parameter_pointed_at_history_after_a_reset_is_refused() -> None:
    """A parameter that now lives in a history tensor would be zeroed with it."""
    params, optimizer = reset_between_steps()
    victim = params[7]
    victim.data = optimizer.state[params[3]]["exp_avg"]
    weight = victim.detach().clone()

    with pytest.raises(opttree.UnsupportedOptimizerState, match="shares memory with a parameter"):
        opttree.reset(optimizer)
    assert torch.equal(victim, weight)


def test_history_shrunk_in_place_after_a_reset_is_refused_as_unlike_its_parameter() -> None:
    """``resize_`` to fewer elements keeps a tensor's address: zeroed in place, it would stay
    short where a fresh optimizer builds it as its parameter is; refused, nothing changed."""
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    opttree.reset(optimizer)
    step(optimizer, params, 1)
    shrunk = optimizer.state[params[-1]]["exp_avg"]
    address = shrunk.data_ptr()
    shrunk.resize_(1)
    assert shrunk.data_ptr() == address
    before = [entry["exp_avg"].clone() for entry in optimizer.state.values()]

    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'exp_avg': history of shape \(1,\) float32 where its parameter is shape \(\d+,\) float32"):
        opttree.reset(optimizer)

    assert all(torch.equal(entry["exp_avg"], old) for entry, old in zip(optimizer.state.values(), before, strict=True))


def test_int_steps_are_set_back_to_the_int_zero_at_every_reset() -> None:
    """SparseAdam counts its steps in ints, a new object at each step."""
    embeddings = [torch.nn.Embedding(4, 3, sparse=True) for _ in range(128)]
    optimizer: torch.optim.Optimizer = torch.optim.SparseAdam([e.weight for e in embeddings])

    def sparse_step(row: int) -> None:
        for embedding in embeddings:
            embedding.zero_grad()
            embedding(torch.tensor([row, 1])).sum().backward()
        optimizer.step()

    sparse_step(0)
    opttree.reset(optimizer)
    sparse_step(2)
    sparse_step(3)

    opttree.reset(optimizer)

    steps = [entry["step"] for entry in optimizer.state.values()]
    assert all(type(s) is int and s == 0 for s in steps)
    assert not any(entry["exp_avg"].any() for entry in optimizer.state.values())


def test_history_set_to_none_after_a_reset_is_refused() -> None:
    params, optimizer = reset_between_steps()
    optimizer.state[params[5]]["exp_avg"] = None
    gc.collect()
    before = [v.clone() for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]

    with pytest.raises(opttree.UnsupportedOptimizerState, match="history is a NoneType"):
        opttree.reset(optimizer)
    after = [v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def others_than_the_last(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.clone() for entry in list(optimizer.state.values())[:-1] for v in entry.values()]


def same_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(map(torch.equal, a, b))


def test_a_storage_given_back_smaller_in_place_is_refused_not_overrun() -> None:
    """``resize_(0)`` and then ``resize_(n)`` give a storage back, often at its old address:
    smaller than its tensor, zeroing the tensor would write past the allocation."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4096)) for _ in range(8)]
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    opttree.reset(optimizer)
    step(optimizer, params, 1)
    history = optimizer.state[params[-1]]["exp_avg"]
    storage = history.untyped_storage()
    storage.resize_(0)
    storage.resize_(history.nbytes - 64)
    before = others_than_the_last(optimizer)

    assert [p.kind for p in opttree.validate(optimizer)] == [opttree.ProblemKind.UNWRITABLE_STATE]
    with pytest.raises(opttree.UnsupportedOptimizerState, match="storage is freed or smaller than the tensor"):
        opttree.reset(optimizer)
    assert same_tensors(others_than_the_last(optimizer), before)


class Guarded(torch.Tensor):
    """A subclass with its own ``__torch_function__`` that refuses to be zeroed."""

    @classmethod
    def __torch_function__(cls, func: object, types: object, args: object = (), kwargs: object = None) -> object:
        if "zero" in getattr(func, "__name__", ""):
            raise RuntimeError("a Guarded tensor refuses to be zeroed")
        return torch.Tensor.__torch_function__.__func__(cls, func, types, args, kwargs)  # type: ignore[attr-defined]


def test_a_tensor_whose_class_is_changed_in_place_is_refused_before_any_write() -> None:
    params, optimizer = reset_between_steps()
    optimizer.state[params[-1]]["exp_avg_sq"].__class__ = Guarded  # the same object, address and size
    before = others_than_the_last(optimizer)

    with pytest.raises(opttree.UnsupportedOptimizerState, match="a Guarded"):
        opttree.reset(optimizer)
    assert same_tensors(others_than_the_last(optimizer), before)


def test_a_parameter_over_foreign_memory_grown_over_history_is_refused() -> None:
    """Tensors over one buffer torch does not own (``frombuffer``; ``from_numpy`` and
    DLPack alike) are distinct storages that may overlap: only their addresses say so.
    Here each weight is followed by its own ``exp_avg`` in one buffer."""
    count, floats = 128, 4
    buffer = bytearray(count * 6 * floats)
    params = [torch.nn.Parameter(torch.frombuffer(buffer, dtype=torch.float32, count=3, offset=6 * i * floats)) for i in range(count)]
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    for i, param in enumerate(params):
        history = torch.frombuffer(buffer, dtype=torch.float32, count=3, offset=(6 * i + 3) * floats)
        history.copy_(optimizer.state[param]["exp_avg"])
        optimizer.state[param]["exp_avg"] = history
    opttree.reset(optimizer)  # side by side, they do not overlap
    step(optimizer, params, 1)
    params[0].data = torch.frombuffer(buffer, dtype=torch.float32, count=6)  # the same address, twice as long
    weight = params[0].detach().clone()

    problems = opttree.validate(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizerState):
        opttree.reset(optimizer)
    assert torch.equal(params[0], weight)
    assert any(p.kind is opttree.ProblemKind.ALIASED_STATE and "shares memory with a parameter" in p.message for p in problems)


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_inference_state_is_refused_in_either_mode(inference: bool) -> None:
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    with torch.inference_mode():
        step(optimizer, params, 0)  # the state is built as inference tensors
    before = [v.clone() for entry in optimizer.state.values() for v in entry.values()]

    with torch.inference_mode(inference), pytest.raises(opttree.UnsupportedOptimizerState, match="an inference tensor"):
        opttree.reset(optimizer)
    assert same_tensors([v for entry in optimizer.state.values() for v in entry.values()], before)


def test_an_identity_history_reshaped_in_place_is_refused() -> None:
    """SOAP's eigenbases start as identity matrices; one no longer square has none."""
    soap = pytest.importorskip("emerging_optimizers.soap.soap")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(70)]
    optimizer = soap.SOAP(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    for entry in optimizer.state.values():  # eigh gives column-major bases; a contiguous copy is as valid
        entry["Q_L"], entry["Q_R"] = entry["Q_L"].contiguous(), entry["Q_R"].contiguous()
    opttree.reset(optimizer)
    basis = optimizer.state[params[0]]["Q_L"]
    basis.data = basis.view(2, 8)  # the same storage, address and bytes

    messages = [p.message for p in opttree.validate(optimizer) if p.key == "Q_L"]
    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"key 'Q_L': history of shape \(2, 8\) float32 .*built as shape \(4, 4\) float32"):
        opttree.reset(optimizer)
    assert len(messages) == 2 and "starts as an identity matrix, but one is of shape (2, 8), not square" in messages[1]


class Shadowed(dict[str, object]):
    """A state entry whose iteration shows a key its dict contents do not."""

    def __iter__(self) -> Iterator[str]:
        return iter([*super().__iter__(), "ema"])


def test_an_entry_replaced_by_a_dict_subclass_reading_by_its_own_methods_is_refused() -> None:
    """After a first reset, an entry that reads its keys by its own ``__iter__`` (showing one
    it does not hold) is refused as such, before anything reads it."""
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    opttree.reset(optimizer)
    optimizer.state[params[9]] = Shadowed(optimizer.state[params[9]])

    with pytest.raises(opttree.UnsupportedOptimizerState, match="a state entry is a Shadowed, which reads its keys by its own __iter__"):
        opttree.reset(optimizer)


def test_tensors_can_be_swapped_after_a_reset() -> None:
    """``torch.utils.swap_tensors`` refuses tensors that have weak references, and
    ``Module._apply`` swaps parameters (of tensor subclasses such as DTensor, or with
    ``swap_module_params_on_conversion``): a reset leaves none behind."""
    net = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(64)])
    optimizer = torch.optim.AdamW(net.parameters())
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    opttree.reset(optimizer)

    param = next(net.parameters())
    torch.utils.swap_tensors(optimizer.state[param]["exp_avg"], torch.ones_like(param))  # type: ignore[no-untyped-call]  # unannotated in torch
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        net.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert param.dtype is torch.float64


def test_a_reset_in_an_atexit_handler_zeroes_everything() -> None:
    """At interpreter shutdown the zeroing threads take no more work: the caller's thread
    zeroes what they would have."""
    script = textwrap.dedent(
        """
        import atexit, torch, opttree
        torch.set_num_threads(2)
        params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2048)]
        optimizer = torch.optim.AdamW(params)
        for p in params:
            p.grad = torch.ones(3)
        optimizer.step()

        def at_exit():
            report = opttree.reset(optimizer)
            zero = all(not optimizer.state[p]["exp_avg"].any() for p in params)
            print("zeroed", report.tensors_zeroed, zero)

        atexit.register(at_exit)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)

    assert done.returncode == 0 and "zeroed 4096 True" in done.stdout, done.stderr


def test_a_refusal_kept_by_the_caller_keeps_no_state_alive() -> None:
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    optimizer.state[params[0]]["ema"] = torch.ones(3)
    try:
        opttree.reset(optimizer)
    except opttree.UnsupportedOptimizerState as error:
        kept = error  # with its traceback, and the frames in it
    old = [weakref.ref(v) for entry in optimizer.state.values() for v in entry.values()]

    optimizer.state.clear()
    gc.collect()

    assert kept.problem is not None and all(ref() is None for ref in old)


def _checked_adamw() -> tuple[list[torch.nn.Parameter], torch.optim.AdamW, opttree.ResetVisitor]:
    """AdamW over 3 parameters after 2 steps, its reset checked by ``refusal`` and not yet carried out."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    for seed in range(2):
        step(optimizer, params, seed)
    visitor = opttree.ResetVisitor()
    assert visitor.refusal(opttree.tree(optimizer)) is None
    return params, optimizer, visitor


def test_carry_out_checks_the_state_again_a_weight_now_on_history_is_refused() -> None:
    params, optimizer, visitor = _checked_adamw()
    params[1].data = optimizer.state[params[0]]["exp_avg"]
    weight = params[1].detach().clone()

    with pytest.raises(opttree.UnsupportedOptimizerState, match="shares memory with"):
        visitor.carry_out()

    assert torch.equal(params[1].detach(), weight)


def test_carry_out_checks_the_state_again_replaced_history_is_the_one_zeroed() -> None:
    params, optimizer, visitor = _checked_adamw()
    optimizer.state[params[0]]["exp_avg"] = torch.ones(4)

    report = visitor.carry_out()

    assert report.tensors_zeroed == 6 and not optimizer.state[params[0]]["exp_avg"].any()


def test_carry_out_checks_the_state_again_a_freed_storage_is_refused_not_written() -> None:
    """Zeroing through a storage freed after the check would write outside any allocation."""
    code = textwrap.dedent(
        """
        import torch, opttree
        params = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
        optimizer = torch.optim.AdamW(params, lr=0.1)
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        visitor = opttree.ResetVisitor()
        assert visitor.refusal(opttree.tree(optimizer)) is None
        optimizer.state[params[0]]["exp_avg"].untyped_storage().resize_(0)
        try:
            visitor.carry_out()
        except opttree.UnsupportedOptimizerState as error:
            assert "storage is freed" in str(error), error
            print("refused")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "refused", (done.returncode, done.stderr[-2000:])
