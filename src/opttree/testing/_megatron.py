"""Real Megatron-Core optimizer stacks, built by Megatron's own factory on the CPU.

:func:`build` wraps a small MLP in Megatron's ``DistributedDataParallel`` and calls
``get_megatron_optimizer`` on it, inside :func:`~opttree.testing.cuda_on_cpu`. The model's
parameters count as GPU tensors there, so the factory, DDP's grad buffers and
``HybridDeviceOptimizer`` take their GPU code paths, computing on the CPU.

Every configuration's state comes from Megatron's own ``optimizer.step()``; none is
filled by hand.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import math
import socket
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import TYPE_CHECKING
from unittest import mock

import torch
import torch.distributed as dist
from attrs import Attribute, field, frozen

from opttree._errors import OptTreeError
from opttree._fields import kind_of, of
from opttree.testing._cuda_on_cpu import CudaOnCpu, cuda_on_cpu

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig
    from megatron.core.transformer import TransformerConfig

HIDDEN = 16


STANDARD_OPTIMIZERS = frozenset({"adam", "sgd"})
"""The ``--optimizer`` names Megatron's factory builds from torch (or TE and apex) alone;
every other name needs emerging-optimizers."""


def _width(recipe: object, attribute: Attribute[int], value: int) -> None:
    given: object = value
    if isinstance(given, int) and not isinstance(given, bool) and given > 0:
        return
    msg = f"Recipe.hidden must be a positive int, got {given!r}"
    raise OptTreeError(msg)


def _fraction(recipe: object, attribute: Attribute[float | None], value: float | None) -> None:
    given: object = value
    if given is None or (isinstance(given, (int, float)) and not isinstance(given, bool) and 0.0 <= given <= 1.0):
        return
    msg = f"Recipe.offload_fraction must be None or a number from 0 to 1, got {given!r}"
    raise OptTreeError(msg)


@frozen
class Recipe:
    """One named configuration: the ``OptimizerConfig`` fields it sets."""

    name: str = field(validator=of(str))
    optimizer: str = field(validator=of(str))
    bf16: bool = field(default=False, validator=of(bool))
    fp16: bool = field(default=False, validator=of(bool))
    distributed: bool = field(default=False, validator=of(bool))
    offload_fraction: float | None = field(default=None, validator=_fraction)
    precision_aware: bool = field(default=True, validator=of(bool))
    """With ``offload_fraction``: offload through Megatron's precision-aware optimizer, as
    the offload recipes do; False offloads without it (a HybridDeviceOptimizer under the
    DistributedOptimizer's own fp32 main weights), which Megatron's factory also builds."""
    layer_wise: bool = field(default=False, validator=of(bool))
    experts: bool = field(default=False, validator=of(bool))
    description: str = field(default="", validator=of(str))
    frozen_dense: bool = field(default=False, validator=of(bool))
    """Train the experts only: Megatron's factory then builds a stub optimizer (holding no
    optimizer) for the frozen dense parameters, first in the chain, whose loss scaler the
    chain scales the loss by."""
    hidden: int = field(default=HIDDEN, validator=_width)
    """The model's width: a narrow one (4, with ``distributed`` and ``experts`` on 2 ranks)
    leaves a rank whose shard of the expert buffer is all padding, and whose
    DistributedOptimizer's inner optimizer holds no parameter."""

    def __attrs_post_init__(self) -> None:
        if self.bf16 and self.fp16:
            msg = f"Recipe {self.name!r} is both bf16 and fp16: Megatron trains in one of them"
            raise OptTreeError(msg)
        if self.frozen_dense and not self.experts:
            msg = f"Recipe {self.name!r} freezes the dense layers without experts=True: nothing would train"
            raise OptTreeError(msg)
        if self.offload_fraction is not None and not self.distributed:
            msg = f"Recipe {self.name!r} offloads without distributed=True: Megatron offloads under its DistributedOptimizer"
            raise OptTreeError(msg)

    @property
    def needs_emerging(self) -> bool:
        """Whether Megatron's factory builds this optimizer from emerging-optimizers."""
        return self.optimizer not in STANDARD_OPTIMIZERS


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("fp32", "adam", description="FP32Optimizer over AdamW"),
        Recipe("bf16", "adam", bf16=True, description="Float16OptimizerWithFloat16Params over AdamW"),
        Recipe(
            "fp16",
            "adam",
            fp16=True,
            description="Float16OptimizerWithFloat16Params over AdamW, fp16 with a DynamicGradScaler",
        ),
        Recipe("dist_fp32", "adam", distributed=True, description="DistributedOptimizer, fp32"),
        Recipe("dist_bf16", "adam", bf16=True, distributed=True, description="DistributedOptimizer, bf16"),
        Recipe(
            "dist_fp16",
            "adam",
            fp16=True,
            distributed=True,
            description="DistributedOptimizer, fp16 with a DynamicGradScaler",
        ),
        Recipe(
            "offload_0.75",
            "adam",
            bf16=True,
            distributed=True,
            offload_fraction=0.75,
            description="precision-aware DistributedOptimizer over HybridDeviceOptimizer, 75% on the CPU",
        ),
        Recipe(
            "offload_1.0",
            "adam",
            bf16=True,
            distributed=True,
            offload_fraction=1.0,
            description="precision-aware DistributedOptimizer over HybridDeviceOptimizer, all on the CPU",
        ),
        Recipe("sgd", "sgd", description="FP32Optimizer over SGD with momentum"),
        Recipe("moe", "adam", experts=True, description="ChainedOptimizer of a dense and an expert optimizer"),
        Recipe(
            "frozen_fp16",
            "adam",
            fp16=True,
            experts=True,
            frozen_dense=True,
            description="experts only, fp16: a stub Float16OptimizerWithFloat16Params for the frozen dense layers",
        ),
        Recipe(
            "frozen_dist_bf16",
            "adam",
            bf16=True,
            distributed=True,
            experts=True,
            frozen_dense=True,
            description="experts only, bf16: a stub DistributedOptimizer for the frozen dense layers",
        ),
        Recipe("muon", "muon", description="TensorParallelMuon chained with AdamW"),
        Recipe(
            "dist_muon",
            "muon",
            bf16=True,
            layer_wise=True,
            description="LayerWiseDistributedOptimizer over TensorParallelMuon and AdamW",
        ),
        Recipe(
            "adaptive_muon",
            "adaptive_muon",
            description="TensorParallelAdaptiveMuon chained with AdamW",
        ),
        Recipe("lion", "lion", description="emerging-optimizers Lion chained with AdamW"),
        Recipe("laprop", "laprop", description="emerging-optimizers LaProp chained with AdamW"),
        Recipe("soap", "soap", description="emerging-optimizers SOAP chained with AdamW"),
        Recipe("rekls", "rekls", description="emerging-optimizers REKLS chained with AdamW"),
    )
}
"""Megatron's factory builds each of these on a CPU. Of the other names in its
emerging-optimizer registry, megatron-core 0.19.2 passes Adam's ``betas`` to mop,
muon_hyperball, polargrad, scion, sinkhorn_muon, spel, psgd_pro and oblique_sgd, which
take none, and lists psgd_pro and the oblique optimizers only where their modules were
imported before ``megatron.core.optimizer``; ``tests/test_emerging_catalogue.py`` builds
every name through the factory (oblique_adam among them, imported first) and each class
directly."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def ensure_process_group() -> None:
    """A one-rank gloo group and Megatron's parallel state, created once per process."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        # An explicit address, not MASTER_PORT in os.environ: a subprocess would inherit
        # the port this process's store listens on, and fail to start its own.
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        atexit.register(_destroy_process_group)
    if not parallel_state.model_parallel_is_initialized():
        with cuda_on_cpu():
            parallel_state.initialize_model_parallel()


def _destroy_process_group() -> None:
    """At exit, the group :func:`ensure_process_group` made: gloo's threads, left running
    while the interpreter shuts down, now and then abort the process ("terminate called
    without an active exception") after all its work is done."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _module(name: str) -> ModuleType | None:
    """The named module, or None where this environment lacks it (or its parent package)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


@functools.cache
def _distributed_optimizer_missing() -> str | None:
    """megatron-core 0.12's ``DistributedOptimizer`` copies its main weights back through
    ``fp8_utils.quantize_param_shard`` on every step, and without TransformerEngine that
    raises even with no fp8 parameter (0.13 returns on an empty list). Asked, not assumed:
    the call with nothing to quantize is what every step here makes."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return None
    fp8_utils = _module("megatron.core.fp8_utils")
    quantize = getattr(fp8_utils, "quantize_param_shard", None)
    if quantize is None:
        return None
    try:
        quantize([], [], [], None)
    except RuntimeError as e:
        return f"this megatron-core's DistributedOptimizer cannot step without TransformerEngine ({e})"
    return None


_STANDARD_PATH = {"lion": "Lion"}
"""Emerging optimizers that megatron-core 0.17 and later also build in the factory's own
path (all parameters on it, nothing chained), from the class ``megatron.core.optimizer``
imports for it, wherever the registry does not take the name."""


@functools.cache
def _emerging_missing(optimizer: str, *, layer_wise: bool) -> str | None:
    """Why ``get_megatron_optimizer`` cannot build ``optimizer`` from emerging-optimizers
    here, or None where it can.

    It can from megatron-core 0.18 on, through its registry
    ``megatron.core.optimizer.emerging_optimizers``, and from 0.17 on for what
    :data:`_STANDARD_PATH` names; 0.16 and 0.17 build Muon only through a separate
    ``get_megatron_muon_optimizer``, and 0.15 and older nothing at all. A legacy
    ``dist_`` name (``"dist_muon"``) is the bare one, layer-wise, as the factory rewrites it."""
    if optimizer.startswith("dist_"):
        optimizer, layer_wise = optimizer.removeprefix("dist_"), True
    if importlib.util.find_spec("emerging_optimizers") is None:
        return "emerging-optimizers is not installed"
    reason = _registry_missing(optimizer)
    if reason is None:
        if layer_wise and _module("megatron.core.optimizer.layer_wise_optimizer") is None:
            return "this megatron-core has no LayerWiseDistributedOptimizer"
        return None
    cls = _STANDARD_PATH.get(optimizer)
    if not layer_wise and cls is not None and getattr(_module("megatron.core.optimizer"), cls, None) is not None:
        return None
    return reason


def _registry_missing(optimizer: str) -> str | None:
    registry = _module("megatron.core.optimizer.emerging_optimizers")
    if registry is None:
        return (
            f"this megatron-core's get_megatron_optimizer builds no {optimizer!r}: "
            "it has no emerging-optimizer registry (megatron.core.optimizer.emerging_optimizers)"
        )
    if not getattr(registry, "HAVE_EMERGING_OPTIMIZERS", False):
        installed = importlib.metadata.version("emerging-optimizers")
        return f"this megatron-core cannot import what it needs from emerging-optimizers {installed}"
    known = getattr(registry, "_EMERGING_OPTIMIZERS", None)
    if isinstance(known, Mapping) and optimizer not in known:
        return f"this megatron-core's emerging-optimizer registry has no {optimizer!r}"
    return None


class UnknownRecipe(OptTreeError, ValueError):
    """A configuration name that :data:`RECIPES` does not hold."""


class RecipeUnavailable(OptTreeError, RuntimeError):
    """A configuration this environment's packages cannot build (see :func:`missing_feature`)."""


def _recipe(configuration: str | Recipe) -> Recipe:
    given: object = configuration
    if isinstance(given, Recipe):
        return given
    if not isinstance(given, str):
        msg = f"a configuration is a name in RECIPES or a Recipe, got {kind_of(given)}"
        raise UnknownRecipe(msg)
    recipe = RECIPES.get(given)
    if recipe is None:
        msg = f"no configuration named {given!r}: RECIPES has {', '.join(RECIPES)}; or pass a Recipe"
        raise UnknownRecipe(msg)
    return recipe


def missing_feature(configuration: str | Recipe) -> str | None:
    """Why this environment's megatron-core cannot build and train a configuration (a name
    of :data:`RECIPES`, or a :class:`Recipe` of your own): the feature it lacks, in words;
    None where it lacks none that this module knows of.

    Each feature is probed in the installed megatron-core (and emerging-optimizers), not
    read off a version number. For every name of :data:`RECIPES`, None means that
    Megatron's factory builds it and its ``step()`` runs here (a test proves both sides).
    A :class:`Recipe` of your own may combine fields that Megatron's factory itself refuses
    (emerging optimizers with ``fp16`` or with the precision-aware offload, say); its
    exception then comes out of :func:`build` unchanged."""
    recipe = _recipe(configuration)
    if importlib.util.find_spec("megatron") is None or _module("megatron.core.optimizer") is None:
        return "megatron-core is not installed"
    if recipe.offload_fraction is not None and _module("megatron.core.optimizer.cpu_offloading.hybrid_optimizer") is None:
        return "this megatron-core has no HybridDeviceOptimizer"
    if recipe.distributed and (recipe.offload_fraction is None or not recipe.precision_aware):
        # The precision-aware (offload) path copies its main weights itself.
        reason = _distributed_optimizer_missing()
        if reason is not None:
            return reason
    if recipe.needs_emerging:
        reason = _emerging_missing(recipe.optimizer, layer_wise=recipe.layer_wise)
        if reason is None and recipe.layer_wise and not (recipe.bf16 or recipe.fp16):
            # Built, but unwrapped: LayerWiseDistributedOptimizer's step calls each member's prepare_grads.
            reason = "Megatron's factory puts emerging optimizers under a LayerWiseDistributedOptimizer with no mixed-precision wrapper where bf16 is not set, and its step then fails"
        return reason
    return None


def is_available(configuration: str | Recipe) -> bool:
    """Whether this environment's megatron-core can build and train a configuration."""
    return missing_feature(configuration) is None


def available() -> tuple[str, ...]:
    """The configuration names this environment can build and train; see :func:`missing_feature`."""
    return tuple(name for name in RECIPES if is_available(name))


def _tiny_mlp(config: TransformerConfig, *, experts: bool, hidden: int) -> torch.nn.Module:
    from megatron.core.transformer.module import MegatronModule

    class TinyMLP(MegatronModule):
        """Two dense layers, and optionally an expert layer (``allreduce = False``, as
        Megatron marks expert-parallel parameters)."""

        def __init__(self) -> None:
            super().__init__(config)
            dtype = config.params_dtype
            self.up = torch.nn.Linear(hidden, 2 * hidden, dtype=dtype)
            self.down = torch.nn.Linear(2 * hidden, hidden, dtype=dtype)
            self.expert = torch.nn.Linear(hidden, hidden, bias=False, dtype=dtype) if experts else None
            if self.expert is not None:
                for p in self.expert.parameters():
                    setattr(p, "allreduce", False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y: torch.Tensor = self.down(torch.relu(self.up(x)))
            return y if self.expert is None else y + self.expert(x)

    return TinyMLP()


@frozen
class MegatronStack:
    """A real Megatron model and optimizer, and the means to train them on the CPU."""

    name: str
    model: DistributedDataParallel
    optimizer: MegatronOptimizer
    device: CudaOnCpu
    hidden: int = HIDDEN

    def step(self, index: int) -> float:
        """One real training step on the deterministic batch ``index``; returns the loss."""
        with self.device:
            generator = torch.Generator().manual_seed(10_000 + index)
            x = torch.randn(8, self.hidden, generator=generator)
            target = torch.randn(8, self.hidden, generator=generator)
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            dtype = next(self.model.parameters()).dtype
            output: torch.Tensor = self.model(x.to(dtype))
            loss = (output.float() - target).pow(2).mean()
            torch.autograd.backward(self.optimizer.scale_loss(loss))  # as Megatron's schedules scale it: by the fp16 loss scale
            self.model.finish_grad_sync()
            self.optimizer.step()
            return float(loss)

    def train(self, start: int, steps: int) -> None:
        """``steps`` training steps on the batches ``start``, ``start + 1``, ...; see :meth:`step`."""
        for index in range(start, start + steps):
            self.step(index)

    def leaves(self) -> list[torch.optim.Optimizer]:
        """The leaf optimizers, in tree order."""
        from opttree import LeafNode, TraverserVisitor, tree

        found: list[torch.optim.Optimizer] = []

        class Collect(TraverserVisitor):
            def visit_leaf(self, node: LeafNode) -> None:
                found.append(node.optimizer)

        tree(self.optimizer).accept(Collect())
        return found

    def main_params(self) -> list[torch.Tensor]:
        """The tensors the leaf optimizers step: fp32 main (master) weights where there are
        any, each followed, for a leaf whose schema says it keeps master copies in its state
        (``master_of``), by what it keeps for it beside history (its ``keep`` keys): TE
        ``FusedAdam``'s ``master_param``, fp32 or int16 remainders, which holds the main
        weights of Megatron's precision-aware ``DistributedOptimizer``."""
        from opttree import schema_for

        found: list[torch.Tensor] = []
        for leaf in self.leaves():
            schema = schema_for(type(leaf))
            kept = sorted(schema.keep) if schema is not None and schema.master_of is not None else []
            for group in leaf.param_groups:
                for param in group["params"]:
                    found.append(param)
                    entry = leaf.state.get(param, {})
                    found.extend(v for v in map(entry.get, kept) if isinstance(v, torch.Tensor) and v is not param)
        return found

    def copy_weights_from(self, other: MegatronStack) -> None:
        """Make this stack's model and main weights bitwise equal to ``other``'s: refused,
        with nothing copied, where the two hold weights of other counts, shapes or dtypes
        (a copy between them would cast, and the weights would not be equal)."""
        given: object = other
        if not isinstance(given, MegatronStack):
            msg = f"copy_weights_from takes a MegatronStack, got {kind_of(given)}"
            raise OptTreeError(msg)
        pairs = [
            *zip(list(self.model.parameters()), list(other.model.parameters())),
            *zip(self.main_params(), other.main_params()),
        ]
        counts = (len(list(self.model.parameters())), len(self.main_params()))
        theirs = (len(list(other.model.parameters())), len(other.main_params()))
        unlike = [(a, b) for a, b in pairs if a.shape != b.shape or a.dtype != b.dtype]
        if counts != theirs or unlike:
            found = (
                f"model and main weights {counts[0]} and {counts[1]} where the other stack holds {theirs[0]} and {theirs[1]}"
                if counts != theirs
                else f"a weight of shape {tuple(unlike[0][0].shape)} {unlike[0][0].dtype} where the other stack's is "
                f"{tuple(unlike[0][1].shape)} {unlike[0][1].dtype}"
            )
            msg = f"cannot make the {self.name!r} stack's weights bitwise equal to the {other.name!r} stack's: {found}"
            raise OptTreeError(msg)
        with torch.no_grad():
            for weight, source in pairs:
                weight.copy_(source)


@contextlib.contextmanager
def _without_transformer_engine_version() -> Iterator[None]:
    """``OptimizerConfig`` asks TE for its version when precision-aware, and fails with a
    ``TypeError`` where TE is not installed; without TE the answer is "older than any"."""
    from megatron.core.optimizer import optimizer_config

    # megatron-core 0.12's config asks no version (it returns early for CPU offload).
    if importlib.util.find_spec("transformer_engine") is not None or not hasattr(optimizer_config, "is_te_min_version"):
        yield
        return
    with mock.patch.object(optimizer_config, "is_te_min_version", lambda *a, **k: False):
        yield


def _refuse_bad_arguments(seed: object, lr: object) -> None:
    """Refuse before Megatron is imported, the process group set up and torch reseeded:
    ``torch.manual_seed`` takes "3" and 1.5 without a word, and a wrong ``lr`` failed only
    in the optimizer's constructor, as a raw error."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        msg = f"build's seed must be an int, got {kind_of(seed)}"
        raise OptTreeError(msg)
    if not -(2**63) <= seed < 2**64:
        msg = f"build's seed must be an int from -2**63 to 2**64 - 1, as torch.manual_seed takes, got {seed}"
        raise OptTreeError(msg)
    if not isinstance(lr, (int, float)) or isinstance(lr, bool):
        msg = f"build's lr must be a float or an int, got {kind_of(lr)}"
        raise OptTreeError(msg)
    if not 0 < lr < math.inf:
        msg = (
            "build's lr must be positive and finite, as Megatron's OptimizerConfig.lr (torch's optimizers refuse a negative "
            f"or NaN one; at 0 or infinity nothing trains), got {lr}"
        )
        raise OptTreeError(msg)


def _unbuildable(recipe: Recipe, part: str, error: Exception) -> RecipeUnavailable:
    return RecipeUnavailable(f"configuration {recipe.name!r} cannot be built: Megatron's {part} raised {type(error).__name__}: {error}")


def build(configuration: str | Recipe, *, seed: int = 0, lr: float = 1e-2) -> MegatronStack:
    """Build a configuration (a name of :data:`RECIPES`, or a :class:`Recipe` of your own)
    with Megatron's ``get_megatron_optimizer``."""
    _refuse_bad_arguments(seed, lr)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    recipe = _recipe(configuration)
    reason = missing_feature(recipe)
    if reason is not None:
        msg = f"configuration {recipe.name!r} cannot be built here: {reason}"
        raise RecipeUnavailable(msg)
    ensure_process_group()
    device = cuda_on_cpu()
    dtype = torch.bfloat16 if recipe.bf16 else torch.float16 if recipe.fp16 else torch.float32
    config = TransformerConfig(
        num_layers=1, hidden_size=recipe.hidden, num_attention_heads=1, bf16=recipe.bf16, fp16=recipe.fp16, params_dtype=dtype
    )
    torch.manual_seed(seed)
    model = _tiny_mlp(config, experts=recipe.experts, hidden=recipe.hidden)
    if recipe.frozen_dense:
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith("expert."))
    device.mark_on_gpu(*model.parameters())
    offload = recipe.offload_fraction is not None
    try:
        with _without_transformer_engine_version():
            optimizer_config = OptimizerConfig(
                optimizer=recipe.optimizer,
                lr=lr,
                weight_decay=0.01,
                bf16=recipe.bf16,
                fp16=recipe.fp16,
                # fp16: a scale that grows at the first steps, then overflows and backs off,
                # within six, so that a scaler kept by a reset shows in the next steps
                initial_loss_scale=2.0**18,
                loss_scale_window=2,
                use_distributed_optimizer=recipe.distributed,
                optimizer_cpu_offload=offload,
                optimizer_offload_fraction=recipe.offload_fraction or 0.0,
                use_precision_aware_optimizer=offload and recipe.precision_aware,
                overlap_cpu_optimizer_d2h_h2d=offload,
                sgd_momentum=0.9,
            )
    except Exception as error:  # Megatron's config refuses some combinations a Recipe allows (offloading SGD)
        raise _unbuildable(recipe, "OptimizerConfig", error) from error
    if recipe.layer_wise:
        optimizer_config.use_layer_wise_distributed_optimizer = True
    with device:
        ddp = DistributedDataParallel(
            config,
            DistributedDataParallelConfig(use_distributed_optimizer=recipe.distributed, overlap_grad_reduce=False),
            model,
        )
        try:
            optimizer = get_megatron_optimizer(optimizer_config, [ddp])
        except Exception as error:  # as its config, Megatron's factory refuses some combinations
            raise _unbuildable(recipe, "factory", error) from error
    stack = MegatronStack(recipe.name, ddp, optimizer, device, recipe.hidden)
    for leaf in stack.leaves():
        _complete_adaptive_muon(leaf, optimizer_config)
    return stack


def _complete_adaptive_muon(leaf: torch.optim.Optimizer, config: OptimizerConfig) -> None:
    """megatron-core 0.19's ``TensorParallelAdaptiveMuon.__init__`` runs only
    ``TensorParallelMuon.__init__``, so with emerging-optimizers 0.3 the instance lacks the
    ``scale_mode`` and ``extra_scale_factor`` that ``AdaptiveMuon.step`` reads, and
    Megatron's own step raises ``AttributeError`` on any machine. Set them from the config
    as ``AdaptiveMuon.__init__`` would have."""
    if type(leaf).__name__ != "TensorParallelAdaptiveMuon" or hasattr(leaf, "scale_mode"):
        return
    setattr(leaf, "scale_mode", config.muon_scale_mode)
    setattr(leaf, "extra_scale_factor", config.muon_extra_scale_factor)
