from dataclasses import dataclass

import torch
from _typeshed import Incomplete

# Deliberately incomplete: megatron-core 0.16.1 and 0.19.2 share some 240 fields, with
# types that name much of Megatron (enums, attention backends, callables). A few are
# declared; the constructor takes the rest as **kwargs, unchecked, rather than reporting
# real fields as errors. (At runtime the fields of ModelParallelConfig, its base, such as
# bf16, fp16 and params_dtype, are inherited; they are declared on this class here.)
# match_args=False: the runtime's __match_args__ lists every field in an order the
# releases do not share; a class pattern that names its fields by keyword is portable.
@dataclass(match_args=False)
class TransformerConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int | None
    num_moe_experts: int | None
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    sequence_parallel: bool
    bf16: bool
    fp16: bool
    params_dtype: torch.dtype
    def __init__(
        self,
        *,
        num_layers: int = 0,
        hidden_size: int = 0,
        num_attention_heads: int = 0,
        ffn_hidden_size: int | None = None,
        num_moe_experts: int | None = None,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        sequence_parallel: bool = False,
        bf16: bool = False,
        fp16: bool = False,
        params_dtype: torch.dtype = ...,
        **kwargs: Incomplete,
    ) -> None: ...
