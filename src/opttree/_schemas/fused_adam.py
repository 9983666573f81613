"""TransformerEngine and apex ``FusedAdam``, by dotted path: neither installs without CUDA,
so opttree never imports them; their schemas are tested against stand-ins that mirror
their state layout (``tests/standins.py``)."""

from __future__ import annotations

import torch

from opttree._errors import UnsupportedOptimizerState
from opttree._schema import StateSchema, StepLocation
from opttree._schemas._keys import MASTER_PARAM


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


# Both build a parameter's moments together where its entry is empty (``len(state) == 0``)
# and read both at every step: an entry lacking one fails the next step (``always_built``).
TE_FUSED_ADAM = StateSchema(
    zero={"exp_avg", "exp_avg_sq"},
    keep={MASTER_PARAM},
    step=StepLocation.PER_GROUP,
    scale_of=te_scale_of,
    always_built={"exp_avg", "exp_avg_sq"},
)
# apex keeps its fp16 master copies in ``optimizer.master_params``, outside ``state``.
APEX_FUSED_ADAM = StateSchema(zero={"exp_avg", "exp_avg_sq"}, step=StepLocation.PER_GROUP, always_built={"exp_avg", "exp_avg_sq"})

LAZY: dict[str, StateSchema] = {
    "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam": TE_FUSED_ADAM,
    "apex.optimizers.fused_adam.FusedAdam": APEX_FUSED_ADAM,
}
