"""Pre-flight checks on the tensors a reset writes, before it writes any.

Everything that would make zeroing fail half-way, or silently do nothing, is found
here: tensors that cannot be written in place (inference tensors outside inference mode,
quantized, sparse and meta tensors, tensors whose storage is freed, tensor subclasses
with their own dispatch) and history that shares memory with other state or with a
parameter (zeroing it would zero them too).

Each check runs over a whole list at once, through ``map`` at C speed; only a list that
fails a cheap check is looked at tensor by tensor, to say why. Memory is compared by
address ranges: one vectorised sort over every range a reset writes or must keep.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence

import torch
from attrs import define, field

_DATA_PTR = torch.Tensor.data_ptr
_NBYTES = operator.attrgetter("nbytes")
_DTYPE = operator.attrgetter("dtype")
_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def _plain_dispatch(cls: type) -> bool:
    """Whether a tensor class zeroes as a plain tensor does: ``Parameter``, or a
    subclass that overrides neither ``__torch_function__`` nor ``__torch_dispatch__``."""
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return True
    return (
        issubclass(cls, torch.Tensor)
        and getattr(cls, "__torch_dispatch__", None) is getattr(torch.Tensor, "__torch_dispatch__", None)
        and getattr(cls.__torch_function__, "__func__", None) is getattr(torch.Tensor.__torch_function__, "__func__", None)
    )


def _span(tensor: torch.Tensor) -> int:
    """The bytes from a tensor's first element to the end of its last."""
    if tensor.numel() == 0:
        return 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return extent * tensor.element_size()


def unwritable_reason(tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` cannot be zeroed in place here, or None."""
    cls = type(tensor)
    if not _plain_dispatch(cls):
        return f"a {cls.__qualname__} (a tensor subclass with its own dispatch: opttree cannot tell that zeroing it is exact)"
    if tensor.layout is not torch.strided:
        return f"a {str(tensor.layout).removeprefix('torch.')} tensor (only dense tensors are zeroed in place)"
    if tensor.is_quantized:
        return "a quantized tensor (it has no in-place zero)"
    if tensor.is_meta:
        return "a meta tensor (it has no data to zero)"
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        return "an inference tensor (it can only be written inside torch.inference_mode())"
    if tensor.numel() and _storage_short(tensor):
        return "a tensor whose storage is freed or smaller than the tensor"
    return None


def _storage_short(tensor: torch.Tensor) -> bool:
    storage = tensor.untyped_storage()
    return bool(tensor.storage_offset() * tensor.element_size() + _span(tensor) > storage.nbytes())


Owner = tuple[str, str, str | None]
"""Where ranges come from: tree path, optimizer class and state key."""


@define
class Extents:
    """The address ranges ``[start, end)`` of some tensors, their bytes in all, and whose
    they are: ``owners`` holds ``(end index, owner)`` for each consecutive segment."""

    starts: list[int] = field(factory=list)
    ends: list[int] = field(factory=list)
    nbytes: int = 0
    owners: list[tuple[int, Owner]] = field(factory=list)

    def extend(self, other: Extents) -> None:
        base = len(self.starts)
        self.starts.extend(other.starts)
        self.ends.extend(other.ends)
        self.nbytes += other.nbytes
        self.owners.extend((base + end, owner) for end, owner in other.owners)

    def owned(self, owner: Owner) -> Extents:
        """These ranges, all owned by ``owner``."""
        self.owners = [(len(self.starts), owner)] if self.starts else []
        return self

    def owner(self, index: int) -> Owner:
        ends = [end for end, _ in self.owners]
        return self.owners[bisect.bisect_right(ends, index)][1]


def ranges(tensors: Sequence[torch.Tensor], starts: list[int] | None = None) -> Extents:
    """The address ranges of ``tensors`` (whose data addresses are ``starts``, where the
    caller has them already); none for tensors without plain storage (a sparse tensor
    kept or dropped, never written)."""
    try:
        if starts is None:
            starts = list(map(_DATA_PTR, tensors))
        sizes = list(map(_NBYTES, tensors))
    except (RuntimeError, NotImplementedError):
        return Extents()
    spans = sizes
    if not all(map(torch.Tensor.is_contiguous, tensors)):
        spans = [size if t.is_contiguous() else _span(t) for t, size in zip(tensors, sizes, strict=True)]
    return Extents(starts, list(map(operator.add, starts, spans)), sum(sizes))


def writable_ranges(tensors: Sequence[torch.Tensor]) -> Extents | tuple[int, str]:
    """:func:`ranges` if every tensor can be zeroed in place, else how many cannot and
    why the first cannot."""
    starts = _writable_starts(tensors)
    if starts is None:
        reasons = [reason for reason in map(unwritable_reason, tensors) if reason is not None]
        if reasons:
            return len(reasons), reasons[0]
    return ranges(tensors, starts)


def _writable_starts(tensors: Sequence[torch.Tensor]) -> list[int] | None:
    """The data addresses of ``tensors`` where every one is surely writable; None sends
    the list to the slow path.

    A storage freed by ``untyped_storage().resize_(0)`` has no data pointer, so a tensor
    at offset 0 of it shows a zero address; tensors at other offsets are checked against
    their storage's size.
    """
    if not all(map(_plain_dispatch, set(map(type, tensors)))):
        return None
    if not _QUANTIZED.isdisjoint(map(_DTYPE, tensors)):
        return None
    if not torch.is_inference_mode_enabled() and any(map(torch.Tensor.is_inference, tensors)):
        return None
    try:
        starts = list(map(_DATA_PTR, tensors))
    except RuntimeError:  # sparse tensors have no data pointer
        return None
    if 0 in starts and any(start == 0 and t.numel() for start, t in zip(starts, tensors, strict=True)):
        return None
    offset = [t for t, o in zip(tensors, map(torch.Tensor.storage_offset, tensors), strict=True) if o]
    return None if any(map(_storage_short, offset)) else starts


def duplicates(ranges: Extents) -> tuple[int, int | None]:
    """How many ranges repeat an earlier one exactly (one step tensor held for several
    parameters), and the index of the first repeat."""
    if len(ranges.starts) < 2:
        return 0, None
    starts = torch.tensor(ranges.starts, dtype=torch.int64)
    unique, inverse = torch.unique(starts, return_inverse=True)
    repeats = len(starts) - len(unique)
    if not repeats:
        return 0, None
    first_of = torch.full((len(unique),), len(starts), dtype=torch.int64).scatter_reduce_(
        0, inverse, torch.arange(len(starts)), reduce="amin"
    )
    repeated = torch.nonzero(first_of[inverse] != torch.arange(len(starts))).flatten()
    return repeats, int(repeated[0])


def unique_ranges(ranges: Extents) -> Extents:
    """``ranges`` without exact repeats, owners kept for the first of each."""
    seen: dict[tuple[int, int], None] = dict.fromkeys(zip(ranges.starts, ranges.ends, strict=True))
    if len(seen) == len(ranges.starts):
        return ranges
    kept = Extents(nbytes=ranges.nbytes)
    done: set[tuple[int, int]] = set()
    for index, pair in enumerate(zip(ranges.starts, ranges.ends, strict=True)):
        if pair in done:
            continue
        done.add(pair)
        kept.starts.append(pair[0])
        kept.ends.append(pair[1])
        kept.owners.append((len(kept.starts), ranges.owner(index)))
    return kept


def overlap(written: Extents, kept: Extents) -> tuple[Owner, Owner] | None:
    """The owners of a written range that overlaps another written range or a kept one,
    or None. Empty ranges overlap nothing."""
    if not written.starts:
        return None
    starts = torch.tensor(written.starts, dtype=torch.int64)
    ends = torch.tensor(written.ends, dtype=torch.int64)
    order = torch.argsort(starts, stable=True)
    starts, ends = starts[order], ends[order]
    live = ends > starts
    # Among written ranges: range i overlaps an earlier one iff it starts before the
    # furthest earlier end (the earlier ones sorted by start).
    furthest = torch.cummax(torch.where(live, ends, starts), dim=0)
    clash = torch.nonzero(live[1:] & (starts[1:] < furthest.values[:-1])).flatten()
    if clash.numel():
        i = int(clash[0]) + 1
        return written.owner(int(order[i])), written.owner(int(order[furthest.indices[i - 1]]))
    if not kept.starts:
        return None
    # Written ranges are now disjoint and sorted, so their ends are sorted too: a kept
    # range [a, b) overlaps one iff the last written range starting before b ends after a.
    a = torch.tensor(kept.starts, dtype=torch.int64)
    b = torch.tensor(kept.ends, dtype=torch.int64)
    last = torch.searchsorted(starts, b, side="left") - 1
    hit = (b > a) & (last >= 0) & (ends[last.clamp(min=0)] > a)
    found = torch.nonzero(hit).flatten()
    if found.numel() == 0:
        return None
    k = int(found[0])
    return written.owner(int(order[int(last[k])])), kept.owner(k)
