"""Reset: validate and plan the whole tree, then zero history in one batch."""

from __future__ import annotations

import logging

from opttree._errors import OptTreeError
from opttree._nodes import Node
from opttree._problems import Severity
from opttree._report import ResetReport
from opttree._validate import ValidateVisitor

logger = logging.getLogger("opttree")


class ResetVisitor(ValidateVisitor):
    """Resets a tree atomically: if any leaf or key is unsupported, nothing changes."""

    def reset(self, root: Node) -> ResetReport:
        """Check the whole tree, then, only if no error was found, carry out the plan."""
        refused = self.refusal(root)
        if refused is not None:
            raise refused
        return self.carry_out()

    def carry_out(self) -> ResetReport:
        """Carry out the plan :meth:`refusal` made and found nothing wrong with, once.
        Raises :class:`~opttree.OptTreeError`, changing nothing, for any other plan: one a
        walk by ``accept`` made or added to, without the tree-wide checks, or one already
        carried out."""
        if not self._passed or any(p.severity is Severity.ERROR for p in self.problems):
            msg = (
                "carry_out carries out the plan of a tree that refusal() has just checked whole and found "
                "nothing wrong with, once: call reset(root), which does both"
            )
            raise OptTreeError(msg)
        self._passed = False
        for warning in self.problems:
            logger.warning("%s", warning)
        report = self._plan.execute()
        logger.info("%s", report)
        return report
