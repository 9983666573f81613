"""opttree.testing.cuda_on_cpu, the context that runs Megatron's CUDA calls on the CPU."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import opttree
from opttree import testing
from opttree.testing import cuda_on_cpu


def test_nested_in_itself_it_leaves_no_mode_or_patch_behind() -> None:
    """Helpers enter a stack's context inside one another; each exit undoes its own enter."""
    device = cuda_on_cpu()
    with device:
        with device:
            assert torch.cuda.is_available()
        assert torch.cuda.is_available() and torch._C._len_torch_function_stack() == 1
    assert torch._C._len_torch_function_stack() == 0
    assert torch.ones(2, device="meta").is_meta


def test_compiled_functions_run_eagerly_on_tensors_it_places_on_cuda() -> None:
    """emerging-optimizers' Lion compiles its update with torch.compile: inside the context
    it runs eagerly, on the CPU, rather than compiling for a GPU that is not there."""

    @torch.compile
    def update(x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x) * 0.5 + x

    with cuda_on_cpu():
        x = torch.linspace(-1, 1, 7, device="cuda")
        assert x.is_cuda
        assert torch.equal(update(x), torch.sign(x) * 0.5 + x)
        # each replaced call is its own function: dynamo keys its rules by object
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and hasattr(accelerator, "synchronize"):
            assert torch.cuda.synchronize is not accelerator.synchronize


def test_threads_entering_and_leaving_in_any_order_leave_nothing_behind() -> None:
    """Two threads in one CudaOnCpu, the first leaving while the second is inside: dynamo's
    config patch, undone on another thread, raised AssertionError, and the CUDA patches of
    one thread were undone under the other."""
    device = testing.cuda_on_cpu()
    available, disabled = torch.cuda.is_available, torch._dynamo.config.disable
    inside, leave_first = threading.Event(), threading.Event()
    seen: list[object] = []

    def first() -> None:
        with device:
            inside.set()
            leave_first.wait(10)

    def second() -> None:
        inside.wait(10)
        with device:
            leave_first.set()
            time.sleep(0.05)  # the first thread leaves while this one is inside
            seen.append(torch.cuda.is_available())

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen == [True]
    assert torch.cuda.is_available is available and torch._dynamo.config.disable == disabled


def test_leaving_without_entering_is_an_opttree_error() -> None:
    with pytest.raises(opttree.OptTreeError, match="exited on a thread that has not entered it"):
        testing.cuda_on_cpu().__exit__(None, None, None)
