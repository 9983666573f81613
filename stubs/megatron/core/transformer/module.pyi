import torch

from megatron.core.transformer.transformer_config import TransformerConfig

class MegatronModule(torch.nn.Module):
    config: TransformerConfig
    def __init__(self, config: TransformerConfig) -> None: ...
