import torch

from megatron.core.transformer.transformer_config import TransformerConfig

class MegatronModule(torch.nn.Module):
    config: TransformerConfig
    def __init__(self, config: TransformerConfig) -> None: ...
    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple[tuple[int, int, int], ...] = (), metadata: dict[str, object] | None = None
    ) -> dict[str, object]: ...
