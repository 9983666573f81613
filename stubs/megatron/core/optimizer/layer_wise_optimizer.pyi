from collections.abc import Callable

from _typeshed import Incomplete

from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig

class LayerWiseDistributedOptimizer(ChainedOptimizer):
    # The parameters 0.16.1 and 0.19.2 share; 0.19 adds model_chunks at the end.
    # pg_collection is a ProcessGroupCollection, not stubbed.
    def __init__(
        self,
        optimizers: list[MegatronOptimizer],
        config: OptimizerConfig,
        pg_collection: Incomplete | None = None,
        init_state_fn_list: list[Callable[..., object]] | None = None,
    ) -> None: ...
