import torch

from megatron.core.transformer.transformer_config import TransformerConfig

class DistributedDataParallelConfig:
    use_distributed_optimizer: bool
    overlap_grad_reduce: bool
    def __init__(
        self,
        *,
        use_distributed_optimizer: bool = ...,
        overlap_grad_reduce: bool = ...,
        overlap_param_gather: bool = ...,
    ) -> None: ...

class DistributedDataParallel(torch.nn.Module):
    module: torch.nn.Module
    def __init__(
        self, config: TransformerConfig, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module
    ) -> None: ...
    def zero_grad_buffer(self) -> None: ...
    def finish_grad_sync(self) -> None: ...
