from collections.abc import Callable

import torch

def is_te_min_version(version: str, check_equality: bool = True) -> bool: ...

class OptimizerConfig:
    # The fields megatron-core 0.16.1 and 0.19.2 share; the constructor is keyword-only
    # here (the releases order their fields differently, so passing them by position is
    # not portable).
    lr: float | None
    min_lr: float | None
    decoupled_lr: float | None
    decoupled_min_lr: float | None
    weight_decay: float
    apply_wd_to_qk_layernorm: bool
    fp8_recipe: str | None
    fp16: bool
    bf16: bool
    reuse_grad_buf_for_mxfp8_param_ag: bool
    params_dtype: torch.dtype
    use_precision_aware_optimizer: bool
    store_param_remainders: bool
    main_grads_dtype: torch.dtype
    main_params_dtype: torch.dtype
    exp_avg_dtype: torch.dtype
    exp_avg_sq_dtype: torch.dtype
    optimizer: str
    loss_scale: float | None
    initial_loss_scale: float
    min_loss_scale: float
    loss_scale_window: float
    hysteresis: int
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    decoupled_weight_decay: bool
    sgd_momentum: float
    muon_momentum: float
    muon_split_qkv: bool
    muon_scale_mode: str
    muon_fp32_matmul_prec: str
    muon_num_ns_steps: int
    muon_tp_mode: str
    muon_extra_scale_factor: float
    use_distributed_optimizer: bool
    overlap_param_gather: bool
    overlap_param_gather_with_optimizer_step: bool
    optimizer_cpu_offload: bool
    optimizer_offload_fraction: float
    use_torch_optimizer_for_cpu_offload: bool
    overlap_cpu_optimizer_d2h_h2d: bool
    pin_cpu_grads: bool
    pin_cpu_params: bool
    clip_grad: float
    log_num_zeros_in_grad: bool
    barrier_with_L1_time: bool
    timers: Callable[..., object] | None
    config_logger_dir: str
    # 0.17 and later only.
    use_layer_wise_distributed_optimizer: bool
    def __init__(
        self,
        *,
        lr: float | None = ...,
        min_lr: float | None = ...,
        decoupled_lr: float | None = ...,
        decoupled_min_lr: float | None = ...,
        weight_decay: float = ...,
        apply_wd_to_qk_layernorm: bool = ...,
        fp8_recipe: str | None = ...,
        fp16: bool = ...,
        bf16: bool = ...,
        reuse_grad_buf_for_mxfp8_param_ag: bool = ...,
        params_dtype: torch.dtype = ...,
        use_precision_aware_optimizer: bool = ...,
        store_param_remainders: bool = ...,
        main_grads_dtype: torch.dtype = ...,
        main_params_dtype: torch.dtype = ...,
        exp_avg_dtype: torch.dtype = ...,
        exp_avg_sq_dtype: torch.dtype = ...,
        optimizer: str = ...,
        loss_scale: float | None = ...,
        initial_loss_scale: float = ...,
        min_loss_scale: float = ...,
        loss_scale_window: float = ...,
        hysteresis: int = ...,
        adam_beta1: float = ...,
        adam_beta2: float = ...,
        adam_eps: float = ...,
        decoupled_weight_decay: bool = ...,
        sgd_momentum: float = ...,
        muon_momentum: float = ...,
        muon_split_qkv: bool = ...,
        muon_scale_mode: str = ...,
        muon_fp32_matmul_prec: str = ...,
        muon_num_ns_steps: int = ...,
        muon_tp_mode: str = ...,
        muon_extra_scale_factor: float = ...,
        use_distributed_optimizer: bool = ...,
        overlap_param_gather: bool = ...,
        overlap_param_gather_with_optimizer_step: bool = ...,
        optimizer_cpu_offload: bool = ...,
        optimizer_offload_fraction: float = ...,
        use_torch_optimizer_for_cpu_offload: bool = ...,
        overlap_cpu_optimizer_d2h_h2d: bool = ...,
        pin_cpu_grads: bool = ...,
        pin_cpu_params: bool = ...,
        clip_grad: float = ...,
        log_num_zeros_in_grad: bool = ...,
        barrier_with_L1_time: bool = ...,
        timers: Callable[..., object] | None = ...,
        config_logger_dir: str = ...,
    ) -> None: ...
