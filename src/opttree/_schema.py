"""State schemas: what a leaf optimizer keeps per parameter, and how each key resets."""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable

import torch
from attrs import field, frozen

from opttree._errors import RegistrationError

ScaleLookup = Callable[[torch.optim.Optimizer, torch.Tensor, str], "torch.Tensor | None"]
"""``(optimizer, param, key) -> scale``: a tensor kept outside ``state`` that scales a
low-precision history tensor and must be reset to one along with it."""


class KeyAction(enum.Enum):
    """What a reset does with one state key; derived from a schema."""

    ZERO = "zero"
    DROP = "drop"
    KEEP = "keep"
    STEP = "step"


class StepLocation(enum.Enum):
    """Where an optimizer counts its steps."""

    PER_PARAMETER = "per-parameter"
    """``state[p]["step"]``, a tensor (torch Adam/AdamW) zeroed in place."""
    PER_GROUP = "per-group"
    """``group["step"]``, an int or a device tensor (TE and apex ``FusedAdam``)."""
    NONE = "none"
    """No step counter (SGD, Muon)."""


def _frozen_keys(keys: frozenset[str] | set[str] | tuple[str, ...] | list[str]) -> frozenset[str]:
    return frozenset(keys)


@frozen(cache_hash=True)
class StateSchema:
    """The state layout of one optimizer class.

    ``zero``: history tensors the optimizer creates as zeros; reset zeroes them in place.
    ``drop``: history the optimizer creates lazily from the first gradient (torch SGD's
    ``momentum_buffer`` is a copy of it); reset deletes the key, as a fresh optimizer has none.
    ``keep``: state that is not history (master weights); reset leaves it untouched.
    """

    zero: frozenset[str] = field(converter=_frozen_keys, factory=frozenset)
    drop: frozenset[str] = field(converter=_frozen_keys, factory=frozenset)
    keep: frozenset[str] = field(converter=_frozen_keys, factory=frozenset)
    step: StepLocation = StepLocation.NONE
    scale_of: ScaleLookup | None = field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        for first, second in (("zero", "drop"), ("zero", "keep"), ("drop", "keep")):
            both = getattr(self, first) & getattr(self, second)
            if both:
                msg = f"state keys {sorted(both)} are named in both {first!r} and {second!r}"
                raise RegistrationError(msg)
        if "step" in self.zero | self.drop | self.keep:
            msg = "'step' is described by StateSchema.step, not by a key set"
            raise RegistrationError(msg)

    @functools.cached_property
    def actions(self) -> dict[str, KeyAction]:
        """Each state key the schema knows, with its action; per-parameter ``step`` included."""
        actions = {key: KeyAction.ZERO for key in self.zero}
        actions.update({key: KeyAction.DROP for key in self.drop})
        actions.update({key: KeyAction.KEEP for key in self.keep})
        if self.step is StepLocation.PER_PARAMETER:
            actions["step"] = KeyAction.STEP
        return actions

    @property
    def resettable(self) -> frozenset[str]:
        """The keys a partial reset may name: history, and ``step`` where there is one."""
        keys = self.zero | self.drop
        return keys if self.step is StepLocation.NONE else keys | {"step"}

    def actions_for(self, resets: Callable[[str], bool]) -> dict[str, KeyAction]:
        """:attr:`actions` for a partial reset of the keys ``resets`` accepts (``"step"``
        for the step counter): other history is kept this time."""
        return {
            key: action if action is KeyAction.KEEP or resets(key) else KeyAction.KEEP
            for key, action in self.actions.items()
        }
