"""What validation finds: typed problems, and the errors they become when a reset refuses."""

from __future__ import annotations

import enum

from attrs import evolve, field, frozen

from opttree import _paths
from opttree._errors import OptTreeError, PartialResetRefused, UnsupportedOptimizer, UnsupportedOptimizerState


class Severity(enum.Enum):
    ERROR = "error"
    """A reset would be wrong; :func:`opttree.reset` refuses."""
    WARNING = "warning"
    """Suspicious but resettable, such as state that looks silently empty."""


class ProblemKind(enum.Enum):
    UNSUPPORTED_OPTIMIZER = "unsupported-optimizer"
    UNSUPPORTED_STATE = "unsupported-state"
    EMPTY_STATE = "empty-state"
    ORPHAN_STATE = "orphan-state"
    SHAPE_MISMATCH = "shape-mismatch"
    PARTIAL_GROUP = "partial-group"
    UNKNOWN_KEY = "unknown-key"

    @property
    def severity(self) -> Severity:
        if self in (ProblemKind.EMPTY_STATE, ProblemKind.ORPHAN_STATE, ProblemKind.SHAPE_MISMATCH):
            return Severity.WARNING
        return Severity.ERROR


@frozen
class Problem:
    """One finding at one node: its kind, tree path, optimizer class and state key; ``rank``
    is set on problems gathered from a process group."""

    kind: ProblemKind
    path: str
    cls: str
    message: str
    key: str | None = None
    rank: int | None = field(default=None, kw_only=True)

    @property
    def severity(self) -> Severity:
        return self.kind.severity

    def __str__(self) -> str:
        key = "" if self.key is None else f" key {self.key!r}:"
        rank = "" if self.rank is None else f"rank {self.rank}: "
        return f"{rank}{self.severity.value}: {self.cls} at {_paths.display(self.path)}:{key} {self.message}"

    def on_rank(self, rank: int) -> Problem:
        return evolve(self, rank=rank)

    def to_error(self, *, others: int = 0) -> OptTreeError:
        """The error a refused reset raises; ``others`` counts further errors found."""
        message = str(self) if not others else f"{self} (and {others} more: see opttree.validate)"
        if self.kind is ProblemKind.UNSUPPORTED_OPTIMIZER:
            return UnsupportedOptimizer(message)
        if self.kind in (ProblemKind.PARTIAL_GROUP, ProblemKind.UNKNOWN_KEY):
            return PartialResetRefused(message)
        return UnsupportedOptimizerState(message)
