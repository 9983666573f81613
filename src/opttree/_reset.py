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

    def refusal(self, root: Node) -> OptTreeError | None:
        """Check the whole tree and plan its reset: the error a reset raises, or None."""
        self.check(root)
        errors = [p for p in self.problems if p.severity is Severity.ERROR]
        if errors:
            self._forget_plan()  # the error's traceback holds this visitor: let the state go
            return errors[0].to_error(others=len(errors) - 1)
        return None

    def carry_out(self) -> ResetReport:
        """Carry out the plan :meth:`refusal` made and found nothing wrong with."""
        for warning in self.problems:
            logger.warning("%s", warning)
        report = self._plan.execute()
        logger.info("%s", report)
        return report
