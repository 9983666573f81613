import torch

class MegatronGradScaler:
    def __init__(self, initial_scale: float) -> None: ...
    @property
    def scale(self) -> torch.Tensor: ...
    @property
    def inv_scale(self) -> torch.Tensor: ...
    def update(self, found_inf: bool) -> None: ...
    def state_dict(self) -> dict[str, object]: ...
    def load_state_dict(self, state_dict: dict[str, object]) -> None: ...

class ConstantGradScaler(MegatronGradScaler): ...

class DynamicGradScaler(MegatronGradScaler):
    min_scale: torch.Tensor
    growth_factor: torch.Tensor
    backoff_factor: torch.Tensor
    growth_interval: int
    hysteresis: int
    _scale: torch.Tensor
    _growth_tracker: int
    _hysteresis_tracker: int
    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
    ) -> None: ...
