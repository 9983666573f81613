"""Real Megatron wrapper instances over real torch optimizers, built directly.

The constructors run for real inside ``opttree.testing.cuda_on_cpu()``, which maps the
CUDA tensors ``FP32Optimizer.__init__`` creates onto the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core.optimizer import ChainedOptimizer, FP32Optimizer, MegatronOptimizer, OptimizerConfig

from opttree.testing import cuda_on_cpu


def config() -> OptimizerConfig:
    return OptimizerConfig(optimizer="adam", lr=1e-3)


def fp32(optimizer: torch.optim.Optimizer | None, shared_config: OptimizerConfig | None = None) -> FP32Optimizer:
    with cuda_on_cpu():
        return FP32Optimizer(optimizer, shared_config or config(), None)


def chained(members: Sequence[MegatronOptimizer]) -> ChainedOptimizer:
    return ChainedOptimizer(list(members))
