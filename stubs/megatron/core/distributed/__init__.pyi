from dataclasses import dataclass

import torch
from _typeshed import Incomplete

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

# match_args=False: the runtime's __match_args__ lists every field in an order the
# releases do not share; a class pattern that names its fields by keyword is portable.
@dataclass(match_args=False)
class DistributedDataParallelConfig:
    # The fields megatron-core 0.16.1 and 0.19.2 share (tests/test_stubtest.py checks the
    # list against the runtime dataclass); 0.16's preserve_fp32_weights and 0.19's
    # num_buckets, fp4_param_gather and Megatron-FSDP settings are left out.
    grad_reduce_in_fp32: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    align_param_gather: bool
    use_distributed_optimizer: bool
    num_distributed_optimizer_instances: int
    check_for_nan_in_grad: bool
    check_for_large_grads: bool
    bucket_size: int | None
    pad_buckets_for_high_nccl_busbw: bool
    reduce_scatter_with_fp32_accumulation: bool
    average_in_collective: bool
    fp8_param_gather: bool
    reuse_grad_buf_for_mxfp8_param_ag: bool
    use_megatron_fsdp: bool
    use_custom_fsdp: bool
    data_parallel_sharding_strategy: str
    gradient_reduce_div_fusion: bool
    # Annotated int, None by default.
    suggested_communication_unit_size: int | None
    keep_fp8_transpose_cache: bool
    nccl_ub: bool
    fsdp_double_buffer: bool
    outer_dp_sharding_strategy: str
    disable_symmetric_registration: bool
    fsdp_manual_registration: bool
    delay_wgrad_compute: bool
    # Keyword-only: the releases order their fields differently.
    def __init__(
        self,
        *,
        grad_reduce_in_fp32: bool = False,
        overlap_grad_reduce: bool = False,
        overlap_param_gather: bool = False,
        align_param_gather: bool = False,
        use_distributed_optimizer: bool = False,
        num_distributed_optimizer_instances: int = 1,
        check_for_nan_in_grad: bool = False,
        check_for_large_grads: bool = False,
        bucket_size: int | None = None,
        pad_buckets_for_high_nccl_busbw: bool = False,
        reduce_scatter_with_fp32_accumulation: bool = False,
        average_in_collective: bool = False,
        fp8_param_gather: bool = False,
        reuse_grad_buf_for_mxfp8_param_ag: bool = False,
        use_megatron_fsdp: bool = False,
        use_custom_fsdp: bool = False,
        data_parallel_sharding_strategy: str = "no_shard",
        gradient_reduce_div_fusion: bool = True,
        suggested_communication_unit_size: int | None = None,
        keep_fp8_transpose_cache: bool = False,
        nccl_ub: bool = False,
        fsdp_double_buffer: bool = False,
        outer_dp_sharding_strategy: str = "no_shard",
        disable_symmetric_registration: bool = False,
        fsdp_manual_registration: bool = False,
        delay_wgrad_compute: bool = False,
    ) -> None: ...

class DistributedDataParallel(MegatronModule):
    module: torch.nn.Module
    ddp_config: DistributedDataParallelConfig
    # The parameters 0.16.1 and 0.19.2 share; 0.19 adds full_param_layout at the end.
    # pg_collection is a ProcessGroupCollection, not stubbed.
    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
        pg_collection: Incomplete | None = None,
    ) -> None: ...
    def zero_grad_buffer(self) -> None: ...
    def start_grad_sync(self, *unused: object) -> None: ...
    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None: ...
    def scale_gradients(self, scaling_factor: float) -> None: ...
    def broadcast_params(self) -> None: ...
