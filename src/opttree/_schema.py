"""State schemas: what a leaf optimizer keeps per parameter, and how each key resets."""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import SupportsFloat, TypeVar, cast

import torch
from attrs import NOTHING, field, fields, frozen

from opttree._errors import RegistrationError
from opttree._numbers import real_number
from opttree._fields import kind_of

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


Fill = SupportsFloat | Callable[[Mapping[str, object], Mapping[str, object]], object]
"""What a history tensor starts as: a number, or ``(param_group, defaults) -> number``
for one that depends on its group (Rprop's ``step_size`` starts at the group's ``lr``);
the number Python's, NumPy's or a one-element real tensor, anything else the key's problem.
Complex tensors start at ``complex(v, v)``, as torch's optimizers fill them."""


ShapeOf = Callable[[tuple[int, ...]], Sequence[int]]
"""``param shape -> shape``: the shape an optimizer builds a history tensor in, from its
parameter's (Adafactor's ``row_var`` keeps the parameter's shape with its last dimension 1)."""

ShapeWith = Callable[[torch.optim.Optimizer, tuple[int, ...]], Sequence[int]]
"""``(optimizer, param shape) -> shape``: the shape an optimizer builds a history tensor in,
from its parameter's and its own settings (AdaptiveMuon's ``moment2_buffer``, by its
``moment2_method``); it raises for settings it knows no shape for."""

DtypeOf = Callable[[torch.dtype], torch.dtype]
"""``param dtype -> dtype``: the dtype an optimizer builds a history tensor in, where it is
not its parameter's (SOAP keeps its moments in float32 whatever the parameter's)."""

MasterOf = Callable[[torch.optim.Optimizer, torch.Tensor, Mapping[str, object]], "torch.Tensor | None"]
"""``(optimizer, param, entry) -> copy``: the copy of ``param`` an optimizer keeps in the
parameter's state entry, steps and writes back into the parameter (TE FusedAdam's
``master_param``); None where it keeps none that can stand for other weights; it raises
where it keeps one that cannot be compared with the parameter."""

BuiltFor = Callable[[tuple[int, ...]], bool]
"""``param shape -> bool``: whether an optimizer builds a history key with the entry of a
parameter of that shape (Adafactor's ``row_var`` for two dimensions or more)."""

_Value = TypeVar("_Value")


def _named_apart(fields: Mapping[str, frozenset[str]], what: str = "state keys") -> None:
    """Refuse a state key (or attribute: ``what``) that two of these schema fields (by
    name) both name."""
    named = list(fields.items())
    for i, (first, first_keys) in enumerate(named):
        for second, second_keys in named[i + 1 :]:
            if first_keys & second_keys:
                msg = f"{what} {sorted(first_keys & second_keys)} are named in both {first} and {second}"
                raise RegistrationError(msg)


def _keyed(
    value: Mapping[str, _Value] | tuple[tuple[str, _Value], ...], field_name: str, meaning: str
) -> tuple[tuple[str, _Value], ...]:
    """A field that maps state key names to ``meaning``, as sorted ``(key, value)`` pairs:
    from a mapping or from the pairs themselves, each key named once."""
    given = cast(object, value)
    if isinstance(given, Mapping):
        items: list[object] = list(given.items())
    elif isinstance(given, (tuple, list)):
        items = list(given)
    else:
        msg = f"{field_name} maps state key names to {meaning}, got {given!r}"
        raise RegistrationError(msg)
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str):
            msg = f"{field_name} maps state key names to {meaning}, got {item!r} among its items"
            raise RegistrationError(msg)
    pairs = cast(list[tuple[str, _Value]], items)
    names = [key for key, _ in pairs]
    repeated = sorted({key for key in names if names.count(key) > 1})
    if repeated:
        msg = f"{field_name} names {repeated} more than once"
        raise RegistrationError(msg)
    return tuple(sorted(pairs, key=lambda item: item[0]))


def _fills(value: Mapping[str, Fill] | tuple[tuple[str, Fill], ...]) -> tuple[tuple[str, Fill], ...]:
    return _keyed(value, "fill", "what they start as")


def _shapes(value: Mapping[str, ShapeOf] | tuple[tuple[str, ShapeOf], ...]) -> tuple[tuple[str, ShapeOf], ...]:
    return _keyed(value, "shape_of", "functions (param shape) -> shape")


def _shapes_with(value: Mapping[str, ShapeWith] | tuple[tuple[str, ShapeWith], ...]) -> tuple[tuple[str, ShapeWith], ...]:
    return _keyed(value, "shape_with", "functions (optimizer, param shape) -> shape")


def _dtypes(value: Mapping[str, DtypeOf] | tuple[tuple[str, DtypeOf], ...]) -> tuple[tuple[str, DtypeOf], ...]:
    return _keyed(value, "dtype_of", "functions (param dtype) -> dtype")


def _shape_tests(value: Mapping[str, BuiltFor] | tuple[tuple[str, BuiltFor], ...]) -> tuple[tuple[str, BuiltFor], ...]:
    return _keyed(value, "built_for", "functions (param shape) -> bool")


GroupCounterStart = int | float | None
"""What a counter starts as in a fresh optimizer (in its group, or as its attribute): a
number, or None where a fresh one holds none (the optimizer makes it at its first step)."""

_Counters = tuple[tuple[str, GroupCounterStart], ...]


def _counters(value: Mapping[str, GroupCounterStart] | _Counters, where: str, field_name: str) -> _Counters:
    """A field mapping counters held ``where`` to what they start as, as sorted pairs."""
    pairs = _keyed(value, field_name, f"what they start as in {where} (a number, or None for none)")
    for key, start in pairs:
        if start is not None and (real_number(start) is None or math.isnan(cast(float, start))):
            msg = f"{field_name} maps {key!r} to {_what(start)}: expected what it starts as in {where}, a number, or None where it has none"
            raise RegistrationError(msg)
    return pairs


def _group_counters(value: Mapping[str, GroupCounterStart] | _Counters) -> _Counters:
    return _counters(value, "a fresh group", "group_counters")


def _attribute_counters(value: Mapping[str, GroupCounterStart] | _Counters) -> _Counters:
    return _counters(value, "a fresh optimizer", "attribute_counters")


def _options(value: Mapping[str, str] | tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    pairs = _keyed(value, "built_if", "the names of group options")
    for key, option in pairs:
        if not isinstance(cast(object, option), str):
            msg = f"built_if maps {key!r} to {kind_of(option)}, expected the name of a group option"
            raise RegistrationError(msg)
    return pairs


def _bases(value: Mapping[str, KeyNames] | tuple[tuple[str, KeyNames], ...]) -> tuple[tuple[str, frozenset[str]], ...]:
    pairs = _keyed(value, "expressed_in", "the keys holding the basis they are expressed in")
    return tuple((key, _frozen_keys(bases, f"expressed_in[{key!r}]")) for key, bases in pairs)


def _what(value: object) -> str:
    """A value as a message names it: a number by itself, anything else by its type."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:g}" if isinstance(value, float) or abs(value) < 10**20 else "an int beyond a float"
    return kind_of(value)


KeyNames = frozenset[str] | set[str] | tuple[str, ...] | list[str]
"""State key names as a schema field takes them."""


def _frozen_keys(keys: KeyNames, name: str | None = None) -> frozenset[str]:
    """A set of state key names: one string would be taken apart into its letters."""
    given = cast(object, keys)
    if not isinstance(given, (set, frozenset, tuple, list)) or not all(isinstance(key, str) for key in given):
        msg = f"{'' if name is None else f'{name}: '}state keys are given as a set of names, got {keys!r}"
        raise RegistrationError(msg)
    return frozenset(keys)


@frozen(cache_hash=True)
class StateSchema:
    """The state layout of one optimizer class.

    ``zero``: history tensors the optimizer creates as zeros; reset zeroes them in place.
    ``drop``: history the optimizer creates lazily from the first gradient (torch SGD's
    ``momentum_buffer`` is a copy of it); reset deletes the key, as a fresh optimizer has none.
    The optimizer must build it again where an entry lacks it: a key built only with a new
    entry (``if not state``) is missing at the next step from an entry that keeps its step.
    ``keep``: state that is not history (master weights); reset leaves it untouched.
    ``fill``: history the optimizer creates filled with another value (Adagrad's ``sum``
    starts at ``initial_accumulator_value``, NAdam's ``mu_product`` at 1); reset fills it
    in place with that value again.
    ``identity``: history the optimizer creates as an identity matrix (SOAP's eigenbases
    ``Q_L``/``Q_R`` start as ``torch.eye``); reset writes the identity in place.

    ``step_type``: what a per-parameter ``step`` starts as (:class:`StepType`).

    ``like_param``: zeroed or filled keys the optimizer creates shaped, typed and laid out
    in memory as their parameter (``zeros_like(param)``, in its ``preserve_format``). Where
    one no longer has its own parameter's shape and dtype (the parameter was cast by
    ``module.double()``, or reshaped or swapped through ``.data``, after the optimizer built
    it), or its memory layout (``model.to(memory_format=torch.channels_last)``; but see
    ``elementwise``), a reset in place would keep it so where a fresh optimizer builds it as
    the parameter is now: refused.

    ``like_grad``: ``like_param`` keys the optimizer builds ``zeros_like`` the gradient at
    the first step (PSGD's ``exp_avg``, torch's Muon's ``momentum_buffer``), laid out as
    autograd lays out a gradient of the parameter: as the parameter where its elements are
    dense and apart, else contiguous (a transposed slice of a weight has a contiguous
    gradient, where ``zeros_like`` would keep its order). The gradient the parameter holds
    now is not read: one kept from before the weight was laid out anew, or set by hand,
    says nothing of the next.

    ``elementwise``: the optimizer steps each element of its ``like_param`` history apart
    from the others (torch's Adam, RMSprop, ...), so history of float32 and float64
    parameters in any memory layout whose elements are apart (another order of dimensions
    than its parameter's now, gaps between elements as in a strided slice of a larger
    buffer) steps as a fresh optimizer's does (bfloat16 and float16 do not: torch rounds
    them after each operation where operands are laid out unlike each other).
    Otherwise (a matrix product over it, Muon's; random numbers drawn like it, PSGD's; an
    optimizer nobody has said this of) history not laid out as a fresh one's is refused,
    as it is in a fused group of any optimizer, whose kernels read memory as
    ``zeros_like`` lays it out.

    ``shape_of``: zeroed, filled or identity keys the optimizer builds typed as their
    parameter, in a shape derived from the parameter's (Adafactor's factored ``row_var`` and
    ``col_var``, SOAP's Kronecker factors), checked as ``like_param`` keys are.

    ``shape_with``: keys as ``shape_of``'s, in a shape derived from the parameter's and
    from the optimizer's own settings, read as they are at each check by a function
    ``(optimizer, param shape) -> shape`` (AdaptiveMuon's ``moment2_buffer``, by its
    ``moment2_method``): history built under other settings (a checkpoint of another mode,
    which torch's load takes as it is) is refused, and so are settings the function knows
    no shape for (it raises): the key's problem, as a ``shape_of`` function's failure is.

    ``dtype_of``: ``like_param``, ``shape_of`` or ``shape_with`` keys the optimizer builds
    in a dtype of their own, derived from (or regardless of) the parameter's (SOAP's moments
    in float32, its Kronecker factors in torch's default dtype): checked against it instead.

    ``one_value``: zeroed or filled keys that hold one real value whatever their parameter
    (NAdam's ``mu_product``). One that holds several, none, or a bool or complex one would
    stay so through a reset in place: refused.

    ``built_if``: zeroed, filled or identity keys the optimizer builds with a parameter's
    entry, and reads at every step, only where an option of the entry's group is true
    (Adam's ``max_exp_avg_sq`` where ``amsgrad``, RMSprop's ``grad_avg`` where
    ``centered``). An entry built while the option was off lacks the key once it is
    switched on; kept through a reset in place, it would make the next step raise where a
    fresh optimizer builds the key: refused.

    ``always_built``: zeroed, filled or identity keys the optimizer builds with every entry
    and reads at every step (Adam's ``exp_avg``), as ``built_if`` keys whose option is
    always on: an entry that holds some of its keys but lacks one (a hand-edited state, a
    checkpoint of another layout) would make the next step raise where a fresh optimizer
    builds it, so it is refused; an empty entry is built whole on the next step. Optional:
    a schema that leaves it out checks nothing of this kind (an optimizer that builds each
    missing key on its own, as Muon does, needs nothing).

    ``built_for``: zeroed, filled or identity keys the optimizer builds with the entry of
    each parameter whose shape a function of theirs accepts, and reads at every step for it
    (Adafactor's ``row_var`` and ``col_var`` for a parameter of two or more dimensions, its
    ``variance`` for one of fewer): checked as ``always_built`` keys are, for those
    parameters.

    ``starts_at_first_step``: the optimizer builds a parameter's entry at its first step,
    filled from its group's values then (Rprop's ``step_size`` from the lr), so a fill in
    place would freeze today's lr where a scheduler moves it before the next step: a reset
    of whole entries deletes them instead, and the optimizer builds them again from the
    group as it is then; a partial reset of some of its filled keys is refused.

    ``indivisible``: the optimizer keeps one state for all its parameters, whose keys
    depend on one another (LBFGS, under its first parameter: its ``n_iter`` says whether
    ``prev_flat_grad`` exists), so a partial reset takes all of it or none of it.

    ``master_of``: the optimizer keeps a master copy of some parameters in their state
    entries, steps it and writes it back into the parameter (TE FusedAdam with
    ``master_weights``): a function ``(optimizer, param, entry) -> copy | None`` names it,
    so that ``validate(..., model=model)`` finds it stale after weights are loaded into the
    model out of band and ``sync_masters`` writes it (see :data:`MasterOf`). A reset keeps
    it, as any ``keep`` key.

    ``counted_with_step``: keys the optimizer derives from its step count, as a second
    counter (NAdam's ``mu_product``, the product of its momentum schedule up to the step;
    ASGD's ``eta`` and ``mu``): they follow the step, reset where a partial reset takes
    ``"step"`` and kept where it keeps it, and ``keys`` naming them without ``"step"`` is
    refused, since either kept apart from the other leaves a state no run reaches.

    ``master_groups``: the name of an instance attribute where the optimizer keeps master
    copies in groups beside its ``param_groups``, each group's ``params`` holding every
    parameter's copy at its place, or None (apex's and TransformerEngine 1.x's
    ``FusedAdam`` keep ``param_groups_master`` with ``master_weights``): compared and
    written as ``master_of``'s are, and kept by a reset. Any other layout there is refused.

    ``expressed_in``: history keys whose values are coordinates in a basis that other
    history keys hold, each mapped to those (SOAP's ``exp_avg`` and ``exp_avg_sq``, kept in
    the eigenbases ``Q_L`` and ``Q_R``, which each step rotates them between). A partial
    reset that takes a basis but keeps what is expressed in it is refused: the kept values
    would be read in the basis the reset starts anew, as no run leaves them. Taking them
    without their basis is fine: zero is zero in every basis.

    ``bound_together``: history keys whose values bound one another element by element,
    where a leaf holds more than one of them (centered RMSprop's ``square_avg`` is at least
    ``grad_avg`` squared, and its step takes the square root of the difference): a reset
    zeroes them together, but ``prune`` and ``scale``, which change each tensor apart, are
    refused for them, since they would break the bound and the next step would write NaN.

    ``dropped_by_group_if``: options of a param group under which the optimizer builds its
    dropped keys for all of the group's parameters at once, at the first step that finds
    none, and steps none of them with some missing (torch's fused SGD: a momentum buffer
    dropped for one parameter of a fused group made the next step raise): a reset that
    drops them (or a release, which deletes them with their entries) takes all of such a
    group's parameters or none of them.

    ``rebuilt_together``: dropped keys the optimizer builds again together wherever any of
    them is missing from an entry (emerging-optimizers' PSGDPro builds its Kronecker factors
    ``Q`` and Lipschitz constants ``L`` anew if either is missing): a partial reset that
    names some of them without the others is refused, since the next step would build the
    others again too, which the reset would have reported as kept.

    ``step_attributes``: instance attributes each holding a tensor that the optimizer
    creates as zeros and reads in counting its steps (TE's and apex's ``FusedAdam`` keep
    ``_dummy_overflow_buf``: a capturable step adds one to the step only where the step
    before did not overflow, so a flag kept through a reset leaves the next step at 0,
    where bias correction divides by zero). A reset that zeroes the optimizer's step
    counters zeroes them in place; one that keeps its counters keeps them; one that takes
    the counters of only some of its parameters is refused, since one flag counts for all.

    ``group_counters``: options the optimizer counts in its param groups as it steps, other
    than ``step``, each with what it starts as in a fresh optimizer's group (a schedule-free
    optimizer's ``{"k": 0, "weight_sum": 0.0, "lr_max": -1.0}``), or None where a fresh group
    holds none until the first step makes it (by ``setdefault``): numbers a reset sets back
    to that start, or deletes. They go with the steps: ``keys`` naming ``"step"`` takes them
    (a schema without a step counter of its own too), a reset that keeps steps keeps them,
    and one that takes part of a group's parameters is refused. A schema that leaves such
    a counter out keeps it, and opttree cannot tell it from a setting a user gave the
    group: name every one.

    ``attribute_counters``: instance attributes holding numbers the optimizer counts in as
    it steps (an ``int`` ``self.iteration`` that a bias correction reads), each with what
    it starts as in a fresh optimizer, or None where a fresh one has no such attribute
    until its first step makes it. Set back, or deleted, with the steps, as
    ``group_counters`` are; one counts for all the optimizer's parameters, so a reset that
    takes the steps of only some of them is refused. A counter held in a tensor is a
    ``step_attributes`` one.

    ``cached``: instance attributes where the optimizer caches what it derives from its
    parameters when it first needs it, None until then (LBFGS's ``_numel_cache``, the
    parameters' total size). A reset sets them back to None, as a fresh optimizer holds
    them, and the optimizer derives them again from its parameters as they are then: kept,
    a weight resized through ``.data`` since left LBFGS's next step raising where a fresh
    one's trains.

    ``known_attributes``: instance attributes holding tensors that the schema's own
    functions account for (TE's ``_scales``, which its ``scale_of`` reads, and its constant
    ``dtype_to_range_map``). A leaf holding tensors in any other attribute or slot beyond
    torch's bookkeeping (looked for through the holders and as deep as optimizers it holds
    are) that are neither its parameters nor its state's is refused, with those named
    neither here, in ``step_attributes`` nor in ``master_groups``: a reset would keep them,
    whatever they count, where a fresh optimizer starts anew.

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
    master_of: MasterOf | None = field(default=None, kw_only=True)
    fill: tuple[tuple[str, Fill], ...] = field(converter=_fills, factory=tuple, kw_only=True)
    identity: frozenset[str] = field(converter=_frozen_keys, factory=frozenset, kw_only=True)
    rebuilds_missing: bool = field(default=False, kw_only=True)
    indivisible: bool = field(default=False, kw_only=True)
    starts_at_first_step: bool = field(default=False, kw_only=True)
    step_type: StepType = field(default=StepType.TENSOR, kw_only=True)
    like_param: frozenset[str] = field(converter=_frozen_keys, factory=frozenset, kw_only=True)
    like_grad: frozenset[str] = field(converter=_frozen_keys, factory=frozenset, kw_only=True)
    elementwise: bool = field(default=False, kw_only=True)
    one_value: frozenset[str] = field(converter=_frozen_keys, factory=frozenset, kw_only=True)
    shape_of: tuple[tuple[str, ShapeOf], ...] = field(converter=_shapes, factory=tuple, kw_only=True)
    shape_with: tuple[tuple[str, ShapeWith], ...] = field(converter=_shapes_with, factory=tuple, kw_only=True)
    dtype_of: tuple[tuple[str, DtypeOf], ...] = field(converter=_dtypes, factory=tuple, kw_only=True)
    built_if: tuple[tuple[str, str], ...] = field(converter=_options, factory=tuple, kw_only=True)
    always_built: frozenset[str] = field(converter=_frozen_keys, factory=frozenset, kw_only=True)
    built_for: tuple[tuple[str, BuiltFor], ...] = field(converter=_shape_tests, factory=tuple, kw_only=True)
    master_groups: str | None = field(default=None, kw_only=True)
    step_attributes: frozenset[str] = field(converter=_frozen_keys, factory=frozenset, kw_only=True)
    known_attributes: frozenset[str] = field(converter=_frozen_keys, factory=frozenset, kw_only=True)
    cached: frozenset[str] = field(converter=_frozen_keys, factory=frozenset, kw_only=True)
    group_counters: _Counters = field(converter=_group_counters, factory=tuple, kw_only=True)
    attribute_counters: _Counters = field(converter=_attribute_counters, factory=tuple, kw_only=True)
    counted_with_step: frozenset[str] = field(converter=_frozen_keys, factory=frozenset, kw_only=True)
    expressed_in: tuple[tuple[str, frozenset[str]], ...] = field(converter=_bases, factory=tuple, kw_only=True)
    bound_together: frozenset[str] = field(converter=_frozen_keys, factory=frozenset, kw_only=True)
    dropped_by_group_if: frozenset[str] = field(converter=_frozen_keys, factory=frozenset, kw_only=True)
    rebuilt_together: frozenset[str] = field(converter=_frozen_keys, factory=frozenset, kw_only=True)

    @functools.cached_property
    def built_with_entry(self) -> tuple[tuple[str, str | None], ...]:
        """Each key the optimizer builds with an entry and reads at every step, with the
        group option it is built under, or None where it always is
        (:attr:`always_built`, :attr:`built_if`)."""
        return (*((key, None) for key in sorted(self.always_built)), *self.built_if)

    @functools.cached_property
    def attributes(self) -> frozenset[str]:
        """The instance attributes the schema names: tensors there are accounted for."""
        named = self.step_attributes | self.known_attributes | self.cached | self.counter_attribute_names
        return named if self.master_groups is None else named | {self.master_groups}

    @functools.cached_property
    def counter_attribute_names(self) -> frozenset[str]:
        """The attributes :attr:`attribute_counters` names."""
        return frozenset(name for name, _ in self.attribute_counters)

    @property
    def filled(self) -> frozenset[str]:
        return frozenset(key for key, _ in self.fill)

    @property
    def shaped(self) -> frozenset[str]:
        """The keys :attr:`shape_of` and :attr:`shape_with` name."""
        return frozenset(self._shape_by_key) | frozenset(self._shape_with_by_key)

    @functools.cached_property
    def built_like_param(self) -> frozenset[str]:
        """The keys the optimizer builds typed as their parameter, shaped as it
        (:attr:`like_param`) or from it (:attr:`shape_of`, :attr:`shape_with`)."""
        return self.like_param | self.shaped

    @functools.cached_property
    def _shape_by_key(self) -> dict[str, ShapeOf]:
        return dict(self.shape_of)

    @functools.cached_property
    def _shape_with_by_key(self) -> dict[str, ShapeWith]:
        return dict(self.shape_with)

    @functools.cached_property
    def typed(self) -> frozenset[str]:
        """The keys :attr:`dtype_of` names."""
        return frozenset(self._dtype_by_key)

    @functools.cached_property
    def _dtype_by_key(self) -> dict[str, DtypeOf]:
        return dict(self.dtype_of)

    def built_dtype(self, key: str, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype the optimizer builds ``key`` in for a parameter of ``param_dtype``:
        the parameter's, or :attr:`dtype_of`'s for it."""
        dtype_of = self._dtype_by_key.get(key)
        if dtype_of is None:
            return param_dtype
        dtype: object = dtype_of(param_dtype)
        if not isinstance(dtype, torch.dtype):
            msg = f"it gave {kind_of(dtype)}, expected a torch.dtype"
            raise TypeError(msg)
        return dtype

    def shape_field(self, key: str) -> str:
        """The field that gives the shape the optimizer builds ``key``, one of
        :attr:`built_like_param`, in (``like_param``, ``shape_of`` or ``shape_with``): what
        a check that fails names."""
        return "shape_with" if key in self._shape_with_by_key else "shape_of" if key in self._shape_by_key else "like_param"

    def built_shape(self, key: str, param_shape: tuple[int, ...], optimizer: torch.optim.Optimizer | None = None) -> torch.Size:
        """The shape ``optimizer`` builds ``key`` in for a parameter of ``param_shape``:
        the parameter's, :attr:`shape_of`'s for it, or :attr:`shape_with`'s for it and
        ``optimizer``, which such a key needs."""
        shape_with = self._shape_with_by_key.get(key)
        if shape_with is not None:
            if optimizer is None:
                msg = f"{key!r} is shaped by its optimizer's settings (shape_with): pass the optimizer"
                raise TypeError(msg)
            return torch.Size(shape_with(optimizer, param_shape))
        shape_of = self._shape_by_key.get(key)
        return torch.Size(param_shape if shape_of is None else shape_of(param_shape))

    def __attrs_pre_init__(self, *positional: object, **named: object) -> None:
        """Each field of key names checked where its name is known, before the one
        converter they share runs: ``zero="exp_avg"`` is refused naming ``zero``."""
        given = dict(zip(_POSITIONAL_FIELDS, positional, strict=False)) | named
        for name in _KEY_SET_FIELDS:
            value = given.get(name, NOTHING)
            if value is not NOTHING:
                _frozen_keys(cast(KeyNames, value), name)

    def __attrs_post_init__(self) -> None:
        for name, kind in (("step", StepLocation), ("step_type", StepType)):
            value: object = getattr(self, name)
            if not isinstance(value, kind):
                msg = f"{name} is a {kind.__name__}, got {value!r}"
                raise RegistrationError(msg)
        for flag in ("rebuilds_missing", "indivisible", "starts_at_first_step", "elementwise"):
            if not isinstance(getattr(self, flag), bool):  # rebuilds_missing="no" would allow a release
                msg = f"{flag} must be True or False, got {getattr(self, flag)!r}"
                raise RegistrationError(msg)
        for name, meaning in (("scale_of", "(optimizer, param, key) -> scale or None"), ("master_of", "(optimizer, param, entry) -> copy or None")):
            function: object = getattr(self, name)
            if function is not None and not callable(function):
                msg = f"{name} is a function {meaning}, got {kind_of(function)}"
                raise RegistrationError(msg)
        names = ("zero", "drop", "keep", "filled", "identity")
        for i, first in enumerate(names):
            for second in names[i + 1 :]:
                self._check_disjoint(first, second)
        for key, value in self.fill:
            if callable(value):
                continue
            number = real_number(value)
            if number is None or math.isnan(number):
                msg = f"the fill of {key!r} is {_what(value)}: expected a real number a float holds, or (group, defaults) -> number"
                raise RegistrationError(msg)
        for name, functions, meaning in (
            ("shape_of", self.shape_of, "(param shape) -> shape"),
            ("shape_with", self.shape_with, "(optimizer, param shape) -> shape"),
            ("dtype_of", self.dtype_of, "(param dtype) -> dtype"),
            ("built_for", self.built_for, "(param shape) -> bool"),
        ):
            for key, function in functions:
                if not callable(cast(object, function)):
                    msg = f"the {name} of {key!r} is {kind_of(function)}: expected {meaning}"
                    raise RegistrationError(msg)
        layouts = {
            "like_param": self.like_param,
            "one_value": self.one_value,
            "shape_of": frozenset(self._shape_by_key),
            "shape_with": frozenset(self._shape_with_by_key),
        }
        for name, named in layouts.items():
            derived = name in ("shape_of", "shape_with")
            allowed = self.zero | self.filled | (self.identity if derived else frozenset())
            if not named <= allowed:
                what = "neither zeroed, filled nor identity" if derived else "neither zeroed nor filled"
                msg = f"{name} names {sorted(named - allowed)}, which are {what}"
                raise RegistrationError(msg)
        if not self.like_grad <= self.like_param:
            msg = f"like_grad names {sorted(self.like_grad - self.like_param)}, which are not like_param keys"
            raise RegistrationError(msg)
        if not self.typed <= self.built_like_param:
            msg = f"dtype_of names {sorted(self.typed - self.built_like_param)}, which are neither like_param nor shape_of keys, nor shape_with ones"
            raise RegistrationError(msg)
        _named_apart(layouts)
        history = self.zero | self.filled | self.identity
        built = {
            "built_if": frozenset(key for key, _ in self.built_if),
            "always_built": self.always_built,
            "built_for": frozenset(key for key, _ in self.built_for),
        }
        for name, named in built.items():
            if not named <= history:
                msg = f"{name} names {sorted(named - history)}, which are neither zeroed, filled nor identity"
                raise RegistrationError(msg)
        _named_apart(built)
        counters = frozenset(name for name, _ in self.group_counters)
        if "step" in self.zero | self.drop | self.keep | self.filled | self.identity | counters:
            msg = "'step' is described by StateSchema.step, not by a key set"
            raise RegistrationError(msg)
        if "params" in counters:
            msg = "group_counters names 'params', a group's parameters: name the options the optimizer counts in its groups"
            raise RegistrationError(msg)
        if self.starts_at_first_step and not self.rebuilds_missing:
            msg = "starts_at_first_step deletes entries for the optimizer to build again: it needs rebuilds_missing=True"
            raise RegistrationError(msg)
        if self.master_groups is not None and not isinstance(cast(object, self.master_groups), str):
            msg = f"master_groups names an instance attribute, got {kind_of(self.master_groups)}"
            raise RegistrationError(msg)
        groups = frozenset() if self.master_groups is None else frozenset({self.master_groups})
        attributes = {
            "step_attributes": self.step_attributes,
            "known_attributes": self.known_attributes,
            "cached": self.cached,
            "master_groups": groups,
            "attribute_counters": self.counter_attribute_names,
        }
        _named_apart(attributes, "attributes")
        odd = sorted(name for name in self.counter_attribute_names if not name.isidentifier())
        if odd:
            msg = f"attribute_counters names {odd}, which are no attribute names"
            raise RegistrationError(msg)
        if self.counted_with_step and self.step is StepLocation.NONE:
            msg = "counted_with_step names keys counted with a step; this schema's step is none"
            raise RegistrationError(msg)
        if not self.counted_with_step <= history | self.drop:
            msg = f"counted_with_step names {sorted(self.counted_with_step - history - self.drop)}, which a reset neither zeroes, fills nor drops"
            raise RegistrationError(msg)
        for key, bases in self.expressed_in:
            if key in bases or not bases or not {key} | bases <= history:
                msg = f"expressed_in maps {key!r} to {sorted(bases)}: a zeroed, filled or identity key to the other such keys holding its basis"
                raise RegistrationError(msg)
        if len(self.bound_together) == 1 or not self.bound_together <= history:
            msg = f"bound_together names {sorted(self.bound_together)}: two or more zeroed, filled or identity keys"
            raise RegistrationError(msg)
        if len(self.rebuilt_together) == 1 or not self.rebuilt_together <= self.drop:
            msg = f"rebuilt_together names {sorted(self.rebuilt_together)}: two or more dropped keys"
            raise RegistrationError(msg)
        if self.dropped_by_group_if and not self.drop:
            msg = f"dropped_by_group_if names {sorted(self.dropped_by_group_if)}, group options under which dropped keys are built together; this schema drops none"
            raise RegistrationError(msg)
        if self.step_attributes and self.step is StepLocation.NONE:
            msg = "step_attributes take part in counting steps; this schema's step is none"
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
        """The keys a partial reset may name: history, and ``step`` where there is one or
        group or attribute counters go with it."""
        keys = self.zero | self.drop | self.filled | self.identity
        counted = self.step is not StepLocation.NONE or self.group_counters or self.attribute_counters
        return keys | {"step"} if counted else keys

    def fill_value(self, key: str, group: Mapping[str, object], defaults: Mapping[str, object]) -> float:
        """The value ``key`` starts as in ``group``."""
        value = self._fill_by_key[key]
        given = value(group, defaults) if callable(value) else value
        number = real_number(given)
        if number is None or math.isnan(number):  # as a fill given as a number is refused at registration
            msg = f"its fill gave {_what(given)}, expected a real number a float holds, not NaN"
            raise TypeError(msg)
        return number

    @functools.cached_property
    def _fill_by_key(self) -> dict[str, Fill]:
        return dict(self.fill)

    def resets_with_step(self, resets: Callable[[str], bool]) -> Callable[[str], bool]:
        """``resets``, a partial reset's keys, with :attr:`counted_with_step` following
        ``"step"``: taken where it is, kept where it is."""
        if not self.counted_with_step:
            return resets
        counted, stepped = self.counted_with_step, resets("step")
        return lambda key: stepped if key in counted else resets(key)

    def actions_for(self, resets: Callable[[str], bool]) -> dict[str, KeyAction]:
        """:attr:`actions` for a partial reset of the keys ``resets`` accepts (``"step"``
        for the step counter): other history is kept this time."""
        return {
            key: action if action is KeyAction.KEEP or resets(key) else KeyAction.KEEP
            for key, action in self.actions.items()
        }


_POSITIONAL_FIELDS = tuple(schema_field.name for schema_field in fields(StateSchema) if schema_field.init and not schema_field.kw_only)
_KEY_SET_FIELDS = tuple(schema_field.name for schema_field in fields(StateSchema) if cast(object, schema_field.converter) is _frozen_keys)
