"""Stand-ins for TransformerEngine's and apex's ``FusedAdam``, which need CUDA to install.

Each mirrors the real class's *state layout* and the methods Megatron calls on it, read
from its source, and is registered under the real dotted path (its ``__module__`` is set
to the real module) so that opttree's lazy dispatch resolves it exactly as it resolves the
real class:

TransformerEngine 2.x ``transformer_engine/pytorch/optimizers/fused_adam.py``:
- ``state[p]``: ``exp_avg``, ``exp_avg_sq`` (created as zeros for every parameter of a
  non-empty group at its first step, before its gradient is looked at) and, with
  ``master_weights``, ``master_param``: an fp32 copy of the parameter, or with
  ``store_param_remainders`` for bf16 parameters an int16 tensor of the low 16 bits of the
  fp32 master, whose high bits are the parameter (rounded to nearest: the parameter's bits
  are one higher where the remainder is negative);
- the master is read and written back only for bf16/fp16 parameters; an fp32 parameter is
  stepped in place and its ``master_param`` stays the copy made at its first step;
- state kept in fp16 (moments, or the master with ``master_weight_dtype=float16``) is
  stored scaled, with an fp32 scale per parameter and key in ``self._scales[p][key]``
  (created as ones for every key not kept in fp32, bf16 included), described by
  ``name_to_dtype_map``, against the ranges in ``dtype_to_range_map`` (one-element fp32
  tensors made once in ``__init__``); ``get_unscaled_state``/``set_scaled_state`` read and write through
  it, and ``initialize_state`` builds an entry: what Megatron's precision-aware
  ``DistributedOptimizer`` calls;
- ``state_dict()`` saves every state unscaled to fp32 (remainders as int16), and
  ``load_state_dict()`` builds each entry anew through ``set_scaled_state``;
- ``group["step"]``: absent until the first step (an empty group is skipped and never gets
  one), then an int, or with ``capturable`` an int32 tensor of shape [1] incremented in
  place; with ``capturable`` the group's ``lr`` is a tensor;
- ``self._dummy_overflow_buf``, an int32 tensor [0]: with ``capturable`` (where torch's
  ``GradScaler`` passes itself to ``step``, ``_step_supports_amp_scaling``) each group's
  step adds ``(flag != 1)``, the flag then takes whether the scaler found an inf in the
  gradients, and the kernels change nothing where it is 1;
- ``use_decoupled_grad`` reads ``param.decoupled_grad`` instead of ``param.grad``.

apex ``apex/optimizers/fused_adam.py``: ``exp_avg``, ``exp_avg_sq`` (fp32 zeros) in state;
``group["step"]`` an int, or with ``capturable`` an int tensor of shape [1] (empty groups
skipped); the same overflow flag and capturable step; with ``master_weights`` (capturable
only) an fp32 copy of each parameter made at construction in ``self.param_groups_master``,
groups beside ``param_groups`` (``None`` at each place without), stepped for fp16 and fp32
parameters and written back into them.

The arithmetic is plain AdamW on the CPU, not the fused CUDA kernels; FP8 (uint8) state is
not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from copy import deepcopy
from itertools import chain
from typing import cast

import torch
from torch.optim.optimizer import ParamsT


def _next_step(group: dict[str, object], capturable: bool, overflow: torch.Tensor) -> float:
    """Add one to the group's step, or start it, as both real classes do: with
    ``capturable``, one only where the step before did not overflow (``overflow``, their
    ``_dummy_overflow_buf``, is not 1), added in place to the step tensor. A step key of
    another kind (None) raises there as here."""
    if "step" not in group:
        group["step"] = torch.tensor([1], dtype=torch.int32) if capturable else 1
    else:
        increment: int | torch.Tensor = (overflow != 1).to(torch.int32) if capturable else 1
        group["step"] += increment  # type: ignore[operator]
    return float(cast(float, group["step"]))


def _capturable_scale(optimizer: torch.optim.Optimizer, overflow: torch.Tensor, grad_scaler: object, device: torch.device) -> float | None:
    """What both real classes' capturable step does before their kernels run: record in
    ``overflow`` whether torch's ``GradScaler`` found an inf in this device's gradients, and
    give the factor that unscales them; None where they overflowed, and the kernels,
    reading the flag, change nothing."""
    if grad_scaler is None:
        overflow.zero_()
        return 1.0
    scaler = cast(torch.amp.GradScaler, grad_scaler)
    found = cast(dict[torch.device, torch.Tensor], scaler._check_inf_per_device(optimizer))[device]
    overflow.copy_(found)
    scale = scaler._get_scale_async()
    if int(overflow) == 1 or scale is None:
        return None
    return float(scale.double().reciprocal().float())


def _adamw(
    param: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    group: dict[str, object],
    step: float,
) -> None:
    lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])  # type: ignore[arg-type]
    beta1, beta2 = cast(tuple[float, float], group["betas"])
    bias1 = 1 - beta1**step  # 0 at step 0, where the real kernels divide by zero
    param.mul_(1 - lr * wd)
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (v / (1 - beta2**step)).sqrt_().add_(eps)
    param.addcdiv_(m, denom, value=-lr / bias1 if bias1 else -math.inf)


def _join(low_precision: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master a bf16 parameter and its int16 remainder stand for."""
    high = low_precision.view(torch.int16).to(torch.int32) - (remainder < 0).to(torch.int32)
    return ((high << 16) | (remainder.to(torch.int32) & 0xFFFF)).view(torch.float32)


def _split(master: torch.Tensor, low_precision: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write an fp32 master as its bf16 parameter (rounded to nearest) and int16 remainder."""
    bits = master.view(torch.int32)
    low = (bits & 0xFFFF).to(torch.int16)  # wraps to a signed remainder
    remainder.copy_(low)
    low_precision.view(torch.int16).copy_(((bits >> 16) + (low < 0).to(torch.int32)).to(torch.int16))


class TEFusedAdam(torch.optim.Optimizer):
    """Stand-in for ``transformer_engine.pytorch.optimizers.FusedAdam`` (see module doc)."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        adam_w_mode: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
    ) -> None:
        assert adam_w_mode, "the stand-in steps AdamW only"
        allowed = (torch.float32, torch.float16, torch.bfloat16)
        if master_weights and master_weight_dtype not in (torch.float32, torch.float16):
            raise RuntimeError("FusedAdam only supports fp32/fp16 master weights.")
        if exp_avg_dtype not in allowed or exp_avg_sq_dtype not in allowed:
            raise RuntimeError("the stand-in keeps moments in fp32, fp16 or bf16 (TE also takes FP8)")
        low_precision = (master_weights and master_weight_dtype != torch.float32) or exp_avg_dtype != torch.float32 or exp_avg_sq_dtype != torch.float32
        if capturable and (low_precision or store_param_remainders):
            raise RuntimeError("Capturable mode only supports fp32 master weights and optimizer states, without remainders.")
        group_lr: float | torch.Tensor = torch.tensor(lr, dtype=torch.float32) if capturable else lr
        super().__init__(params, {"lr": group_lr, "bias_correction": True, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.adam_w_mode = 1
        self.capturable = capturable
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype, "master_param": master_weight_dtype}
        self.dtype_to_range_map = {
            torch.float16: torch.full([1], torch.finfo(torch.float16).max / 2.0, dtype=torch.float32),
            torch.uint8: torch.full([1], 448.0, dtype=torch.float32),
        }
        self._scales: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self._dummy_overflow_buf = torch.tensor([0], dtype=torch.int32)
        if capturable:
            self._step_supports_amp_scaling = True  # torch's GradScaler passes itself to step
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = store_param_remainders and master_weights and master_weight_dtype == torch.float32

    def _remainders(self, param: torch.Tensor, name: str) -> bool:
        return self.store_param_remainders and name == "master_param" and param.dtype == torch.bfloat16

    def _initialize_state(self, param: torch.Tensor, name: str, zero_buffer: bool, remainders: bool = False) -> None:
        dtype = self.name_to_dtype_map[name]
        data = torch.zeros_like(param, dtype=torch.int16) if remainders else torch.empty_like(param, dtype=dtype)
        if zero_buffer:
            data.zero_()
        self.state[param][name] = data
        if dtype != torch.float32:
            self._scales.setdefault(param, {})[name] = torch.ones([1], dtype=torch.float32)

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool) -> None:
        """As TE 2.x's, which takes ``store_param_remainders`` (megatron-core's
        ``init_state_fn`` passes the parameter alone, and would raise a TypeError here as
        there; no stack opttree's tests build calls it)."""
        remainders = store_param_remainders
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if self.master_weights:
            self._initialize_state(param, "master_param", zero_buffer=False, remainders=remainders)
            if not remainders:
                self.set_scaled_state(param, "master_param", param.clone().detach().float())

    def get_unscaled_state(self, param: torch.Tensor, name: str) -> torch.Tensor:
        stored: torch.Tensor = self.state[param][name]
        dtype = self.name_to_dtype_map[name]
        if dtype == torch.float16:
            return stored.float().mul_(self._scales[param][name])
        if dtype == torch.bfloat16:
            return stored.float()
        return stored

    def set_scaled_state(self, param: torch.Tensor, name: str, unscaled: torch.Tensor) -> None:
        remainders = self._remainders(param, name)
        assert unscaled.dtype == (torch.int16 if remainders else torch.float32)
        if name not in self.state[param]:
            self._initialize_state(param, name, False, remainders)
        stored: torch.Tensor = self.state[param][name]
        if self.name_to_dtype_map[name] == torch.float32:
            stored.copy_(unscaled)
        elif stored.dtype == torch.bfloat16:
            stored.copy_(unscaled)
        else:  # TE scales the tensor it is given in place: a loaded state dict's fp32 values too
            scale = self._scales[param][name]
            torch.div(unscaled.abs().max().reshape(1), self.dtype_to_range_map[torch.float16], out=scale)
            stored.copy_(unscaled.mul_(torch.where(scale > 0, scale.reciprocal(), 0.0)))

    def _by_saved_id(self, saved_groups: list[dict[str, object]]) -> dict[object, torch.Tensor]:
        saved = chain.from_iterable(cast(list[object], group["params"]) for group in saved_groups)
        return dict(zip(saved, chain.from_iterable(group["params"] for group in self.param_groups), strict=False))

    def state_dict(self) -> dict[str, object]:
        saved = super().state_dict()
        by_id = self._by_saved_id(deepcopy(saved["param_groups"]))
        state = cast(dict[object, dict[str, object]], saved["state"])
        for key, entry in state.items():
            if key in by_id:
                state[key] = {name: self.get_unscaled_state(by_id[key], name) for name in entry}
        return saved

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        super().load_state_dict(state_dict)
        by_id = self._by_saved_id(deepcopy(cast(list[dict[str, object]], state_dict["param_groups"])))
        for key, entry in cast(dict[object, dict[str, torch.Tensor | None]], state_dict["state"]).items():
            if key not in by_id:
                continue
            param = by_id[key]
            self.state[param] = {}
            for name, value in entry.items():
                if value is not None:
                    self.set_scaled_state(param, name, value if self._remainders(param, name) else value.float())

    @torch.no_grad()
    def step(self, closure: None = None, grad_scaler: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            if not group["params"]:
                continue
            step = _next_step(group, self.capturable, self._dummy_overflow_buf)
            for param in group["params"]:
                if not self.state[param]:
                    self.initialize_state(param, self._remainders(param, "master_param"))
            unscale = _capturable_scale(self, self._dummy_overflow_buf, grad_scaler, group["params"][0].device) if self.capturable else 1.0
            if unscale is None:
                continue
            for param in group["params"]:
                grad = getattr(param, "decoupled_grad", None) if self.use_decoupled_grad else param.grad
                if grad is not None:
                    self._step_param(param, grad if unscale == 1.0 else grad * unscale, group, step)

    def _step_param(self, param: torch.Tensor, grad: torch.Tensor, group: dict[str, object], step: float) -> None:
        """AdamW on the fp32 weights: the master of a bf16/fp16 parameter, written back
        into it; else the parameter itself (a copy of a bf16/fp16 one)."""
        moments = [self.get_unscaled_state(param, name) for name in ("exp_avg", "exp_avg_sq")]
        held = self.master_weights and param.dtype in (torch.float16, torch.bfloat16)
        remainders = held and self._remainders(param, "master_param")
        if remainders:
            weights = _join(param.data, self.state[param]["master_param"])
        elif held:
            weights = self.get_unscaled_state(param, "master_param").clone()
        else:
            weights = param.data.float()  # the parameter itself where it is fp32
        _adamw(weights, grad.float(), moments[0], moments[1], group, step)
        if remainders:
            _split(weights, param.data, self.state[param]["master_param"])
        elif held:
            param.data.copy_(weights)  # before the master is stored: storing scales it in place
            self.set_scaled_state(param, "master_param", weights)
        elif weights.data_ptr() != param.data_ptr():
            param.data.copy_(weights)
        for name, value in zip(("exp_avg", "exp_avg_sq"), moments, strict=True):
            if self.name_to_dtype_map[name] != torch.float32:
                self.set_scaled_state(param, name, value)


class ApexFusedAdam(torch.optim.Optimizer):
    """Stand-in for ``apex.optimizers.FusedAdam`` (see module doc)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, *, capturable: bool = False, master_weights: bool = False) -> None:
        if master_weights and not capturable:
            raise RuntimeError("Master weights is currently only supported with the capturable version.")
        group_lr: float | torch.Tensor = torch.tensor(lr, dtype=torch.float32) if capturable else lr
        super().__init__(params, {"lr": group_lr, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0})
        self.capturable = capturable
        self.master_weights = master_weights
        self.param_groups_master = [
            {"params": [p.clone().detach().float() if master_weights else None for p in group["params"]]} for group in self.param_groups
        ]
        if capturable:
            self._step_supports_amp_scaling = True
        self._dummy_overflow_buf = torch.tensor([0], dtype=torch.int32)

    @torch.no_grad()
    def step(self, closure: None = None, grad_scaler: object = None) -> None:  # type: ignore[override]
        for group, group_master in zip(self.param_groups, self.param_groups_master, strict=False):
            if not group["params"]:
                continue
            step = _next_step(group, self.capturable, self._dummy_overflow_buf)
            live = []
            for param, master in zip(group["params"], group_master["params"], strict=False):
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param).float()
                    state["exp_avg_sq"] = torch.zeros_like(param).float()
                live.append((param, master))
            unscale = _capturable_scale(self, self._dummy_overflow_buf, grad_scaler, group["params"][0].device) if self.capturable else 1.0
            if unscale is None:
                continue
            for param, master in live:
                state = self.state[param]
                grad = param.grad.float() * unscale
                held = self.master_weights and param.dtype in (torch.float16, torch.float32)
                weights = master if held and master is not None else param.data
                _adamw(weights, grad, state["exp_avg"], state["exp_avg_sq"], group, step)
                if held:
                    param.data.copy_(weights)  # the master kernel writes the stepped master into the parameter


for _cls, _module in (
    (TEFusedAdam, "transformer_engine.pytorch.optimizers.fused_adam"),
    (ApexFusedAdam, "apex.optimizers.fused_adam"),
):
    _cls.__module__ = _module
    _cls.__qualname__ = _cls.__name__ = "FusedAdam"
