"""A registered wrapper that steps copies of its parameters, for the tests of what
``register_wrapper``'s ``inner_params`` reaches: partial resets and master checks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

import opttree


class CopyingWrapper:
    """A wrapper that steps fp32 copies of its parameters, as Megatron's mixed-precision
    ones do: clones of them, or the ``copies`` given (of any kind a test needs)."""

    def __init__(self, params: list[torch.nn.Parameter], copies: Sequence[torch.Tensor] = ()) -> None:
        self.params = params
        self.copies = list(copies) or [p.detach().clone() for p in params]
        self.optimizer = torch.optim.AdamW(self.copies)


def _children(wrapper: object) -> Iterator[tuple[str, object]]:
    assert isinstance(wrapper, CopyingWrapper)
    yield "optimizer", wrapper.optimizer


def _inner(wrapper: object, path: str) -> Iterator[tuple[torch.Tensor, list[torch.Tensor]]]:
    assert isinstance(wrapper, CopyingWrapper)
    for param, copy in zip(wrapper.params, wrapper.copies, strict=True):
        yield param, [copy]


opttree.register_wrapper(CopyingWrapper, children=_children, inner_params=_inner)
