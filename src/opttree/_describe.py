"""``describe``: an indented, human-readable tree, bounded in length however many leaves.

HybridDeviceOptimizer with overlap builds one CPU optimizer per parameter, so a tree can
hold thousands of leaves. Up to :data:`DETAIL_LIMIT` alike sibling leaves are described
one by one; a longer run prints one line with its totals, computed in bulk. Equal
neighbouring summaries then print once, with a count and the range of their paths.
"""

from __future__ import annotations

import contextlib
import operator
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from itertools import chain
from typing import cast

import torch
from attrs import evolve, field, frozen

from opttree._eager import eager
from opttree._containers import malformed, pooled, tensors_held
from opttree._errors import OptTreeError
from opttree._fields import kind_of
from opttree._nodes import ChainedNode, HybridNode, LeafNode, Node, WrapperNode
from opttree._inspect import step_numbers
from opttree._preflight import plain_dispatch, plain_reads, plain_torch, ranges, torch_name
from opttree._report import format_bytes
from opttree._scalers import scaler_text
from opttree._runs import alike_runs, sibling_groups, visits_leaves_as
from opttree._problems import Problem, ProblemKind
from opttree._trees import lenient_tree
from opttree._visitor import NodeVisitor

DETAIL_LIMIT = 8
"""Runs of more alike sibling leaves than this are described by their totals."""

_PLACEMENT = operator.attrgetter("dtype", "device")
_NBYTES = operator.attrgetter("nbytes")


@frozen
class Summary:
    """Lines for ``count`` nodes, the first at ``path`` and the last at ``last_path``:
    one line, and the children's summaries. Equality ignores the paths."""

    text: str
    children: tuple[Summary, ...]
    path: str = field(eq=False)
    count: int = 1
    last_path: str = field(eq=False, default="")


def _bytes_by_placement(tensors: list[torch.Tensor]) -> dict[tuple[torch.dtype, torch.device], int]:
    """Bytes per dtype and device (``meta`` and ``npu:0`` as themselves); read at C speed
    where all share one placement, as they usually do. Tensors without a byte size
    (sparse ones) count their dense size."""
    placements = set(map(_PLACEMENT, tensors))
    if len(placements) == 1 and all(map(plain_dispatch, set(map(type, tensors)))):
        with contextlib.suppress(RuntimeError):
            return {placements.pop(): sum(map(_NBYTES, tensors))}
    totals: defaultdict[tuple[torch.dtype, torch.device], int] = defaultdict(int)
    for tensor in tensors:
        totals[(tensor.dtype, tensor.device)] += nbytes(tensor)
    return dict(totals)


def nbytes(tensor: torch.Tensor) -> int:
    """A tensor's bytes; a sparse one, which has no byte size, counts its indices and
    values, and a wrapper subclass the tensors it wraps (a DTensor's ``nbytes`` is its
    global size, the local shard what this rank holds), as a reset's report does."""
    if not plain_dispatch(type(tensor)):
        return ranges([tensor]).nbytes
    try:
        return tensor.nbytes
    except RuntimeError:
        return ranges([tensor]).nbytes


def _step_text(counters: list[object]) -> str:
    """The range of step counters (see :func:`step_numbers`), and how many are NaN."""
    numbers = [n for n in step_numbers(counters) if n is not None]
    real = [n for n in numbers if n == n]  # NaN is the one number unequal to itself
    nan = f" ({len(numbers) - len(real)} NaN)" if len(real) < len(numbers) else ""
    if not real:
        return " step=NaN" if numbers else ""
    low, high = min(real), max(real)
    return (f" step={low:g}" if low == high else f" step={low:g}..{high:g}") + nan


def leaves_text(optimizers: Sequence[torch.optim.Optimizer]) -> str:
    """Parameters, state bytes by placement and the step range of some leaves, together;
    malformed ones are counted and the first one's fault named."""
    with plain_reads():
        try:
            return _leaves_text(optimizers)
        except Exception as error:  # noqa: BLE001  # a tensor subclass's own code may raise anything
            return f"unreadable: {type(error).__name__}: {error}"


def _leaves_text(optimizers: Sequence[torch.optim.Optimizer]) -> str:
    found = pooled(optimizers)
    faults = ""
    if found is None:
        reasons = list(map(malformed, optimizers))
        bad = [reason for reason in reasons if reason is not None]
        if len(bad) == len(optimizers):
            return f"malformed: {bad[0]}" + (f" ({len(bad)} leaves)" if len(bad) > 1 else "")
        if bad:
            faults = f"; {len(bad)} of {len(optimizers)} leaves malformed, the first: {bad[0]}"
        sound = [optimizer for optimizer, reason in zip(optimizers, reasons, strict=True) if reason is None]
        groups = [group for optimizer in sound for group in optimizer.param_groups]
        params = [param for group in groups for param in group["params"]]
        entries = [entry for optimizer in sound for entry in optimizer.state.values()]
        values = [value for entry in entries for value in entry.values()]
    else:
        groups, params, _, _, entries = found
        values = list(chain.from_iterable(map(dict.values, found.entries)))
    tensors = tensors_held(values)
    counters: list[object] = [group["step"] for group in groups if group.get("step") is not None]
    counters += [entry["step"] for entry in entries if "step" in entry]
    by_placement = _bytes_by_placement(tensors) if tensors else {}
    detail = ", ".join(
        sorted(f"{torch_name(dtype)}@{device} {format_bytes(n)}" for (dtype, device), n in by_placement.items())
    )
    state = f" state={format_bytes(sum(by_placement.values()))} [{detail}]" if by_placement else " state=empty"
    elements = sum(map(torch.Tensor.numel, params))
    return f"params={len(params)} ({elements:,} elements){state}{_step_text(counters)}{faults}"


def leaf_text(optimizer: torch.optim.Optimizer) -> str:
    """One line for a leaf."""
    return f"{type(optimizer).__qualname__} {leaves_text([optimizer])}"


class DescribeVisitor(NodeVisitor[Summary]):
    """Summarises each node; :meth:`render` turns the root's summary into text.

    ``refused`` maps the paths of objects the adapter refused to the reason, which their
    line shows instead of their contents.
    """

    def __init__(self, refused: Mapping[str, str] | None = None) -> None:
        if refused is not None and not isinstance(cast(object, refused), Mapping):  # read only at render, where it raised
            msg = f"refused must be a mapping of paths to reasons, or None, got {kind_of(refused)}"
            raise OptTreeError(msg)
        self.refused: Mapping[str, str] = {} if refused is None else refused

    def summarise(self, node: Node, text: str) -> Summary:
        """``node``'s line, ``text``, over its children's summaries; a node of a tree built
        by hand nested deeper than a built one may stands refused, as :meth:`render` cuts it."""
        problem = self._too_deep(node)
        if problem is not None:
            return Summary(f"{type(node.optimizer).__qualname__} (refused: {problem.message})", (), node.path)
        with self._below():
            children = tuple(summary for siblings in sibling_groups(node) for summary in self.siblings(siblings))
        return Summary(text, children, node.path)

    def siblings(self, nodes: Sequence[Node]) -> tuple[Summary, ...]:
        """Summaries of sibling nodes; long runs of alike leaves as one line of their totals."""
        summaries: list[Summary] = []
        for item in alike_runs(nodes):
            if isinstance(item, Node):
                summaries.append(item.accept(self))
            elif len(item) <= DETAIL_LIMIT or not visits_leaves_as(self, DescribeVisitor):
                summaries.extend(leaf.accept(self) for leaf in item)
            else:
                cls = type(item[0].optimizer).__qualname__
                text = f"{cls}, in all: {leaves_text([leaf.optimizer for leaf in item])}"
                summaries.append(Summary(text, (), item[0].path, len(item), item[-1].path))
        return _collapsed(summaries)

    def visit_chained(self, node: ChainedNode) -> Summary:
        """A chained optimizer's line: its class and member count."""
        return self.summarise(node, f"{type(node.optimizer).__qualname__} members={len(node.members)}")

    def visit_hybrid(self, node: HybridNode) -> Summary:
        """A hybrid optimizer's line: its sub-optimizers and offload fraction."""
        gpu = "none" if node.gpu is None else "1"
        offload = getattr(node.optimizer, "offload_fraction", None)
        fraction = f" offload_fraction={offload:g}" if isinstance(offload, (int, float)) else ""
        text = f"{type(node.optimizer).__qualname__} cpu_optimizers={len(node.cpu)} gpu_optimizer={gpu}{fraction}"
        return self.summarise(node, text)

    def visit_wrapper(self, node: WrapperNode) -> Summary:
        """A wrapper's line: its class, loss scale, and whether it is a stub or refused."""
        refused = self.refused.get(node.path)
        if refused is not None:
            return Summary(f"{type(node.optimizer).__qualname__} (refused: {refused})", (), node.path)
        stub = " (stub: no optimizer on this rank)" if node.is_stub else "" if node.inner else " (holds no optimizer)"
        return self.summarise(node, f"{type(node.optimizer).__qualname__}{scaler_text(node.optimizer)}{stub}")

    def visit_leaf(self, node: LeafNode) -> Summary:
        """A leaf's line: parameters, state bytes by dtype and device, step."""
        if node.shared_with is not None:
            text = f"{type(node.optimizer).__qualname__} (shared with {node.shared_with})"
        else:
            text = leaf_text(node.optimizer)
        return Summary(text, (), node.path)

    @eager
    def render(self, root: Node) -> str:
        """The indented description of the tree under ``root``, as :func:`opttree.describe`
        gives it: objects the adapter refuses stand as lines saying why, a tree nested too
        deep is cut where a built one would be, and a tree built by hand that is not the one
        opttree builds for its root's optimizer is described as opttree builds it, a last
        line saying so."""
        return self._render_checked(*lenient_tree(root))

    def _render_checked(self, root: Node, problems: Sequence[Problem]) -> str:
        """:meth:`render` of a tree :func:`~opttree._trees.lenient_tree` gave, with the
        problems it found."""
        given = self.refused
        self.refused = {**given, **{p.path: p.message for p in problems if p.kind is not ProblemKind.FOREIGN_TREE}}
        try:
            text = self._render_built(root)
        finally:
            self.refused = given
        notes = [f"(described as opttree builds it: the tree passed in at {p.path} is not: {p.message})" for p in problems if p.kind is ProblemKind.FOREIGN_TREE]
        return "\n".join([text, *notes])

    def _render_built(self, root: Node) -> str:
        """:meth:`render`, for a tree opttree has just built, read as plain torch calls
        (see :func:`~opttree._preflight.plain_torch`)."""
        with plain_torch():
            return "\n".join(_lines(root.accept(self), depth=0))


def _collapsed(summaries: list[Summary]) -> tuple[Summary, ...]:
    """Consecutive equal single summaries merged into one with their count and last path.
    (A run's totals never merge: its neighbours are not leaves of its class.)"""
    merged: list[Summary] = []
    for summary in summaries:
        if merged and summary.count == 1 and merged[-1] == evolve(summary, count=merged[-1].count):
            merged[-1] = evolve(merged[-1], count=merged[-1].count + summary.count, last_path=summary.path)
        else:
            merged.append(summary)
    return tuple(merged)


def _lines(summary: Summary, *, depth: int) -> Iterator[str]:
    indent = "  " * depth
    where = summary.path
    if summary.count > 1:
        yield f"{indent}{summary.count} x {summary.text}  @ {where} .. {summary.last_path}"
    else:
        yield f"{indent}{summary.text}  @ {where}"
    for child in summary.children:
        yield from _lines(child, depth=depth + 1)
