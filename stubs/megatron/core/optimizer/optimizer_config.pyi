import torch

def is_te_min_version(version: str, check_equality: bool = True) -> bool: ...

class OptimizerConfig:
    optimizer: str
    lr: float | None
    weight_decay: float
    bf16: bool
    use_distributed_optimizer: bool
    optimizer_cpu_offload: bool
    optimizer_offload_fraction: float
    use_precision_aware_optimizer: bool
    overlap_cpu_optimizer_d2h_h2d: bool
    sgd_momentum: float
    muon_scale_mode: str
    muon_extra_scale_factor: float
    use_layer_wise_distributed_optimizer: bool
    def __init__(
        self,
        *,
        optimizer: str = ...,
        lr: float | None = ...,
        weight_decay: float = ...,
        bf16: bool = ...,
        use_distributed_optimizer: bool = ...,
        optimizer_cpu_offload: bool = ...,
        optimizer_offload_fraction: float = ...,
        use_precision_aware_optimizer: bool = ...,
        overlap_cpu_optimizer_d2h_h2d: bool = ...,
        sgd_momentum: float = ...,
        main_params_dtype: torch.dtype = ...,
    ) -> None: ...
