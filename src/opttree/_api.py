"""The public functions. Each accepts a live optimizer or a tree already built from one."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import cast

import torch
import torch.distributed as dist
from attrs import evolve

from opttree._eager import eager
from opttree import _distributed
from opttree._describe import DescribeVisitor
from opttree._errors import OptTreeError, ReleaseRefused
from opttree._masters import SyncReport, check_masters
from opttree._masters import sync_masters as _sync_masters
from opttree._nodes import Node
from opttree._problems import Problem
from opttree._report import ResetReport
from opttree._reset import ResetVisitor
from opttree._selection import EVERYTHING, Selection, model_weights, select
from opttree._trees import lenient_tree, tree
from opttree._validate import ValidateVisitor
from opttree._fields import kind_of


@eager
def validate(
    optimizer: object, *, group: dist.ProcessGroup | None = None, model: torch.nn.Module | None = None
) -> tuple[Problem, ...]:
    """Every problem in the tree, errors and warnings, without raising for them.

    With ``model``, every master copy the stack steps is also compared with the model
    parameter it stands for: a copy that does not round to it is a ``stale-master`` error
    naming the parameter (see :func:`sync_masters`).

    With a process group (collective: call it on every rank of ``group``), rank 0 of the
    group returns every rank's problems, each with its ``rank``, plus a warning for each
    rank whose tree shape differs from its own, and for each wrapper whose steps or loss
    scale, saved once for all ranks, differ from its own; the other ranks return their own
    problems.
    """
    root, refused = lenient_tree(optimizer)
    visitor = ValidateVisitor._selecting(_kept_model(model))
    visitor._check_built(root)
    masters = check_masters(root, model).problems if model is not None else ()
    problems = tuple(dict.fromkeys((*refused, *visitor.problems, *masters)))  # a wrapper both checks read fails once
    if group is None:
        return problems
    summaries = _distributed.gather(root, group, problems)
    if summaries is None:
        return problems
    gathered = [p.on_rank(s.rank) for s in summaries for p in s.problems]
    return (*gathered, *_distributed.shape_problems(summaries), *_distributed.saved_problems(summaries))


@eager
def reset(
    optimizer: object,
    *,
    params: Iterable[torch.Tensor] | Callable[[str], bool] | None = None,
    keys: Iterable[str] | None = None,
    model: torch.nn.Module | None = None,
    keep_loss_scale: bool = False,
    release: bool = False,
    group: dist.ProcessGroup | None = None,
) -> ResetReport:
    """Reset optimizer history so the next step equals a fresh optimizer's.

    History tensors and per-parameter step tensors are zeroed in place; keys the
    optimizer creates lazily are dropped; per-group steps become 0; master weights and
    other non-history state are kept. The whole tree is validated first: on any
    unsupported leaf or key this raises and changes nothing.

    ``params`` resets only the state of those model parameters (or, with ``model``, of the
    parameters whose names the predicate accepts), mapped through the wrappers to the
    tensors the leaves hold state for; ``keys`` resets only those history keys (``"step"``
    names the step counter). A per-group step is only reset with its whole group.

    An fp16 wrapper's loss scaler is reset with its steps to the initial scale of its
    ``OptimizerConfig``, as a fresh optimizer's starts, unless ``keep_loss_scale``.

    ``release=True`` deletes the state entries of the selected parameters instead, freeing
    their memory until the next step builds them again, as a fresh optimizer builds its
    own: for optimizers whose schema says they do (``rebuilds_missing``), with no kept
    state in those entries, not capturable, and under no Megatron wrapper, whose
    checkpoints of an emptied state fail; otherwise it raises
    :class:`~opttree.ReleaseRefused` and changes nothing. ``keys`` cannot be combined
    with it: an entry is deleted whole, or the optimizer would not rebuild it.

    With a process group (collective: call it on every rank of ``group``), the ranks
    agree before any writes: where one refuses, or where they were given different
    arguments (``keys``, ``keep_loss_scale``, ``release``, ``params`` on some and not
    others), every rank raises, naming the rank, and none changes anything. A partial reset's checks see each rank's own shards, so
    without it one rank can refuse what another carries out.
    """
    planned, _ = _distributed.agreed(
        group,
        lambda: _planned_reset(optimizer, params, keys, model, keep_loss_scale=keep_loss_scale, release=release),
        operator.itemgetter(1),
    )
    return planned._carry_out_passed()


def _kept_model(model: torch.nn.Module | None) -> Selection:
    """Everything, keeping the model's weights where they can be read (where they cannot,
    the masters check reports it)."""
    try:
        return EVERYTHING if model is None else evolve(EVERYTHING, model=model_weights(model))
    except OptTreeError:
        return EVERYTHING


def _planned_reset(
    optimizer: object,
    params: Iterable[torch.Tensor] | Callable[[str], bool] | None,
    keys: Iterable[str] | None,
    model: torch.nn.Module | None,
    *,
    keep_loss_scale: bool,
    release: bool,
) -> tuple[ResetVisitor, _distributed.Asked]:
    """A reset checked and planned, ready to carry out, and what it was asked (see
    :func:`~opttree._distributed.asked`); its refusal raised."""
    for name, flag in (("keep_loss_scale", keep_loss_scale), ("release", release)):
        if not isinstance(cast(object, flag), bool):  # release="False" would delete every entry
            msg = f"{name} must be True or False, got {kind_of(flag)}"
            raise OptTreeError(msg)
    if release and keys is not None:
        msg = "release=True deletes whole state entries, which their optimizer builds again: leave keys out"
        raise ReleaseRefused(msg)
    root = tree(optimizer)
    selection = select(root, params, keys, model)
    if release:
        selection = evolve(selection, release=True)
    visitor = ResetVisitor._selecting(selection, keep_loss_scale=keep_loss_scale)
    refused = visitor._refusal_of_built(root)
    if refused is not None:
        raise refused
    return visitor, _distributed.asked("reset", root, selection, keep_loss_scale=keep_loss_scale)


@eager
def sync_masters(optimizer: object, *, model: torch.nn.Module | None = None, group: dist.ProcessGroup | None = None) -> SyncReport:
    """Make every master copy the stack steps equal to the model's weights again, after
    weights were written into the model out of band.

    Megatron's own ``reload_model_params()`` does it where the stack has it; the copies
    are then compared again, and any still stale (or, without a reload, every stale one)
    are written by opttree and named in the report. ``model`` names the parameters, and
    must be one the stack steps some trainable parameters of (else, as after
    ``load_state_dict(..., assign=True)``, its copies stand for other tensors).
    Raises :class:`~opttree.StaleMaster`, having written nothing, where a copy's part of
    its parameter is not known.

    With a process group (collective: call it on every rank of ``group``), every rank
    raises where any rank refuses, naming it, with nothing written: a rank left with stale
    masters would write the old weights back over its part of the model at its next step.
    """
    return _sync_masters(optimizer, model, group)


@eager
def describe(optimizer: object, *, group: dist.ProcessGroup | None = None) -> str:
    """An indented description of the tree: class, path, parameters, state bytes, step.

    With a process group (collective: call it on every rank of ``group``), rank 0 of the
    group appends each rank's total state bytes and tree shape, and names the ranks whose
    shape differs from its own; the other ranks return their own description.
    """
    root, problems = lenient_tree(optimizer)
    text = DescribeVisitor()._render_checked(root, problems)
    if group is None:
        return text
    summaries = _distributed.gather(root, group)
    return text if summaries is None else f"{text}\n{_distributed.render(summaries)}"
