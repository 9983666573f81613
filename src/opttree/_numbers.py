"""Numbers as users give them: Python's, NumPy's, or a one-element real tensor."""

from __future__ import annotations

import numbers

import torch

from opttree._fields import kind_of
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


def shown_value(value: object) -> str:
    """A setting's or counter's value as a message shows it: None, a bool or a string as
    itself, a number as the number it holds, anything else as what it is (no ``repr`` of
    an int of over 4300 digits, which raises)."""
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    number = real_number(value)
    if isinstance(value, numbers.Integral):
        return "an int beyond a float's range" if number is None else repr(int(value))
    return kind_of(value) if number is None else repr(number)
