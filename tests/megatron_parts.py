"""Real Megatron wrapper instances over real torch optimizers, built directly.

The constructors run for real inside ``opttree.testing.cuda_on_cpu()``, which maps the
CUDA tensors ``FP32Optimizer.__init__`` creates onto the CPU.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import pytest
import torch
from megatron.core.optimizer import ChainedOptimizer, FP32Optimizer, MegatronOptimizer, OptimizerConfig
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

from opttree.testing import CudaOnCpu, MegatronStack, cuda_on_cpu
from opttree.testing._megatron import HIDDEN, _tiny_mlp, ensure_process_group
from tests.standins import TEFusedAdam


def config() -> OptimizerConfig:
    return OptimizerConfig(optimizer="adam", lr=1e-3)


def fp32(optimizer: torch.optim.Optimizer | None, shared_config: OptimizerConfig | None = None) -> FP32Optimizer:
    with cuda_on_cpu():
        return FP32Optimizer(optimizer, shared_config or config(), None)


GROUP_SETTINGS: dict[str, object] = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
"""The settings Megatron pairs saved param groups with the optimizer's by (megatron-core
0.16 asks every group for them), for a torch optimizer built by hand under a wrapper."""


def megatron_group(params: Iterable[torch.Tensor], **options: object) -> dict[str, object]:
    """A param group of ``params`` with Megatron's pairing settings and ``options``."""
    return {"params": list(params), **GROUP_SETTINGS, **options}


def chained(members: Sequence[MegatronOptimizer]) -> ChainedOptimizer:
    return ChainedOptimizer(list(members))


Hybrid = tuple[HybridDeviceOptimizer, list[torch.nn.Parameter], CudaOnCpu]
"""A HybridDeviceOptimizer, the "GPU" parameters it steps, and the context they live in."""


def hybrid(
    sizes: list[int],
    *,
    offload: float = 1.0,
    like: Sequence[torch.Tensor] = (),
    gpu_optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    cpu_optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    options: Mapping[str, object] | None = None,
) -> Hybrid:
    """A real HybridDeviceOptimizer with one CPU optimizer (AdamW unless named) per
    offloaded parameter (overlap on), over new parameters of ``sizes`` (values copied from
    ``like`` where given); ``options`` go to its sub-optimizers' groups, with lr 0.1."""
    device = cuda_on_cpu()
    params = [torch.nn.Parameter(torch.linspace(-1, 1, n)) for n in sizes]
    with torch.no_grad():
        for param, source in zip(params, like, strict=False):
            param.copy_(source)
    device.mark_on_gpu(*params)
    with device:
        optimizer = HybridDeviceOptimizer(
            params,
            offload_fraction=offload,
            cpu_optimizer_cls=cpu_optimizer_cls,
            gpu_optimizer_cls=gpu_optimizer_cls,
            overlap_cpu_optimizer_d2h_h2d=True,
            **cast("dict[str, Any]", {"lr": 0.1, **(options or {})}),  # keyword arguments it takes as defaults
        )
    return optimizer, params, device


def train_hybrid(stack: Hybrid, start: int, steps: int) -> None:
    """Deterministic steps: step ``i`` brings the same gradients for every caller."""
    optimizer, params, device = stack
    with device:
        for i in range(start, start + steps):
            for param in params:
                param.grad = torch.full_like(param, 0.1 * (i + 1)).sin()
            optimizer.step()


def precision_aware(monkeypatch: pytest.MonkeyPatch, *, remainders: bool, seed: int = 0) -> MegatronStack:
    """Megatron's precision-aware ``DistributedOptimizer`` (bf16, ``use_precision_aware_optimizer``)
    over the TE ``FusedAdam`` stand-in, built by ``get_megatron_optimizer``, as on a machine
    with TransformerEngine 2.1 or later: its main weights are TE's ``master_param``
    (fp32, or int16 remainders). TE cannot be installed here, so ``monkeypatch`` points
    Megatron's module-level choices of optimizer class at the stand-in for the test."""
    from megatron.core import optimizer as megatron_optimizer
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import distrib_optimizer, get_megatron_optimizer, optimizer_config
    from megatron.core.transformer import TransformerConfig

    te = types.ModuleType("transformer_engine.pytorch.optimizers")
    setattr(te, "FusedAdam", TEFusedAdam)
    for name in ("transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.optimizers", te)
    for module in (megatron_optimizer, distrib_optimizer):
        monkeypatch.setattr(module, "Adam", TEFusedAdam)
    monkeypatch.setattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", False, raising=False)  # 0.16 on
    for module in (megatron_optimizer, optimizer_config):
        monkeypatch.setattr(module, "is_te_min_version", lambda *_, **__: True)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", True, raising=False)  # 0.16 on

    ensure_process_group()
    device = cuda_on_cpu()
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, bf16=True, params_dtype=torch.bfloat16)
    torch.manual_seed(seed)
    model = _tiny_mlp(config, experts=False, hidden=HIDDEN)
    device.mark_on_gpu(*model.parameters())
    options = OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        weight_decay=0.01,
        bf16=True,
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=True,
        store_param_remainders=remainders,
    )
    with device:
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False), model)
        optimizer = get_megatron_optimizer(options, [ddp])
    if not getattr(optimizer.optimizer, "master_weights", False):
        pytest.skip(
            "this megatron-core keeps fp32 main weights itself under the precision-aware optimizer (0.13 does): "
            "TE holds them there only for another main_params_dtype or delayed FP8 scaling"
        )
    return MegatronStack("precision_aware", ddp, optimizer, device)


def mimo_over(stack: MegatronStack) -> object:
    """A MimoOptimizer whose one module, ``vision``, is ``stack``'s optimizer."""
    mimo = pytest.importorskip("megatron.core.models.mimo.optimizer")
    import torch.distributed as dist

    groups = pytest.importorskip("megatron.core.process_groups_config").ProcessGroupCollection()
    groups.tp = groups.pp = groups.dp = dist.group.WORLD
    (wrapper, *_) = getattr(stack.optimizer, "chained_optimizers")
    return mimo.MimoOptimizer({"vision": mimo.ModuleOptimizerInfo(stack.optimizer, None, groups, True)}, wrapper.config)
