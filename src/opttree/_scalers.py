"""Loss scalers held by Megatron's mixed-precision wrappers, and what a reset does to them.

An fp16 ``Float16OptimizerWithFloat16Params`` or ``DistributedOptimizer`` holds a
``DynamicGradScaler`` (``grad_scaler``) whose scale backs off after overflows and grows
after ``loss_scale_window`` clean steps. A fresh optimizer's scaler starts at its
``OptimizerConfig.initial_loss_scale`` with both trackers at rest, so a reset that kept a
warmed-up scale would not train as a fresh optimizer does: a reset of the wrapper's steps
puts the scaler back to that start (``keep_loss_scale=True`` keeps it). Scalers are known
by class: a ``ConstantGradScaler`` has nothing to reset, and any other class is refused,
as is a known one running code of its own (a subclass's, a patch's, an instance's).
A ``DynamicGradScaler`` is reset only where it was built as Megatron's factory builds it,
from the wrapper's config: otherwise the scale it started from is not known. It keeps no
record of that scale, so one built by hand with the factory's settings but another
``initial_scale`` than its wrapper's config cannot be told apart, and is reset to the
config's: whoever built it so resets with ``keep_loss_scale=True`` and sets the scale."""

from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Callable

import torch
from attrs import frozen

from opttree._dispatch import LazyDispatch, dotted_name
from opttree._fields import kind_of
from opttree._held import own_attributes
from opttree._overrides import foreign_method, own_definition, own_instance_method
from opttree._numbers import real_number, shown_value
from opttree._preflight import unfillable_reason, writable_ranges


@frozen(eq=False)
class ScalerReset:
    """Puts one ``DynamicGradScaler`` back to its start: the scale tensor in place."""

    scaler: object
    scale: torch.Tensor
    initial: float
    hysteresis: numbers.Integral

    def apply(self) -> None:
        self.scale.fill_(self.initial)
        setattr(self.scaler, "_growth_tracker", 0)
        setattr(self.scaler, "_hysteresis_tracker", self.hysteresis)


SCALE = "_scale"
"""The attribute a ``DynamicGradScaler`` keeps its scale tensor in."""

Planned = ScalerReset | str | None
"""A scaler's reset, the reason it cannot be reset, or None where there is nothing to reset."""


def _nothing(scaler: object, config: object) -> Planned:
    return None


def _dynamic(scaler: object, config: object) -> Planned:
    mine, theirs = own_attributes(scaler), own_attributes(config)
    scale, min_scale = mine.get(SCALE), mine.get("min_scale")
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or not scale.is_floating_point():
        return f"its scale is {type(scale).__qualname__}, expected a one-element float tensor"
    unwritable = writable_ranges([scale])
    if isinstance(unwritable, tuple):
        return f"its scale tensor cannot be written in place: it is {unwritable[1]}"
    initial = real_number(theirs.get("initial_loss_scale"))  # None for an int beyond a float too
    if initial is None or not 0 < initial < math.inf:
        return "the wrapper's config has no positive, finite initial_loss_scale to start from"
    fault = unfillable_reason(initial, scale.dtype, scale.device)
    if fault is not None:
        return f"its scale tensor cannot hold the initial_loss_scale: {fault}"
    config, factory = "the wrapper's config says", "Megatron's factory builds it with"
    pairs = {
        "hysteresis": (mine.get("hysteresis"), theirs.get("hysteresis"), config),
        "growth_interval": (mine.get("growth_interval"), theirs.get("loss_scale_window"), config),
        "min_scale": (min_scale, theirs.get("min_loss_scale"), config),
        "growth_factor": (mine.get("growth_factor"), 2.0, factory),
        "backoff_factor": (mine.get("backoff_factor"), 0.5, factory),
    }
    for name, (value, expected, source) in pairs.items():
        if not _same(value, expected):
            return (
                f"its {name} is {shown_value(value)} and {source} {shown_value(expected)}: it was not built from the config "
                "as Megatron's factory builds it, so the scale it started from is not known"
            )
    hysteresis = mine["hysteresis"]
    if isinstance(hysteresis, bool) or not isinstance(hysteresis, numbers.Integral):
        return f"its hysteresis is {shown_value(hysteresis)} ({kind_of(hysteresis)}), where Megatron's factory gives it a whole number"
    constant = theirs.get("loss_scale")
    fixed = None if constant is None else real_number(constant)
    if constant is not None and fixed is None:
        return f"the wrapper's config's loss_scale is {kind_of(constant)}, where Megatron takes a number or None"
    if fixed:
        return "the wrapper's config asks for a constant loss scale"
    return ScalerReset(scaler, scale, initial, hysteresis)  # as the scaler holds it: a fresh one's tracker starts as it


def _same(held: object, configured: object) -> bool:
    """Whether a scaler's value is its config's, both read as numbers (anything else, a
    tensor of several elements among them, is not known to be): ``DynamicGradScaler``
    keeps ``min_scale`` in a one-element float32 tensor, which holds 1e-4 as
    9.99999975e-05, so a configured float is compared rounded to float32 as it was (by
    ``struct``: no tensor is made)."""
    value, number = real_number(held), real_number(configured)
    if value is None or number is None:
        return False
    if isinstance(held, torch.Tensor) and held.dtype is torch.float32 and math.isfinite(number) and abs(number) <= torch.finfo(torch.float32).max:
        number = struct.unpack("f", struct.pack("f", number))[0]
    return value == number


_SCALERS: LazyDispatch[Callable[[object, object], Planned]] = LazyDispatch()
_SCALERS.register_lazy("megatron.core.optimizer.grad_scaler.ConstantGradScaler", _nothing)
_SCALERS.register_lazy("megatron.core.optimizer.grad_scaler.DynamicGradScaler", _dynamic)

_HOLDERS: LazyDispatch[bool] = LazyDispatch()
_HOLDERS.register_lazy("megatron.core.optimizer.optimizer.MixedPrecisionOptimizer", True)
"""Wrapper kinds that keep a loss scaler in ``grad_scaler`` (``None`` where bf16 runs without one)."""


def held_scale(scaler: object) -> torch.Tensor | None:
    """The scale tensor a loss scaler holds (``_scale``), or None."""
    scale = own_attributes(scaler).get(SCALE)
    return scale if isinstance(scale, torch.Tensor) else None


def loss_scaler(wrapper: object) -> object | None:
    """The loss scaler a wrapper holds, or None."""
    if _HOLDERS.lookup(type(wrapper)) is None:
        return None
    return own_attributes(wrapper).get("grad_scaler")


def plan_scaler(wrapper: object) -> Planned:
    """What a reset does to ``wrapper``'s loss scaler (see :data:`Planned`)."""
    scaler = loss_scaler(wrapper)
    if scaler is None:
        return None
    cls = type(scaler)
    found = _SCALERS.lookup_owner(cls)
    if found is None:
        return f"its loss scaler is a {dotted_name(cls)}: only DynamicGradScaler and ConstantGradScaler are known"
    known, planner = found
    own_code = _own_code(scaler, known)
    if own_code is not None:
        return (
            f"its loss scaler {own_code}: it may count or keep what a reset of a {known.__qualname__} does not put back "
            "(reset with keep_loss_scale=True and put the scaler back yourself)"
        )
    return planner(scaler, own_attributes(wrapper).get("config"))


def _own_code(scaler: object, known: type) -> str | None:
    """Where a scaler runs code other than the class opttree knows, as leaves and wrappers
    are checked (see :mod:`opttree._overrides`): a subclass defining anything of its own, a
    method patched into the class from outside Megatron, or one set on the instance."""
    cls = type(scaler)
    name = own_definition(cls, known)
    if name is not None:
        return f"is a {dotted_name(cls)}, which defines {name} of its own over {dotted_name(known)}"
    patch = foreign_method(cls)
    if patch is not None:
        klass, name, file = patch
        return f"is a {dotted_name(cls)}, whose {dotted_name(klass)}.{name} runs code from {file}, outside Megatron"
    name = own_instance_method(scaler)
    if name is not None:
        return f"holds its own {name} on the instance, otherwise than its class {dotted_name(cls)}"
    return None


def scaler_text(wrapper: object) -> str:
    """`` loss_scale=... (Class)`` for ``describe``, or nothing; never raises."""
    scaler = loss_scaler(wrapper)
    if scaler is None:
        return ""
    value = real_number(own_attributes(scaler).get(SCALE))  # None for a freed, complex or nested scale, as validate reports it
    return f" loss_scale={'?' if value is None else f'{value:.8g}'} ({type(scaler).__name__})"
