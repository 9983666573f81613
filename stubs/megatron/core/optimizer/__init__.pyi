from collections.abc import Sequence

import torch

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer as HybridDeviceOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DistributedOptimizer
from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer as LayerWiseDistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer as ChainedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params as Float16OptimizerWithFloat16Params
from megatron.core.optimizer.optimizer import FP32Optimizer as FP32Optimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer as MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig as OptimizerConfig

def get_megatron_optimizer(
    config: OptimizerConfig, model_chunks: Sequence[torch.nn.Module]
) -> MegatronOptimizer: ...
