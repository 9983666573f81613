"""Built-in state schemas, one per supported leaf class.

torch's optimizers are registered by class. Muon, TransformerEngine and apex classes
are registered by dotted path (both megatron-core layouts for Muon), so that opttree
never imports ``emerging_optimizers``, ``transformer_engine`` or ``apex`` itself.
"""

from __future__ import annotations

import torch

from opttree._dispatch import LazyDispatch
from opttree._errors import UnsupportedOptimizerState
from opttree._schema import StateSchema, StepLocation

# HybridDeviceOptimizer with param_update_in_fp32 stores the fp32 copy it steps as
# "master_param" in its sub-optimizers' state dicts, whatever their class.
_HYBRID_MASTER = "master_param"

ADAM = StateSchema(
    zero={"exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    keep={_HYBRID_MASTER},
    step=StepLocation.PER_PARAMETER,
)
SGD = StateSchema(drop={"momentum_buffer"}, keep={_HYBRID_MASTER})
MUON = StateSchema(zero={"momentum_buffer"}, keep={_HYBRID_MASTER})
ADAPTIVE_MUON = StateSchema(zero={"momentum_buffer", "moment2_buffer"}, keep={_HYBRID_MASTER})


def te_scale_of(optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str) -> torch.Tensor | None:
    """The fp32 scale TE's FusedAdam keeps in ``_scales[param][key]`` for fp16/bf16 moments.

    FP8 moments are ``Float8Tensor`` objects whose quantizer holds further scales that
    only TE can rebuild; they are refused rather than half-reset.
    """
    dtypes = getattr(optimizer, "name_to_dtype_map", None)
    if isinstance(dtypes, dict) and dtypes.get(key) is torch.uint8:
        msg = f"FP8 (uint8) {key!r} is a Float8Tensor with its own quantizer state"
        raise UnsupportedOptimizerState(msg)
    scales = getattr(optimizer, "_scales", None)
    per_param = scales.get(param) if isinstance(scales, dict) else None
    scale = per_param.get(key) if isinstance(per_param, dict) else None
    return scale if isinstance(scale, torch.Tensor) else None


TE_FUSED_ADAM = StateSchema(
    zero={"exp_avg", "exp_avg_sq"},
    keep={"master_param"},
    step=StepLocation.PER_GROUP,
    scale_of=te_scale_of,
)
# apex keeps its fp16 master copies in ``optimizer.master_params``, outside ``state``.
APEX_FUSED_ADAM = StateSchema(zero={"exp_avg", "exp_avg_sq"}, step=StepLocation.PER_GROUP)

_LAZY: dict[str, StateSchema] = {
    "megatron.core.optimizer.muon.TensorParallelMuon": MUON,
    "megatron.core.optimizer.emerging_optimizers.TensorParallelMuon": MUON,
    "megatron.core.optimizer.emerging_optimizers.TensorParallelAdaptiveMuon": ADAPTIVE_MUON,
    "emerging_optimizers.orthogonalized_optimizers.muon.Muon": MUON,
    "emerging_optimizers.orthogonalized_optimizers.adaptive_muon.AdaptiveMuon": ADAPTIVE_MUON,
    "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam": TE_FUSED_ADAM,
    "apex.optimizers.fused_adam.FusedAdam": APEX_FUSED_ADAM,
}


def builtin_schemas() -> LazyDispatch[StateSchema]:
    table: LazyDispatch[StateSchema] = LazyDispatch()
    table.register(torch.optim.Adam, ADAM)
    table.register(torch.optim.AdamW, ADAM)
    table.register(torch.optim.SGD, SGD)
    for dotted, schema in _LAZY.items():
        table.register_lazy(dotted, schema)
    return table
