"""Validation: every problem in a tree at once, gathered in the same pass that plans a reset."""

from __future__ import annotations

from opttree import _registry
from opttree._nodes import LeafNode, Node
from opttree._inspect import LeafInspector
from opttree._plan import ResetPlan
from opttree._problems import Problem, ProblemKind
from opttree._runs import alike_runs, sibling_groups
from opttree._selection import EVERYTHING, Selection
from opttree._visitor import TraverserVisitor


class ValidateVisitor(TraverserVisitor):
    """Checks each leaf against its schema, collecting ``problems`` and the reset ``plan``.

    A leaf reached a second time (``shared_with``) is checked once, at its first path.
    Runs of alike sibling leaves are planned in one pooled pass where that cannot change
    the outcome (:meth:`~opttree._inspect.LeafInspector.inspect_alike`), else leaf by leaf.
    """

    def __init__(self, selection: Selection = EVERYTHING) -> None:
        self.problems: list[Problem] = []
        self.plan = ResetPlan()
        self.selection = selection
        self.resettable: set[str] = set()
        self._inspectors: dict[type, LeafInspector | None] = {}

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

    def inspector_for(self, cls: type) -> LeafInspector | None:
        if cls in self._inspectors:
            return self._inspectors[cls]
        schema = _registry.schema_for(cls)
        inspector = None if schema is None else LeafInspector(schema, self.plan, self.problems, self.selection)
        if schema is not None and self.selection.keys is not None:
            self.resettable |= schema.resettable
        self._inspectors[cls] = inspector
        return inspector

    def visit_children(self, node: Node) -> None:
        for siblings in sibling_groups(node):
            self.visit_siblings(siblings)

    def visit_siblings(self, nodes: tuple[Node, ...]) -> None:
        for item in alike_runs(nodes):
            if isinstance(item, Node):
                item.accept(self)
                continue
            inspector = self.inspector_for(type(item[0].optimizer))
            if inspector is None or not inspector.inspect_alike(item):
                for leaf in item:
                    self.visit_leaf(leaf)

    def visit_leaf(self, node: LeafNode) -> None:
        if node.shared_with is not None:
            self.plan.shared_leaves += 1
            return
        cls = type(node.optimizer)
        inspector = self.inspector_for(cls)
        if inspector is None:
            self.problems.append(
                Problem(
                    ProblemKind.UNSUPPORTED_OPTIMIZER,
                    node.path,
                    cls.__qualname__,
                    f"no state schema is registered for {cls.__module__}.{cls.__qualname__}",
                )
            )
            return
        inspector.inspect(node)
