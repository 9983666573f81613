"""The errors opttree raises. Every one derives from :class:`OptTreeError`."""

from __future__ import annotations


class OptTreeError(Exception):
    """Base of every error opttree raises on purpose."""


class NotAnOptimizer(OptTreeError):
    """An object in the tree is neither an optimizer nor a registered wrapper."""


class OptimizerCycle(OptTreeError):
    """A wrapper is reachable from itself."""


class UnsupportedOptimizer(OptTreeError):
    """A leaf optimizer's class has no state schema."""


class UnsupportedOptimizerState(OptTreeError):
    """A leaf holds state that its schema does not describe."""


class RegistrationError(OptTreeError):
    """A schema or wrapper registration is contradictory or repeated."""


class MalformedWrapper(OptTreeError):
    """A known wrapper class lacks the attributes its kind defines, or yields bad children."""


class UnmappedParameter(OptTreeError):
    """A parameter selected for a partial reset is held by no optimizer in the tree."""


class PartialResetRefused(OptTreeError):
    """A partial reset would split state that is shared, or names keys no optimizer has."""
