"""What validation finds: typed problems, and the errors they become when a reset refuses."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from attrs import evolve, field, frozen

from opttree._errors import (
    HiddenOptimizer,
    MalformedWrapper,
    NotAnOptimizer,
    OptimizerCycle,
    OptTreeError,
    PartialResetRefused,
    ReleaseRefused,
    StaleMaster,
    UnknownWrapper,
    UnsupportedCheckpoint,
    UnsupportedOptimizer,
    UnsupportedOptimizerState,
)
from opttree._fields import kind_of, of


class Severity(enum.Enum):
    """How serious a problem is."""

    ERROR = "error"
    """A reset would be wrong; :func:`opttree.reset` refuses."""
    WARNING = "warning"
    """Suspicious but resettable, such as state that looks silently empty."""


class ProblemKind(enum.Enum):
    """What kind of problem validation found; each maps to a severity and to the error a
    refused reset raises."""

    NOT_AN_OPTIMIZER = "not-an-optimizer"
    """An object in the stack is neither an optimizer nor a known wrapper."""
    UNKNOWN_WRAPPER = "unknown-wrapper"
    """A Megatron optimizer class that is not a known kind and not registered."""
    OPTIMIZER_CYCLE = "optimizer-cycle"
    MALFORMED_WRAPPER = "malformed-wrapper"
    HIDDEN_OPTIMIZER = "hidden-optimizer"
    """A wrapper holds an optimizer, in an attribute, that the tree does not contain."""
    UNSUPPORTED_OPTIMIZER = "unsupported-optimizer"
    UNSUPPORTED_STATE = "unsupported-state"
    MALFORMED_STATE = "malformed-state"
    """``state`` or ``param_groups`` are not the containers torch optimizers hold."""
    UNWRITABLE_STATE = "unwritable-state"
    """History that cannot be zeroed in place: inference, quantized, sparse or meta
    tensors, freed storage, tensor subclasses."""
    ALIASED_STATE = "aliased-state"
    """History sharing memory with other state or a parameter: zeroing it would zero those."""
    SHARED_STEP = "shared-step"
    """One step tensor counts the steps of several parameters."""
    UNEQUAL_STEPS = "unequal-steps"
    """The steps a Megatron wrapper saves as one differ: its checkpoint fails until a
    reset (or a partial one naming ``"step"`` for all of them) sets them equal. Under
    ``validate(group=)``, also its steps or loss scale differing between ranks."""
    EMPTY_STATE = "empty-state"
    ORPHAN_STATE = "orphan-state"
    SHAPE_MISMATCH = "shape-mismatch"
    PARTIAL_GROUP = "partial-group"
    PARTIAL_STEP = "partial-step"
    """A partial reset of step counters inside one Megatron optimizer, which checkpoints
    one step for all its parameters."""
    PARTIAL_LOSS_SCALE = "partial-loss-scale"
    """A reset of some of a Megatron stack's fp16 loss scalers and not the others: the
    stack scales its loss by one of them, and each wrapper unscales by its own."""
    UNKNOWN_KEY = "unknown-key"
    DETACHED_SHARD = "detached-shard"
    """A shard of a model parameter that a Megatron wrapper steps in place, no longer a view
    of the model's weights, or a model weight no longer in the buffer the wrapper's step
    writes it through: its steps no longer reach the model."""
    STALE_MASTER = "stale-master"
    """A master copy a wrapper steps differs from the model parameter it stands for."""
    UNCHECKED_MASTER = "unchecked-master"
    """A master copy whose part of its model parameter is not known."""
    UNRELEASABLE_STATE = "unreleasable-state"
    """State that ``reset(..., release=True)`` cannot delete: not rebuilt by its optimizer,
    kept state in its entries, captured addresses, or a Megatron wrapper above it."""
    FOREIGN_TREE = "foreign-tree"
    """A tree built by hand that is not the one opttree builds for its optimizer."""
    WITHOUT_ITS_WRAPPER = "without-its-wrapper"
    """An optimizer Megatron's factory built (its param groups hold the factory's
    ``is_expert_parallel``, ``max_lr`` and ``min_lr``), or a Megatron stub, reached without the chain the factory
    built it under (passed alone, as a node built by hand, or held by a user's wrapper),
    whose wrappers a reset of it cannot see: it would keep an fp16 wrapper's loss scale,
    split the steps a wrapper saves as one, or empty a state the wrapper checkpoints."""
    CHECKPOINT_LAYOUT = "checkpoint-layout"
    """A state dict that is not laid out as Megatron writes it, met while saving or loading."""
    UNCHANGEABLE_HISTORY = "unchangeable-history"
    """History ``prune`` or ``scale`` cannot change in place as asked: not zero at the start
    (its schema drops, fills, scales or starts it as an identity), of a dtype they do not
    change, or, for ``scale``, not finite after it. Met by those two only."""

    @property
    def severity(self) -> Severity:
        return Severity.WARNING if self in _WARNINGS else Severity.ERROR

    @property
    def error(self) -> type[OptTreeError]:
        """The error a reset raises when it refuses for a problem of this kind."""
        return _ERRORS.get(self, UnsupportedOptimizerState)


_WARNINGS = frozenset(
    {
        ProblemKind.EMPTY_STATE,
        ProblemKind.ORPHAN_STATE,
        ProblemKind.SHAPE_MISMATCH,
        ProblemKind.SHARED_STEP,
        ProblemKind.UNEQUAL_STEPS,
        ProblemKind.UNCHECKED_MASTER,
    }
)
_ERRORS: dict[ProblemKind, type[OptTreeError]] = {
    ProblemKind.NOT_AN_OPTIMIZER: NotAnOptimizer,
    ProblemKind.UNKNOWN_WRAPPER: UnknownWrapper,
    ProblemKind.OPTIMIZER_CYCLE: OptimizerCycle,
    ProblemKind.MALFORMED_WRAPPER: MalformedWrapper,
    ProblemKind.DETACHED_SHARD: MalformedWrapper,
    ProblemKind.FOREIGN_TREE: MalformedWrapper,
    ProblemKind.HIDDEN_OPTIMIZER: HiddenOptimizer,
    ProblemKind.UNSUPPORTED_OPTIMIZER: UnsupportedOptimizer,
    ProblemKind.WITHOUT_ITS_WRAPPER: UnsupportedOptimizer,
    ProblemKind.PARTIAL_GROUP: PartialResetRefused,
    ProblemKind.PARTIAL_STEP: PartialResetRefused,
    ProblemKind.PARTIAL_LOSS_SCALE: PartialResetRefused,
    ProblemKind.UNKNOWN_KEY: PartialResetRefused,
    ProblemKind.UNCHANGEABLE_HISTORY: PartialResetRefused,
    ProblemKind.CHECKPOINT_LAYOUT: UnsupportedCheckpoint,
    ProblemKind.UNRELEASABLE_STATE: ReleaseRefused,
    ProblemKind.STALE_MASTER: StaleMaster,
    ProblemKind.UNCHECKED_MASTER: StaleMaster,
}


@frozen
class Problem:
    """One finding at one node: its kind, tree path, optimizer class and state key; ``rank``
    is set on problems gathered from a process group."""

    kind: ProblemKind = field(validator=of(ProblemKind))
    path: str = field(validator=of(str))
    cls: str = field(validator=of(str))
    message: str = field(validator=of(str))
    key: str | None = field(default=None, validator=of(str, optional=True))
    rank: int | None = field(default=None, kw_only=True, validator=of(int, optional=True))

    @property
    def severity(self) -> Severity:
        return self.kind.severity

    def __str__(self) -> str:
        key = "" if self.key is None else f" key {self.key!r}:"
        rank = "" if self.rank is None else f"rank {self.rank}: "
        return f"{rank}{self.severity.value}: {self.cls} at {self.path}:{key} {self.message}"

    def to_dict(self) -> dict[str, str | int | None]:
        """The problem as plain JSON values."""
        return {
            "kind": self.kind.value,
            "severity": self.severity.value,
            "path": self.path,
            "class": self.cls,
            "key": self.key,
            "message": self.message,
            "rank": self.rank,
        }

    def on_rank(self, rank: int) -> Problem:
        """The same problem, found on ``rank`` of a process group."""
        return evolve(self, rank=rank)

    def to_error(self, *, others: Sequence[Problem] = ()) -> OptTreeError:
        """The error a refused operation raises; ``others`` are the further errors found,
        which the error carries in ``problems`` after this one."""
        given: object = others
        if not isinstance(given, (list, tuple)) or not all(isinstance(problem, Problem) for problem in given):
            msg = f"to_error takes others as a sequence of problems, got {kind_of(given)}"
            raise OptTreeError(msg)
        message = str(self) if not others else f"{self} (and {len(others)} more: see the error's problems)"
        error = self.kind.error(message)
        error.problem = self
        error.problems = (self, *others)
        return error


MAX_DEPTH = 64
"""Deeper stacks are refused: no real optimizer nests this far, and a clear error beats
a ``RecursionError`` from a pathological one."""


def too_deep(obj: object, path: str) -> Problem:
    """The problem of a wrapper nested :data:`MAX_DEPTH` deep that holds more."""
    return Problem(ProblemKind.OPTIMIZER_CYCLE, path, type(obj).__qualname__, f"the stack is nested deeper than {MAX_DEPTH}")
