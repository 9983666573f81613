"""Reset: validate and plan the whole tree, then zero history in one batch."""

from __future__ import annotations

import logging

from opttree._nodes import Node
from opttree._problems import Severity
from opttree._report import ResetReport
from opttree._validate import ValidateVisitor

logger = logging.getLogger("opttree")


class ResetVisitor(ValidateVisitor):
    """Resets a tree atomically: if any leaf or key is unsupported, nothing changes."""

    def reset(self, root: Node) -> ResetReport:
        """Check the whole tree, then, only if no error was found, carry out the plan."""
        self.check(root)
        errors = [p for p in self.problems if p.severity is Severity.ERROR]
        if errors:
            self._forget_plan()  # the error's traceback holds this visitor: let the state go
            raise errors[0].to_error(others=len(errors) - 1)
        for warning in self.problems:
            logger.warning("%s", warning)
        report = self._plan.execute()
        logger.info("%s", report)
        return report
