import torch

class TransformerConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    bf16: bool
    fp16: bool
    params_dtype: torch.dtype
    def __init__(
        self,
        *,
        num_layers: int = ...,
        hidden_size: int = ...,
        num_attention_heads: int = ...,
        bf16: bool = ...,
        fp16: bool = ...,
        params_dtype: torch.dtype = ...,
    ) -> None: ...
