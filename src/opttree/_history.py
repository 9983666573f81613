"""Pruning and scaling history in place, through the same selection, mapping through the
wrappers and validation as a partial reset; step counters and loss scalers are kept.

ReLoRA prunes optimizer state at each merge: in each history tensor the elements smallest
in magnitude (or a random share of them) are set to zero; SPAM-style recipes scale moments.
"Each tensor" is each tensor a leaf holds: on a ``DistributedOptimizer`` that is this
rank's shard, so a magnitude threshold is this shard's, not the whole parameter's.
Both write as plain torch calls (see :func:`~opttree._preflight.plain_torch`), as a reset
does, over tensors its checks found writable.
"""

from __future__ import annotations

import math
import operator
from fractions import Fraction
from collections.abc import Callable, Iterable
from typing import Literal, SupportsFloat, cast

import torch
import torch.distributed as dist
from attrs import evolve

from opttree._dispatch import is_megatron_class
from opttree._eager import eager
from opttree import _distributed
from opttree._distributed import Asked
from opttree._trees import tree
from opttree._errors import OptTreeError, PartialResetRefused
from opttree._nodes import LeafNode, Node, tree_nodes
from opttree._numbers import real_number
from opttree._plan import ResetPlan
from opttree._preflight import Owner, plain_torch
from opttree._problems import Problem, ProblemKind
from opttree._report import ResetReport
from opttree._registry import schema_for
from opttree._selection import ParamsArg, Selection, key_names, select
from opttree._validate import ValidateVisitor
from opttree._fields import kind_of


def _plan(
    optimizer: object,
    params: ParamsArg | None,
    keys: Iterable[str] | None,
    model: torch.nn.Module | None,
    what: str,
    dtypes: tuple[str, Callable[[torch.dtype], bool]],
    *,
    keeps_bounds: bool,
) -> tuple[ResetPlan, Asked]:
    """The checked plan of a partial reset of ``keys``, whose history ``what`` changes in
    place: refused, as a reset is, for anything a reset refuses, and for history that is
    not zero at the start (a fill of zero is) or whose dtype ``what`` cannot change (``dtypes``: its name and test),
    or that bounds other history, unless ``what`` ``keeps_bounds`` where it changes all of them
    alike (a scale by at most 1, a prune of everything); and what it selects, as the ranks
    of a collective call compare it."""
    key_list = None if keys is None else sorted(key_names(keys))
    if key_list is not None and "step" in key_list:
        raise PartialResetRefused(f"{what} keeps step counters: leave 'step' out of keys")
    root = tree(optimizer)
    chosen = select(root, params, key_list, model)
    visitor = ValidateVisitor._selecting(evolve(chosen, steps=False))
    refused = visitor._refusal_of_built(root)
    if refused is not None:
        raise refused
    plan = visitor._plan
    state = plan.state
    if state.release:
        cls = type(state.release[0][0]).__qualname__
        msg = (
            f"{what} changes history in place, and {cls} builds its entries at its first step from its group's "
            "values (its schema's starts_at_first_step), which a reset deletes instead: leave its filled keys out of keys"
        )
        raise PartialResetRefused(msg)
    for (list_key, value), tensors in list(state.fills.items()):
        if value == 0:  # history a fill starts at zero (Adagrad's sum, initial_accumulator_value=0) starts at zero
            del state.fills[(list_key, value)]
            state.zero_list(list_key).extend(tensors)
            state.filled -= len(tensors)
            state.zeroed += len(tensors)
    changed_otherwise = [
        *(key for _, key in state.drop),
        *(key for (key, _, _), _ in state.fills),
        *(key for key, _ in state.identities),
        *sorted(state.scaled_keys),
    ]
    if changed_otherwise:
        name = changed_otherwise[0]
        dropped = next((entry for entry, key in state.drop if key == name), None)
        path, cls, _ = _owner(plan, lambda owner: owner[2] == name) if dropped is None else _entry_owner(root, dropped)
        zeroed = sorted({key for key, _, _ in state.lists} - set(changed_otherwise))
        advice = (
            "leave it out of keys"
            if key_list is not None
            else f"name the keys to change (keys={zeroed!r} start at zero here)"
            if zeroed
            else "no key of it starts at zero here"
        )
        msg = f"{what} changes history in place, and it is not zero at the start (its schema drops, fills, scales or starts it as an identity): {advice}"
        raise _unchangeable(path, cls, name, msg)
    _refuse_bound_together(root, chosen, key_list, what, keeps_bounds=keeps_bounds)
    kind, accepts = dtypes
    for (key, _, _), tensors in state.lists.items():
        with plain_torch():
            wrong = next((tensor for tensor in map(_plain, tensors) if not accepts(tensor.dtype)), None)
        if wrong is not None:
            path, cls, _ = _holder(wrong, plan)
            raise _unchangeable(path, cls, key, f"{what} changes {kind} history, and this holds {wrong.dtype} tensors: leave it out of keys")
    return plan, _distributed.asked(what, root, chosen)


def _refuse_bound_together(root: Node, chosen: Selection, keys: list[str] | None, what: str, *, keeps_bounds: bool) -> None:
    """Refuse to change history its schema's ``bound_together`` binds to other history a
    leaf holds for the selected parameters: changed tensor by tensor, the bound breaks;
    not where ``what`` ``keeps_bounds`` (it then changes all of them: centered RMSprop's
    square_avg less grad_avg squared, both scaled by f <= 1, is f times what it was less
    f squared times the square: no smaller than f times the difference, which is >= 0)."""
    for node in tree_nodes(root):
        if not isinstance(node, LeafNode) or node.shared_with is not None:
            continue
        schema = schema_for(type(node.optimizer))
        if schema is None or not schema.bound_together:
            continue
        entries = [
            entry for param, entry in node.optimizer.state.items() if chosen.tensors is None or id(param) in chosen.tensors
        ]
        held = sorted(schema.bound_together.intersection(set().union(*entries)))
        # keys naming some of them only were refused by the partial reset's own check (bound_apart)
        if len(held) > 1 and not set(held).isdisjoint(held if keys is None else keys) and not keeps_bounds:
            msg = (
                f"{what} changes each tensor apart, and the entries hold {', '.join(held)}, whose values bound one "
                "another (its schema's bound_together: centered RMSprop's step takes the square root of square_avg "
                "less grad_avg squared): changed apart, the bound can break and the next step write NaN; reset them instead"
            )
            raise _unchangeable(node.path, type(node.optimizer).__qualname__, held[0], msg)


def _unchangeable(path: str, cls: str, key: str | None, message: str) -> OptTreeError:
    return Problem(ProblemKind.UNCHANGEABLE_HISTORY, path, cls, message, key).to_error()


_PRUNABLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""What prune orders by magnitude: the floating dtypes torch compares and sorts on every
device (not float8, whose comparisons it does not implement)."""
_SCALABLE = _PRUNABLE | {torch.complex64, torch.complex128}
_REAL_FLOATS = ("float16, bfloat16, float32 or float64", _PRUNABLE.__contains__)
_FLOATS = ("floating-point or complex", _SCALABLE.__contains__)


def _described(value: object) -> str:
    """An argument as a refusal shows it: its repr where that is short, else what it is;
    an optimizer or a tree where a number belongs names the order the arguments go in."""
    if isinstance(value, (torch.optim.Optimizer, Node)) or is_megatron_class(type(value)):
        return f"{kind_of(value)}: the optimizer comes first (opttree.prune(optimizer, fraction), opttree.scale(optimizer, factor))"
    try:
        shown = repr(value)
    except Exception:  # noqa: BLE001  # an argument's own __repr__ may raise anything
        return kind_of(value)
    return kind_of(value) if "\n" in shown or len(shown) > 80 else f"{shown} ({kind_of(value)})"


def _tensors(plan: ResetPlan) -> list[torch.Tensor]:
    return [_plain(t) for tensors in plan.state.lists.values() for t in tensors]


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A history tensor as a plain one over its memory: a subclass's own attributes (a
    ``dtype`` property whose code raises) are not read as it is checked and changed."""
    return tensor if type(tensor) is torch.Tensor else tensor.as_subclass(torch.Tensor)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """What magnitudes are ordered and compared in: float32, or float64 for float64
    history; either holds every magnitude of the history exactly."""
    return torch.promote_types(dtype, torch.float32)


def _threshold(tensor: torch.Tensor, fraction: float) -> torch.Tensor | None:
    """The magnitude at or below which ``tensor``'s elements lie at or below its
    ``fraction`` quantile (linear, as ``torch.quantile``, without its size limit), in
    :func:`_wide`'s dtype; None where every element is NaN. The quantile lies between two
    neighbouring magnitudes in order, the lower one included, and no element lies strictly
    between them: the lower one is the threshold, exactly, where the interpolated quantile
    could round up onto the higher one (magnitudes 1 and 1 + 2**-23 at 0.9 pruned both),
    unless the higher one is inf, which the quantile then is.
    Its index is taken exactly too. The quantile is of the elements that are not NaN (which
    sort last, and would make it NaN where they are many): NaN is above no threshold.
    Overflowed (inf) history is ordered as torch.quantile orders it: the largest."""
    ordered = tensor.flatten().abs().to(_wide(tensor.dtype)).sort().values
    count = int(ordered.numel() - ordered.isnan().sum())
    if count == 0:
        return None
    position = Fraction(fraction) * (count - 1)
    low = math.floor(position)
    if position != low and bool(ordered[low + 1].isinf()):
        return ordered[low + 1]  # interpolated towards inf, the quantile is inf
    return ordered[low]


class _Scratch:
    """Buffers for the masks of every tensor a prune writes, allocated before the first
    write, one of each dtype per device as large as its largest tensor: the writes then
    allocate nothing, so none can run out of memory half-way."""

    def __init__(self, tensors: list[torch.Tensor], dtype_of: Callable[[torch.Tensor], torch.dtype]) -> None:
        sizes: dict[tuple[torch.device, torch.dtype], int] = {}
        for tensor in tensors:
            for kind in ((tensor.device, dtype_of(tensor)), (tensor.device, torch.bool)):
                sizes[kind] = max(sizes.get(kind, 0), tensor.numel())
        self._buffers = {kind: torch.empty(size, dtype=kind[1], device=kind[0]) for kind, size in sizes.items()}
        self._dtype_of = dtype_of

    def work(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._buffers[(tensor.device, self._dtype_of(tensor))][: tensor.numel()].view(tensor.shape)

    def mask(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._buffers[(tensor.device, torch.bool)][: tensor.numel()].view(tensor.shape)


@eager
def prune(
    optimizer: object,
    fraction: SupportsFloat,
    *,
    by: Literal["magnitude", "random"] = "magnitude",
    generator: torch.Generator | None = None,
    params: ParamsArg | None = None,
    keys: Iterable[str] | None = None,
    model: torch.nn.Module | None = None,
    group: dist.ProcessGroup | None = None,
) -> ResetReport:
    """Set ``fraction`` of each selected history tensor's elements to zero: those smallest in
    magnitude (at or below the tensor's ``fraction`` quantile, as ReLoRA computes it, so
    that ties at the quantile can prune more than ``fraction``, and ``fraction=0`` prunes
    each tensor's smallest elements) or a random
    share, drawn from ``generator`` tensor by tensor, key by key and then in the leaf's
    parameter order. Pruned elements become +0 (multiplying by a mask would leave -0, and
    NaN), and a NaN element, whose magnitude is above no threshold, is pruned by
    magnitude, the quantile being of the other elements; so ``fraction=1.0`` zeroes them bitwise as a reset of those keys does; step
    counters are kept. Raises as ``reset`` does, having changed nothing; every tensor is
    ordered, and the buffers of its masks allocated, before the first write, so memory
    running out refuses the prune with nothing pruned.

    "Each tensor" is each tensor a leaf holds. Under a ``DistributedOptimizer`` that is this
    rank's shard of a parameter's history, so the magnitude threshold is the shard's own
    quantile, not the whole parameter's: ranks prune their shards independently, without
    communicating. With ``group`` (collective) the ranks agree to prune or refuse, as
    ``reset`` does, once each has ordered its tensors and allocated its masks: one that
    runs out of memory refuses on every rank."""

    def planned() -> tuple[tuple[float, ResetPlan, list[torch.Tensor], list[torch.Tensor | None], _Scratch], Asked]:
        with plain_torch():
            share = real_number(fraction)
        if share is None or not 0.0 <= share <= 1.0:
            raise PartialResetRefused(f"fraction must be a number between 0 and 1, got {_described(fraction)}")
        if not isinstance(cast(object, by), str) or by not in ("magnitude", "random"):  # an array's == gives no bool
            raise PartialResetRefused(f"by must be 'magnitude' or 'random', got {_described(by)}")
        if generator is not None and not isinstance(cast(object, generator), torch.Generator):
            raise PartialResetRefused(f"generator must be a torch.Generator or None, got {_described(generator)}")
        plan, selected = _plan(optimizer, params, keys, model, "prune", _REAL_FLOATS, keeps_bounds=share == 1.0)
        if by == "random" and generator is not None:
            with plain_torch():
                devices = {tensor.device.type for tensor in _tensors(plan)} - {generator.device.type}
            if devices:
                msg = f"prune draws from a {generator.device.type} generator, which cannot draw for the {devices.pop()} history it selects"
                raise PartialResetRefused(msg)
        with plain_torch(), torch.no_grad():
            tensors = [tensor for tensor in _tensors(plan) if tensor.numel()]
            try:  # everything that allocates, before the ranks agree and before the first write
                thresholds = [_threshold(tensor, share) for tensor in tensors] if by == "magnitude" else []
                draws = torch.get_default_dtype()
                scratch = _Scratch(tensors, (lambda t: _wide(t.dtype)) if by == "magnitude" else (lambda t: draws))
            except RuntimeError as error:  # out of memory, on any device
                msg = f"prune could not allocate what it orders or masks with, and changed nothing: {type(error).__name__}: {error}"
                raise PartialResetRefused(msg) from error
        return (share, plan, tensors, thresholds, scratch), {**selected, "fraction": share, "by": by}

    (share, plan, tensors, thresholds, scratch), _ = _distributed.agreed(group, planned, operator.itemgetter(1))
    with plain_torch(), torch.no_grad():
        for index, tensor in enumerate(tensors):
            work, pruned = scratch.work(tensor), scratch.mask(tensor)
            if by == "random":
                work.uniform_(0, 1, generator=generator)  # as torch.rand draws
                torch.gt(work, share, out=pruned)
            elif (threshold := thresholds[index]) is None:
                pruned.fill_(False)
            else:
                work.copy_(tensor).abs_()
                torch.gt(work, threshold, out=pruned)
            tensor.masked_fill_(pruned.logical_not_(), 0)
    return evolve(plan.report(), action="prune")


@eager
def scale(
    optimizer: object,
    factor: SupportsFloat,
    *,
    params: ParamsArg | None = None,
    keys: Iterable[str] | None = None,
    model: torch.nn.Module | None = None,
    group: dist.ProcessGroup | None = None,
) -> ResetReport:
    """Multiply each selected history tensor by ``factor`` in place (a run that halved its
    first moment after a spike: ``keys=["exp_avg"], factor=0.5``); step counters are kept.
    ``factor`` must be a finite number >= 0: a negative second moment, or a NaN one, makes
    the next step's update NaN. A factor of zero zeroes history as a reset does (multiplied,
    a negative element would become -0.0). It is refused where the product would not be finite: a
    factor or an element carried past the largest value of the history's dtype, or
    history that holds inf or NaN already. With ``group`` (collective) the ranks agree to
    scale or refuse, as ``reset`` does."""

    def planned() -> tuple[tuple[float, ResetPlan, list[torch.Tensor]], Asked]:
        with plain_torch():
            ratio = real_number(factor)
        if ratio is None or not 0.0 <= ratio < math.inf:
            raise PartialResetRefused(f"factor must be a finite number >= 0, got {_described(factor)}")
        plan, selected = _plan(optimizer, params, keys, model, "scale", _FLOATS, keeps_bounds=ratio <= 1.0)
        with plain_torch(), torch.no_grad():
            tensors = [tensor for tensor in _tensors(plan) if tensor.numel()]
            if tensors:
                _refuse_non_finite(tensors, ratio, plan)
        return (ratio, plan, tensors), {**selected, "factor": ratio}

    (ratio, plan, tensors), _ = _distributed.agreed(group, planned, operator.itemgetter(1))
    with plain_torch(), torch.no_grad():
        if tensors and ratio == 0.0:  # -0.0 too: multiplied, negative history would become -0.0, which a fresh one never holds
            torch._foreach_zero_(tensors)
        elif tensors:
            _multiply(tensors, ratio)
    return evolve(plan.report(), action="scale")


_HALVES = frozenset({torch.float16, torch.bfloat16})


def _multiply(tensors: list[torch.Tensor], ratio: float) -> None:
    """Multiply history by ``ratio`` in place as ``tensor.mul_(ratio)`` does, in float32 for
    half-precision history (torch's CPU ``_foreach_mul_`` rounds the factor to the
    history's dtype first: by 0.3, bfloat16 history was multiplied by 0.30078125), and a
    complex tensor's parts each by the real factor (a complex product by ``ratio + 0j``
    turns a part of -0.0 into +0.0)."""
    parts = [torch.view_as_real(tensor) if tensor.is_complex() else tensor for tensor in tensors]
    halves = [tensor for tensor in parts if tensor.dtype in _HALVES]
    rest = [tensor for tensor in parts if tensor.dtype not in _HALVES]
    if rest:
        torch._foreach_mul_(rest, ratio)
    for tensor in halves:
        tensor.mul_(ratio)


def _refuse_non_finite(tensors: list[torch.Tensor], ratio: float, plan: ResetPlan) -> None:
    """Refuse a scale by ``ratio`` whose product is not finite somewhere: history that
    holds inf or NaN already (no factor makes it finite, and 0 makes inf NaN), a factor
    beyond what the history's dtype holds, or one that carries an element past the
    largest value of its dtype. The refusal names the leaf and key that hold the tensor.
    A real factor scales a complex element's parts: they are measured, not its modulus."""
    peaks = torch._foreach_norm([torch.view_as_real(t) if t.is_complex() else t for t in tensors], math.inf)
    factors = {dtype: _largest_factor(ratio, dtype) for dtype in {tensor.dtype for tensor in tensors}}
    for tensor, peak in zip(tensors, peaks, strict=True):
        largest, highest = torch.finfo(tensor.dtype).max, float(peak)
        if not math.isfinite(highest):
            raise _unchangeable(*_holder(tensor, plan), f"scale found {tensor.dtype} history holding inf or NaN, which no factor makes finite: reset it instead")
        if not highest * factors[tensor.dtype] <= largest:  # a factor torch rounds to inf makes even 0 NaN
            msg = f"scale by {ratio:g} would carry {tensor.dtype} history (up to {highest:g}) past its largest value, {largest:g}"
            raise _unchangeable(*_holder(tensor, plan), msg)


def _largest_factor(ratio: float, dtype: torch.dtype) -> float:
    """The largest factor :func:`_multiply` may multiply ``dtype`` history by for ``ratio``:
    the ratio, or it rounded to float32, in which torch multiplies all but float64 history
    (a factor of 1e39 is inf there)."""
    real = torch.empty(0, dtype=dtype).real.dtype
    return abs(ratio) if real is torch.float64 else max(abs(ratio), abs(float(torch.tensor(ratio, dtype=torch.float32))))


def _holder(tensor: torch.Tensor, plan: ResetPlan) -> Owner:
    """The path, class and key of the leaf a planned history tensor is of."""
    written = plan.state.written
    start = tensor.data_ptr()
    index = next((i for i, at in enumerate(written.starts) if at == start), None)
    return _owner(plan) if index is None else written.owner(index)


def _entry_owner(root: Node, entry: object) -> Owner:
    """The path and class of the leaf whose state holds ``entry`` (a dropped key may hold
    no tensor, whose memory would name it), read from the planned tree."""
    for node in tree_nodes(root):
        if isinstance(node, LeafNode) and any(held is entry for held in node.optimizer.state.values()):
            return node.path, type(node.optimizer).__qualname__, None
    return root.path, type(root.optimizer).__qualname__, None


def _owner(plan: ResetPlan, where: Callable[[Owner], bool] = lambda _: True) -> Owner:
    """The first owner of written memory ``where`` accepts: every planned write has one."""
    return next((owner for _, owner in plan.state.written.owners if where(owner)), ("<root>", "history", None))
