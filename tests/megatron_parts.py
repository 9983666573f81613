"""Real Megatron wrapper instances over real torch optimizers, built directly.

The constructors run for real inside ``opttree.testing.cuda_on_cpu()``, which maps the
CUDA tensors ``FP32Optimizer.__init__`` creates onto the CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from megatron.core.optimizer import ChainedOptimizer, FP32Optimizer, MegatronOptimizer, OptimizerConfig
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

from opttree.testing import CudaOnCpu, cuda_on_cpu


def config() -> OptimizerConfig:
    return OptimizerConfig(optimizer="adam", lr=1e-3)


def fp32(optimizer: torch.optim.Optimizer | None, shared_config: OptimizerConfig | None = None) -> FP32Optimizer:
    with cuda_on_cpu():
        return FP32Optimizer(optimizer, shared_config or config(), None)


GROUP_SETTINGS: dict[str, object] = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
"""The settings Megatron pairs saved param groups with the optimizer's by (megatron-core
0.16 asks every group for them), for a torch optimizer built by hand under a wrapper."""


def megatron_group(params: Iterable[torch.Tensor], **options: object) -> dict[str, object]:
    """A param group of ``params`` with Megatron's pairing settings and ``options``."""
    return {"params": list(params), **GROUP_SETTINGS, **options}


def chained(members: Sequence[MegatronOptimizer]) -> ChainedOptimizer:
    return ChainedOptimizer(list(members))


Hybrid = tuple[HybridDeviceOptimizer, list[torch.nn.Parameter], CudaOnCpu]
"""A HybridDeviceOptimizer, the "GPU" parameters it steps, and the context they live in."""


def hybrid(
    sizes: list[int],
    *,
    offload: float = 1.0,
    like: Sequence[torch.Tensor] = (),
    gpu_optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
) -> Hybrid:
    """A real HybridDeviceOptimizer with one CPU AdamW per offloaded parameter (overlap on),
    over new parameters of ``sizes`` (values copied from ``like`` where given)."""
    device = cuda_on_cpu()
    params = [torch.nn.Parameter(torch.linspace(-1, 1, n)) for n in sizes]
    with torch.no_grad():
        for param, source in zip(params, like, strict=False):
            param.copy_(source)
    device.mark_on_gpu(*params)
    with device:
        optimizer = HybridDeviceOptimizer(
            params,
            offload_fraction=offload,
            cpu_optimizer_cls=torch.optim.AdamW,
            gpu_optimizer_cls=gpu_optimizer_cls,
            overlap_cpu_optimizer_d2h_h2d=True,
            lr=0.1,
        )
    return optimizer, params, device


def train_hybrid(stack: Hybrid, start: int, steps: int) -> None:
    """Deterministic steps: step ``i`` brings the same gradients for every caller."""
    optimizer, params, device = stack
    with device:
        for i in range(start, start + steps):
            for param in params:
                param.grad = torch.full_like(param, 0.1 * (i + 1)).sin()
            optimizer.step()
