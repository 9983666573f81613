"""opttree.testing.cuda_on_cpu, the context that runs Megatron's CUDA calls on the CPU."""

from __future__ import annotations

import torch

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
