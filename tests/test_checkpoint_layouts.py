"""``opttree.load_state_dict`` checks a state dict as each Megatron wrapper kind's load reads
it before anything is loaded or written, and ``opttree.sharded_state_dict`` its arguments.

Megatron's side: its loads are not all-or-nothing, and some load part of a checkpoint
silently; shown here beside opttree's refusal, which leaves both the stack and the state
dict it was given unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from megatron.core import dist_checkpointing

import opttree
from opttree import testing
from tests.helpers import snapshot, unchanged
from tests.megatron_parts import fp32, megatron_group
from tests.test_checkpoints import fresh_like, model_state, reset_and_save
from tests.test_preflight import read_only_map

K = 2

Edit = Callable[[dict[str, object]], object]


def recipe(name: str) -> testing.MegatronStack:
    if name not in testing.available():
        pytest.skip(f"no {name} recipe in this lane")
    stack = testing.build(name)
    stack.train(0, K)
    return stack


def saved(stack: testing.MegatronStack) -> dict[str, object]:
    with stack.device:
        state = stack.optimizer.state_dict()
    assert isinstance(state, dict)
    return state


def same(a: object, b: object) -> bool:
    """Whether two state dicts hold the same keys, values and tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.layout == b.layout and a.device == b.device):
            return False
        if a.is_meta:
            return a.dtype == b.dtype and a.stride() == b.stride()
        return torch.equal(a.to_dense(), b.to_dense()) if a.is_sparse else a.stride() == b.stride() and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def inner(state: dict[str, object]) -> dict[str, object]:
    """The torch-format state dict of a stack's leaf: the state dict itself for ``fp32``,
    under ``"optimizer"`` for the mixed-precision kinds."""
    found = state.get("optimizer", state)
    assert isinstance(found, dict)
    return found


def entries(state: dict[str, object]) -> dict[object, object]:
    found = inner(state)["state"]
    assert isinstance(found, dict)
    return found


def entry(state: dict[str, object]) -> dict[object, object]:
    """The saved state entry of the leaf's first parameter."""
    found = entries(state)[0]
    assert isinstance(found, dict)
    return found


def groups(state: dict[str, object]) -> list[dict[str, object]]:
    found = inner(state)["param_groups"]
    assert isinstance(found, list)
    return found


def masters(state: dict[str, object]) -> list[list[torch.Tensor]]:
    found = state["fp32_from_fp16_params"]
    assert isinstance(found, list)
    return found


def put(container: dict[object, object] | dict[str, object], key: object, value: object) -> None:
    container[key] = value  # type: ignore[index]


def _inference_full(value: float) -> torch.Tensor:
    """A loss scale as Megatron's scaler holds it, made inside inference mode."""
    with torch.inference_mode():
        return torch.full((1,), value)


def _inference_zeros(*shape: int) -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(*shape)


class HashRaises:
    """A saved option whose ``__hash__`` raises (equal to any other of its kind)."""

    def __eq__(self, other: object) -> bool:
        return type(other) is HashRaises

    def __hash__(self) -> int:
        raise RuntimeError("no hash")


class Uncopyable:
    """A saved option that torch's load cannot copy, as a generator cannot be."""

    def __deepcopy__(self, memo: dict[int, object]) -> Uncopyable:
        raise TypeError("cannot copy an Uncopyable")


MALFORMED: list[tuple[str, str, Edit, str, str]] = [
    ("fp32", "no param groups", lambda s: s.pop("param_groups"), "param_groups", "has no 'param_groups'"),
    ("fp32", "state a list", lambda s: put(s, "state", [1, 2]), "state", "is a list"),
    ("fp32", "an entry a str", lambda s: put(entries(s), 0, "garbage"), "0", "not a dict"),
    ("fp32", "an entry for no parameter", lambda s: put(entries(s), 99, {}), "99", "no parameter of the param groups"),
    ("fp32", "a group short of a parameter", lambda s: groups(s)[0]["params"].pop(), "param_groups", "param group 0 holds"),  # type: ignore[attr-defined]
    ("fp32", "a group missing", lambda s: groups(s).pop(), "param_groups", "holds 1 param groups, and the optimizer has 2"),
    ("fp32", "betas a str", lambda s: put(groups(s)[0], "betas", "0.9,0.999"), "param_groups", "param group 0 holds a str as 'betas', which AdamW reads as a sequence of 2 values"),
    ("fp32", "eps a list", lambda s: put(groups(s)[1], "eps", [1e-8]), "param_groups", r"param group 1 holds a sequence of 1 values \(a real number\) as 'eps', which AdamW reads as a real number"),
    ("fp32", "lr None", lambda s: put(groups(s)[0], "lr", None), "param_groups", "param group 0 holds None as 'lr', which AdamW reads as a real number"),
    ("fp32", "betas holding None", lambda s: put(groups(s)[0], "betas", (None, 0.999)), "param_groups", r"holds a sequence of 2 values \(None, a real number\) as 'betas'"),
    ("fp32", "betas of strs", lambda s: put(groups(s)[0], "betas", ("0.9", "0.999")), "param_groups", r"param group 0 holds a sequence of 2 values \(a str, a str\) as 'betas', which AdamW reads as a sequence of 2 values \(a real number, a real number\)"),
    ("fp32", "amsgrad a str", lambda s: put(groups(s)[0], "amsgrad", "False"), "param_groups", "param group 0 holds a str as 'amsgrad', which AdamW reads as True or False"),
    ("fp32", "a group of other settings", lambda s: put(groups(s)[0], "wd_mult", 7.0), "param_groups", "Megatron pairs no saved param group"),
    ("fp32", "a setting whose hash raises", lambda s: put(groups(s)[0], "lr_mult", HashRaises()), "param_groups", "Megatron pairs no saved param group with one of the optimizer's: RuntimeError: no hash"),
    ("fp32", "fused a tensor of several values", lambda s: put(groups(s)[0], "fused", torch.tensor([1.0, 0.0])), "param_groups", "param group 0 holds .* as 'fused', whose truth torch's load and AdamW's step read"),
    ("dist_bf16", "fused a tensor of no value", lambda s: put(groups(s)[1], "fused", torch.tensor([])), "param_groups", "param group 1 holds .* as 'fused', whose truth"),
    ("bf16", "no torch state", lambda s: s.pop("optimizer"), "optimizer", "has no 'optimizer'"),
    ("bf16", "master weights missing", lambda s: s.pop("fp32_from_fp16_params"), "fp32_from_fp16_params", "has no"),
    ("bf16", "a master weight short", lambda s: masters(s)[1].pop(), "fp32_from_fp16_params", "Megatron would load only some"),
    ("bf16", "a master group short", lambda s: masters(s).pop(), "fp32_from_fp16_params", "Megatron would load only some"),
    ("bf16", "a master weight of a scalar", lambda s: masters(s)[0].__setitem__(0, torch.ones(1)), "fp32_from_fp16_params", r"of shape \(1,\)"),
    ("bf16", "a meta master weight", lambda s: masters(s)[0].__setitem__(0, masters(s)[0][0].to("meta")), "fp32_from_fp16_params", "group 0 holds a master weight that is a meta tensor"),
    ("bf16", "an entry a str", lambda s: put(entries(s), 0, "garbage"), "0", "not a dict"),
    ("fp16", "a loss scale missing", lambda s: s["grad_scaler"].pop("scale"), "grad_scaler", "has no 'scale'"),  # type: ignore[attr-defined]
    ("fp16", "a loss scale a float", lambda s: put(s["grad_scaler"], "scale", 2.0), "grad_scaler", "holds a float under 'scale'"),  # type: ignore[arg-type]
    ("fp16", "an infinite loss scale", lambda s: put(s["grad_scaler"], "scale", torch.tensor(float("inf"))), "grad_scaler", "its 'scale' is inf, where the loss scale is one positive finite number"),  # type: ignore[arg-type]
    ("fp16", "a loss scale of 0", lambda s: put(s["grad_scaler"], "scale", torch.tensor(0.0)), "grad_scaler", "its 'scale' is 0, where"),  # type: ignore[arg-type]
    ("fp16", "an inference loss scale", lambda s: put(s["grad_scaler"], "scale", _inference_full(2.0**18)), "grad_scaler", "its 'scale' is an inference tensor .*, which Megatron's load keeps where it lies"),  # type: ignore[arg-type]
    ("fp16", "an int64 loss scale", lambda s: put(s["grad_scaler"], "scale", torch.tensor([2.0**21], dtype=torch.int64)), "grad_scaler", "holds an int64 tensor under 'scale', where DynamicGradScaler holds a float32 tensor"),  # type: ignore[arg-type]
    ("fp16", "a group step a str", lambda s: put(groups(s)[0], "step", "2"), "step", "param group 0's step is a str, where a step counts from 0 in one whole number"),
    ("fp32", "a group step of 2.5", lambda s: put(groups(s)[0], "step", 2.5), "step", "param group 0's step is 2.5, where a step counts from 0 in one whole number"),
    ("fp16", "a tracker of -1", lambda s: put(s["grad_scaler"], "growth_tracker", -1), "grad_scaler", "its 'growth_tracker' is -1, where it counts steps from 0"),  # type: ignore[arg-type]
    ("fp32", "history of another shape", lambda s: put(entry(s), "exp_avg", torch.zeros(3)), "exp_avg", r"its 'exp_avg' has shape \(3,\), where AdamW builds it in shape \(32, 16\)"),
    ("fp32", "history a str", lambda s: put(entry(s), "exp_avg_sq", "s"), "exp_avg_sq", "its 'exp_avg_sq' is a str, where AdamW keeps a tensor"),
    ("fp32", "sparse history", lambda s: put(entry(s), "exp_avg", torch.zeros(32, 16).to_sparse()), "exp_avg", "its 'exp_avg' is a sparse_coo tensor .*, which AdamW's step updates in place"),
    ("fp32", "expanded history", lambda s: put(entry(s), "exp_avg", torch.zeros(1).expand(32, 16)), "exp_avg", "its 'exp_avg' is a tensor whose elements share or may share memory"),
    ("fp32", "inference history", lambda s: put(entry(s), "exp_avg", _inference_zeros(32, 16)), "exp_avg", "its 'exp_avg' is an inference tensor"),
    ("fp32", "a step a str", lambda s: put(entry(s), "step", "s"), "step", "its 'step' is a str, where AdamW counts steps from 0 in one whole number"),
    ("fp32", "a fractional step", lambda s: put(entry(s), "step", torch.tensor(1.5)), "step", "its 'step' is 1.5, where AdamW counts"),
    ("fp32", "an int64 step tensor", lambda s: put(entry(s), "step", torch.tensor(2, dtype=torch.int64)), "step", "its 'step' is an int64 tensor of 1 value, where AdamW counts steps from 0 in one whole number: a float tensor of the dtype a fresh one counts in"),
    ("fp32", "a float64 step", lambda s: put(entry(s), "step", torch.tensor(2.0, dtype=torch.float64)), "step", r"its 'step' is a float64 tensor, where a fresh AdamW counts in float32 \(torch's default dtype is float32; .*torch's load keeps it float64, and a reset of the loaded optimizer is refused"),
    ("fp32", "a step of shape (1,)", lambda s: put(entry(s), "step", torch.tensor([2.0])), "step", r"its 'step' is a tensor of shape \(1,\), where a fresh AdamW counts in a 0-d tensor: torch's load keeps its shape"),
    ("fp32", "a float64 common step", lambda s: put(entries(s), "common_step", torch.tensor(2.0, dtype=torch.float64)), "common_step", "is a float64 tensor, which Megatron's load writes as the step of every entry, where a fresh AdamW counts in float32"),
    ("fp32", "a bfloat16 step", lambda s: put(entry(s), "step", torch.tensor(2.0, dtype=torch.bfloat16)), "step", "its 'step' is a bfloat16 tensor of 1 value,"),
    ("fp32", "a common step of -1", lambda s: put(entries(s), "common_step", torch.tensor(-1.0)), "common_step", "is -1, which Megatron's load writes as the step of every entry"),
    ("fp32", "a common step a str", lambda s: put(entries(s), "common_step", "2"), "common_step", "is a str, which Megatron's load writes"),
    ("fp32", "a key of no schema", lambda s: put(entry(s), "my_ema", torch.zeros(1)), "my_ema", "its 'my_ema' is not a key AdamW keeps"),
    ("fp32", "a step of several values", lambda s: put(entry(s), "step", torch.ones(3)), "step", "its 'step' is a float32 tensor of 3 values"),
    ("fp32", "a negative step", lambda s: put(entry(s), "step", torch.tensor(-5.0)), "step", "its 'step' is -5, where AdamW counts steps from 0"),
    ("fp32", "an infinite step", lambda s: put(entry(s), "step", float("inf")), "step", "its 'step' is inf"),
    ("fp32", "an entry without its step", lambda s: entry(s).pop("step"), "step", "state entry 0 holds history but no step, where other entries hold one"),
    ("fp32", "an entry without its second moment", lambda s: entry(s).pop("exp_avg_sq"), "exp_avg_sq", "lacks 'exp_avg_sq', which AdamW builds with every entry and reads at every step"),
    ("fp32", "amsgrad over entries without its history", lambda s: put(groups(s)[0], "amsgrad", True), "max_exp_avg_sq", "lacks 'max_exp_avg_sq', which AdamW reads at every step where 'amsgrad' is on"),
    ("bf16", "history of another shape", lambda s: put(entry(s), "exp_avg", torch.zeros(32, 15)), "exp_avg", r"has shape \(32, 15\), where AdamW builds it in shape \(32, 16\)"),
    ("dist_bf16", "no torch state", lambda s: s.pop("optimizer"), "optimizer", "has no 'optimizer'"),
    ("dist_bf16", "groups without a step", lambda s: [g.pop("step") for g in groups(s)], "step", "do not hold one step"),
    ("dist_bf16", "groups at two steps", lambda s: put(groups(s)[0], "step", 7), "step", "do not hold one step"),
    ("dist_bf16", "betas a str", lambda s: put(groups(s)[0], "betas", "0.9,0.999"), "param_groups", "param group 0 holds a str as 'betas', which AdamW reads as a sequence of 2 values"),
    ("offload_0.75", "betas a str", lambda s: put(groups(s)[0], "betas", "0.9,0.999"), "param_groups", "param group 0 holds a str as 'betas', which HybridDeviceOptimizer reads as a sequence of 2 values"),
    ("dist_bf16", "groups at step -1", lambda s: [g.update(step=-1) for g in groups(s)], "step", "its param groups' step is -1, which Megatron's load gives each parameter"),
    ("dist_bf16", "groups at step 1.5", lambda s: [g.update(step=1.5) for g in groups(s)], "step", "its param groups' step is 1.5"),
    ("fp32", "a parameter named by a list", lambda s: put(groups(s)[0], "params", [[0], *groups(s)[0]["params"][1:]]), "param_groups", "param group 0 names a parameter by a list, which torch's load cannot index"),  # type: ignore[index]
    ("fp32", "steps that differ", lambda s: put(entry(s), "step", torch.tensor(7.0)), "step", r"the saved steps differ \(2 values, 2 to 7\), where FP32Optimizer saves one step for all its parameters"),
    ("bf16", "steps that differ", lambda s: put(entry(s), "step", torch.tensor(7.0)), "step", "the saved steps differ"),
    ("fp32", "a group Megatron cannot tell from another", lambda s: groups(s).append({**copy.deepcopy(groups(s)[1]), "lr": 5.0}), "param_groups", "saved param groups 1 and 2 hold other options but the settings Megatron pairs groups by alike"),
    ("fp32", "capturable on over CPU parameters", lambda s: put(groups(s)[0], "capturable", True), "param_groups", "param group 0 turns 'capturable' on, which AdamW's step runs only on .*, and its parameters lie on cpu"),
    ("fp32", "capturable 1 over CPU parameters", lambda s: put(groups(s)[0], "capturable", 1), "param_groups", "param group 0 turns 'capturable' on, which AdamW's step runs only on"),
    ("fp32", "capturable a 0-d tensor over CPU parameters", lambda s: put(groups(s)[0], "capturable", torch.tensor(1.0)), "param_groups", "param group 0 turns 'capturable' on, which AdamW's step runs only on"),
    ("dist_bf16", "amsgrad on over the entries it keeps", lambda s: [g.update(amsgrad=True) for g in groups(s)], "max_exp_avg_sq", "param group 0 turns 'amsgrad' on, where the optimizer's is off and 2 of its entries, which this state dict does not replace, lack 'max_exp_avg_sq'"),
    ("dist_bf16", "amsgrad on beside a param_state", lambda s: [s.update(param_state={}, param_state_sharding_type="dp_reshardable"), *[g.update(amsgrad=True) for g in groups(s)]], "max_exp_avg_sq", "param group 0 turns 'amsgrad' on, where the optimizer's is off and 2 of its entries"),
    ("fp32", "a step in read-only memory", lambda s: put(entry(s), "step", read_only_map(torch.full((1,), 2.0)).reshape(())), "step", "its 'step' is a tensor in memory the process cannot write"),
    ("dist_bf16", "buckets of another layout", lambda s: s.update(param_state={"per_bucket_numel_unpadded": [{"x": [1]}]}, param_state_sharding_type="dp_reshardable"), "per_bucket_numel_unpadded", "its buckets hold other numbers of elements than this stack's"),
    ("dist_bf16", "an unknown sharding", lambda s: s.update(param_state={}, param_state_sharding_type="zigzag"), "param_state_sharding_type", "'zigzag' is not one of"),
]


@pytest.mark.parametrize(("name", "what", "edit", "key", "message"), MALFORMED, ids=[f"{case[0]}-{case[1]}" for case in MALFORMED])
def test_a_malformed_state_dict_is_refused_with_the_stack_and_the_state_dict_unchanged(
    name: str, what: str, edit: Edit, key: str, message: str
) -> None:
    stack = recipe(name)
    state = saved(stack)
    edit(state)
    given = copy.deepcopy(state)
    loaded = fresh_like(stack)
    loaded.train(0, 1)  # something to keep
    before = [snapshot(leaf) for leaf in loaded.leaves()]
    weights = [param.clone() for param in loaded.main_params()]

    with loaded.device, pytest.raises(opttree.UnsupportedCheckpoint, match=message) as refused:
        opttree.load_state_dict(loaded.optimizer, state)

    assert refused.value.problem is not None and refused.value.problem.key == key
    assert all(unchanged(leaf, snap) for leaf, snap in zip(loaded.leaves(), before, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(loaded.main_params(), weights, strict=True))
    assert same(state, given)


def test_a_step_numpy_counts_in_is_loaded() -> None:
    """torch's Adam takes a step saved as NumPy's number, as it takes Python's."""
    import numpy as np

    stack = recipe("fp32")
    state = saved(stack)
    for saved_entry in entries(state).values():
        assert isinstance(saved_entry, dict)
        saved_entry["step"] = np.int64(int(saved_entry["step"]))
    loaded = fresh_like(stack)
    with loaded.device:
        opttree.load_state_dict(loaded.optimizer, state)
    loaded.train(K, 1)
    assert opttree.validate(loaded.optimizer) == ()


def test_a_hysteresis_tracker_overflows_counted_below_zero_is_loaded() -> None:
    """``DynamicGradScaler.update`` lowers its hysteresis tracker at every overflow, below 0
    too, and sets it back only when the scale grows: a checkpoint saved after one overflow
    in a row more than its hysteresis holds a count below 0. Megatron's own load takes it, and so does
    opttree's, where it refused it as a count from 0. A tracker that is no whole number
    is still refused."""
    stack = recipe("fp16")
    (member,) = getattr(stack.optimizer, "chained_optimizers")
    scaler = member.grad_scaler
    for _ in range(scaler.hysteresis + 1):
        scaler.update(found_inf=True)
    state = saved(stack)
    assert scaler._hysteresis_tracker < 0

    ours = loaded_as_by_megatron(stack, copy.deepcopy(state), steps=1)
    assert opttree.validate(ours.optimizer) == ()
    refused = fresh_like(stack)
    put(state["grad_scaler"], "hysteresis_tracker", 0.5)  # type: ignore[arg-type]
    with refused.device, pytest.raises(opttree.UnsupportedCheckpoint, match="its 'hysteresis_tracker' is 0.5, where it is a whole number"):
        opttree.load_state_dict(refused.optimizer, state)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [("fused", torch.tensor([1.0, 0.0]), "as 'fused', whose truth torch's load"), ("my_option", Uncopyable(), "cannot be copied as torch's load copies it: TypeError")],
    ids=["a flag without a truth", "an option torch cannot copy"],
)
def test_a_chains_second_member_whose_groups_torch_cannot_load_is_refused_before_the_first_loads(option: str, value: object, message: str) -> None:
    """Torch's load copies the saved groups and reads the truth of ``fused``: a group there
    raised inside Megatron's load of the chain's second member, after the first had
    loaded. Both are checked before anything loads."""
    stack = recipe("moe")
    state = stack.optimizer.state_dict()
    assert isinstance(state, list)
    put(inner(state[1])["param_groups"][0], option, value)  # type: ignore[index]
    loaded = fresh_like(stack)
    loaded.train(0, 1)
    before = [snapshot(leaf) for leaf in loaded.leaves()]

    with loaded.device, pytest.raises(opttree.UnsupportedCheckpoint, match=f"param group 0 {'holds .*' if option == 'fused' else ''}{message}") as refused:
        opttree.load_state_dict(loaded.optimizer, state)

    assert refused.value.problem is not None and refused.value.problem.path == "chained[1]"
    assert all(unchanged(leaf, snap) for leaf, snap in zip(loaded.leaves(), before, strict=True))


@pytest.mark.skipif("dist_bf16" not in testing.available(), reason="no dist_bf16 recipe in this lane")
def test_a_distributed_checkpoint_loaded_under_a_float64_default_counts_steps_as_a_fresh_optimizer() -> None:
    """Megatron's ``DistributedOptimizer`` load gives every entry a float32 step whatever
    torch's default dtype; under float64, where a fresh AdamW counts in float64, the loaded
    stack was refused by every later reset. opttree's load gives back the saved group steps
    in the dtype a fresh optimizer counts in."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        stack = recipe("dist_bf16")
        state = saved(stack)
        loaded = fresh_like(stack)
        with loaded.device:
            opttree.load_state_dict(loaded.optimizer, state)
        steps = [entry["step"] for leaf in loaded.leaves() for entry in leaf.state.values()]
        assert steps and {step.dtype for step in steps} == {torch.float64}
        assert opttree.validate(loaded.optimizer) == ()
        opttree.reset(loaded.optimizer)
    finally:
        torch.set_default_dtype(default)


def test_param_groups_saved_with_a_step_of_none_load_and_train_as_megatrons_own_load() -> None:
    """megatron-core 0.14's ``ChainedOptimizer`` saves ``step: None`` in every param group
    where none counts there (torch's optimizers count per parameter): no step, as ``reset``
    takes it, not a refused counter."""
    stack = recipe("fp32")
    state = saved(stack)
    for group in groups(state):
        group["step"] = None
    ours = loaded_as_by_megatron(stack, state, steps=1)
    assert opttree.validate(ours.optimizer) == ()


def loaded_as_by_megatron(stack: testing.MegatronStack, state: dict[str, object], *, steps: int) -> testing.MegatronStack:
    """A fresh stack like ``stack`` that opttree loaded ``state`` into, once it has trained
    ``steps`` to the same weights as one Megatron's own load loaded it into."""
    megatrons, ours = fresh_like(stack), fresh_like(stack)
    with megatrons.device:
        megatrons.optimizer.load_state_dict(copy.deepcopy(state))
    with ours.device:
        opttree.load_state_dict(ours.optimizer, state)
    megatrons.train(K, steps)
    ours.train(K, steps)
    assert all(torch.equal(a, b) for a, b in zip(ours.main_params(), megatrons.main_params(), strict=True))
    return ours


LOADED_THEN_FAILING: list[tuple[str, Edit, type[Exception], str, str]] = [
    ("an entry lacking a moment", lambda s: entry(s).pop("exp_avg_sq"), KeyError, "exp_avg_sq", "lacks 'exp_avg_sq'"),
    ("history of another shape", lambda s: put(entry(s), "exp_avg", torch.zeros(3)), RuntimeError, "must match the size", "its 'exp_avg' has shape"),
    ("betas of strs", lambda s: put(groups(s)[0], "betas", ("0.9", "0.999")), TypeError, "unsupported operand", r"holds a sequence of 2 values \(a str, a str\) as 'betas'"),
    ("expanded history", lambda s: put(entry(s), "exp_avg", torch.zeros(1).expand(32, 16)), RuntimeError, "more than one element", "elements share or may share memory"),
]


def test_history_torch_copies_at_the_load_is_taken_as_its_copy() -> None:
    """torch's load casts history to its parameter's dtype, and keeps one of that dtype as
    it is: float64 history made in inference mode becomes a normal float32 copy, which the
    next step updates in place; the same history in float32 stays an inference tensor
    (refused above). Loaded through opttree, it trains as Megatron's own load does."""
    stack = recipe("fp32")
    state = copy.deepcopy(saved(stack))
    with torch.inference_mode():
        for saved_entry in entries(state).values():
            assert isinstance(saved_entry, dict)
            saved_entry["exp_avg"] = saved_entry["exp_avg"].double()
    loaded_as_by_megatron(stack, state, steps=2)


def test_a_flag_saved_as_a_number_and_history_torch_copies_apart_load() -> None:
    """A flag saved as 0 reads as False; float64 history that views one buffer is cast by
    torch's load into float32 tensors of their own, so it is not one tensor updated twice."""
    stack = recipe("fp32")
    state = copy.deepcopy(saved(stack))
    groups(state)[0]["amsgrad"] = 0
    shared = torch.zeros(32 * 16, dtype=torch.float64)
    for saved_entry in list(entries(state).values())[:2]:  # both views start at the buffer's start
        assert isinstance(saved_entry, dict)
        shape = saved_entry["exp_avg"].shape
        saved_entry["exp_avg"] = shared[: shape.numel()].view(shape)
    loaded = fresh_like(stack)
    with loaded.device:
        opttree.load_state_dict(loaded.optimizer, state)
    loaded.train(K, 1)
    assert opttree.validate(loaded.optimizer) == ()


def test_options_missing_from_a_saved_group_load_as_torch_loads_them() -> None:
    """What a step reads cannot be told from an optimizer's ``defaults``: a
    HybridDeviceOptimizer's hold ``offload_fraction`` and the optimizer classes, which no
    step reads, so a checkpoint of groups without them (a DistributedOptimizer's of the
    same model without offloading) loads as Megatron's own load takes it, each entry
    given the saved step."""
    stack = recipe("offload_0.75")
    state = copy.deepcopy(saved(stack))
    for group in groups(state):
        for option in ("offload_fraction", "cpu_optimizer_cls", "gpu_optimizer_cls"):
            assert option in group
            group.pop(option)
    loaded = fresh_like(stack)
    with loaded.device:
        opttree.load_state_dict(loaded.optimizer, state)
    steps = [entry["step"] for leaf in loaded.leaves() for entry in leaf.state.values()]
    assert steps and [float(step) for step in steps] == [float(K)] * len(steps)


def test_an_option_the_optimizer_holds_as_none_takes_anything_in_a_sequence_too() -> None:
    """Adafactor's ``eps`` defaults to ``(None, 1e-3)``: a group that sets it to
    ``(1e-30, 1e-3)`` loads; one of strs does not."""

    params = [torch.nn.Parameter(torch.ones(4, 3))]
    saver = torch.optim.Adafactor([megatron_group(params, eps=(1e-30, 1e-3))])
    assert saver.defaults["eps"] == (None, 1e-3)
    state = saver.state_dict()
    fresh = torch.optim.Adafactor([megatron_group([torch.nn.Parameter(torch.ones(4, 3))])])
    opttree.load_state_dict(fp32(fresh), copy.deepcopy(state))
    assert fresh.param_groups[0]["eps"] == (1e-30, 1e-3)
    default_saver = torch.optim.Adafactor([megatron_group(params)])
    opttree.load_state_dict(fp32(fresh), default_saver.state_dict())  # (None, 1e-3), as Adafactor declares, into (1e-30, 1e-3)
    assert fresh.param_groups[0]["eps"] == (None, 1e-3)
    state["param_groups"][0]["eps"] = ("a", "b")
    with pytest.raises(opttree.UnsupportedCheckpoint, match=r"holds a sequence of 2 values \(a str, a str\) as 'eps', which Adafactor reads as a sequence of 2 values \(None, a real number\)"):
        opttree.load_state_dict(fp32(fresh), state)


def test_a_group_without_the_flags_torch_added_later_is_loaded() -> None:
    """A checkpoint saved before torch's Adam had ``foreach``, ``maximize``, ``capturable``,
    ``differentiable`` or ``fused`` lacks them in its groups: its ``__setstate__`` fills
    them in at the load, and training goes on bitwise as the saver's."""
    stack = recipe("fp32")
    state = copy.deepcopy(saved(stack))  # torch's load keeps a saved tensor of the right dtype and device as it is
    for group in groups(state):
        for flag in ("foreach", "maximize", "capturable", "differentiable", "fused"):
            group.pop(flag)
    loaded = fresh_like(stack)
    with loaded.device:
        opttree.load_state_dict(loaded.optimizer, state)
    loaded.train(K, 2)
    stack.train(K, 2)
    assert all(torch.equal(a, b) for a, b in zip(loaded.main_params(), stack.main_params(), strict=True))


@pytest.mark.parametrize(("edit", "error", "raised", "refusal"), [case[1:] for case in LOADED_THEN_FAILING], ids=[case[0] for case in LOADED_THEN_FAILING])
def test_megatron_loads_what_fails_the_next_step_and_opttree_refuses_it(edit: Edit, error: type[Exception], raised: str, refusal: str) -> None:
    """Torch's load casts history to its parameter's dtype but keeps its shape, and builds an
    entry whole only where it is empty: Megatron's own load takes a moment of another shape,
    or an entry without its ``exp_avg_sq``, and the next step raises inside torch."""
    stack = recipe("fp32")
    state = saved(stack)
    edit(state)
    megatrons = fresh_like(stack)
    with megatrons.device:
        megatrons.optimizer.load_state_dict(copy.deepcopy(state))
    with pytest.raises(error, match=raised):
        megatrons.train(K, 1)

    refused = fresh_like(stack)
    with refused.device, pytest.raises(opttree.UnsupportedCheckpoint, match=refusal):
        opttree.load_state_dict(refused.optimizer, state)
    refused.train(K, 1)  # nothing loaded: it trains as the fresh stack it is


@pytest.mark.parametrize("edit", [lambda s: masters(s)[1].pop(), lambda s: masters(s).pop()], ids=["a weight", "a group"])
def test_megatron_loads_a_checkpoint_short_of_master_weights_silently_and_opttree_refuses_it(edit: Edit) -> None:
    """Megatron's side: ``Float16OptimizerWithFloat16Params.load_state_dict`` copies the
    saved master weights with ``zip``, so the ones a checkpoint lacks keep the loading
    stack's values, and nothing says so."""
    stack = recipe("bf16")
    state = saved(stack)
    edit(state)
    megatrons, ours = fresh_like(stack), fresh_like(stack)
    for loaded in (megatrons, ours):
        with torch.no_grad():
            for param in loaded.main_params():
                param.add_(1.0)  # weights the checkpoint's are not

    with megatrons.device:
        megatrons.optimizer.load_state_dict(copy.deepcopy(state))
    with ours.device, pytest.raises(opttree.UnsupportedCheckpoint, match="Megatron would load only some"):
        opttree.load_state_dict(ours.optimizer, state)

    loaded_right = [torch.equal(a, b) for a, b in zip(megatrons.main_params(), stack.main_params(), strict=True)]
    assert any(loaded_right) and not all(loaded_right)


def test_megatron_keeps_an_entry_for_no_parameter_and_opttree_refuses_it() -> None:
    """Megatron's side: torch's load keeps a state entry whose index is no parameter's
    under that index, a state ``validate`` then reports and a reset refuses."""
    stack = recipe("fp32")
    state = saved(stack)
    put(entries(state), 99, {"exp_avg": torch.ones(1)})
    megatrons, ours = fresh_like(stack), fresh_like(stack)

    with megatrons.device:
        megatrons.optimizer.load_state_dict(copy.deepcopy(state))
    with ours.device, pytest.raises(opttree.UnsupportedCheckpoint, match="no parameter of the param groups"):
        opttree.load_state_dict(ours.optimizer, state)

    assert 99 in megatrons.leaves()[0].state
    assert opttree.validate(megatrons.optimizer) != ()
    assert opttree.validate(ours.optimizer) == ()


def test_the_older_name_of_the_torch_state_that_megatron_still_reads_is_loaded() -> None:
    """Old checkpoints name the torch optimizer's state ``optimizer_state_dict``, which
    Megatron's mixed-precision load still reads; so does opttree's."""
    stack = recipe("bf16")
    state = saved(stack)
    state["optimizer_state_dict"] = state.pop("optimizer")
    ours, megatrons = fresh_like(stack), fresh_like(stack)
    with ours.device:
        opttree.load_state_dict(ours.optimizer, copy.deepcopy(state))
    with megatrons.device:
        megatrons.optimizer.load_state_dict(copy.deepcopy(state))  # state_dict() holds the stack's own tensors
    for loaded in (ours, megatrons, stack):
        loaded.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(ours.main_params(), stack.main_params(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(megatrons.main_params(), stack.main_params(), strict=True))


def saved_and_loaded(name: str, directory: Path, *, with_opttree: bool) -> tuple[testing.MegatronStack, dict[int, Any]]:
    """A chain's sharded checkpoint, saved right after a reset and loaded back by member
    index through ``dist_checkpointing``, and the fresh stack to load it into."""
    if name not in testing.available():
        pytest.skip(f"no {name} recipe in this lane")
    loaded = reset_and_save(name, directory, with_opttree=with_opttree)
    with loaded.device:
        wanted = loaded.optimizer.sharded_state_dict(model_state(loaded), is_loading=True)
        return loaded, cast(dict[int, Any], dist_checkpointing.load(wanted, str(directory)))


def test_a_chain_refused_at_its_second_member_leaves_the_first_members_state_dict_alone(tmp_path: Path) -> None:
    """Saved by Megatron right after a reset, so no member's state holds a step: the step 0
    opttree gives back to the first member is written only once every member passed."""
    loaded, state = saved_and_loaded("moe", tmp_path, with_opttree=False)
    assert sorted(state) == [0, 1]
    put(inner(state[1]), "param_groups", "garbage")
    given = copy.deepcopy(state)

    with loaded.device, pytest.raises(opttree.UnsupportedCheckpoint, match="is not a list of param groups") as refused:
        opttree.load_state_dict(loaded.optimizer, state)

    assert refused.value.problem is not None and refused.value.problem.path == "chained[1]"
    assert "common_step" not in entries(state[0])
    assert same(state, given)


@pytest.mark.parametrize(
    ("arguments", "key"),
    [
        ({"model_sharded_state_dict": None}, "model_sharded_state_dict"),
        ({"metadata": "x"}, "metadata"),
        ({"model_sharded_state_dict": {}}, "sharded_state_dict"),
        ({"is_loading": "yes"}, "is_loading"),
    ],
    ids=["no model state", "metadata a str", "an empty model state", "is_loading a str"],
)
def test_sharded_state_dict_refuses_arguments_megatron_cannot_use(arguments: dict[str, object], key: str) -> None:
    """The last is Megatron's own error, raised for a model state without the optimizer's
    parameters, given back as an opttree error with Megatron's as its cause."""
    stack = recipe("bf16")
    given: dict[str, object] = {"model_sharded_state_dict": model_state(stack), "metadata": None, "is_loading": False, **arguments}
    with stack.device, pytest.raises(opttree.UnsupportedCheckpoint) as refused:
        opttree.sharded_state_dict(
            stack.optimizer, given["model_sharded_state_dict"], metadata=given["metadata"], is_loading=given["is_loading"]  # type: ignore[arg-type]
        )
    assert refused.value.problem is not None and refused.value.problem.key == key
    if key == "sharded_state_dict":
        assert "Megatron's own sharded_state_dict raised" in str(refused.value)
        assert refused.value.__cause__ is not None


@pytest.mark.parametrize("sharding", [["dp_reshardable"], {"a": 1}, 5, "dp_sharded"], ids=["a list", "a dict", "an int", "an unknown str"])
def test_a_sharding_type_megatron_does_not_know_is_refused_before_it_saves(sharding: object) -> None:
    """A ``DistributedOptimizer``'s format in ``metadata`` that is no format Megatron
    names: an unhashable one raised a raw TypeError from opttree's own check."""
    stack = recipe("dist_bf16")
    with stack.device, pytest.raises(opttree.UnsupportedCheckpoint, match=r"key 'distrib_optim_sharding_type': .* is not one of dp_reshardable, "):
        opttree.sharded_state_dict(stack.optimizer, model_state(stack), metadata={"distrib_optim_sharding_type": sharding})


def test_megatrons_own_checkpointing_exception_comes_back_as_an_unsupported_checkpoint() -> None:
    """Where Megatron's save of a DistributedOptimizer in its default format raises its own
    ``CheckpointingException`` (``flattened_range``, from megatron-core 0.16 on), opttree's
    gives it back as an opttree error, Megatron's as its cause, as it gives back the
    built-in errors Megatron raises."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    if "dist_fp32" not in testing.available():
        pytest.skip("no DistributedOptimizer recipe in this lane")
    stack = recipe("dist_fp32")
    state = model_state(stack)
    with stack.device:
        try:
            stack.optimizer.sharded_state_dict(state)
        except CheckpointingException:
            pass
        else:
            pytest.skip("this megatron-core saves a DistributedOptimizer in its default format")
        with pytest.raises(opttree.UnsupportedCheckpoint, match="Megatron's own sharded_state_dict raised CheckpointingException") as refused:
            opttree.sharded_state_dict(stack.optimizer, model_state(stack))
    assert isinstance(refused.value.__cause__, CheckpointingException)


def test_a_layer_wise_chain_loads_master_weights_by_index_and_refuses_them_short(tmp_path: Path) -> None:
    """A sharded load gives each member's master weights back as a dict by group index,
    which ``LayerWiseDistributedOptimizer``'s load turns into the list its members load;
    checked as that list, one short is refused."""
    loaded, state = saved_and_loaded("dist_muon", tmp_path, with_opttree=True)
    by_index = state[0]["fp32_from_fp16_params"]
    assert isinstance(by_index, dict)
    by_index[0].pop()
    given = copy.deepcopy(state)

    with loaded.device, pytest.raises(opttree.UnsupportedCheckpoint, match="Megatron would load only some") as refused:
        opttree.load_state_dict(loaded.optimizer, state)

    assert refused.value.problem is not None and refused.value.problem.path == "chained[0]"
    assert same(state, given)


def test_the_checkpoint_functions_take_the_tree_of_a_stack_as_the_others_do(tmp_path: Path) -> None:
    stack = recipe("fp32")
    root = opttree.tree(stack.optimizer)
    with stack.device:
        state = opttree.sharded_state_dict(root, model_state(stack))
        loaded = fresh_like(stack)
        opttree.load_state_dict(opttree.tree(loaded.optimizer), copy.deepcopy(saved(stack)))
    assert "common_step" in entries(state)
    loaded.train(K, K)
    stack.train(K, K)
    assert all(torch.equal(a, b) for a, b in zip(loaded.main_params(), stack.main_params(), strict=True))


def test_megatron_loads_history_that_shares_a_tensor_and_opttree_refuses_it() -> None:
    """A state dict whose history is one tensor under two keys (as a saved aliased state
    holds it): torch's load keeps it one tensor, which the optimizer then updates as two
    histories, and opttree's next reset refuses; opttree's load refuses it first."""
    stack = recipe("fp32")
    state = saved(stack)
    put(entry(state), "exp_avg_sq", entry(state)["exp_avg"])
    megatrons = fresh_like(stack)
    with megatrons.device:
        megatrons.optimizer.load_state_dict(copy.deepcopy(state))
    (leaf,) = megatrons.leaves()
    loaded = next(iter(leaf.state.values()))
    assert loaded["exp_avg"] is loaded["exp_avg_sq"]
    assert opttree.ProblemKind.ALIASED_STATE in [p.kind for p in opttree.validate(megatrons.optimizer)]

    ours = fresh_like(stack)
    before = [snapshot(leaf) for leaf in ours.leaves()]
    with ours.device, pytest.raises(opttree.UnsupportedCheckpoint, match=r"the 'exp_avg(_sq)?' of state entry 0 at chained\[0\] shares memory with the 'exp_avg(_sq)?' of state entry 0 at chained\[0\]"):
        opttree.load_state_dict(ours.optimizer, state)
    assert all(unchanged(leaf, snap) for leaf, snap in zip(ours.leaves(), before, strict=True))


@pytest.mark.skipif("moe" not in testing.available(), reason="the moe recipe needs megatron-core's MoE")
def test_history_two_members_share_is_refused_before_anything_loads() -> None:
    """One member's history a view into another's (as ``torch.save`` keeps an aliased
    state): the members would update one buffer as two histories."""
    stack = recipe("moe")
    with stack.device:
        state = stack.optimizer.state_dict()
    assert isinstance(state, list)  # a chain of several members saves one state dict each
    first, second = (member["state"][0] for member in state)
    rows, columns = second["exp_avg"].shape
    second["exp_avg"] = first["exp_avg"].reshape(-1)[: rows * columns].view(rows, columns)
    loaded = fresh_like(stack)
    before = [snapshot(leaf) for leaf in loaded.leaves()]

    with loaded.device, pytest.raises(opttree.UnsupportedCheckpoint, match=r"the 'exp_avg' of state entry 0 at chained\[1\] shares memory with the 'exp_avg' of state entry 0 at chained\[0\]"):
        opttree.load_state_dict(loaded.optimizer, state)
    assert all(unchanged(leaf, snap) for leaf, snap in zip(loaded.leaves(), before, strict=True))


def test_with_te_or_apex_a_group_without_a_step_over_a_hybrid_optimizer_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where TE or apex is installed (Megatron's ``HAVE_APEX_OR_TE``, set here as it would
    be), a DistributedOptimizer over a HybridDeviceOptimizer writes no step into its param
    groups before a CPU sub-optimizer has stepped, and its load reads only the steps they
    hold: such a state loads, as Megatron's own load takes it. Without them it reads every
    group's step, and a group without one is refused."""
    from megatron.core.optimizer import distrib_optimizer

    if "offload_0.75" not in testing.available():
        pytest.skip("no offload_0.75 recipe in this lane")
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    stack = testing.build("offload_0.75")
    state = saved(stack)
    assert all("step" not in group for group in groups(state))
    loaded = fresh_like(stack)
    with loaded.device:
        opttree.load_state_dict(loaded.optimizer, copy.deepcopy(state))
    subclassed = fresh_like(stack)  # a user's subclass, defined outside Megatron's module, loads with its base's code
    (member,) = getattr(subclassed.optimizer, "chained_optimizers")
    member.__class__ = type("MyDistributedOptimizer", (distrib_optimizer.DistributedOptimizer,), {})
    with subclassed.device:
        opttree.load_state_dict(subclassed.optimizer, copy.deepcopy(state))

    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    with loaded.device, pytest.raises(opttree.UnsupportedCheckpoint, match="its param groups do not hold one step"):
        opttree.load_state_dict(loaded.optimizer, state)


@pytest.mark.parametrize("dtype", [torch.complex128, torch.float32], ids=["complex128", "float32"])
def test_history_of_a_complex_parameter_in_another_dtype_is_refused(dtype: torch.dtype) -> None:
    """torch's load casts history to a float parameter's dtype, but keeps a complex
    parameter's as it is: complex128 or real history for complex64 weights loads in
    Megatron's own load and its next step raises; opttree refuses it, nothing loaded."""

    def adam() -> torch.optim.Adam:
        param = torch.nn.Parameter(torch.ones(4, 3, dtype=torch.complex64))
        return torch.optim.Adam([megatron_group([param])])

    saver = adam()
    saver.param_groups[0]["params"][0].grad = torch.ones(4, 3, dtype=torch.complex64)
    saver.step()
    state = saver.state_dict()
    state["state"][0]["exp_avg"] = torch.zeros(4, 3, dtype=dtype)
    megatrons = adam()
    fp32(megatrons).load_state_dict(copy.deepcopy(state))
    megatrons.param_groups[0]["params"][0].grad = torch.ones(4, 3, dtype=torch.complex64)
    with pytest.raises(RuntimeError):
        megatrons.step()

    ours = adam()
    with pytest.raises(opttree.UnsupportedCheckpoint, match=rf"its 'exp_avg' would be held as {str(dtype).removeprefix('torch.')}, where Adam builds it in complex64"):
        opttree.load_state_dict(fp32(ours), state)
    assert ours.state == {}


@pytest.mark.parametrize("with_opttree", [False, True], ids=["megatron", "opttree"])
def test_any_error_megatrons_load_raises_past_the_checks_comes_back_saying_what_stayed_loaded(with_opttree: bool) -> None:
    """Megatron's side: ``Float16OptimizerWithFloat16Params.load_state_dict`` loads its torch
    optimizer, then its loss scaler, which moves the saved scale to the device: an error
    there (the device out of memory, here raised by the scaler's load) leaves the torch
    optimizer loaded. opttree's side: whatever the error's type, it comes back as an
    ``UnsupportedCheckpoint`` saying that what Megatron loaded stays loaded, the error as
    its cause (a torch ``RuntimeError`` once came back raw)."""
    source = recipe("fp16")
    state = saved(source)
    stack = testing.build("fp16")
    stack.train(0, 1)
    (wrapper,) = getattr(stack.optimizer, "chained_optimizers")

    def out_of_memory(state_dict: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    wrapper.grad_scaler.load_state_dict = out_of_memory
    (leaf,) = stack.leaves()
    before = snapshot(leaf)
    with stack.device:
        if with_opttree:
            with pytest.raises(opttree.UnsupportedCheckpoint, match="raised OutOfMemoryError: CUDA out of memory.*stays loaded") as refused:
                opttree.load_state_dict(stack.optimizer, copy.deepcopy(state))
            assert isinstance(refused.value.__cause__, torch.OutOfMemoryError)
        else:
            with pytest.raises(torch.OutOfMemoryError):
                stack.optimizer.load_state_dict(copy.deepcopy(state))
    assert not unchanged(leaf, before)  # the torch optimizer was loaded before the scaler raised


@pytest.mark.parametrize(
    "spoil",
    [lambda group: group.pop("params"), lambda group: group.__setitem__("params", None)],
    ids=["no params", "params None"],
)
def test_a_load_into_a_stack_whose_own_param_group_is_malformed_is_refused_not_raised(spoil: Callable[[dict[str, object]], object]) -> None:
    """The checks read the live groups' ``params`` unguarded, and a raw ``KeyError`` or
    ``TypeError`` escaped the load, where ``validate`` reports the same stack. The leaf's
    containers are now checked as a reset checks them, before anything else."""
    stack = recipe("fp32")
    state = saved(stack)
    (leaf,) = stack.leaves()
    spoil(leaf.param_groups[0])

    with stack.device, pytest.raises(opttree.UnsupportedCheckpoint, match="key 'param_groups': param group 0 has no 'params' list") as refused:
        opttree.load_state_dict(stack.optimizer, state)
    assert refused.value.problem is not None and refused.value.problem.path == "chained[0].optimizer"
    assert [p.kind for p in opttree.validate(stack.optimizer)] == [opttree.ProblemKind.MALFORMED_STATE]


class MappingEntry(dict[str, object]):
    """A state entry reading its keys by its own ``__iter__`` (as a mapping that is not a
    dict does): validate reports it, and a reset refuses it."""

    def __iter__(self) -> Iterator[str]:
        return iter(list(dict.keys(self)))


def _spoiled(name: str) -> tuple[testing.MegatronStack, object, torch.optim.Optimizer]:
    stack = recipe(name)
    (leaf,) = stack.leaves()
    param = next(iter(leaf.state))
    leaf.state[param] = MappingEntry(leaf.state[param])
    return stack, leaf.state[param], leaf


@pytest.mark.parametrize("call", ["load_state_dict", "sharded_state_dict loading", "sharded_state_dict saving"])
@pytest.mark.parametrize("name", ["fp32", "dist_bf16"])
def test_a_stack_whose_entries_a_reset_refuses_is_refused_by_the_checkpoint_functions_before_megatron_reads_them(name: str, call: str) -> None:
    """Megatron's own code reads the state a load or a sharded state dict meets: a
    DistributedOptimizer's loading sharded state dict rebuilt the entry into one that can
    no longer be read, its load wrote the saved param groups and then raised, and a save
    raised the state's own error raw. Each is refused first, with nothing changed."""
    source = recipe(name)
    state = saved(source)
    for group in groups(state):
        group["lr"] = 0.5
    stack, entry, leaf = _spoiled(name)
    lrs = [group["lr"] for group in leaf.param_groups]

    with stack.device, pytest.raises(opttree.UnsupportedCheckpoint, match="key 'state': a state entry is a MappingEntry, which reads its keys by its own __iter__"):
        if call == "load_state_dict":
            opttree.load_state_dict(stack.optimizer, state)
        else:
            opttree.sharded_state_dict(stack.optimizer, model_state(stack), is_loading=call.endswith("loading"))

    assert next(iter(leaf.state.values())) is entry and [group["lr"] for group in leaf.param_groups] == lrs
