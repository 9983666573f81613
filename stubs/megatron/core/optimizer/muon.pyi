# megatron-core 0.16 keeps TensorParallelMuon here; 0.17 and later leave a shim (no
# classes) and move it to .emerging_optimizers, with renamed parameters.
from collections.abc import Callable
from typing import Literal

import torch
from _typeshed import Incomplete
from torch.optim.optimizer import ParamsT

# A subclass of emerging-optimizers' OrthogonalizedOptimizer where that is installed (of
# object where it is not, and then unusable); a torch optimizer either way here.
# pg_collection is a ProcessGroupCollection, not stubbed.
class TensorParallelMuon(torch.optim.Optimizer):
    def __init__(
        self,
        params: ParamsT,
        lr: float = 0.0003,
        momentum_beta: float = 0.95,
        use_nesterov: bool = True,
        weight_decay: float = 0.01,
        use_decoupled_weight_decay: bool = True,
        split_qkv: bool = False,
        is_qkv_fn: Callable[[torch.Tensor], bool] | None = None,
        qkv_split_shapes: tuple[int, int, int] | None = None,
        fp32_matmul_prec: str = "medium",
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        pg_collection: Incomplete | None = None,
        mode: Literal["blockwise", "duplicated", "distributed"] = "duplicated",
    ) -> None: ...
