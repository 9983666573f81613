"""Real Megatron-Core optimizer stacks on a CPU, for opttree's tests and for yours.

``build(name)`` runs Megatron's own ``get_megatron_optimizer`` over a small model in
Megatron's ``DistributedDataParallel``, with CUDA device, stream, event and tensor-type
calls mapped onto the CPU by :func:`cuda_on_cpu`. Names: see :data:`RECIPES` and
:func:`available`; :func:`missing_feature` says why one is not available.
"""

from opttree.testing._cuda_on_cpu import CudaOnCpu, cuda_on_cpu
from opttree.testing._megatron import (
    RECIPES,
    MegatronStack,
    Recipe,
    RecipeUnavailable,
    UnknownRecipe,
    available,
    build,
    ensure_process_group,
    is_available,
    missing_feature,
)
from opttree.testing._ranks import run_ranks

__all__ = [
    "RECIPES",
    "CudaOnCpu",
    "MegatronStack",
    "Recipe",
    "RecipeUnavailable",
    "UnknownRecipe",
    "available",
    "build",
    "cuda_on_cpu",
    "ensure_process_group",
    "is_available",
    "missing_feature",
    "run_ranks",
]
