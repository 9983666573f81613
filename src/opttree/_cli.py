"""``opttree describe MODULE:FACTORY [--json]`` (or ``python -m opttree``): print a user's
optimizer tree and its problems; ``opttree validate MODULE:FACTORY [--json]``: print the
problems only, exiting 1 if any is an error.

``FACTORY`` is a callable in ``MODULE`` that takes no arguments and returns an optimizer.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TextIO, cast

from opttree._api import describe, validate
from opttree._trees import lenient_tree
from opttree._describe import leaf_text
from opttree._nodes import ChainedNode, HybridNode, LeafNode, Node, WrapperNode
from opttree._paths import ROOT
from opttree._problems import Problem, ProblemKind, Severity
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
    try:
        module = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # a module that exits at import validated nothing; any other of its own classes too
        msg = f"importing {module_name} raised {_raised(error)}"
        raise SystemExit(msg) from error
    try:
        factory: object = getattr(module, attribute, None)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # a module's __getattr__ may raise anything, not only AttributeError; any other of its own classes too
        msg = f"getting {attribute} from {module_name} raised {_raised(error)}"
        raise SystemExit(msg) from error
    if not callable(factory):
        msg = f"{spec} is not a callable in {module_name}"
        raise SystemExit(msg)
    return factory


def call_factory(spec: str) -> object:
    """What the factory ``spec`` names returns; one line, not a traceback, where it fails."""
    factory = load_factory(spec)
    try:
        return factory()
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # sys.exit(0) in the factory must not pass as validated; any other of its own classes too
        msg = f"{spec}() raised {_raised(error)}"
        raise SystemExit(msg) from error


def _raised(error: BaseException) -> str:
    """What the factory raised, in one line: its own ``__str__`` or ``__repr__`` may raise too."""
    try:
        if isinstance(error, SystemExit):
            return f"SystemExit({error.code!r}) before returning an optimizer"
        return f"{type(error).__name__}: {error}"
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001  # a message that cannot be made (or that exits) is named by its class
        return f"{type(error).__name__} (whose message cannot be printed)"


@contextlib.contextmanager
def exits_refused(command: str, spec: str) -> Iterator[None]:
    """A ``sys.exit`` in a function opttree calls while it checks (a registered
    ``children`` or ``fill``: opttree reports what they raise, but lets an exit through,
    as Python code expects) ends the command with status 1: ``sys.exit(0)`` there would
    pass as a clean validation of what was never checked."""
    try:
        yield
    except SystemExit as error:
        msg = f"opttree {command}: a function called while checking {spec}() (a registered one?) raised SystemExit({error.code!r}): nothing was checked"
        raise SystemExit(msg) from error


def refuse_non_optimizer(spec: str, problems: Sequence[Problem]) -> None:
    """Exit where the factory returned no optimizer at all: there is no tree to describe."""
    for problem in problems:
        if problem.kind is ProblemKind.NOT_AN_OPTIMIZER and problem.path == ROOT:
            msg = f"{spec}() returned a {problem.cls}, {problem.message}"
            raise SystemExit(msg)


def _stdout_or_none() -> TextIO | None:
    """``sys.stdout``, which Python sets to None where file descriptor 1 is closed at launch
    (``>&-``), as a factory may."""
    return cast("TextIO | None", sys.stdout)


def _stdout() -> TextIO:
    out = _stdout_or_none()
    if out is None:
        raise OSError("it is closed")
    return out


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send to stderr what is written to stdout meanwhile, through ``sys.stdout`` and below
    it (a subprocess, ``os.write(1, ...)``, C code) where stdout is a file descriptor."""
    if _stdout_or_none() is not None:
        sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1: what Python prints is all there is to send
        saved = None
    try:
        if saved is not None:
            os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def parser() -> argparse.ArgumentParser:
    help_text = (__doc__ or "").replace("``", "")  # the docstring's literals, without their reST quotes
    parser = argparse.ArgumentParser(prog="opttree", description=help_text, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"opttree {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for command, text in (
        ("describe", "print the optimizer tree a factory returns, and its problems"),
        ("validate", "print the problems of the optimizer tree a factory returns; exit 1 if any is an error"),
    ):
        sub = commands.add_parser(command, help=text)
        sub.add_argument("factory", help="MODULE:FACTORY, a callable returning an optimizer")
        sub.add_argument("--json", action="store_true", help="print the problems (and for describe, the tree) as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    spec: str = args.factory
    describing = args.command == "describe"
    # With --json, what the module, the factory and registered functions print goes to stderr: stdout is the JSON alone.
    with stdout_to_stderr() if args.json else contextlib.nullcontext():
        optimizer = call_factory(spec)
        with exits_refused(args.command, spec):
            problems = validate(optimizer)
        refuse_non_optimizer(spec, problems)
        with exits_refused(args.command, spec):
            payload: dict[str, object] = {"problems": [p.to_dict() for p in problems]}
            if args.json and describing:
                payload = {"tree": lenient_tree(optimizer)[0].accept(JsonVisitor()), **payload}
            lines = [json.dumps(payload, indent=2)] if args.json else [*([describe(optimizer)] if describing else []), *map(str, problems)]
    try:
        if lines:  # a validation with nothing to say writes nothing, to a closed stdout too
            out = _stdout()
            out.write("".join(line + "\n" for line in lines))
            out.flush()
    except (OSError, ValueError) as error:  # a factory that closed sys.stdout, a closed pipe
        raise SystemExit(f"opttree {args.command}: cannot write to stdout: {error}") from error
    errors = any(p.severity is Severity.ERROR for p in problems)
    return 1 if errors and not describing else 0
