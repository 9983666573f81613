"""``describe``: an indented, human-readable tree with runs of identical siblings collapsed.

HybridDeviceOptimizer with overlap builds one CPU optimizer per parameter, so a tree can
hold thousands of equal leaves. Each node is first summarised without its path; equal
neighbouring summaries print once, with a count and the range of their paths.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import torch
from attrs import field, frozen

from opttree import _paths
from opttree._nodes import ChainedNode, HybridNode, LeafNode, Node, WrapperNode
from opttree._plan import step_number
from opttree._report import format_bytes
from opttree._visitor import NodeVisitor


@frozen
class Summary:
    """A node's printed line and its children's summaries; equality ignores the path."""

    text: str
    children: tuple[Summary, ...]
    path: str = field(eq=False)


def _step_text(values: set[float]) -> str:
    if not values:
        return ""
    low, high = min(values), max(values)
    return f" step={low:g}" if low == high else f" step={low:g}..{high:g}"


def _placement(dtype: torch.dtype, device_index: int) -> str:
    device = "cpu" if device_index < 0 else f"cuda:{device_index}"
    return f"{str(dtype).removeprefix('torch.')}@{device}"


def leaf_text(optimizer: torch.optim.Optimizer) -> str:
    """One line for a leaf. Tensors are keyed by ``(dtype, get_device())``, which costs less
    than building a ``torch.device`` per tensor: HybridDeviceOptimizer has thousands of leaves."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    by_placement: defaultdict[tuple[torch.dtype, int], int] = defaultdict(int)
    steps: set[float] = set()
    for group in optimizer.param_groups:
        group_step = step_number(group.get("step"))
        if group_step is not None:
            steps.add(group_step)
    for entry in optimizer.state.values():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                by_placement[(value.dtype, value.get_device())] += value.nbytes
            if key == "step":
                number = step_number(value)
                if number is not None:
                    steps.add(number)
    elements = sum(p.numel() for p in params)
    total = sum(by_placement.values())
    detail = ", ".join(
        sorted(f"{_placement(dtype, index)} {format_bytes(n)}" for (dtype, index), n in by_placement.items())
    )
    state = f" state={format_bytes(total)} [{detail}]" if by_placement else " state=empty"
    return f"{type(optimizer).__qualname__} params={len(params)} ({elements:,} elements){state}{_step_text(steps)}"


class DescribeVisitor(NodeVisitor[Summary]):
    """Summarises each node; :meth:`render` turns the root's summary into text."""

    def summarise(self, node: Node, text: str) -> Summary:
        return Summary(text, tuple(child.accept(self) for child in node.children), node.path)

    def visit_chained(self, node: ChainedNode) -> Summary:
        return self.summarise(node, f"{type(node.optimizer).__qualname__} members={len(node.members)}")

    def visit_hybrid(self, node: HybridNode) -> Summary:
        gpu = "none" if node.gpu is None else "1"
        offload = getattr(node.optimizer, "offload_fraction", None)
        fraction = f" offload_fraction={offload:g}" if isinstance(offload, (int, float)) else ""
        return self.summarise(
            node, f"{type(node.optimizer).__qualname__} cpu_optimizers={len(node.cpu)} gpu_optimizer={gpu}{fraction}"
        )

    def visit_wrapper(self, node: WrapperNode) -> Summary:
        stub = " (stub: no optimizer on this rank)" if node.is_stub else ""
        return self.summarise(node, f"{type(node.optimizer).__qualname__}{stub}")

    def visit_leaf(self, node: LeafNode) -> Summary:
        if node.shared_with is not None:
            text = f"{type(node.optimizer).__qualname__} (shared with {_paths.display(node.shared_with)})"
        else:
            text = leaf_text(node.optimizer)
        return Summary(text, (), node.path)

    def render(self, root: Node) -> str:
        return "\n".join(_lines(root.accept(self), count=1, last_path=root.path, depth=0))


def _lines(summary: Summary, *, count: int, last_path: str, depth: int) -> Iterator[str]:
    indent = "  " * depth
    where = _paths.display(summary.path)
    if count > 1:
        yield f"{indent}{count} x {summary.text}  @ {where} .. {_paths.display(last_path)}"
    else:
        yield f"{indent}{summary.text}  @ {where}"
    for run in _runs(summary.children):
        first, n, last = run
        yield from _lines(first, count=n, last_path=last, depth=depth + 1)


def _runs(children: tuple[Summary, ...]) -> Iterator[tuple[Summary, int, str]]:
    """Consecutive equal summaries as (first, how many, path of the last)."""
    i = 0
    while i < len(children):
        j = i + 1
        while j < len(children) and children[j] == children[i]:
            j += 1
        yield children[i], j - i, children[j - 1].path
        i = j
