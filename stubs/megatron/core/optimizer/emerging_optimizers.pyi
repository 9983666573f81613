# megatron-core 0.19 (0.17 and later) only; 0.16 keeps TensorParallelMuon in .muon.
from collections.abc import Callable
from typing import Literal

import torch
from _typeshed import Incomplete
from torch.optim.optimizer import ParamsT

from emerging_optimizers.orthogonalized_optimizers import AdaptiveMuon, OrthogonalizedOptimizer

# pg_collection is a ProcessGroupCollection, not stubbed.
class TensorParallelMuon(OrthogonalizedOptimizer):
    def __init__(
        self,
        params: ParamsT,
        lr: float = 0.0003,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.01,
        use_decoupled_weight_decay: bool = True,
        split_qkv: bool = False,
        is_qkv_fn: Callable[[torch.Tensor], bool] | None = None,
        qkv_split_shapes: list[int] | None = None,
        fp32_matmul_prec: str = "medium",
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        pg_collection: Incomplete | None = None,
        tp_mode: Literal["blockwise", "duplicated", "distributed"] = "duplicated",
    ) -> None: ...

class TensorParallelAdaptiveMuon(TensorParallelMuon, AdaptiveMuon):
    def __init__(
        self,
        params: ParamsT,
        lr: float = 0.0003,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.01,
        use_decoupled_weight_decay: bool = True,
        split_qkv: bool = False,
        is_qkv_fn: Callable[[torch.Tensor], bool] | None = None,
        qkv_split_shapes: list[int] | None = None,
        fp32_matmul_prec: str = "medium",
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        pg_collection: Incomplete | None = None,
        tp_mode: Literal["blockwise", "duplicated", "distributed"] = "duplicated",
        moment2_method: Literal["adamuon", "normuon"] = "adamuon",
        beta2: float = 0.95,
        eps: float = 1e-08,
    ) -> None: ...
