"""Numbers as users give them: Python's, NumPy's, or a one-element real tensor."""

from __future__ import annotations

import numbers

import torch

from opttree._preflight import unreadable_reason


def real_number(value: object) -> float | None:
    """``value`` as a float where it is a real number (Python's, NumPy's, a one-element
    real tensor), else None: not a bool, a string or a number beyond a float, nor a tensor
    whose memory is not there to read (a storage freed or shrunk under it)."""
    try:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1 or value.dtype is torch.bool or value.is_complex() or unreadable_reason(value) is not None:
                return None
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return None
        return float(value)
    except Exception:  # noqa: BLE001  # an int beyond a float, a meta tensor, a subclass whose own code raises
        return None
