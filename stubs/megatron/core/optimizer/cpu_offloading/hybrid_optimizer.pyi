import torch

class HybridDeviceOptimizer(torch.optim.Optimizer):
    offload_fraction: float
    cpu_optimizers: list[torch.optim.Optimizer]
    gpu_optimizer: torch.optim.Optimizer | None
    @property
    def sub_optimizers(self) -> list[torch.optim.Optimizer]: ...
