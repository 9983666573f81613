"""The public functions, run as plain Python where code ``torch.compile`` traces calls them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar, cast

import torch

_P = ParamSpec("_P")
_R = TypeVar("_R")
_DISABLE = cast(Callable[[Callable[..., object]], Callable[..., object]], torch.compiler.disable)


def eager(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """``function``, run as plain Python where code that ``torch.compile`` traces calls it
    (a compiled training step that resets, or logs ``describe``, on a schedule): dynamo
    cannot trace opttree's checks (its nodes' attrs-made ``__init__``, reads of what it
    guards on), and raised its own errors from ``validate`` and ``describe``, which never
    raise, or made a sound state look malformed. The function is handed to
    ``torch.compiler.disable`` only there, so importing opttree imports no part of dynamo."""

    @functools.wraps(function)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if torch.compiler.is_compiling():
            return cast(_R, _DISABLE(function)(*args, **kwargs))
        return function(*args, **kwargs)

    return run
