"""Reset: validate and plan the whole tree, then zero history in one batch."""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback

from opttree._eager import eager
from opttree._errors import OptTreeError
from opttree._nodes import Node
from opttree._problems import Severity
from opttree._report import ResetReport
from opttree._validate import ValidateVisitor

logger = logging.getLogger("opttree")


class ResetVisitor(ValidateVisitor):
    """Resets a tree atomically: if any leaf or key is unsupported, nothing changes."""

    _checked_root: Node | None = None
    """The tree :meth:`refusal` last passed, which :meth:`carry_out` checks again."""

    @eager
    def refusal(self, root: Node) -> OptTreeError | None:
        """:meth:`check` the whole tree: the error a reset of it raises, or None."""
        refused = super().refusal(root)
        self._checked_root = root if refused is None else None
        return refused

    @eager
    def reset(self, root: Node) -> ResetReport:
        """Check the whole tree, then, only if no error was found, carry out the plan."""
        refused = self.refusal(root)
        if refused is not None:
            raise refused
        return self._carry_out_passed()

    @eager
    def carry_out(self) -> ResetReport:
        """Carry out the reset of the tree :meth:`refusal` has just checked and found
        nothing wrong with, once, checked again first from the state as it is now: code
        that ran in between (a training step, a load, a weight swap) may have replaced,
        freed or shared the tensors the first check planned to write, and its plan would
        write where it must not, or nowhere. A refusal then is raised, changing nothing.
        Raises :class:`~opttree.OptTreeError`, changing nothing, for any other plan: one a
        walk by ``accept`` made or added to, without the tree-wide checks, or one already
        carried out."""
        self._require_passed()
        root = self._checked_root
        if root is None:  # passed by an internal check, which carries out at once
            return self._carry_out_passed()
        refused = self.refusal(root)
        if refused is not None:
            raise refused
        return self._carry_out_passed()

    def _require_passed(self) -> None:
        if not self._passed or any(p.severity is Severity.ERROR for p in self.problems):
            msg = (
                "carry_out carries out the plan of a tree that refusal() has just checked whole and found "
                "nothing wrong with, once: call reset(root), which does both"
            )
            raise OptTreeError(msg)

    def _carry_out_passed(self) -> ResetReport:
        """Carry out the plan a check has just passed, with nothing run in between."""
        self._require_passed()
        self._passed = False
        self._checked_root = None
        report = self._plan.execute()
        for warning in self.problems:
            _log(logging.WARNING, warning)
        _log(logging.INFO, report)
        return report


def _log(level: int, message: object) -> None:
    """Log through the ``opttree`` logger once a reset is done: a filter or handler of the
    caller's that raises must not turn a reset carried out into an error, which its caller
    would take for one that changed nothing. The error is printed as logging prints a
    handler's (where ``logging.raiseExceptions``, to standard error)."""
    try:
        logger.log(level, "%s", message)
    except Exception:  # noqa: BLE001  # the caller's filters may raise anything
        if logging.raiseExceptions and sys.stderr:
            with contextlib.suppress(Exception):  # a closed or failing stream: nothing left to tell
                sys.stderr.write("--- Logging error on the opttree logger, after the reset was carried out ---\n")
                traceback.print_exc(file=sys.stderr)
