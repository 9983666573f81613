"""Reset: validate and plan the whole tree, then zero history in one batch."""

from __future__ import annotations

import logging

from opttree import _plan_cache as plan_cache
from opttree._nodes import Node
from opttree._problems import Severity
from opttree._report import ResetReport
from opttree._validate import ValidateVisitor

logger = logging.getLogger("opttree")


class ResetVisitor(ValidateVisitor):
    """Resets a tree atomically: if any leaf or key is unsupported, nothing changes."""

    def reset(self, root: Node) -> ResetReport:
        """Check the whole tree, then, only if no error was found, carry out the plan.

        Plans of large leaves are kept for the next reset once this one has run, and only
        where nothing at all was found, warnings included.
        """
        self.check(root)
        errors = [p for p in self.problems if p.severity is Severity.ERROR]
        if errors:
            raise errors[0].to_error(others=len(errors) - 1)
        for warning in self.problems:
            logger.warning("%s", warning)
        report = self._plan.execute()
        if not self.problems:
            for planned in self._plan.to_store:
                plan_cache.store(planned)
        logger.info("%s", report)
        return report
