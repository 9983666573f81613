"""Stand-ins for TransformerEngine's and apex's ``FusedAdam``, which need CUDA to install.

Each mirrors the real class's *state layout*, read from its source, and is registered
under the real dotted path (its ``__module__`` is set to the real module) so that
opttree's lazy dispatch resolves it exactly as it resolves the real class:

TransformerEngine ``transformer_engine/pytorch/optimizers/fused_adam.py``:
- ``state[p]``: ``exp_avg``, ``exp_avg_sq`` (created as zeros) and, with
  ``master_weights``, ``master_param`` (an fp32 copy, or with ``store_param_remainders``
  for bf16 params an int16 tensor of the low 16 bits of the fp32 master);
- moments in fp16 are stored scaled, with an fp32 scale per parameter and key in
  ``self._scales[p][key]`` (created as ones), described by ``name_to_dtype_map``;
- ``group["step"]``: absent until the first step, then an int, or with ``capturable`` an
  int32 tensor of shape [1] that is incremented in place.

apex ``apex/optimizers/fused_adam.py``: ``exp_avg``, ``exp_avg_sq`` (fp32 zeros) in state;
``group["step"]`` an int, or with ``capturable`` an int tensor of shape [1].

The arithmetic is plain AdamW on the CPU, not the fused CUDA kernels.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch.optim.optimizer import ParamsT

_FP16_RANGE = torch.finfo(torch.float16).max / 2.0


def _next_step(group: dict[str, object], capturable: bool) -> float:
    step = group.get("step")
    if isinstance(step, torch.Tensor):
        step.add_(1)  # the real classes add the overflow flag in place
        return float(step.item())
    if isinstance(step, int):
        group["step"] = step + 1
        return float(step + 1)
    group["step"] = torch.tensor([1], dtype=torch.int32) if capturable else 1
    return 1.0


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
    param.mul_(1 - lr * wd)
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (v / (1 - beta2**step)).sqrt_().add_(eps)
    param.addcdiv_(m, denom, value=-lr / (1 - beta1**step))


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
        capturable: bool = False,
        master_weights: bool = False,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        store_param_remainders: bool = False,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.capturable = capturable
        self.master_weights = master_weights
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype, "master_param": torch.float32}
        self._scales: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self.store_param_remainders = store_param_remainders and master_weights

    def _initialize_state(self, param: torch.Tensor) -> None:
        state = self.state[param]
        for name in ("exp_avg", "exp_avg_sq"):
            dtype = self.name_to_dtype_map[name]
            state[name] = torch.zeros_like(param, dtype=dtype)
            if dtype != torch.float32:
                self._scales.setdefault(param, {})[name] = torch.ones([1], dtype=torch.float32)
        if self.master_weights:
            if self.store_param_remainders and param.dtype == torch.bfloat16:
                state["master_param"] = torch.zeros_like(param, dtype=torch.int16)
            else:
                state["master_param"] = param.detach().clone().float()

    def _unscaled(self, param: torch.Tensor, name: str) -> torch.Tensor:
        stored: torch.Tensor = self.state[param][name]
        if stored.dtype == torch.float32:
            return stored
        scale = self._scales[param][name] if stored.dtype == torch.float16 else torch.ones(1)
        return stored.float() * scale

    def _store(self, param: torch.Tensor, name: str, unscaled: torch.Tensor) -> None:
        stored: torch.Tensor = self.state[param][name]
        if stored.dtype == torch.float32:
            return
        if stored.dtype == torch.float16:
            scale = self._scales[param][name]
            torch.div(unscaled.abs().max().reshape(1), _FP16_RANGE, out=scale)
            stored.copy_(unscaled * torch.where(scale > 0, scale.reciprocal(), 0.0))
        else:
            stored.copy_(unscaled)

    def _master(self, param: torch.Tensor) -> torch.Tensor:
        state = self.state[param]
        if not self.master_weights:
            return param.data
        held: torch.Tensor = state["master_param"]
        if held.dtype == torch.int16:
            high = param.data.view(torch.int16).to(torch.int32) << 16
            return (high | (held.to(torch.int32) & 0xFFFF)).view(torch.float32)
        return held

    def _write_master(self, param: torch.Tensor, master: torch.Tensor) -> None:
        held = self.state[param].get("master_param")
        if isinstance(held, torch.Tensor) and held.dtype == torch.int16:
            bits = master.view(torch.int32)
            param.data.view(torch.int16).copy_((bits >> 16).to(torch.int16))
            held.copy_((bits & 0xFFFF).to(torch.int16))
        elif master is not param.data:
            param.data.copy_(master)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            step = _next_step(group, self.capturable)
            for param in group["params"]:
                if not self.state[param]:
                    self._initialize_state(param)
                if param.grad is None:
                    continue
                m, v = self._unscaled(param, "exp_avg"), self._unscaled(param, "exp_avg_sq")
                master = self._master(param)
                _adamw(master, param.grad.float(), m, v, group, step)
                self._store(param, "exp_avg", m)
                self._store(param, "exp_avg_sq", v)
                self._write_master(param, master)


class ApexFusedAdam(torch.optim.Optimizer):
    """Stand-in for ``apex.optimizers.FusedAdam`` (see module doc)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, *, capturable: bool = False) -> None:
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0})
        self.capturable = capturable

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            step = _next_step(group, self.capturable)
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param).float()
                    state["exp_avg_sq"] = torch.zeros_like(param).float()
                _adamw(param, param.grad, state["exp_avg"], state["exp_avg_sq"], group, step)


for _cls, _module in (
    (TEFusedAdam, "transformer_engine.pytorch.optimizers.fused_adam"),
    (ApexFusedAdam, "apex.optimizers.fused_adam"),
):
    _cls.__module__ = _module
    _cls.__qualname__ = _cls.__name__ = "FusedAdam"
