from collections.abc import Callable
from typing import Any

import torch
from _typeshed import Incomplete

from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.module import MegatronModule

class DistributedOptimizer(MixedPrecisionOptimizer):
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler: MegatronGradScaler | None,
        init_state_fn: Callable[..., object] | None,
        model_chunks: list[MegatronModule],
        # dict[int, list[_ParamAndGradBuffer]]; the buffers are not stubbed.
        per_model_buffers: dict[int, list[Incomplete]],
        data_parallel_group: torch.distributed.ProcessGroup,
        data_parallel_group_gloo: torch.distributed.ProcessGroup | None,
        data_parallel_group_idx: int,
        distributed_optimizer_instance_id: int,
    ) -> None: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: Any) -> None: ...
    # The runtime puts sharding_type third, where the base class has metadata: a
    # positional metadata, which the base class allows, means sharding_type here.
    def sharded_state_dict(  # type: ignore[override]
        self,
        model_sharded_state_dict: dict[str, Any] = ...,
        is_loading: bool = False,
        sharding_type: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any]: ...
    def save_parameter_state(self, filename: str) -> None: ...
    def load_parameter_state(self, filename: str, *, update_legacy_format: bool = False) -> None: ...
