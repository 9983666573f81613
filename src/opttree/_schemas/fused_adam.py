"""TransformerEngine and apex ``FusedAdam``, by dotted path: neither installs without CUDA,
so opttree never imports them; their schemas are tested against stand-ins that mirror
their state layout (``tests/standins.py``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from opttree._errors import UnsupportedOptimizerState
from opttree._schema import StateSchema, StepLocation
from opttree._schemas._keys import MASTER_PARAM

MASTER_GROUPS = "param_groups_master"
OVERFLOW_FLAG = "_dummy_overflow_buf"


def te_scale_of(optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str) -> torch.Tensor | None:
    """The fp32 scale TE's FusedAdam keeps in ``_scales[param][key]`` for fp16 moments.

    FP8 moments are ``Float8Tensor`` objects whose quantizer holds further scales that
    only TE can rebuild; they are refused rather than half-reset.
    """
    dtypes = getattr(optimizer, "name_to_dtype_map", None)
    if isinstance(dtypes, dict) and dtypes.get(key) is torch.uint8:
        msg = f"FP8 (uint8) {key!r} is a Float8Tensor with its own quantizer state"
        raise UnsupportedOptimizerState(msg)
    if isinstance(dtypes, dict) and dtypes.get(key) is torch.bfloat16:
        return None  # TE makes a bf16 state's scale (a 1) and never reads or writes it
    scales = getattr(optimizer, "_scales", None)
    per_param = scales.get(param) if isinstance(scales, dict) else None
    scale = per_param.get(key) if isinstance(per_param, dict) else None
    return scale if isinstance(scale, torch.Tensor) else None


def te_master_of(optimizer: torch.optim.Optimizer, param: torch.Tensor, entry: Mapping[str, object]) -> torch.Tensor | None:
    """The fp32 master TE's FusedAdam (``master_weights``) steps a bf16, fp16 or FP8
    parameter through and writes back into it; Megatron's precision-aware
    ``DistributedOptimizer`` keeps its main weights there.

    An fp32 parameter is stepped in place: its ``master_param`` is never read. One of a
    tensor subclass (TE's ``Float8Tensor``) is not compared here. Remainders
    (``store_param_remainders``: int16, the low bits of a master whose high bits are the
    bf16 parameter itself) always round to the parameter, so they cannot stand for other
    weights. A master kept in another dtype (``master_weight_dtype``) is stored scaled by
    ``_scales``: it is not compared.
    """
    master = entry.get(MASTER_PARAM)
    if not isinstance(master, torch.Tensor) or master.dtype == torch.int16:
        return None
    if type(param) not in (torch.Tensor, torch.nn.Parameter):
        msg = f"its parameter is a {type(param).__qualname__} (an FP8 weight): how its master rounds to it is that class's own"
        raise UnsupportedOptimizerState(msg)
    if param.dtype == torch.float32:
        return None
    if master.dtype != torch.float32:
        msg = f"its master_param is kept in {master.dtype}, scaled by _scales"
        raise UnsupportedOptimizerState(msg)
    return master


# Both build a parameter's moments together where its entry is empty (``len(state) == 0``)
# and read both at every step: an entry lacking one fails the next step (``always_built``).
# Both keep a capturable step's overflow flag, which decides whether the next step counts.
# TE 1.x and apex keep master copies in ``param_groups_master``, beside ``param_groups``;
# TE 2.x keeps them in state, as ``master_param``.
TE_FUSED_ADAM = StateSchema(
    zero={"exp_avg", "exp_avg_sq"},
    keep={MASTER_PARAM},
    step=StepLocation.PER_GROUP,
    scale_of=te_scale_of,
    master_of=te_master_of,
    always_built={"exp_avg", "exp_avg_sq"},
    master_groups=MASTER_GROUPS,
    step_attributes={OVERFLOW_FLAG},
    known_attributes={"_scales", "dtype_to_range_map"},  # fp16 scales; the constant fp16 and FP8 ranges
)
APEX_FUSED_ADAM = StateSchema(
    zero={"exp_avg", "exp_avg_sq"},
    step=StepLocation.PER_GROUP,
    always_built={"exp_avg", "exp_avg_sq"},
    master_groups=MASTER_GROUPS,
    step_attributes={OVERFLOW_FLAG},
)

LAZY: dict[str, StateSchema] = {
    "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam": TE_FUSED_ADAM,
    "apex.optimizers.fused_adam.FusedAdam": APEX_FUSED_ADAM,
}
