# emerging-optimizers 0.3.0. Only the classes Megatron builds on are stubbed.
from collections.abc import Callable
from typing import Any, Literal, TypeAlias

import torch
from torch.optim.optimizer import ParamsT

_WeightDecayMethod: TypeAlias = Literal["decoupled", "independent", "l2", "palm"]
_FP32MatmulPrec: TypeAlias = Literal["highest", "high", "medium"]
_Coefficients: TypeAlias = Literal["simple", "quintic", "polar_express", "cans", "aol", "deepseekv4", "custom"]
_ScaleMode: TypeAlias = Literal["shape_scaling", "spectral", "unit_rms_norm"]

class OrthogonalizedOptimizer(torch.optim.Optimizer):
    def __init__(
        self,
        params: ParamsT,
        lr: float,
        momentum: float,
        weight_decay: float,
        *,
        nesterov: bool,
        weight_decay_method: _WeightDecayMethod,
        fp32_matmul_prec: _FP32MatmulPrec,
        scaled_orthogonalize_fn: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> None: ...

class Muon(OrthogonalizedOptimizer):
    def __init__(
        self,
        params: ParamsT,
        lr: float = 0.0003,
        momentum: float = 0.95,
        weight_decay: float = 0.01,
        *,
        nesterov: bool = False,
        weight_decay_method: _WeightDecayMethod = "decoupled",
        fp32_matmul_prec: _FP32MatmulPrec = "medium",
        coefficient_type: _Coefficients = "quintic",
        num_ns_steps: int = 5,
        scale_mode: _ScaleMode = "spectral",
        extra_scale_factor: float = 1.0,
        use_syrk: bool = False,
    ) -> None: ...

class AdaptiveMuon(OrthogonalizedOptimizer):
    def __init__(
        self,
        params: ParamsT,
        lr: float,
        momentum: float,
        weight_decay: float,
        *,
        nesterov: bool = False,
        weight_decay_method: _WeightDecayMethod = "decoupled",
        fp32_matmul_prec: _FP32MatmulPrec = "medium",
        coefficient_type: _Coefficients = "quintic",
        num_ns_steps: int = 5,
        scale_mode: _ScaleMode = "spectral",
        extra_scale_factor: float = 1.0,
        moment2_method: Literal["adamuon", "normuon", "namo"] = "adamuon",
        beta2: float = 0.95,
        eps: float = 1e-08,
    ) -> None: ...

def get_muon_scale_factor(size_out: int, size_in: int, mode: _ScaleMode = "spectral") -> float: ...
