from collections.abc import Sequence

from _typeshed import Incomplete

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer as HybridDeviceOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DistributedOptimizer
from megatron.core.optimizer.grad_scaler import ConstantGradScaler as ConstantGradScaler
from megatron.core.optimizer.grad_scaler import DynamicGradScaler as DynamicGradScaler
from megatron.core.optimizer.optimizer import ChainedOptimizer as ChainedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params as Float16OptimizerWithFloat16Params
from megatron.core.optimizer.optimizer import FP32Optimizer as FP32Optimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer as MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig as OptimizerConfig
from megatron.core.optimizer.optimizer_config import ParamKey as ParamKey
from megatron.core.optimizer_param_scheduler import ParamGroupOverride as ParamGroupOverride
from megatron.core.transformer.module import MegatronModule

# LayerWiseDistributedOptimizer is exported here from 0.17 on only: import it from
# megatron.core.optimizer.layer_wise_optimizer.

def get_standard_config_overrides(config: OptimizerConfig) -> dict[ParamKey, ParamGroupOverride]: ...

# The same signature in megatron-core 0.16.1 and 0.19.2. model_chunks is annotated List at
# runtime, which only reads it: a Sequence spares callers list invariance (a
# list[DistributedDataParallel] is one). pg_collection is a ProcessGroupCollection, not
# stubbed.
def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: Sequence[MegatronModule],
    config_overrides: dict[ParamKey, ParamGroupOverride] | None = None,
    use_gloo_process_groups: bool = True,
    pg_collection: Incomplete | None = None,
    dump_param_to_param_group_map: str | None = None,
) -> MegatronOptimizer: ...
