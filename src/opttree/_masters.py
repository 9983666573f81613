"""Master copies that no longer stand for the model's weights, found and synced.

When weights are written into the model out of band (a checkpoint loaded without its
optimizer, LoRA adapters restored, a weight sync in RL), the copies a wrapper steps
(``Float16OptimizerWithFloat16Params``' fp32 mains, ``DistributedOptimizer``'s main
shards, ``HybridDeviceOptimizer``'s fp32 or CPU copies, the ``master_param`` a TE
``FusedAdam`` keeps in its state) keep the old values, and the next
step writes them back over the new weights. A copy is stale when it does not round to the
model parameter it stands for: the same comparison Megatron's copy from main to model
makes true after every step.

opttree's own comparisons and writes run as plain torch calls, under no mode of the
caller's (see :func:`~opttree._preflight.plain_torch`); a copy it cannot read is reported,
not raised from, and a sync checks every copy it will write before it writes any.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from itertools import chain
from typing import cast

import torch
import torch.distributed as dist
from attrs import frozen

from opttree._dispatch import LazyDispatch
from opttree._distributed import agreed
from opttree._errors import OptTreeError
from opttree._held import own_attributes
from opttree._containers import malformed, malformed_state, tensors_held
from opttree._inspect import held_gradients, key_label
from opttree._master_groups import master_pairs
from opttree._nodes import LeafNode, Node, WrapperNode, tree_nodes
from opttree._preflight import Extents, overlap, plain_torch, ranges, surely_readable, unreadable_reason, unwritable_reason
from opttree._problems import Problem, ProblemKind
from opttree._registry import schema_for
from opttree._selection import INNER_PARAMS, InnerParams, model_parameters, tree_params, unnamed_param
from opttree._trees import tree
from opttree._fields import kind_of


def _hybrid_copies(hybrid: object, path: str) -> Iterator[tuple[torch.Tensor, Sequence[torch.Tensor]]]:
    """Besides the copies its sub-optimizers step, a ``HybridDeviceOptimizer`` updating in
    fp32 keeps ``param_to_fp32_param`` and, in its sub-optimizers' state, ``master_param``."""
    attributes = own_attributes(hybrid)
    fp32 = attributes.get("param_to_fp32_param")
    inner = attributes.get("param_to_inner_param")
    cpu = attributes.get("cpu_optimizers")
    subs = [*(cpu if isinstance(cpu, (list, tuple)) else ()), attributes.get("gpu_optimizer")]
    if not isinstance(inner, dict):
        return
    masters = {
        id(held): entry["master_param"]
        for sub in subs
        if sub is not None
        for held, entry in getattr(sub, "state", {}).items()
        if isinstance(entry, dict) and "master_param" in entry
    }
    for param, held in inner.items():
        copies = [fp32[param]] if isinstance(fp32, dict) and param in fp32 else []
        if id(held) in masters:
            copies.append(masters[id(held)])
        yield param, copies


EXTRA_COPIES: LazyDispatch[InnerParams] = LazyDispatch()
EXTRA_COPIES.register_lazy("megatron.core.optimizer.cpu_offloading.hybrid_optimizer.HybridDeviceOptimizer", _hybrid_copies)


@frozen
class _Uncompared:
    """A copy a leaf's schema says cannot be compared with its parameter, and why."""

    reason: str


def _leaf_masters(leaf: LeafNode) -> Iterator[tuple[torch.Tensor, Sequence[torch.Tensor | _Uncompared]]]:
    """The master copies a leaf keeps in its parameters' state entries, as its schema's
    ``master_of`` names them (TE FusedAdam's ``master_param``, where Megatron's
    precision-aware ``DistributedOptimizer`` keeps its main weights)."""
    schema = schema_for(type(leaf.optimizer))
    if schema is None or leaf.shared_with is not None:
        return
    optimizer = leaf.optimizer
    if schema.master_groups is not None:
        pairs = master_pairs(optimizer, schema.master_groups)
        if isinstance(pairs, str):
            first = next(iter(chain.from_iterable(group["params"] for group in optimizer.param_groups)), None)
            if first is not None:
                yield first, [_Uncompared(pairs)]
        else:
            yield from ((param, [copy]) for param, copy in pairs)
    master_of = schema.master_of
    if master_of is None:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = optimizer.state.get(param)
            if not isinstance(entry, Mapping) or not entry:
                continue
            try:
                master = master_of(optimizer, param, cast(Mapping[str, object], entry))
            except Exception as error:  # noqa: BLE001  # a registered function may raise anything
                yield param, [_Uncompared(f"{type(error).__name__}: {error}")]
                continue
            if master is not None:
                yield param, [master]


def _pairs(node: Node) -> Iterator[tuple[torch.Tensor, Sequence[torch.Tensor | _Uncompared]]]:
    if isinstance(node, LeafNode):
        yield from _leaf_masters(node)
        return
    if isinstance(node, WrapperNode) and node.is_stub:
        return  # it steps nothing (see inner_params_of)
    cls = type(node.optimizer)
    for table in (INNER_PARAMS, EXTRA_COPIES):
        found = table.lookup(cls)
        if found is not None:
            yield from found(node.optimizer, node.path)


def _model_slice(wrapper: object, param: torch.Tensor, copy: torch.Tensor) -> torch.Tensor | None:
    """The part of ``param`` that ``copy`` stands for: all of it, or, for a shard, the
    range ``DistributedOptimizer`` keeps on this rank; None where that is not known (a
    whole copy shaped otherwise than its parameter, and not flat as a shard is: a
    transposed one, whose elements stand for others than those at their places)."""
    if copy.numel() == param.numel():
        if copy.shape != param.shape and copy.dim() != 1:
            return None
        return param.detach().reshape(copy.shape)
    range_map = getattr(wrapper, "_get_model_param_range_map", None)
    if range_map is None:
        return None
    try:
        span = range_map(param)["param"]
    except (KeyError, TypeError):
        return None
    start, end = getattr(span, "start", None), getattr(span, "end", None)
    if not isinstance(start, int) or not isinstance(end, int) or end - start != copy.numel():
        return None
    if not 0 <= start <= end <= param.numel():
        return None
    return param.detach().reshape(-1)[start:end].reshape(copy.shape)


@frozen(eq=False)
class _Pair:
    path: str
    cls: str
    name: str
    param: torch.Tensor
    copy: torch.Tensor
    part: torch.Tensor


@frozen(eq=False)
class MasterCheck:
    """What :func:`check_masters` compared, outer wrappers' copies first, and what it
    found; ``stale`` holds each stale copy with its problem."""

    problems: tuple[Problem, ...]
    stale: tuple[tuple[_Pair, Problem], ...]
    compared: tuple[_Pair, ...]
    params: tuple[tuple[str, torch.Tensor], ...]
    """The parameters the copies stand for, with their names."""
    model_params: tuple[tuple[str, torch.Tensor], ...]
    """The model's named parameters, read once."""


@frozen
class SyncReport:
    """What :func:`opttree.sync_masters` did: ``copies`` compared, ``stale`` found stale,
    ``reloaded`` whether Megatron's ``reload_model_params()`` ran, and ``written`` the
    copies opttree wrote itself (where there is no reload, or it left them stale), each
    with what was wrong with it before it was written, which it no longer is."""

    copies: int
    stale: int
    reloaded: bool
    written: tuple[str, ...]


def _count_differing(first: torch.Tensor, second: torch.Tensor) -> int:
    """How many elements of two tensors of one dtype differ; NaN equals NaN, as a copy
    of a NaN weight holds NaN."""
    differ = first != second
    if first.is_floating_point() or first.is_complex():
        differ &= ~(first.isnan() & second.isnan())
    return int(differ.sum())


def _differing(pair: _Pair) -> int | str:
    """How many elements of a copy differ from its part of the parameter, or why they
    cannot be compared (a meta copy, a tensor subclass whose own code refuses)."""
    try:
        rounded = pair.copy.detach().to(device=pair.part.device, dtype=pair.part.dtype)
        return _count_differing(rounded, pair.part)
    except Exception as error:  # noqa: BLE001  # a tensor subclass's own code may raise anything
        return f"{type(error).__name__}: {error}"[:300]


def _group_equal(group: list[_Pair]) -> bool:
    """Whether every copy of a group alike in dtype and device rounds to its part, in one
    comparison; False where that comparison cannot run, so the pairs are compared one by one."""
    dtype, device = group[0].part.dtype, group[0].part.device
    try:
        copies = torch.cat([pair.copy.detach().reshape(-1) for pair in group]).to(device=device, dtype=dtype)
        return torch.equal(copies, torch.cat([pair.part.reshape(-1) for pair in group]))
    except Exception:  # noqa: BLE001  # as in _differing
        return False


def _stale_pairs(pairs: list[_Pair]) -> Iterator[tuple[_Pair, int | str]]:
    """The stale pairs with how many elements differ, or why they cannot be compared: one
    comparison per group of copies alike in dtype and device, and tensor by tensor only
    in a group that differs."""
    groups: dict[tuple[torch.dtype, torch.device, torch.dtype, torch.device], list[_Pair]] = {}
    readable = surely_readable([tensor for pair in pairs for tensor in (pair.copy, pair.part)])
    for pair in pairs:
        unreadable = None if readable else unreadable_reason(pair.copy) or unreadable_reason(pair.part)
        if unreadable is not None:  # a freed storage: read, it segfaulted
            yield pair, f"its memory cannot be read: {unreadable}"
            continue
        key = (pair.copy.dtype, pair.copy.device, pair.part.dtype, pair.part.device)
        groups.setdefault(key, []).append(pair)
    with torch.no_grad():
        for group in groups.values():
            if _group_equal(group):
                continue
            for pair in group:
                differ = _differing(pair)
                if differ:
                    yield pair, differ


def check_masters(root: Node, model: torch.nn.Module | None) -> MasterCheck:
    """Compare every master copy in the tree with the model parameter it stands for."""
    with plain_torch():
        return _check_masters(root, model)


def _param_name(names: dict[int, str], param: torch.Tensor) -> str:
    name = names.get(id(param))
    return f"a parameter {unnamed_param(param)}" if name is None else name


def _named_parameters(root: Node, model: torch.nn.Module | None, problems: list[Problem]) -> list[tuple[str, torch.Tensor]]:
    """The model's named parameters; none, with a problem on the root, where they cannot be
    read: the copies are still compared, with their parameters named by shape, and a sync
    refuses."""
    if model is None:
        return []
    try:
        return model_parameters(model)
    except OptTreeError as error:
        message = f"{error}, so the parameters of the copies cannot be named"
        problems.append(Problem(ProblemKind.UNCHECKED_MASTER, root.path, type(root.optimizer).__qualname__, message))
        return []


def _check_masters(root: Node, model: torch.nn.Module | None) -> MasterCheck:
    problems: list[Problem] = []
    model_params = _named_parameters(root, model, problems)
    names = {id(p): name for name, p in model_params}
    seen: dict[int, tuple[int, str]] = {}  # by copy: its parameter; a copy reached twice (a GPU sub-optimizer's fp32 copy) is compared once
    compared: list[_Pair] = []
    params: dict[int, tuple[str, torch.Tensor]] = {}
    readable = True
    for node in tree_nodes(root):
        cls = type(node.optimizer).__qualname__
        reason = malformed(node.optimizer) if isinstance(node, LeafNode) else None
        if reason is not None:  # what it steps cannot be read: said so, not that it steps none of the model's
            problems.append(Problem(ProblemKind.MALFORMED_STATE, node.path, cls, reason))
            readable = False
            continue
        try:
            pairs = list(_pairs(node))
        except OptTreeError as error:
            problems.append(error.problem or Problem(ProblemKind.MALFORMED_WRAPPER, node.path, cls, str(error)))
            readable = False
            continue
        except Exception as error:  # noqa: BLE001  # a wrapper's own containers may raise anything
            message = f"reading the copies it keeps raised {type(error).__name__}: {error}"
            problems.append(Problem(ProblemKind.MALFORMED_WRAPPER, node.path, cls, message))
            readable = False
            continue
        for param, inner in pairs:
            if not isinstance(cast(object, param), torch.Tensor):
                message = f"it names {kind_of(param)} as a parameter its copies stand for, expected a tensor"
                problems.append(Problem(ProblemKind.UNCHECKED_MASTER, node.path, cls, message))
                readable = False
                continue
            name = _param_name(names, param)
            params.setdefault(id(param), (name, param))
            for copy in cast(Sequence[object], inner):  # what a wrapper holds, checked here
                if copy is None or copy is param:
                    continue  # precision-aware shards have no separate main copy
                if id(copy) in seen:
                    first, first_name = seen[id(copy)]
                    if first != id(param):
                        message = f"its copy of {name} is also listed as the copy of {first_name}: one copy cannot stand for two parameters, and a sync could write only one of them into it"
                        problems.append(Problem(ProblemKind.UNCHECKED_MASTER, node.path, cls, message))
                    continue
                if isinstance(copy, _Uncompared):
                    message = f"its copy of {name} cannot be compared with the model's weights: {copy.reason}"
                    problems.append(Problem(ProblemKind.UNCHECKED_MASTER, node.path, cls, message))
                    continue
                if not isinstance(copy, torch.Tensor):
                    message = f"its copy of {name} is {kind_of(copy)}, expected a tensor"
                    problems.append(Problem(ProblemKind.UNCHECKED_MASTER, node.path, cls, message))
                    continue
                seen[id(copy)] = (id(param), name)
                names.setdefault(id(copy), name)  # a copy's own copies, further in, stand for it too
                try:
                    part = _model_slice(node.optimizer, param, copy)
                except Exception:  # noqa: BLE001  # as in _differing
                    part = None
                if part is None:
                    message = f"cannot tell which part of {name} its copy of {_elements(copy)}{_shaped(copy)} stands for"
                    problems.append(Problem(ProblemKind.UNCHECKED_MASTER, node.path, cls, message))
                    continue
                compared.append(_Pair(node.path, cls, name, param, copy, part))
    if readable:  # else what the stack steps is not known, which is reported already
        _check_held(root, model_params, params, problems)
    stale: list[tuple[_Pair, Problem]] = []
    for pair, differ in _stale_pairs(compared):
        if isinstance(differ, str):
            message = f"its copy of {pair.name} cannot be compared with the model's weights: {differ}"
            problems.append(Problem(ProblemKind.UNCHECKED_MASTER, pair.path, pair.cls, message))
            continue
        message = (
            f"its copy of {pair.name} differs from the model's weights in {differ} of {_elements(pair.copy)}: "
            "the next step writes the copy back over them (opttree.sync_masters)"
        )
        problems.append(Problem(ProblemKind.STALE_MASTER, pair.path, pair.cls, message))
        stale.append((pair, problems[-1]))
    return MasterCheck(tuple(problems), tuple(stale), tuple(compared), tuple(params.values()), tuple(model_params))


def _check_held(
    root: Node, model_params: list[tuple[str, torch.Tensor]], stepped: dict[int, tuple[str, torch.Tensor]], problems: list[Problem]
) -> None:
    """The stack must step some of the model's trainable parameters: one built over
    tensors the model no longer has (``load_state_dict(..., assign=True)`` puts new ones
    in their place) keeps training those, and its copies match them, not the model. Some
    not stepped is no problem: other optimizers may step them (a chain member checked
    with the whole model, an embedding under its own optimizer)."""
    held = {*stepped, *map(id, tree_params(root))}
    trainable = [name for name, param in model_params if param.requires_grad]
    if trainable and not any(id(param) in held for _, param in model_params if param.requires_grad):
        message = (
            f"the stack steps none of the model's {len(trainable)} trainable parameters ({trainable[0]} first): it was "
            "built over other tensors (load_state_dict(..., assign=True) replaces a model's parameters), or the "
            "model is not its; its copies cannot be told to stand for the model's weights"
        )
        problems.append(Problem(ProblemKind.UNCHECKED_MASTER, root.path, type(root.optimizer).__qualname__, message))


def _shaped(tensor: torch.Tensor) -> str:
    try:
        return f" shaped {tuple(tensor.shape)}"
    except Exception:  # noqa: BLE001  # as in _differing
        return ""


def _elements(tensor: torch.Tensor) -> str:
    try:
        return f"{tensor.numel()} elements"
    except Exception:  # noqa: BLE001  # as in _differing
        return "unknown size"


_PARAMETER = "parameter"
"""The class that the memory of a parameter is owned by, in the check before a sync."""


def _writes(check: MasterCheck) -> list[_Pair]:
    """The copies a sync writes, in the order it writes them: each stale copy, and each
    copy further in that stands for a copy written before it (the next link of a chain of
    copies, which its outer link's new values make stale)."""
    stale = {id(pair) for pair, _ in check.stale}
    written: set[int] = set()
    writes: list[_Pair] = []
    for pair in check.compared:
        if id(pair) in stale or id(pair.param) in written:
            writes.append(pair)
            written.add(id(pair.copy))
    return writes


def _unwritable(root: Node, check: MasterCheck, writes: list[_Pair]) -> list[Problem]:
    """What makes ``writes`` fail or go wrong, found before any is written: a copy that
    cannot be written in place, one whose dtype cannot hold the weights (written, it would
    still differ), and one sharing memory with a parameter of the model or the wrappers,
    with another copy, or with the optimizers' state or gradients (writing it would change
    that too)."""
    problems: list[Problem] = []
    written, kept = Extents(), Extents()
    writing = {id(pair.copy) for pair in writes}
    with plain_torch():
        for pair in writes:
            reason = unwritable_reason(pair.copy)
            if reason is None and not _holds(pair):
                reason = f"a {pair.copy.dtype} tensor, which cannot hold the model's {pair.part.dtype} values: written, it would still differ"
            if reason is not None:
                message = f"its copy of {pair.name} is stale and cannot be written: it is {reason}"
                problems.append(Problem(ProblemKind.STALE_MASTER, pair.path, pair.cls, message))
                continue
            written.extend(ranges([pair.copy]).owned((pair.path, pair.cls, pair.name)))
        for name, param in (*check.params, *check.model_params):
            if id(param) not in writing:  # a link of a chain, written as a copy
                kept.extend(ranges([param]).owned(("", _PARAMETER, name)))
        for pair in check.compared:
            if id(pair.copy) not in writing:
                kept.extend(ranges([pair.copy]).owned((pair.path, pair.cls, pair.name)))
        try:
            spans = set(zip(written.starts, written.ends))
            for leaf, key, tensors, copies in _state_and_gradients(root):
                held = [tensor for tensor in tensors if not copies or not _written_whole(tensor, spans)]
                kept.extend(ranges(held).owned((leaf.path, _STATE, f"{type(leaf.optimizer).__qualname__} at {leaf.path}: {key}")))
        except Exception as error:  # noqa: BLE001  # a state entry's own items() may raise anything
            message = f"the optimizers' state cannot be read ({type(error).__name__}: {error}) to tell that no copy shares its memory"
            problems.append(Problem(ProblemKind.STALE_MASTER, root.path, type(root.optimizer).__qualname__, message))
    clash = overlap(written, kept)
    if clash is not None:
        (path, cls, copy_of), (_, other_cls, other) = clash
        what = f"the parameter {other}" if other_cls == _PARAMETER else f"the optimizer state of {other}" if other_cls == _STATE else f"the copy of {other}"
        message = f"its copy of {copy_of} shares memory with {what}: writing it would change that too"
        problems.append(Problem(ProblemKind.STALE_MASTER, path, cls, message))
    return problems


_STATE = "<state>"


def _written_whole(tensor: torch.Tensor, spans: set[tuple[int, int]]) -> bool:
    """Whether a sync writes all of ``tensor``'s memory, and only it, as one copy: a master
    copy kept in state, or what a schema's ``master_of`` names of it (a view of a flat one)."""
    found = ranges([tensor])
    return not found.unseen and bool(found.starts) and all(span in spans for span in zip(found.starts, found.ends))


def _state_and_gradients(root: Node) -> Iterator[tuple[LeafNode, str, list[torch.Tensor], bool]]:
    """Each leaf's state tensors by key, and its parameters' gradients (``grad``, and
    Megatron's ``main_grad``): memory a sync must leave alone, as a copy that is also
    history (a registered ``master_of`` naming ``exp_avg``, or a view of it) would write
    the weights into it; with whether the key is one its schema keeps, where a master
    copy a sync writes may lie (TE's ``master_param``): none of history or gradients. A
    leaf whose state cannot be read raises, and the sync is refused: nothing could tell
    that no copy shares its memory."""
    for node in tree_nodes(root):
        if not isinstance(node, LeafNode):
            continue
        schema = schema_for(type(node.optimizer))
        kept = schema.keep if schema is not None else frozenset()
        reason = malformed(node.optimizer)
        state = node.optimizer.state if reason is None else {}
        reason = reason or malformed_state(state)
        if reason is not None:
            raise ValueError(f"{type(node.optimizer).__qualname__} at {node.path}: {reason}")
        by_key: dict[str, list[object]] = {}
        for entry in state.values():
            for key, value in entry.items():
                by_key.setdefault(key_label(key), []).append(value)
        for key, values in by_key.items():
            yield node, key, tensors_held(values), key in kept
        params = [p for group in node.optimizer.param_groups for p in group["params"]]
        yield node, "gradients", held_gradients(params), False


def _holds(pair: _Pair) -> bool:
    """Whether the copy's dtype holds its part of the weights exactly, so that a written
    copy rounds back to them."""
    held = pair.part.to(pair.copy.dtype).to(pair.part.dtype)
    return _count_differing(held, pair.part) == 0


def sync_masters(optimizer: object, model: torch.nn.Module | None, group: dist.ProcessGroup | None = None) -> SyncReport:
    """Make every master copy equal to the model's weights: Megatron's own
    ``reload_model_params()`` where the stack has it (which writes every master from the
    model's weights, as a stack built over them starts), then opttree's own copy for what
    is still stale and for the links of chains of copies further in, named in the report.
    Refused before anything is written: a copy whose part of its parameter is not known,
    one it cannot compare, or one it would write that it cannot write in place, that
    cannot hold the weights, or that shares memory with a parameter or another copy. With
    ``group``, the ranks agree on that before any reload, and again before opttree writes."""
    root, before, writes = agreed(group, lambda: _checked(optimizer, model))
    after, writes, reloaded = agreed(group, lambda: _reloaded(root, model, before, writes))
    with plain_torch(), torch.no_grad():
        for pair in writes:
            pair.copy.copy_(pair.part)
    stale = {id(pair): problem for pair, problem in after.stale}
    written = [stale.get(id(pair)) or _link_problem(pair) for pair in writes]
    return SyncReport(len(before.compared), len(before.stale), reloaded, tuple(f"{p.cls} at {p.path}: before it was written, {p.message}" for p in written))


def _checked(optimizer: object, model: torch.nn.Module | None) -> tuple[Node, MasterCheck, list[_Pair]]:
    """The tree of ``optimizer`` (or the tree passed in), its copies compared, and the
    writes a sync makes, or its refusal."""
    root = tree(optimizer)
    check = check_masters(root, model)
    return root, check, _refuse(root, check)


def _reloaded(root: Node, model: torch.nn.Module | None, before: MasterCheck, writes: list[_Pair]) -> tuple[MasterCheck, list[_Pair], bool]:
    """After Megatron's own reload where the stack has one and a copy is stale: the copies
    compared again and the writes still to make; else ``before`` and its ``writes``."""
    reload = getattr(root.optimizer, "reload_model_params", None)
    if not before.stale or not callable(reload):
        return before, writes, False
    try:
        reload()
    except Exception as error:  # past opttree's checks: Megatron's own code, on a stack opttree does not know all of
        cls = type(root.optimizer).__qualname__
        msg = f"{cls} at {root.path}: its reload_model_params() raised {type(error).__name__}: {error}; the masters it wrote before are written"
        raise OptTreeError(msg) from error
    after = check_masters(root, model)
    return after, _refuse(root, after), True


def _refuse(root: Node, check: MasterCheck) -> list[_Pair]:
    """The writes a sync makes from ``check``, or its refusal: every problem but a stale
    copy, and anything that makes a write fail or go wrong."""
    writes = _writes(check)
    refused = [p for p in check.problems if p.kind is not ProblemKind.STALE_MASTER] or _unwritable(root, check, writes)
    if refused:
        raise refused[0].to_error(others=refused[1:])
    return writes


def _link_problem(pair: _Pair) -> Problem:
    message = f"its copy of {pair.name} stands for a copy written before it, and was written after it"
    return Problem(ProblemKind.STALE_MASTER, pair.path, pair.cls, message)
