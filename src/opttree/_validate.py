"""Validation: every problem in a tree at once, gathered in the same pass that plans a reset."""

from __future__ import annotations

from opttree import _registry
from opttree._nodes import LeafNode, Node
from opttree._plan import LeafInspector, ResetPlan
from opttree._problems import Problem, ProblemKind
from opttree._schema import StateSchema
from opttree._selection import EVERYTHING, Selection
from opttree._visitor import TraverserVisitor


class ValidateVisitor(TraverserVisitor):
    """Checks each leaf against its schema, collecting ``problems`` and the reset ``plan``.

    A leaf reached a second time (``shared_with``) is checked once, at its first path.
    """

    def __init__(self, selection: Selection = EVERYTHING) -> None:
        self.problems: list[Problem] = []
        self.plan = ResetPlan()
        self.selection = selection
        self.resettable: set[str] = set()
        self._schemas: dict[type, StateSchema | None] = {}

    def check_keys(self, root: Node) -> None:
        """Keys named for a partial reset must be history in at least one leaf."""
        unknown = sorted((self.selection.keys or frozenset()) - self.resettable)
        if unknown:
            known = ", ".join(sorted(self.resettable)) or "none"
            self.problems.append(
                Problem(
                    ProblemKind.UNKNOWN_KEY,
                    root.path,
                    type(root.optimizer).__qualname__,
                    f"no optimizer in the tree has history {unknown} (resettable here: {known})",
                )
            )

    def visit_leaf(self, node: LeafNode) -> None:
        if node.shared_with is not None:
            self.plan.shared_leaves += 1
            return
        cls = type(node.optimizer)
        if cls in self._schemas:
            schema = self._schemas[cls]
        else:
            schema = self._schemas[cls] = _registry.schema_for(cls)
        if schema is None:
            self.problems.append(
                Problem(
                    ProblemKind.UNSUPPORTED_OPTIMIZER,
                    node.path,
                    cls.__qualname__,
                    f"no state schema is registered for {cls.__module__}.{cls.__qualname__}",
                )
            )
            return
        if self.selection.keys is not None:
            self.resettable |= schema.resettable
        LeafInspector(node, schema, self.plan, self.problems, self.selection).inspect()
