"""``opttree describe MODULE:FACTORY [--json]`` (or ``python -m opttree``): print a user's optimizer tree.

``FACTORY`` is a callable in ``MODULE`` that takes no arguments and returns an optimizer.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence

from opttree._api import describe, tree, validate
from opttree._describe import leaf_text
from opttree._nodes import ChainedNode, HybridNode, LeafNode, Node, WrapperNode
from opttree._version import __version__
from opttree._visitor import NodeVisitor

Json = dict[str, "str | list[Json] | None"]


class JsonVisitor(NodeVisitor[Json]):
    """The tree as plain JSON values: kind, class, path, children, and a leaf's summary."""

    def node(self, kind: str, node: Node, summary: str | None = None) -> Json:
        return {
            "kind": kind,
            "class": type(node.optimizer).__qualname__,
            "path": node.path,
            "summary": summary,
            "children": [child.accept(self) for child in node.children],
        }

    def visit_chained(self, node: ChainedNode) -> Json:
        return self.node("chained", node)

    def visit_hybrid(self, node: HybridNode) -> Json:
        return self.node("hybrid", node)

    def visit_wrapper(self, node: WrapperNode) -> Json:
        return self.node("wrapper", node)

    def visit_leaf(self, node: LeafNode) -> Json:
        if node.shared_with is not None:
            return self.node("leaf", node, f"shared with {node.shared_with}")
        return self.node("leaf", node, leaf_text(node.optimizer))


def load_factory(spec: str) -> Callable[[], object]:
    """The callable ``MODULE:FACTORY`` names, with the working directory importable, as
    ``python -m`` has it, so the console script finds the same modules."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        msg = f"expected MODULE:FACTORY, got {spec!r}"
        raise SystemExit(msg)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    factory: object = getattr(importlib.import_module(module_name), attribute, None)
    if not callable(factory):
        msg = f"{spec} is not a callable in {module_name}"
        raise SystemExit(msg)
    return factory


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="opttree", description=__doc__)
    parser.add_argument("--version", action="version", version=f"opttree {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    describe_cmd = commands.add_parser("describe", help="print the optimizer tree a factory returns")
    describe_cmd.add_argument("factory", help="MODULE:FACTORY, a callable returning an optimizer")
    describe_cmd.add_argument("--json", action="store_true", help="print the tree and problems as JSON")
    args = parser.parse_args(argv)
    spec: str = args.factory
    optimizer = load_factory(spec)()
    root = tree(optimizer)
    problems = validate(root)
    if args.json:
        payload = {"tree": root.accept(JsonVisitor()), "problems": [p.to_dict() for p in problems]}
        json.dump(payload, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(describe(root))
        for problem in problems:
            print(problem)
    return 0
