"""State schemas: what a leaf optimizer keeps per parameter, and how each key resets."""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Mapping
from typing import cast

import torch
from attrs import field, frozen

from opttree._errors import RegistrationError

ScaleLookup = Callable[[torch.optim.Optimizer, torch.Tensor, str], "torch.Tensor | None"]
"""``(optimizer, param, key) -> scale``: a tensor kept outside ``state`` that scales a
low-precision history tensor and must be reset to one along with it."""


class KeyAction(enum.Enum):
    """What a reset does with one state key; derived from a schema."""

    ZERO = "zero"
    FILL = "fill"
    IDENTITY = "identity"
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


class StepType(enum.Enum):
    """What a per-parameter step counter is when the optimizer creates it: what a reset
    leaves, and what a loader gives back where a checkpoint holds history but no step (see
    :func:`opttree.load_state_dict`)."""

    TENSOR = "tensor"
    """``torch.tensor(0.0)``, as torch's optimizers start it; their ``load_state_dict``
    moves it where they keep it."""
    INT = "int"
    """A Python ``int`` (torch's ``SparseAdam``, emerging-optimizers' LaProp and SOAP): a
    tensor in its place would change the arithmetic of bias correction."""


Fill = float | Callable[[Mapping[str, object], Mapping[str, object]], float]
"""What a history tensor starts as: a number, or ``(param_group, defaults) -> number``
for one that depends on its group (Rprop's ``step_size`` starts at the group's ``lr``).
Complex tensors start at ``complex(v, v)``, as torch's optimizers fill them."""


def _fills(value: Mapping[str, Fill] | tuple[tuple[str, Fill], ...]) -> tuple[tuple[str, Fill], ...]:
    """``fill`` as sorted ``(key, fill)`` pairs: from a mapping of key names, or from the
    pairs themselves, each key named once."""
    given = cast(object, value)
    if isinstance(given, Mapping):
        items: list[object] = list(given.items())
    elif isinstance(given, (tuple, list)):
        items = list(given)
    else:
        msg = f"fill maps state key names to what they start as, got {given!r}"
        raise RegistrationError(msg)
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str):
            msg = f"fill maps state key names to what they start as, got {item!r} among its items"
            raise RegistrationError(msg)
    pairs = cast(list[tuple[str, Fill]], items)
    names = [key for key, _ in pairs]
    repeated = sorted({key for key in names if names.count(key) > 1})
    if repeated:
        msg = f"fill names {repeated} more than once"
        raise RegistrationError(msg)
    return tuple(sorted(pairs, key=lambda item: item[0]))


def _frozen_keys(keys: frozenset[str] | set[str] | tuple[str, ...] | list[str]) -> frozenset[str]:
    """A set of state key names: one string would be taken apart into its letters."""
    given = cast(object, keys)
    if not isinstance(given, (set, frozenset, tuple, list)) or not all(isinstance(key, str) for key in given):
        msg = f"state keys are given as a set of names, got {keys!r}"
        raise RegistrationError(msg)
    return frozenset(keys)


@frozen(cache_hash=True)
class StateSchema:
    """The state layout of one optimizer class.

    ``zero``: history tensors the optimizer creates as zeros; reset zeroes them in place.
    ``drop``: history the optimizer creates lazily from the first gradient (torch SGD's
    ``momentum_buffer`` is a copy of it); reset deletes the key, as a fresh optimizer has none.
    ``keep``: state that is not history (master weights); reset leaves it untouched.
    ``fill``: history the optimizer creates filled with another value (Adagrad's ``sum``
    starts at ``initial_accumulator_value``, NAdam's ``mu_product`` at 1); reset fills it
    in place with that value again.
    ``identity``: history the optimizer creates as an identity matrix (SOAP's eigenbases
    ``Q_L``/``Q_R`` start as ``torch.eye``); reset writes the identity in place.

    ``step_type``: what a per-parameter ``step`` starts as (:class:`StepType`).

    ``like_param``: zeroed or filled keys the optimizer creates shaped and typed as their
    parameter (``zeros_like(param)``). Where one no longer has its own parameter's shape
    and dtype (the parameter was cast by ``module.double()``, or reshaped or swapped through
    ``.data``, after the optimizer built it), a reset in place would keep it so where a
    fresh optimizer builds it as the parameter is now: refused.

    ``one_value``: zeroed or filled keys that hold one real value whatever their parameter
    (NAdam's ``mu_product``). One that holds several, none, or a bool or complex one would
    stay so through a reset in place: refused.

    ``starts_at_first_step``: the optimizer builds a parameter's entry at its first step,
    filled from its group's values then (Rprop's ``step_size`` from the lr), so a fill in
    place would freeze today's lr where a scheduler moves it before the next step: a reset
    of whole entries deletes them instead, and the optimizer builds them again from the
    group as it is then; a partial reset of some of its filled keys is refused.

    ``indivisible``: the optimizer keeps one state for all its parameters, whose keys
    depend on one another (LBFGS, under its first parameter: its ``n_iter`` says whether
    ``prev_flat_grad`` exists), so a partial reset takes all of it or none of it.

    ``rebuilds_missing``: the optimizer builds a parameter's whole entry on its next step
    when the entry is missing, as it builds a fresh one (torch's ``len(state) == 0``
    initialisation), so ``reset(..., release=True)`` may delete entries to free their memory.

    Dropped and kept keys may hold anything (LBFGS keeps lists and numbers): the tensors
    among them, and inside lists and tuples, count as dropped or kept memory. Zeroed and
    filled ones must be tensors that can be written in place.
    """

    zero: frozenset[str] = field(converter=_frozen_keys, factory=frozenset)
    drop: frozenset[str] = field(converter=_frozen_keys, factory=frozenset)
    keep: frozenset[str] = field(converter=_frozen_keys, factory=frozenset)
    step: StepLocation = StepLocation.NONE
    scale_of: ScaleLookup | None = field(default=None, kw_only=True)
    fill: tuple[tuple[str, Fill], ...] = field(converter=_fills, factory=tuple, kw_only=True)
    identity: frozenset[str] = field(converter=_frozen_keys, factory=frozenset, kw_only=True)
    rebuilds_missing: bool = field(default=False, kw_only=True)
    indivisible: bool = field(default=False, kw_only=True)
    starts_at_first_step: bool = field(default=False, kw_only=True)
    step_type: StepType = field(default=StepType.TENSOR, kw_only=True)
    like_param: frozenset[str] = field(converter=_frozen_keys, factory=frozenset, kw_only=True)
    one_value: frozenset[str] = field(converter=_frozen_keys, factory=frozenset, kw_only=True)

    @property
    def filled(self) -> frozenset[str]:
        return frozenset(key for key, _ in self.fill)

    def __attrs_post_init__(self) -> None:
        for name, kind in (("step", StepLocation), ("step_type", StepType)):
            value: object = getattr(self, name)
            if not isinstance(value, kind):
                msg = f"{name} is a {kind.__name__}, got {value!r}"
                raise RegistrationError(msg)
        for flag in ("rebuilds_missing", "indivisible", "starts_at_first_step"):
            if not isinstance(getattr(self, flag), bool):  # rebuilds_missing="no" would allow a release
                msg = f"{flag} must be True or False, got {getattr(self, flag)!r}"
                raise RegistrationError(msg)
        scale_of: object = self.scale_of
        if scale_of is not None and not callable(scale_of):
            msg = f"scale_of is a function (optimizer, param, key) -> scale or None, got a {type(scale_of).__qualname__}"
            raise RegistrationError(msg)
        names = ("zero", "drop", "keep", "filled", "identity")
        for i, first in enumerate(names):
            for second in names[i + 1 :]:
                self._check_disjoint(first, second)
        for key, value in self.fill:
            if not callable(value) and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                msg = f"the fill of {key!r} is a {type(value).__qualname__}: expected a number or (group, defaults) -> number"
                raise RegistrationError(msg)
        for name in ("like_param", "one_value"):
            named: frozenset[str] = getattr(self, name)
            if not named <= self.zero | self.filled:
                msg = f"{name} names {sorted(named - self.zero - self.filled)}, which are neither zeroed nor filled"
                raise RegistrationError(msg)
        if self.like_param & self.one_value:
            msg = f"state keys {sorted(self.like_param & self.one_value)} are named in both like_param and one_value"
            raise RegistrationError(msg)
        if "step" in self.zero | self.drop | self.keep | self.filled | self.identity:
            msg = "'step' is described by StateSchema.step, not by a key set"
            raise RegistrationError(msg)
        if self.starts_at_first_step and not self.rebuilds_missing:
            msg = "starts_at_first_step deletes entries for the optimizer to build again: it needs rebuilds_missing=True"
            raise RegistrationError(msg)
        if self.step_type is not StepType.TENSOR and self.step is not StepLocation.PER_PARAMETER:
            msg = f"step_type describes a per-parameter step; this schema's step is {self.step.value}"
            raise RegistrationError(msg)

    def _check_disjoint(self, first: str, second: str) -> None:
        both = getattr(self, first) & getattr(self, second)
        if both:
            msg = f"state keys {sorted(both)} are named in both {first.removesuffix('ed')!r} and {second.removesuffix('ed')!r}"
            raise RegistrationError(msg)

    @functools.cached_property
    def actions(self) -> dict[str, KeyAction]:
        """Each state key the schema knows, with its action; per-parameter ``step`` included."""
        actions = {key: KeyAction.ZERO for key in self.zero}
        actions.update({key: KeyAction.DROP for key in self.drop})
        actions.update({key: KeyAction.KEEP for key in self.keep})
        actions.update({key: KeyAction.FILL for key in self.filled})
        actions.update({key: KeyAction.IDENTITY for key in self.identity})
        if self.step is StepLocation.PER_PARAMETER:
            actions["step"] = KeyAction.STEP
        return actions

    @property
    def resettable(self) -> frozenset[str]:
        """The keys a partial reset may name: history, and ``step`` where there is one."""
        keys = self.zero | self.drop | self.filled | self.identity
        return keys if self.step is StepLocation.NONE else keys | {"step"}

    def fill_value(self, key: str, group: Mapping[str, object], defaults: Mapping[str, object]) -> float:
        """The value ``key`` starts as in ``group``."""
        value = self._fill_by_key[key]
        return float(value(group, defaults) if callable(value) else value)

    @functools.cached_property
    def _fill_by_key(self) -> dict[str, Fill]:
        return dict(self.fill)

    def actions_for(self, resets: Callable[[str], bool]) -> dict[str, KeyAction]:
        """:attr:`actions` for a partial reset of the keys ``resets`` accepts (``"step"``
        for the step counter): other history is kept this time."""
        return {
            key: action if action is KeyAction.KEEP or resets(key) else KeyAction.KEEP
            for key, action in self.actions.items()
        }
