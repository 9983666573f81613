"""A full reset reuses the previous reset's plan of a large leaf only while its state is
the very same; any change is seen and planned afresh."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import opttree
from opttree import _plan_cache


def many_params(count: int = 2 * _plan_cache.MIN_ENTRIES) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3)) for _ in range(count)]


def step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step()


def test_repeated_resets_match_a_fresh_optimizer_each_time() -> None:
    params = many_params()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    for rollout in range(3):
        for i in range(3):
            step(optimizer, params, 10 * rollout + i)
        opttree.reset(optimizer)
        assert optimizer in _plan_cache._plans
        with torch.no_grad():
            for twin, p in zip(twins, params, strict=True):
                twin.copy_(p)
        fresh = torch.optim.AdamW(twins, lr=0.1)
        step(optimizer, params, 99 + rollout)
        step(fresh, twins, 99 + rollout)
        assert all(torch.equal(a, b) for a, b in zip(params, twins, strict=True))


def test_a_replaced_state_tensor_is_the_one_zeroed() -> None:
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    opttree.reset(optimizer)
    step(optimizer, params, 1)
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


def test_a_loaded_state_dict_is_planned_afresh() -> None:
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    saved = copy.deepcopy(optimizer.state_dict())  # state_dict() shares the tensors
    opttree.reset(optimizer)
    kept = _plan_cache._plans[optimizer]

    optimizer.load_state_dict(saved)

    assert all(optimizer.state[p]["exp_avg"].any() for p in params)
    opttree.reset(optimizer)
    assert not any(optimizer.state[p]["exp_avg"].any() for p in params)
    assert _plan_cache._plans[optimizer] is not kept  # the tensors it was made for are gone


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


def test_a_step_key_moving_to_the_next_entry_is_seen() -> None:
    """A step kept as a Python number moves from the end of one entry to the start of the
    next: the flattened keys and values stay identical, the entry sizes do not."""
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    first, second = optimizer.state[params[0]], optimizer.state[params[1]]
    for entry in optimizer.state.values():
        del entry["step"]
        entry["step"] = 0  # last, and a number, which the plan sets by entry
    del second["step"]
    opttree.reset(optimizer)
    assert optimizer in _plan_cache._plans
    moved = {"step": first.pop("step"), **second}
    second.clear()
    second.update(moved)

    opttree.reset(optimizer)

    assert "step" not in first and "step" in second


def test_a_storage_freed_in_place_after_a_reset_is_refused_not_written() -> None:
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    opttree.reset(optimizer)
    assert optimizer in _plan_cache._plans
    last = optimizer.state[params[-1]]["exp_avg_sq"]
    last.untyped_storage().resize_(0)  # the same tensor object, its memory gone

    with pytest.raises(opttree.UnsupportedOptimizerState, match="storage is freed"):
        opttree.reset(optimizer)


def test_validate_stores_no_plan() -> None:
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)

    assert opttree.validate(optimizer) == ()
    assert optimizer not in _plan_cache._plans
    opttree.reset(optimizer)
    assert optimizer in _plan_cache._plans


def test_a_kept_plan_holds_no_tensor_alive() -> None:
    """Megatron's offload_to_cpu() replaces every state tensor with a copy: the old ones
    must be freed at once, not kept by the plan of the last reset."""
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    opttree.reset(optimizer)
    assert optimizer in _plan_cache._plans
    old = [weakref.ref(v) for entry in optimizer.state.values() for v in entry.values()]

    for entry in optimizer.state.values():
        entry.update({key: value.clone() for key, value in entry.items()})  # offload_to_cpu() uses .cpu()
    gc.collect()

    assert all(ref() is None for ref in old)
    step(optimizer, params, 1)
    report = opttree.reset(optimizer)  # the stale plan is not reused: the copies are zeroed
    assert report.tensors_zeroed == 2 * len(params)
    assert all(not v.any() for entry in optimizer.state.values() for v in entry.values())


def test_cleared_state_is_freed_the_kept_plan_holds_no_entry() -> None:
    """``state.clear()`` after a reset lets every tensor go: the kept plan holds neither
    the tensors nor the entry dicts that hold them."""
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    opttree.reset(optimizer)
    assert optimizer in _plan_cache._plans
    old = [weakref.ref(v) for entry in optimizer.state.values() for v in entry.values()]

    optimizer.state.clear()
    gc.collect()

    assert all(ref() is None for ref in old)


def test_a_parameter_pointed_at_history_after_a_reset_is_refused() -> None:
    """A kept plan checks the parameters' addresses too: one that now lives in a history
    tensor would be zeroed with it."""
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    opttree.reset(optimizer)
    assert optimizer in _plan_cache._plans
    step(optimizer, params, 1)
    victim = params[7]
    victim.data = optimizer.state[params[3]]["exp_avg"]
    weight = victim.detach().clone()

    with pytest.raises(opttree.UnsupportedOptimizerState, match="shares memory with a parameter"):
        opttree.reset(optimizer)
    assert torch.equal(victim, weight)


def test_history_shrunk_in_place_after_a_reset_is_counted_as_it_now_is() -> None:
    """``resize_`` to fewer elements keeps a tensor's address: the report still counts the
    bytes really zeroed."""
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    first = opttree.reset(optimizer)
    step(optimizer, params, 1)
    shrunk = optimizer.state[params[-1]]["exp_avg"]
    address = shrunk.data_ptr()
    shrunk.resize_(1)
    assert shrunk.data_ptr() == address

    report = opttree.reset(optimizer)

    assert report.bytes_reset == first.bytes_reset - 2 * shrunk.element_size()


def test_a_plan_over_int_steps_is_reused_and_sets_them_back_to_zero() -> None:
    """SparseAdam counts its steps in ints, a new object at each step: a kept plan matches
    them by type, not identity, and gives each the int 0 again."""
    embeddings = [torch.nn.Embedding(4, 3, sparse=True) for _ in range(2 * _plan_cache.MIN_ENTRIES)]
    optimizer: torch.optim.Optimizer = torch.optim.SparseAdam([e.weight for e in embeddings])

    def sparse_step(row: int) -> None:
        for embedding in embeddings:
            embedding.zero_grad()
            embedding(torch.tensor([row, 1])).sum().backward()
        optimizer.step()

    sparse_step(0)
    opttree.reset(optimizer)
    kept = _plan_cache._plans[optimizer]
    sparse_step(2)
    sparse_step(3)

    opttree.reset(optimizer)

    assert _plan_cache._plans[optimizer] is kept
    steps = [entry["step"] for entry in optimizer.state.values()]
    assert all(type(s) is int and s == 0 for s in steps)
    assert not any(entry["exp_avg"].any() for entry in optimizer.state.values())


def test_history_set_to_none_after_a_reset_is_refused_not_matched() -> None:
    """A weak reference whose tensor is gone reads as None: a None now in its place must
    not pass for it."""
    params = many_params()
    optimizer = torch.optim.AdamW(params)
    step(optimizer, params, 0)
    opttree.reset(optimizer)
    assert optimizer in _plan_cache._plans
    step(optimizer, params, 1)
    optimizer.state[params[5]]["exp_avg"] = None
    gc.collect()
    before = [v.clone() for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]

    with pytest.raises(opttree.UnsupportedOptimizerState, match="history is a NoneType"):
        opttree.reset(optimizer)
    after = [v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
