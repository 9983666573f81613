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
