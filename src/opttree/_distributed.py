"""Per-rank summaries gathered to rank 0 of a process group, for ``describe`` and ``validate``.

Megatron runs one optimizer per rank, and ranks can hold different trees (a rank without
parameters holds a stub optimizer). Every rank sends a small summary of its own tree with
``torch.distributed.gather_object``; rank 0 of the group compares them.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import groupby
from typing import TypeVar

import torch
import torch.distributed as dist
from attrs import frozen

from opttree import _errors, _paths
from opttree._containers import malformed
from opttree._describe import nbytes
from opttree._errors import OptTreeError
from opttree._nodes import ChainedNode, HybridNode, LeafNode, Node, WrapperNode, tree_nodes
from opttree._numbers import real_number
from opttree._problems import Problem, ProblemKind
from opttree._report import format_bytes
from opttree._scalers import held_scale, loss_scaler
from opttree._selection import STEP_UNITS, Selection, tree_params
from opttree._validate import unit_steps
from opttree._visitor import NodeVisitor, TraverserVisitor
from opttree._fields import kind_of


_Planned = TypeVar("_Planned")


class ShapeVisitor(NodeVisitor[str]):
    """A tree's shape as one line of class names, such as ``ChainedOptimizer[FP32Optimizer[AdamW]]``.

    Equal neighbouring shapes are written once with their count, ``AdamW*10000``, so a
    HybridDeviceOptimizer's one leaf per parameter keeps the line short.
    """

    def inner(self, node: Node) -> str:
        name = type(node.optimizer).__qualname__
        if not node.children:
            return name
        runs = groupby(child.accept(self) for child in node.children)
        return name + "[" + ",".join(_counted(shape, sum(1 for _ in run)) for shape, run in runs) + "]"

    def visit_chained(self, node: ChainedNode) -> str:
        return self.inner(node)

    def visit_hybrid(self, node: HybridNode) -> str:
        return self.inner(node)

    def visit_wrapper(self, node: WrapperNode) -> str:
        return self.inner(node)

    def visit_leaf(self, node: LeafNode) -> str:
        return self.inner(node)


def _counted(shape: str, count: int) -> str:
    return shape if count == 1 else f"{shape}*{count}"


class _StateBytes(TraverserVisitor):
    def __init__(self) -> None:
        self.total = 0

    def visit_leaf(self, node: LeafNode) -> None:
        if node.shared_with is None and malformed(node.optimizer) is None:
            try:
                self.total += sum(
                    nbytes(v) for entry in node.optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)
                )
            except Exception:  # noqa: BLE001  # an entry whose own reads raise: validate reports it; this rank must still join the gather
                return


Saved = tuple[str, str, tuple[float, ...], float | None]
"""A Megatron wrapper that saves one step for all its parameters: its path, its class, the
distinct steps its leaves count, and its loss scale (None where it has no scaler)."""


@frozen
class RankSummary:
    """What one rank reports about its own tree."""

    rank: int
    shape: str
    state_bytes: int
    problems: tuple[Problem, ...] = ()
    saved: tuple[Saved, ...] = ()


def summarise(root: Node, problems: tuple[Problem, ...] = ()) -> RankSummary:
    state_bytes = _StateBytes()
    root.accept(state_bytes)
    return RankSummary(dist.get_rank(), root.accept(ShapeVisitor()), state_bytes.total, problems, _saved_once(root))


def _saved_once(root: Node) -> tuple[Saved, ...]:
    """What each wrapper saving one step for all its parameters (a DistributedOptimizer)
    saves once: every rank of a run steps alike and, fp16, backs off alike, so the ranks
    hold the same. A wrapper stepping no parameter on this rank (a stub, a rank holding no
    shard) counts no step and saves none of its own: it is left out. Never raises: a leaf
    whose state cannot be read counts no step."""
    found: list[Saved] = []
    for node in tree_nodes(root):
        if STEP_UNITS.lookup(type(node.optimizer)) is None:
            continue
        try:
            if not tree_params(node):
                continue
            steps = tuple(sorted(unit_steps(node)))
            scaler = loss_scaler(node.optimizer)
            scale = None if scaler is None else real_number(held_scale(scaler))
        except Exception:  # noqa: BLE001  # a wrapper's own containers may raise anything; validate reports them
            continue
        found.append((node.path, type(node.optimizer).__qualname__, steps, scale))
    return tuple(found)


def saved_problems(summaries: list[RankSummary]) -> list[Problem]:
    """A warning for every wrapper whose steps or loss scale, saved once for all ranks,
    differ from group rank 0's: their checkpoints disagree, and a sharded load gives every
    rank the same (a hand-written reset on some ranks; opttree refuses arguments that
    differ between ranks under ``group=``)."""
    reference = summaries[0]
    theirs = {(path, cls): (steps, scale) for path, cls, steps, scale in reference.saved}
    problems = []
    for summary in summaries[1:]:
        for path, cls, steps, scale in summary.saved:
            other = theirs.get((path, cls))
            if other is None or other == (steps, scale):
                continue
            message = (
                f"what it saves once for all ranks ({_saved_text(steps, scale)}) differs from rank {reference.rank}'s "
                f"({_saved_text(*other)}): their checkpoints disagree, and a load gives every rank the same"
            )
            problems.append(Problem(ProblemKind.UNEQUAL_STEPS, path, cls, message, "step", rank=summary.rank))
    return problems


def _saved_text(steps: tuple[float, ...], scale: float | None) -> str:
    counted = "no step" if not steps else f"step {steps[0]:.8g}" if len(steps) == 1 else f"steps {steps[0]:.8g} to {steps[-1]:.8g}"
    return counted if scale is None else f"{counted}, loss scale {scale:.8g}"


def _check_group(group: object) -> None:
    """A process group this rank can take part in a collective of, or an error saying why not."""
    if not isinstance(group, dist.ProcessGroup) or not dist.is_initialized():
        raise OptTreeError(f"group must be a process group of an initialised torch.distributed, got {kind_of(group)}")
    try:
        rank = dist.get_rank(group)
    except Exception as error:  # noqa: BLE001  # torch's own reasons (a destroyed group is no longer registered)
        raise OptTreeError(f"group cannot be used: {type(error).__name__}: {error}") from error
    if rank < 0:
        raise OptTreeError("group does not hold this rank: call with a group every calling rank belongs to")


Asked = dict[str, object]
"""What a rank was asked to change, by argument (see :func:`asked`)."""

_PER_TREE = frozenset({"keys"})
"""What ranks holding different trees may be asked apart: history keys name each rank's
own optimizers, and pipeline stages may hold different ones (AdamW on one, SGD on another)."""


def asked(call: str, root: Node, selection: Selection, **options: object) -> Asked:
    """What ``call`` changes on this rank, as the ranks of a collective call compare it:
    one rank resetting what another keeps (a step, a loss scale that a DistributedOptimizer
    saves once for all of them, a shard of a parameter's history) would leave them apart."""
    return {
        "call": call,
        "params": "all" if selection.tensors is None else "selected",
        "keys": None if selection.keys is None else sorted(selection.keys),
        "'step' in keys": selection.steps,
        "release": selection.release,
        **options,
        "tree": root.accept(ShapeVisitor()),
    }


def agree(group: dist.ProcessGroup, refused: OptTreeError | None, request: Asked | None = None) -> OptTreeError | None:
    """Collective: this rank's refusal, or, where it has none, the first other rank's, so
    that every rank of ``group`` refuses or goes ahead alike (a check can pass on one
    rank's shards and fail on another's); where none refuses, a refusal if the ranks were
    asked different things (``request``, this rank's)."""
    _check_group(group)
    found = None if refused is None else (type(refused).__name__, str(refused), refused.problem)
    gathered: list[tuple[tuple[str, str, Problem | None] | None, Asked | None]] = [(None, None)] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (found, request), group=group)
    if refused is not None:
        return refused
    for index, (item, _) in enumerate(gathered):
        if item is not None:
            name, text, problem = item
            rank = dist.get_global_rank(group, index)
            if problem is not None:
                return problem.on_rank(rank).to_error()
            cls = vars(_errors).get(name)
            kind = cls if isinstance(cls, type) and issubclass(cls, OptTreeError) else OptTreeError
            return kind(f"rank {rank}: {text}")
    return _unlike(group, [other for _, other in gathered])


def _unlike(group: dist.ProcessGroup, requests: list[Asked | None]) -> OptTreeError | None:
    """A refusal where the ranks were asked different things (each compared with group
    rank 0), the same on every rank, or None."""
    first = requests[0]
    for index, other in enumerate(requests):
        if first is None or other is None:
            continue
        name = _differing(first, other)
        if name is None:
            continue
        ranks = (dist.get_global_rank(group, 0), dist.get_global_rank(group, index))
        msg = (
            f"the ranks were given different arguments: {name} is {first.get(name)!r} on rank {ranks[0]} and "
            f"{other.get(name)!r} on rank {ranks[1]}; a collective call takes the same on every rank (what one rank "
            "resets and another keeps, a step or loss scale a DistributedOptimizer saves once for all of them, would "
            "leave them apart)"
        )
        return OptTreeError(msg)
    return None


def _differing(first: Asked, other: Asked) -> str | None:
    """The first argument ``other`` was given otherwise than ``first``, or None; history
    keys are compared only between ranks holding alike trees (see :data:`_PER_TREE`)."""
    alike_trees = first.get("tree") == other.get("tree")
    names = [*first, *(name for name in other if name not in first)]
    return next(
        (name for name in names if name != "tree" and (alike_trees or name not in _PER_TREE) and first.get(name) != other.get(name)),
        None,
    )


def agreed(group: dist.ProcessGroup | None, plan: Callable[[], _Planned], request: Callable[[_Planned], Asked] | None = None) -> _Planned:
    """``plan()``, which checks everything an operation could refuse and writes nothing;
    with a process group (collective), every rank raises where any rank's plan refused,
    or where ``request`` (what the plan changes, by argument) differs between ranks."""
    try:
        planned = plan()
    except Exception as error:  # noqa: BLE001  # any error: the other ranks must not wait for this one
        if group is not None:
            shared = error if isinstance(error, OptTreeError) else OptTreeError(f"planning raised {type(error).__name__}: {error}")
            agree(group, shared)  # every rank learns of it, and raises
        raise
    if group is not None:
        refused = agree(group, None, None if request is None else request(planned))
        if refused is not None:
            raise refused
    return planned


def gather(root: Node, group: dist.ProcessGroup, problems: tuple[Problem, ...] = ()) -> list[RankSummary] | None:
    """Every rank's summary of its tree on group rank 0, in rank order; ``None`` on the other ranks."""
    _check_group(group)
    summary = summarise(root, problems)
    leader = dist.get_global_rank(group, 0)
    is_leader = dist.get_rank() == leader
    received: list[RankSummary | None] | None = [None] * dist.get_world_size(group) if is_leader else None
    dist.gather_object(summary, received, dst=leader, group=group)
    if received is None:
        return None
    return [s for s in received if s is not None]


def shape_problems(summaries: list[RankSummary]) -> list[Problem]:
    """A warning for every rank whose tree shape differs from group rank 0's."""
    reference = summaries[0]
    return [
        Problem(
            ProblemKind.SHAPE_MISMATCH,
            _paths.ROOT,
            s.shape.split("[", 1)[0],
            f"tree shape {s.shape} differs from rank {reference.rank}'s {reference.shape}",
            rank=s.rank,
        )
        for s in summaries[1:]
        if s.shape != reference.shape
    ]


def render(summaries: list[RankSummary]) -> str:
    lines = [f"ranks: {len(summaries)}, state {format_bytes(sum(s.state_bytes for s in summaries))} in all"]
    lines += [f"  rank {s.rank}: state {format_bytes(s.state_bytes)}  {s.shape}" for s in summaries]
    lines += [f"  {p}" for p in shape_problems(summaries)]
    return "\n".join(lines)
