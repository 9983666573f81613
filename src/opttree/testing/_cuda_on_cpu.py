"""Run Megatron's CUDA-only code paths on the CPU, for tests and demos.

Megatron's optimizer factory, ``DistributedDataParallel`` and ``HybridDeviceOptimizer``
ask for CUDA devices, streams and events and check ``tensor.is_cuda``. Inside
:func:`cuda_on_cpu`, a ``TorchFunctionMode`` sends every CUDA placement to the CPU and
keeps a *pretend device* tag per tensor: a tensor made "on CUDA", or computed from one,
answers ``is_cuda`` as True and ``type()`` as ``torch.cuda.*Tensor``; ``.cpu()``,
``.to("cpu")`` and ``pin_memory`` copies answer False. ``HybridDeviceOptimizer`` thereby
splits its parameters between CPU and "GPU" sub-optimizers exactly as on a GPU machine.
The ``torch.cuda`` stream, event and device calls Megatron makes are replaced by CPU
no-ops for the duration. Arithmetic is untouched: every kernel is the CPU one.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from opttree._errors import OptTreeError

_TENSOR_TYPE_NAMES = {
    torch.float32: "FloatTensor",
    torch.float16: "HalfTensor",
    torch.bfloat16: "BFloat16Tensor",
    torch.float64: "DoubleTensor",
    torch.int32: "IntTensor",
    torch.int64: "LongTensor",
    torch.int16: "ShortTensor",
    torch.int8: "CharTensor",
    torch.uint8: "ByteTensor",
    torch.bool: "BoolTensor",
}


_IS_CUDA: object = inspect.getattr_static(torch.Tensor, "is_cuda").__get__


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _device_argument(func: Callable[..., object], args: list[object], kwargs: dict[str, object]) -> tuple[str, int | str] | None:
    """Where a call names a device: ``("kw", "device")`` or ``("pos", 1)`` for ``Tensor.to``."""
    if kwargs.get("device") is not None:
        return ("kw", "device")
    if func is torch.Tensor.to and len(args) > 1:
        first = args[1]
        if isinstance(first, (str, torch.device)) or (isinstance(first, int) and not isinstance(first, bool)):
            return ("pos", 1)
    return None


def _call(func: Callable[..., object], args: list[object], kwargs: dict[str, object]) -> object:
    return func(*args, **kwargs)


class _CudaOnCpu(TorchFunctionMode):
    def __init__(self, on_gpu: WeakIdKeyDictionary) -> None:
        super().__init__()
        self.on_gpu = on_gpu

    def tag(self, value: object) -> None:
        if isinstance(value, torch.Tensor):
            self.on_gpu[value] = True
        elif isinstance(value, (list, tuple)):
            for item in value:
                self.tag(item)

    def on(self, value: object) -> bool:
        return isinstance(value, torch.Tensor) and value in self.on_gpu

    def move(self, source: object, result: object, *, to_gpu: bool) -> object:
        """A device copy is a new tensor; the CPU call may have returned its input."""
        if isinstance(result, torch.Tensor) and result is source and self.on(source) != to_gpu:
            result = result.clone()
        if to_gpu:
            self.tag(result)
        return result

    def __torch_function__(
        self,
        func: Callable[..., object],
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        call_args = list(args)
        call_kwargs = dict(kwargs or {})
        tensor = torch.Tensor
        if func == _IS_CUDA:  # a fresh method-wrapper on every access: compare, not ``is``
            return self.on(call_args[0])
        if func is tensor.is_pinned:
            return False
        if func is tensor.pin_memory:
            return call_args[0]
        if func is tensor.type and len(call_args) == 1 and not call_kwargs:
            source = call_args[0]
            if isinstance(source, torch.Tensor) and self.on(source):
                return f"torch.cuda.{_TENSOR_TYPE_NAMES.get(source.dtype, 'FloatTensor')}"
        if func is tensor.cuda:
            return self.move(call_args[0], call_args[0], to_gpu=True)
        if func is tensor.cpu:
            return self.move(call_args[0], _call(func, call_args, call_kwargs), to_gpu=False)
        if call_kwargs.get("pin_memory"):
            call_kwargs["pin_memory"] = False
        where = _device_argument(func, call_args, call_kwargs)
        if where is not None:
            kind, slot = where
            target = call_kwargs[str(slot)] if kind == "kw" else call_args[int(slot)]
            to_gpu = _is_cuda_device(target)
            if kind == "kw":
                call_kwargs[str(slot)] = "cpu"
            else:
                call_args[int(slot)] = "cpu"
            result = func(*call_args, **call_kwargs)
            return self.move(call_args[0] if call_args else None, result, to_gpu=to_gpu)
        result = func(*call_args, **call_kwargs)
        if any(self.on(a) for a in call_args) and not any(result is a for a in call_args):
            self.tag(result)
        return result


class _Stream:
    """A CPU stand-in for ``torch.cuda.Stream``: work is already in order on the CPU."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def record_event(self, event: object = None) -> _Event:
        return _Event()

    def synchronize(self) -> None:
        pass

    def is_capturing(self) -> bool:
        return False


class _Event:
    """A CPU stand-in for ``torch.cuda.Event``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: object) -> float:
        return 0.0


@contextlib.contextmanager
def _stream_context(stream: object = None) -> Iterator[None]:
    yield


def _does_nothing(name: str) -> Callable[..., None]:
    """A function that does nothing, its own object for each name it replaces: torch.compile
    (dynamo) keys its rules for torch's functions by object, and asserts on one object
    found under two functions with different rules (``torch.cuda.synchronize`` and
    ``torch.accelerator.synchronize``)."""

    def nothing(*args: object, **kwargs: object) -> None:
        return None

    nothing.__name__ = nothing.__qualname__ = name
    return nothing


_CUDA_PATCHES: dict[str, object] = {
    "Stream": _Stream,
    "Event": _Event,
    "stream": _stream_context,
    "current_stream": lambda *a, **k: _Stream(),
    "default_stream": lambda *a, **k: _Stream(),
    "current_device": lambda: 0,
    "device_count": lambda: 1,
    "set_device": _does_nothing("set_device"),
    "synchronize": _does_nothing("synchronize"),
    "empty_cache": _does_nothing("empty_cache"),
    "is_available": lambda: True,
    "memory_allocated": lambda *a, **k: 0,
    "max_memory_allocated": lambda *a, **k: 0,
    "is_current_stream_capturing": lambda: False,
}
# torch >= 2.8 optimizers ask the accelerator API whether a graph is being captured.
_ACCELERATOR_PATCHES: dict[str, object] = {
    "current_stream": lambda *a, **k: _Stream(),
    "current_device_index": lambda: 0,
    "synchronize": _does_nothing("synchronize"),
}


class _Patches:
    """The process-wide patches (``torch.cuda``'s and the accelerator's calls, and dynamo
    turned off), applied while any thread is inside any :class:`CudaOnCpu`: counted under
    a lock, so that threads entering and leaving in any order neither undo another's nor
    leave them behind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._stack: contextlib.ExitStack | None = None

    def enter(self) -> None:
        with self._lock:
            if self._users == 0:
                stack = contextlib.ExitStack()
                for name, value in _CUDA_PATCHES.items():
                    stack.enter_context(mock.patch.object(torch.cuda, name, value))
                accelerator = getattr(torch, "accelerator", None)
                for name, value in _ACCELERATOR_PATCHES.items():
                    if hasattr(accelerator, name):
                        stack.enter_context(mock.patch.object(accelerator, name, value))
                # torch.compile would compile for the CUDA device the tensors claim, and finds
                # no GPU: compiled functions (emerging-optimizers' Lion, LaProp, SOAP, REKLS
                # updates) run eagerly instead, the same arithmetic on the CPU. Set as a value,
                # not through dynamo's config.patch, whose undoing must run on the thread that
                # made it.
                stack.enter_context(mock.patch.object(torch._dynamo.config, "disable", True))
                self._stack = stack
            self._users += 1

    def exit(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._stack is not None:
                self._stack.close()
                self._stack = None


_PATCHES = _Patches()


class CudaOnCpu:
    """Context manager behind :func:`cuda_on_cpu`; re-entrant, also nested and from several
    threads at once, with the same tags. The pretend-device mode is each thread's own, as
    torch's function modes are; the patches are the process's (see :class:`_Patches`)."""

    def __init__(self) -> None:
        self.on_gpu: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._entered = threading.local()  # this thread's modes, one per enter not yet exited

    def _modes(self) -> list[contextlib.ExitStack]:
        modes: list[contextlib.ExitStack] | None = getattr(self._entered, "modes", None)
        if modes is None:
            modes = self._entered.modes = []
        return modes

    def mark_on_gpu(self, *tensors: torch.Tensor) -> None:
        """Treat existing tensors (a model's parameters) as if they lived on the GPU."""
        for t in tensors:
            self.on_gpu[t] = True

    def __enter__(self) -> CudaOnCpu:
        _PATCHES.enter()
        mode = contextlib.ExitStack()
        try:
            mode.enter_context(_CudaOnCpu(self.on_gpu))
        except BaseException:
            _PATCHES.exit()
            raise
        self._modes().append(mode)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        modes = self._modes()
        if not modes:
            msg = "CudaOnCpu exited on a thread that has not entered it"
            raise OptTreeError(msg)
        try:
            modes.pop().close()
        finally:
            _PATCHES.exit()


def cuda_on_cpu() -> CudaOnCpu:
    """A context in which Megatron's CUDA device, stream and tensor-type calls run on the CPU."""
    return CudaOnCpu()
