from typing import TypedDict

# total=False as megatron-core 0.19 declares it (0.16 declares it total but builds it
# with some keys only, as in ParamGroupOverride(wd_mult=0.0)). The keys both releases
# have; 0.19 adds optimizer: str, a per-group optimizer name.
class ParamGroupOverride(TypedDict, total=False):
    max_lr: float
    min_lr: float
    start_wd: float
    end_wd: float
    wd_mult: float
