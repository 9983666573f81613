"""Pre-flight checks on the tensors a reset writes, before it writes any.

Everything that would make zeroing fail half-way, or silently do nothing, is found
here: tensors that cannot be written in place, or that no step outside inference mode
could write (inference tensors, in either mode), quantized, sparse and meta tensors,
tensors whose storage is freed or smaller than the tensor, expanded views whose elements
share memory, tensor subclasses with their own dispatch, and history that shares memory with
other state or with a parameter (zeroing it would zero them too).

Each check runs over a list at once, through ``map`` at C speed, a few hundred tensors at
a time (:data:`CHUNK`); only a list that fails a cheap check is looked at tensor by tensor,
to say why. Memory is compared by address ranges: one sort over every range a reset
writes or must keep.
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from itertools import accumulate, compress, count, islice, repeat, starmap
from typing import cast

import torch
from attrs import define, field
from torch.utils._python_dispatch import _disable_current_modes, is_traceable_wrapper_subclass

from opttree._fields import article
from opttree._mappings import Mappings

_Tensor = torch._C.TensorBase
_IS_WRAPPER: Callable[[object], bool] = is_traceable_wrapper_subclass  # a plain bool, not a narrowing guard


def _getter(name: str) -> Callable[[torch.Tensor], object]:
    """The C getter of a tensor attribute, which a subclass's own Python property of
    that name does not replace (it could report a size or type the memory does not have)."""
    return cast(Callable[[torch.Tensor], object], _Tensor.__dict__[name].__get__)


_DATA_PTR = cast(Callable[[torch.Tensor], int], _Tensor.data_ptr)
_NBYTES = cast(Callable[[torch.Tensor], int], _getter("nbytes"))
_DTYPE = cast(Callable[[torch.Tensor], torch.dtype], _getter("dtype"))
_SHAPE = cast(Callable[[torch.Tensor], torch.Size], _getter("shape"))
_NDIM = cast(Callable[[torch.Tensor], int], _getter("ndim"))
_LAYOUT = cast(Callable[[torch.Tensor], torch.layout], _getter("layout"))
_IS_META = cast(Callable[[torch.Tensor], bool], _getter("is_meta"))
_IS_NESTED = cast(Callable[[torch.Tensor], bool], _getter("is_nested"))
_REQUIRES_GRAD = cast(Callable[[torch.Tensor], bool], _getter("requires_grad"))
_IS_CONTIGUOUS = cast(Callable[[torch.Tensor], bool], _Tensor.is_contiguous)
_IS_INFERENCE = cast(Callable[[torch.Tensor], bool], _Tensor.is_inference)
_IS_NEG = cast(Callable[[torch.Tensor], bool], _Tensor.is_neg)
_IS_CONJ = cast(Callable[[torch.Tensor], bool], _Tensor.is_conj)
_STORAGE = cast(Callable[[torch.Tensor], torch.UntypedStorage], _Tensor.untyped_storage)
_STORAGE_START = torch.UntypedStorage.data_ptr
_STORAGE_NBYTES = torch.UntypedStorage.nbytes
_RESIZABLE = torch.UntypedStorage.resizable
_STORAGE_DEVICE = cast(Callable[[torch.UntypedStorage], torch.device], vars(torch._C.StorageBase)["device"].__get__)
_INTERNAL_OVERLAP = cast(Callable[[torch.Tensor], int], torch._debug_has_internal_overlap)
_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})
_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})


@contextmanager
def plain_torch() -> Iterator[None]:
    """Run torch as plain calls: no torch function mode or subclass override, and no
    dispatch mode. Modes are per thread and the zeroing threads have none, so one active
    on the calling thread would see, change or refuse some of a reset's reads and writes
    and not others; a reset's checks and writes run under this on every thread alike."""
    with torch._C.DisableTorchFunction(), _disable_current_modes():
        yield


def plain_reads() -> AbstractContextManager[None]:
    """Read tensors' metadata as their C++ objects hold it: a subclass's own
    ``__torch_function__``, which may refuse or change what it is asked, is not called.
    For reading tensors not yet known to be of a plain class."""
    return torch._C.DisableTorchFunctionSubclass()


CHUNK = 512
"""Tensors read per round. A tensor's fields live in its TensorImpl and StorageImpl, which
cost a cache and TLB miss to reach the first time and little after: reading every field
of a few hundred tensors before moving on pays that miss once per tensor, where reading
one field of all of them at a time pays it once per field."""


def torch_name(value: torch.dtype | torch.layout) -> str:
    """A dtype or layout as messages name it: ``bfloat16``, not ``torch.bfloat16``."""
    return str(value).removeprefix("torch.")


def plain_dispatch(cls: type) -> bool:
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


def unwritable_reason(tensor: torch.Tensor, *, copied: bool = False) -> str | None:
    """Why ``tensor`` cannot be zeroed in place here, or None: the checks of
    :func:`_surely_writable`, one tensor at a time, to say which. A tensor whose memory
    torch refuses to show (a functorch wrapper leaked from ``torch.func.grad``) is one.
    ``copied``: what is written is a dense copy of it (torch's load casts history to its
    parameter's dtype or device), so only what a copy keeps, or cannot read, counts."""
    try:
        return _unwritable_reason(tensor, copied=copied)
    except Exception as error:  # noqa: BLE001  # a wrapper tensor's own C++ code may raise anything
        return f"a tensor whose memory cannot be read ({type(error).__name__}: {error})"


def _unwritable_reason(tensor: torch.Tensor, *, copied: bool) -> str | None:
    cls = type(tensor)
    if not plain_dispatch(cls):
        return f"{article(cls.__qualname__)} (a tensor subclass with its own dispatch: opttree cannot tell that zeroing it is exact)"
    layout = _LAYOUT(tensor)
    if layout is not torch.strided:
        return f"{article(torch_name(layout))} tensor (only dense tensors are zeroed in place)"
    if _IS_NESTED(tensor):
        return "a nested tensor (it has no in-place zero of its own)"
    if _DTYPE(tensor) in _QUANTIZED:
        return "a quantized tensor (it has no in-place zero)"
    if _IS_META(tensor):
        return "a meta tensor (it has no data to zero)"
    if not copied and _IS_INFERENCE(tensor):
        return (
            "an inference tensor (state loaded or built inside torch.inference_mode(): no step outside it can update "
            "it in place, and a fresh optimizer's is not one)"
        )
    if not copied and (_IS_CONJ(tensor) or _IS_NEG(tensor)):
        return "a conjugate or negative view (zeroing through it leaves -0 in memory, where a fresh optimizer has +0)"
    missing = _missing_memory(tensor)
    if missing is not None:
        return missing
    if not copied and not _in_writable_memory([tensor], Mappings()):
        return (
            "a tensor in memory the process cannot write, or cannot tell it can (a read-only memory map, as "
            "np.load(mmap_mode='r') gives: zeroing it would kill the process)"
        )
    if not copied and _overlaps_itself(tensor):
        return "a tensor whose elements share or may share memory (an expanded or overlapping strided view: an in-place step through it is not a fresh one's)"
    return None


def _missing_memory(tensor: torch.Tensor) -> str | None:
    """Why a dense tensor's elements are not in memory it holds, or None."""
    if tensor.numel() and _storage_short(tensor):
        return "a tensor whose storage is freed or smaller than the tensor"
    if tensor.numel() and _DATA_PTR(tensor) == 0:
        return (
            "a tensor that shows no memory of its own (a functional tensor, as torch.func.functionalize "
            "makes: opttree cannot tell that writing or reading it reaches the data it stands for)"
        )
    return None


def unreadable_reason(tensor: torch.Tensor) -> str | None:
    """Why the values of ``tensor`` cannot be read to copy them elsewhere (a checkpoint's
    master weight, which Megatron's load copies in after loading everything else), or None."""
    try:
        with plain_reads():
            if not plain_dispatch(type(tensor)) or _LAYOUT(tensor) is not torch.strided or _IS_NESTED(tensor):
                return None  # its own code reads it, as torch's copy does
            if _IS_META(tensor):
                return "a meta tensor (it has no data)"
            return _missing_memory(tensor)
    except Exception as error:  # noqa: BLE001  # a wrapper tensor's own C++ code may raise anything
        return f"a tensor whose memory cannot be read ({type(error).__name__}: {error})"


def unfillable_reason(value: float, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why a tensor of ``dtype`` on ``device`` cannot hold ``value``, or None. For a finite
    value beyond the dtype's range (an fp16 ``step_size`` filled with an lr of 1e5)
    ``fill_`` either raises, half-way through a reset, or writes inf where a fresh
    optimizer would refuse; for some dtypes (bcomplex32 on the CPU) torch implements no
    ``fill_`` at all."""
    unfilled = _unfillable_dtype(dtype, device.type)
    if unfilled is not None:
        return unfilled
    try:
        if dtype.is_floating_point or dtype.is_complex:
            largest = torch.finfo(dtype).max
            if math.isfinite(value) and abs(value) > largest:
                return f"{value:g} is beyond {torch_name(dtype)}'s largest value, {largest:g}"
            return None
        if dtype is torch.bool:
            return None
        info = torch.iinfo(dtype)
    except (TypeError, RuntimeError):  # a dtype torch gives no range for (bits8)
        return f"torch gives no range for {torch_name(dtype)}, so whether it holds {value:g} is not known"
    if not math.isfinite(value) or not info.min <= value <= info.max:
        return f"{value:g} is outside {torch_name(dtype)}'s range"
    return None


@functools.cache
def _unfillable_dtype(dtype: torch.dtype, device_type: str) -> str | None:
    """Why torch's ``fill_`` cannot write ``dtype`` tensors on ``device_type``, or None:
    asked of torch once, by filling a few elements there with one (a dtype's ``finfo``
    does not tell; one element, or zero, takes paths of their own that bcomplex32's pass)."""
    try:
        with plain_torch(), torch.inference_mode(False), torch.no_grad():
            torch.empty(64, dtype=dtype, device=device_type).fill_(1)
    except Exception as error:  # noqa: BLE001  # NotImplementedError on the CPU; a device's own errors
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        return f"torch cannot fill {torch_name(dtype)} tensors on {device_type} ({reason})"
    return None


def _overlaps_itself(tensor: torch.Tensor) -> bool:
    """Whether some elements of ``tensor`` may share memory, where an in-place step
    through it is not a fresh optimizer's (torch's own operations refuse some such views
    and run through others). Torch tells a dense tensor, in any memory format, from one
    that surely overlaps; any other view (a slice of columns) is looked at here: its
    elements are apart if, its dimensions taken by stride, each stride passes the reach
    of the dimensions before it."""
    if _INTERNAL_OVERLAP(tensor) == 0:
        return False
    reach = 0
    for stride, size in sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def unlike_layouts(
    history: Sequence[torch.Tensor], params: Sequence[torch.Tensor], *, from_grad: bool
) -> list[tuple[int, tuple[int, ...], tuple[int, ...] | None]]:
    """Where history that its optimizer builds ``zeros_like`` its parameter (or, with
    ``from_grad``, ``zeros_like`` the parameter's gradient) is not laid out in memory as a
    fresh one would be (see :func:`_fresh_strides` and :func:`_gradient_strides`): each
    place, with the history's strides and the fresh ones (None where torch cannot lay one
    out for the parameter). Strides are compared over the dimensions of more than one
    element (the others place nothing)."""
    layout = _gradient_strides if from_grad else _fresh_strides
    found: list[tuple[int, tuple[int, ...], tuple[int, ...] | None]] = []
    with plain_torch():
        for index, (tensor, param) in enumerate(zip(history, params, strict=True)):
            shape, strides = tuple(tensor.shape), tuple(tensor.stride())
            fresh = layout(param)
            if fresh is None or any(strides[dim] != fresh[dim] for dim, size in enumerate(shape) if size > 1):
                found.append((index, strides, fresh))
    return found


def _fresh_strides(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The strides ``zeros_like(tensor)`` gives, or None where torch cannot lay one out."""
    try:
        return tuple(torch.empty_like(tensor, device="meta").stride())
    except Exception:  # noqa: BLE001  # a tensor subclass's own code may raise anything
        return None


def _gradient_strides(param: torch.Tensor) -> tuple[int, ...] | None:
    """The strides of the gradient autograd gives ``param`` (its layout contract): the
    parameter's own where its elements are dense and apart, as ``zeros_like`` lays them
    out, else contiguous. What the gradient held now is laid out as says nothing of the
    next one (kept from before the weight was laid out anew, or set by hand)."""
    fresh = _fresh_strides(param)
    if fresh is None:
        return None
    shape = tuple(param.shape)
    if all(held == laid for held, laid, size in zip(param.stride(), fresh, shape, strict=True) if size > 1):
        return fresh
    return _contiguous_strides(shape)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _storage_short(tensor: torch.Tensor) -> bool:
    storage = _STORAGE(tensor)
    return bool(tensor.storage_offset() * tensor.element_size() + _span(tensor) > _STORAGE_NBYTES(storage))


Owner = tuple[str, str, str | None]
"""Where ranges come from: tree path, optimizer class and state key."""


@define
class Extents:
    """The address ranges ``[start, end)`` of some tensors, their bytes in all, and whose
    they are: ``owners`` holds ``(end index, owner)`` for each consecutive segment.
    ``unseen`` counts the tensors whose memory could not be read (see :func:`ranges`)."""

    starts: list[int] = field(factory=list)
    ends: list[int] = field(factory=list)
    nbytes: int = 0
    owners: list[tuple[int, Owner]] = field(factory=list)
    unseen: int = 0
    dtypes: list[torch.dtype] = field(factory=list)
    """The dtype of each tensor, in order, where :func:`writable_ranges` placed them."""
    contiguous: bool = True
    """Whether every tensor placed is contiguous (read as their spans are)."""

    def extend(self, other: Extents) -> None:
        base = len(self.starts)
        self.starts.extend(other.starts)
        self.ends.extend(other.ends)
        self.nbytes += other.nbytes
        self.unseen += other.unseen
        self.contiguous &= other.contiguous
        self.owners.extend((base + end, owner) for end, owner in other.owners)

    def owned(self, owner: Owner) -> Extents:
        """These ranges, all owned by ``owner``."""
        self.owners = [(len(self.starts), owner)] if self.starts else []
        return self

    def owner(self, index: int) -> Owner:
        ends = [end for end, _ in self.owners]
        return self.owners[bisect.bisect_right(ends, index)][1]


def bytes_once(found: Extents) -> int:
    """The bytes of the memory ``found`` spans, each address range counted once: one step
    tensor held for several parameters (as Megatron's CPU load path leaves it), or views of
    its memory, is one tensor's memory, as a reset counts it one step. A strided view with
    gaps counts the memory from its first element to its last."""
    return sum(starmap(operator.sub, set(zip(found.ends, found.starts, strict=True))))


def _chunks(tensors: Sequence[torch.Tensor]) -> list[Sequence[torch.Tensor]]:
    return [tensors] if len(tensors) <= CHUNK else [tensors[i : i + CHUNK] for i in range(0, len(tensors), CHUNK)]


def ranges(tensors: Sequence[torch.Tensor]) -> Extents:
    """The address ranges of ``tensors``, which a reset keeps or drops.

    A wrapper subclass (DTensor, a float8 tensor) is placed by the tensors it wraps, and a
    sparse tensor by its indices and values. A tensor whose memory cannot be read otherwise
    counts in ``unseen``: a kept one is refused by the caller, since opttree cannot tell
    that zeroing history leaves it alone.
    """
    found = Extents()
    with plain_reads():
        if all(map(plain_dispatch, set(map(type, tensors)))):
            for chunk in _chunks(tensors):
                try:
                    _add_plain(found, chunk)
                except (RuntimeError, NotImplementedError):  # sparse tensors have no data pointer
                    for tensor in chunk:
                        _add_any(found, tensor)
        else:
            for tensor in tensors:
                _add_any(found, tensor)
    return found


def _add_plain(found: Extents, tensors: Sequence[torch.Tensor]) -> None:
    starts = list(map(_DATA_PTR, tensors))
    sizes = list(map(_NBYTES, tensors))
    contiguous = all(map(_IS_CONTIGUOUS, tensors))
    spans = sizes if contiguous else list(map(_span, tensors))
    found.contiguous &= contiguous
    found.starts.extend(starts)
    found.ends.extend(map(operator.add, starts, spans))
    found.nbytes += sum(sizes)


def _parts(tensor: torch.Tensor) -> list[torch.Tensor] | None:
    """The tensors that hold a wrapper subclass's or a sparse tensor's memory, or None."""
    if _IS_WRAPPER(tensor):
        names, _ = getattr(tensor, "__tensor_flatten__")()
        inner = [getattr(tensor, name) for name in names]
        return [part for part in inner if isinstance(part, torch.Tensor)]  # DTensor lists its mesh too
    layout = _LAYOUT(tensor)
    if layout is torch.sparse_coo:
        return [tensor._indices(), tensor._values()]
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    return None


def _add_any(found: Extents, tensor: torch.Tensor, depth: int = 0) -> None:
    """Add ``tensor``'s ranges, whatever its class, layout or dispatch: any error its own
    code raises means its memory cannot be read, and it counts as unseen."""
    try:
        parts = _parts(tensor)
        if parts is None:
            if not plain_dispatch(type(tensor)) and _DATA_PTR(tensor) == 0 and _NBYTES(tensor):
                found.unseen += 1  # a wrapper with no storage of its own, which it does not name
                return
            _add_plain(found, [tensor])
            return
    except Exception:  # noqa: BLE001  # a subclass's own code may raise anything
        found.unseen += 1
        return
    if depth >= 8 or not parts:
        found.unseen += 1
        return
    for part in parts:
        _add_any(found, part, depth + 1)


def surely_readable(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor surely has its memory, read in bulk as the writable fast path
    reads it; False where any may not, for :func:`unreadable_reason` to tell tensor by tensor."""
    return _surely_writable(tensors) is not None


def writable_ranges(tensors: Sequence[torch.Tensor]) -> Extents | tuple[int, str]:
    """:func:`ranges` if every tensor can be zeroed in place, else how many cannot and
    why the first cannot."""
    found = _surely_writable(tensors)
    if found is not None:
        return found
    with plain_reads():
        reasons = [reason for reason in map(unwritable_reason, tensors) if reason is not None]
    if reasons:
        return len(reasons), reasons[0]
    found = ranges(tensors)
    with plain_reads():
        found.dtypes = list(map(_DTYPE, tensors))
    return found


def _surely_writable(tensors: Sequence[torch.Tensor]) -> Extents | None:
    """The ranges of ``tensors`` where every one is surely writable; None sends the list
    to the slow path.

    A tensor's extent, measured from its storage's start, must fit in the storage: a
    storage freed by ``untyped_storage().resize_(0)`` or shrunk in place has no room, and
    zeroing through it would write outside any allocation.
    """
    if not all(map(plain_dispatch, set(map(type, tensors)))):
        return None
    found = Extents()
    mappings = Mappings()  # read where there is memory torch did not allocate, once
    for chunk in _chunks(tensors):
        try:
            starts = list(map(_DATA_PTR, chunk))
            storages = list(map(_STORAGE, chunk))
            bases = list(map(_STORAGE_START, storages))
            capacities = list(map(_STORAGE_NBYTES, storages))
        except (RuntimeError, NotImplementedError):  # sparse tensors have no data pointer
            return None
        sizes = list(map(_NBYTES, chunk))
        if 0 in starts:
            return None  # meta tensors and freed storages show no address, and an empty one may be meta
        chunk_dtypes = list(map(_DTYPE, chunk))
        dtypes = set(chunk_dtypes)
        if not _QUANTIZED.isdisjoint(dtypes) or any(map(_IS_NEG, chunk)) or any(map(_IS_NESTED, chunk)):
            return None
        if not _COMPLEX.isdisjoint(dtypes) and any(map(_IS_CONJ, chunk)):
            return None
        if any(map(_IS_INFERENCE, chunk)):
            return None
        contiguous = all(map(_IS_CONTIGUOUS, chunk))
        if not contiguous and any(map(_overlaps_itself, chunk)):
            return None
        ends = list(map(operator.add, starts, sizes if contiguous else map(_span, chunk)))
        if any(map(operator.gt, map(operator.sub, ends, bases), capacities)):
            return None
        if not all(map(_RESIZABLE, storages)) and not _in_writable_memory(chunk, mappings, storages, starts, ends):
            return None
        found.starts.extend(starts)
        found.ends.extend(ends)
        found.nbytes += sum(sizes)
        found.dtypes.extend(chunk_dtypes)
        found.contiguous &= contiguous
    return found


def _in_writable_memory(
    tensors: Sequence[torch.Tensor],
    mappings: Mappings,
    storages: Sequence[torch.UntypedStorage] | None = None,
    starts: Sequence[int] | None = None,
    ends: Sequence[int] | None = None,
) -> bool:
    """Whether the elements of ``tensors`` whose storages torch did not allocate (it
    cannot resize them), in CPU memory, lie in memory the process may write (see
    :mod:`opttree._mappings`); device memory is not mapped read-only. ``storages``,
    ``starts`` and ``ends``, where given, are the tensors' own, already read."""
    storages = list(map(_STORAGE, tensors)) if storages is None else storages
    fixed = [i for i, resizable in enumerate(map(_RESIZABLE, storages)) if not resizable and _STORAGE_DEVICE(storages[i]).type == "cpu"]
    if not fixed:
        return True
    if starts is None or ends is None:
        found = Extents()
        _add_plain(found, tensors)
        starts, ends = found.starts, found.ends
    return mappings.first_unwritable([starts[i] for i in fixed], [ends[i] for i in fixed]) is None


def identities(objects: Sequence[object]) -> Extents:
    """Objects as one-byte ranges at their identity hashes (unique among live objects, as
    ``id()`` is, without its audit event): :func:`duplicates` then finds one reached twice."""
    starts = list(map(object.__hash__, objects))
    return Extents(starts, [start + 1 for start in starts])


def duplicates(ranges: Extents) -> tuple[int, int | None]:
    """How many ranges repeat an earlier one exactly (one step tensor held for several
    parameters), and the index of the first repeat."""
    starts = ranges.starts
    repeats = len(starts) - len(set(starts))
    first = None
    if repeats:
        seen: set[int] = set()
        for index, start in enumerate(starts):
            if start in seen:
                first = index
                break
            seen.add(start)
    return repeats, first


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


def _disjoint(starts: list[int], ends: list[int]) -> bool:
    """Whether no two of the ranges ``[start, end)`` overlap (empty ones overlap nothing):
    with starts and ends sorted apart, the k-th end must come no later than the next
    start, or two ranges are open at once."""
    starts, ends = sorted(starts), sorted(ends)
    return all(map(operator.le, ends, islice(starts, 1, None)))


def overlap(written: Extents, kept: Extents) -> tuple[Owner, Owner] | None:
    """The owners of a written range that overlaps another written range or a kept one,
    or None. Empty ranges overlap nothing.

    Over Python lists, at C speed: addresses come in a few ascending runs (one per state
    key, in allocation order), which Python's sort merges in near-linear time; and no
    torch kernel runs, whose intra-op threads hang in a child forked after its parent
    used them. Where all ranges, kept ones included, are disjoint, as they usually are,
    one check over them says so; else each written range is looked at.
    """
    n = len(written.starts)
    if not n or _disjoint([*written.starts, *kept.starts], [*written.ends, *kept.ends]):
        return None
    order = sorted(range(n), key=written.starts.__getitem__)
    starts = list(map(written.starts.__getitem__, order))
    ends = list(map(written.ends.__getitem__, order))
    live = list(map(operator.gt, ends, starts))
    # Among written ranges: range i overlaps an earlier one iff it is not empty and starts
    # before the furthest end of those sorted before it (an empty one ends where it starts).
    furthest = list(accumulate(ends, max))
    clashes = compress(count(1), map(operator.and_, live[1:], map(operator.lt, starts[1:], furthest)))
    i = next(clashes, None)
    if i is not None:
        return written.owner(order[i]), written.owner(order[ends.index(furthest[i - 1])])
    if not kept.starts:
        return None
    if not all(live):  # empty written ranges overlap nothing
        order, starts, ends = (list(compress(values, live)) for values in (order, starts, ends))
    # Written ranges are now disjoint and sorted, so their ends are sorted too: a kept
    # range [a, b) overlaps one iff the last written range starting before b ends after a.
    before = list(map(bisect.bisect_left, repeat(starts), kept.ends))
    reach = [0, *ends]  # the end of the last written range starting before b; 0 where none does
    hits = map(operator.and_, map(operator.gt, map(reach.__getitem__, before), kept.starts), map(operator.gt, kept.ends, kept.starts))
    k = next(compress(count(), hits), None)
    return None if k is None else (written.owner(order[before[k] - 1]), kept.owner(k))
