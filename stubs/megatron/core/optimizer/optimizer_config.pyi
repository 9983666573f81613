from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

def is_te_min_version(version: str, check_equality: bool = True) -> bool: ...
@dataclass(frozen=True)
class ParamPredicate:
    name: str
    fn: Callable[[torch.nn.Parameter], bool]
    def __call__(self, param: torch.nn.Parameter) -> bool: ...

@dataclass(frozen=True)
class ParamWithNamePredicate:
    name: str
    fn: Callable[[torch.nn.Parameter, str], bool]
    def __call__(self, param: torch.nn.Parameter, name: str) -> bool: ...

@dataclass(frozen=True)
class ParamKey:
    # The runtime says Tuple[str] (a 1-tuple); it means and matches any tuple of them.
    name: str | tuple[str, ...] = ...
    attr: str | tuple[str, ...] = ...
    predicate: ParamPredicate | tuple[ParamPredicate, ...] = ...
    with_name_predicate: ParamWithNamePredicate | tuple[ParamWithNamePredicate, ...] = ...
    def matches(self, param: torch.nn.Parameter, param_name: str) -> bool: ...

# match_args=False: the runtime's __match_args__ lists every field in an order the
# releases do not share; a class pattern that names its fields by keyword is portable.
@dataclass(match_args=False)
class OptimizerConfig:
    # The fields megatron-core 0.16.1 and 0.19.2 share, with the types both give them
    # (tests/test_stubtest.py checks the list against the runtime dataclass). Fields of one
    # release only are left out: 0.16's muon_use_nesterov, 0.19's muon_nesterov, the Lion,
    # SOAP and Adaptive Muon settings, grad_norm_skip_threshold, optimizer_cuda_graph.
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
    timers: Callable[..., Any] | None
    config_logger_dir: str
    # 0.17 and later only: an attribute here, to be set after construction where the
    # release has it, but no constructor argument (0.16 would refuse it).
    use_layer_wise_distributed_optimizer: bool
    # Keyword-only: the releases order their fields differently (0.16's muon_use_nesterov
    # sits where 0.19 has muon_nesterov), so passing them by position is not portable.
    def __init__(
        self,
        *,
        lr: float | None = None,
        min_lr: float | None = None,
        decoupled_lr: float | None = None,
        decoupled_min_lr: float | None = None,
        weight_decay: float = 0.01,
        apply_wd_to_qk_layernorm: bool = False,
        fp8_recipe: str | None = None,
        fp16: bool = False,
        bf16: bool = False,
        reuse_grad_buf_for_mxfp8_param_ag: bool = False,
        params_dtype: torch.dtype = ...,
        use_precision_aware_optimizer: bool = False,
        store_param_remainders: bool = True,
        main_grads_dtype: torch.dtype = ...,
        main_params_dtype: torch.dtype = ...,
        exp_avg_dtype: torch.dtype = ...,
        exp_avg_sq_dtype: torch.dtype = ...,
        optimizer: str = "adam",
        loss_scale: float | None = None,
        initial_loss_scale: float = 4294967296,
        min_loss_scale: float = 1.0,
        loss_scale_window: float = 1000,
        hysteresis: int = 2,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.999,
        adam_eps: float = 1e-08,
        decoupled_weight_decay: bool = True,
        sgd_momentum: float = 0.9,
        muon_momentum: float = 0.95,
        muon_split_qkv: bool = True,
        muon_scale_mode: str = "spectral",
        muon_fp32_matmul_prec: str = "medium",
        muon_num_ns_steps: int = 5,
        muon_tp_mode: str = "blockwise",
        muon_extra_scale_factor: float = 1.0,
        use_distributed_optimizer: bool = False,
        overlap_param_gather: bool = False,
        overlap_param_gather_with_optimizer_step: bool = False,
        optimizer_cpu_offload: bool = False,
        optimizer_offload_fraction: float = 0.0,
        use_torch_optimizer_for_cpu_offload: bool = False,
        overlap_cpu_optimizer_d2h_h2d: bool = False,
        pin_cpu_grads: bool = True,
        pin_cpu_params: bool = True,
        clip_grad: float = 1.0,
        log_num_zeros_in_grad: bool = False,
        barrier_with_L1_time: bool = False,
        timers: Callable[..., Any] | None = None,
        config_logger_dir: str = "",
    ) -> None: ...
