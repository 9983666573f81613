from collections.abc import Callable, Sequence

import torch

from megatron.core.optimizer.optimizer_config import OptimizerConfig

_Groups = list[dict[str, object]]

class MegatronOptimizer:
    optimizer: torch.optim.Optimizer | None
    config: OptimizerConfig
    is_stub_optimizer: bool
    def __init__(
        self, optimizer: torch.optim.Optimizer | None, config: OptimizerConfig, init_state_fn: Callable[..., object] = ...
    ) -> None: ...
    @property
    def param_groups(self) -> _Groups: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def step(self) -> tuple[bool, float | None, int | None]: ...
    def state_dict(self) -> dict[str, object]: ...
    def load_state_dict(self, state_dict: dict[str, object]) -> None: ...
    def sharded_state_dict(
        self, model_sharded_state_dict: dict[str, object], is_loading: bool = False, metadata: dict[str, object] | None = None
    ) -> dict[str, object]: ...

class FP32Optimizer(MegatronOptimizer):
    def __init__(
        self, optimizer: torch.optim.Optimizer | None, config: OptimizerConfig, init_state_fn: Callable[..., object] | None
    ) -> None: ...

class MixedPrecisionOptimizer(MegatronOptimizer): ...

class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    fp32_from_float16_groups: list[list[torch.Tensor]]

class ChainedOptimizer(MegatronOptimizer):
    chained_optimizers: list[MegatronOptimizer | torch.optim.Optimizer]
    def __init__(self, chained_optimizers: Sequence[MegatronOptimizer]) -> None: ...
