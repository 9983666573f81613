"""Pre-flight checks on the tensors a reset writes, before it writes any.

Everything that would make zeroing fail half-way, or silently do nothing, is found
here: tensors that cannot be written in place (inference tensors outside inference mode,
quantized, sparse and meta tensors, tensors whose storage is freed or smaller than the
tensor, tensor subclasses with their own dispatch) and history that shares memory with
other state or with a parameter (zeroing it would zero them too).

Each check runs over a list at once, through ``map`` at C speed, a few hundred tensors at
a time (:data:`CHUNK`); only a list that fails a cheap check is looked at tensor by tensor,
to say why. Memory is compared by address ranges: one vectorised sort over every range a
reset writes or must keep.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence
from itertools import compress

import torch
from attrs import define, field

_DATA_PTR = torch.Tensor.data_ptr
_NBYTES = operator.attrgetter("nbytes")
_DTYPE = operator.attrgetter("dtype")
_STORAGE = torch.Tensor.untyped_storage
_STORAGE_START = torch.UntypedStorage.data_ptr
_STORAGE_NBYTES = torch.UntypedStorage.nbytes
_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})

CHUNK = 512
"""Tensors read per round. A tensor's fields live in its TensorImpl and StorageImpl, which
cost a cache and TLB miss to reach the first time and little after: reading every field
of a few hundred tensors before moving on pays that miss once per tensor, where reading
one field of all of them at a time pays it once per field."""


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
    they are: ``owners`` holds ``(end index, owner)`` for each consecutive segment.

    ``whole`` says that each range is known to be the whole of a storage of its own
    tensor's (at offset 0, and as long as the storage): such a tensor cannot grow or move
    in place without its data address changing, which a reused plan checks.
    """

    starts: list[int] = field(factory=list)
    ends: list[int] = field(factory=list)
    nbytes: int = 0
    owners: list[tuple[int, Owner]] = field(factory=list)
    whole: bool = True

    def extend(self, other: Extents) -> None:
        base = len(self.starts)
        self.whole = self.whole and other.whole
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


def _chunks(tensors: Sequence[torch.Tensor]) -> list[Sequence[torch.Tensor]]:
    return [tensors] if len(tensors) <= CHUNK else [tensors[i : i + CHUNK] for i in range(0, len(tensors), CHUNK)]


def ranges(tensors: Sequence[torch.Tensor]) -> Extents:
    """The address ranges of ``tensors``; none for a tensor without plain storage (a
    sparse tensor kept or dropped, never written)."""
    found = Extents(whole=not tensors)
    for chunk in _chunks(tensors):
        try:
            starts = list(map(_DATA_PTR, chunk))
        except (RuntimeError, NotImplementedError):
            chunk = [t for t in chunk if _has_data(t)]
            starts = list(map(_DATA_PTR, chunk))
        sizes = list(map(_NBYTES, chunk))
        spans = sizes if all(map(torch.Tensor.is_contiguous, chunk)) else list(map(_span, chunk))
        found.starts.extend(starts)
        found.ends.extend(map(operator.add, starts, spans))
        found.nbytes += sum(sizes)
    return found


def _has_data(tensor: torch.Tensor) -> bool:
    try:
        tensor.data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def writable_ranges(tensors: Sequence[torch.Tensor]) -> Extents | tuple[int, str]:
    """:func:`ranges` if every tensor can be zeroed in place, else how many cannot and
    why the first cannot."""
    found = _surely_writable(tensors)
    if found is not None:
        return found
    reasons = [reason for reason in map(unwritable_reason, tensors) if reason is not None]
    if reasons:
        return len(reasons), reasons[0]
    return ranges(tensors)


def _surely_writable(tensors: Sequence[torch.Tensor]) -> Extents | None:
    """The ranges of ``tensors`` where every one is surely writable, with ``whole`` set
    where each is its storage's whole; None sends the list to the slow path.

    A tensor's extent, measured from its storage's start, must fit in the storage: a
    storage freed by ``untyped_storage().resize_(0)`` or shrunk in place has no room, and
    zeroing through it would write outside any allocation.
    """
    if not all(map(_plain_dispatch, set(map(type, tensors)))):
        return None
    outside_inference = not torch.is_inference_mode_enabled()
    found = Extents()
    for chunk in _chunks(tensors):
        try:
            starts = list(map(_DATA_PTR, chunk))
            storages = list(map(_STORAGE, chunk))
            bases = list(map(_STORAGE_START, storages))
            capacities = list(map(_STORAGE_NBYTES, storages))
        except (RuntimeError, NotImplementedError):  # sparse tensors have no data pointer
            return None
        sizes = list(map(_NBYTES, chunk))
        if 0 in starts and any(compress(sizes, map(operator.not_, starts))):
            return None  # meta tensors and freed storages show no address
        if not _QUANTIZED.isdisjoint(map(_DTYPE, chunk)):
            return None
        if outside_inference and any(map(torch.Tensor.is_inference, chunk)):
            return None
        contiguous = all(map(torch.Tensor.is_contiguous, chunk))
        ends = list(map(operator.add, starts, sizes if contiguous else map(_span, chunk)))
        if any(map(operator.gt, map(operator.sub, ends, bases), capacities)):
            return None
        found.whole = found.whole and contiguous and bases == starts and capacities == sizes
        found.starts.extend(starts)
        found.ends.extend(ends)
        found.nbytes += sum(sizes)
    return found


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
