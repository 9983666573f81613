from collections.abc import Iterable

import torch

class HybridDeviceOptimizer(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, object]],
        offload_fraction: float = 0.5,
        cpu_optimizer_cls: type[torch.optim.Optimizer] | None = None,
        gpu_optimizer_cls: type[torch.optim.Optimizer] | None = None,
        param_update_in_fp32: bool = False,
        pin_cpu_grads: bool = True,
        pin_cpu_params: bool = True,
        overlap_cpu_optimizer_d2h_h2d: bool = True,
        **kwargs: object,
    ) -> None: ...
    offload_fraction: float
    cpu_optimizers: list[torch.optim.Optimizer]
    gpu_optimizer: torch.optim.Optimizer | None
    @property
    def sub_optimizers(self) -> list[torch.optim.Optimizer]: ...
    def _sync_sub_optimizers_state_to_hdo(self) -> None: ...
