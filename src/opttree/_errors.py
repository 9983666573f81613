"""The errors opttree raises. Every one derives from :class:`OptTreeError`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opttree._problems import Problem


class OptTreeError(Exception):
    """Base of every error opttree raises on purpose.

    ``problem`` is the finding behind the error, where it came from one: its kind, path,
    class and key, as :func:`opttree.validate` would report it. ``problems`` holds it and
    every other error the same check found: for a partial reset, ``prune`` or ``scale``
    too, whose checks of the selection ``validate`` does not make.
    """

    problem: Problem | None = None
    problems: tuple[Problem, ...] = ()


class NotAnOptimizer(OptTreeError):
    """An object in the tree is neither an optimizer nor a registered wrapper."""


class UnknownWrapper(NotAnOptimizer):
    """A Megatron optimizer class whose layout opttree does not know: register it."""


class OptimizerCycle(OptTreeError):
    """A wrapper is reachable from itself."""


class HiddenOptimizer(OptTreeError):
    """A wrapper holds an optimizer that the tree does not contain, so a reset would miss it."""


class UnsupportedOptimizer(OptTreeError):
    """A leaf optimizer's class has no state schema."""


class UnsupportedOptimizerState(OptTreeError):
    """A leaf holds state that its schema does not describe, or that cannot be reset in place."""


class ReleaseRefused(OptTreeError):
    """``reset(..., release=True)`` cannot delete this state and stay exact and checkpointable."""


class RegistrationError(OptTreeError):
    """A schema or wrapper registration is contradictory or repeated."""


class MalformedWrapper(OptTreeError):
    """A known wrapper class lacks the attributes its kind defines, or yields bad children;
    or a tree built by hand is not the one opttree builds for its optimizer."""


class UnmappedParameter(OptTreeError):
    """A parameter selected for a partial reset is held by no optimizer in the tree."""


class PartialResetRefused(OptTreeError):
    """A partial reset would split state that is shared, or names keys no optimizer has."""


class UnsupportedCheckpoint(OptTreeError):
    """A state dict is not laid out as Megatron's wrapper kinds write it, so opttree cannot
    tell where to put back the step Megatron drops at 0."""


class StaleMaster(OptTreeError):
    """A master copy does not stand for the model's weights, or cannot be told to."""
