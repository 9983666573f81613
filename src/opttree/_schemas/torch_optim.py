"""torch.optim, registered by class: each schema follows how the class creates its state.

Derived from torch's sources (``_init_group`` or ``__init__``): history created by
``zeros_like`` is zeroed; Adagrad's ``sum`` (``full_like`` of ``initial_accumulator_value``,
read from the defaults), Rprop's ``step_size`` (the group's ``lr``), ASGD's ``eta`` (the
group's ``lr``) and ``mu``, and NAdam's ``mu_product`` (1) are filled with their starting
values (Rprop's and ASGD's entries are deleted instead where a reset takes them whole: they
read the lr at their first step); SGD's ``momentum_buffer`` (a copy of the first gradient) and everything LBFGS keeps
(lists, numbers and tensors it builds on its first step) are dropped. Every per-parameter
step starts as a float tensor but SparseAdam's, an int. Adafactor factors the history of a
parameter of two or more dimensions into ``row_var`` and ``col_var``, reduced along its last
and its next-to-last dimension, and keeps a ``variance`` like any other's. Adam's
``max_exp_avg_sq`` is built only where its group has ``amsgrad``, RMSprop's
``momentum_buffer`` and ``grad_avg`` only where it has ``momentum`` and ``centered``
(``built_if``), Adafactor's ``row_var`` and ``col_var`` only for a parameter of two or more
dimensions and its ``variance`` for one of fewer (``built_for``); every other key is built
with every entry (``always_built``). Every class but
Adagrad builds a missing entry again on its next step, so its state can be released
(Adagrad builds its state in ``__init__``; torch 2.13 and 2.14 also build a missing entry on
a step, which opttree, supporting torch from 2.4, does not rely on).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from opttree._schema import BuiltFor, Fill, ShapeOf, StateSchema, StepLocation, StepType
from opttree._schemas._keys import MASTER_PARAM


def _lr(group: Mapping[str, object], defaults: Mapping[str, object]) -> object:
    return group["lr"]


def _initial_accumulator(group: Mapping[str, object], defaults: Mapping[str, object]) -> object:
    return defaults["initial_accumulator_value"]


def _rows(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Adafactor's ``row_var``: the parameter's shape, its last dimension reduced to 1."""
    return (*shape[:-1], 1)


def _columns(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Adafactor's ``col_var``: the parameter's shape, its next-to-last dimension reduced to 1."""
    return (*shape[:-2], 1, *shape[-1:])


def _factored(shape: tuple[int, ...]) -> bool:
    """Adafactor factors the history of a parameter of two or more dimensions."""
    return len(shape) > 1


def _unfactored(shape: tuple[int, ...]) -> bool:
    return len(shape) <= 1


def _per_step(
    *zero: str,
    fill: Mapping[str, Fill] | None = None,
    rebuilds_missing: bool = True,
    step_type: StepType = StepType.TENSOR,
    starts_at_first_step: bool = False,
    shape_of: Mapping[str, ShapeOf] | None = None,
    one_value: frozenset[str] = frozenset(),
    built_if: Mapping[str, str] | None = None,
    built_for: Mapping[str, BuiltFor] | None = None,
    counted_with_step: frozenset[str] = frozenset(),
    bound_together: frozenset[str] = frozenset(),
) -> StateSchema:
    """A schema whose history is built ``*_like`` its parameter but for the keys of
    ``shape_of`` (Adafactor's factored ones, typed as the parameter in a shape derived from
    its) and ``one_value`` (NAdam's ``mu_product`` and ASGD's ``eta`` and ``mu``, scalars).
    Every entry is built whole (``if len(state) == 0``) with each of its keys but those of
    ``built_if`` and ``built_for`` (Adafactor's, which depend on its parameter's dimensions).
    Each steps its history element by element (``elementwise``), in its for-loop, foreach
    and fused kernels alike; a fused group is checked for gaps all the same."""
    shapes = dict(shape_of or {})
    fills = dict(fill or {})
    optional = dict(built_if or {})
    return StateSchema(
        zero=set(zero),
        keep={MASTER_PARAM},
        step=StepLocation.PER_PARAMETER,
        fill=fills,
        rebuilds_missing=rebuilds_missing,
        step_type=step_type,
        starts_at_first_step=starts_at_first_step,
        like_param=(set(zero) | set(fills)) - set(shapes) - one_value,
        one_value=one_value,
        shape_of=shapes,
        built_if=optional,
        built_for=dict(built_for or {}),
        always_built=(set(zero) | set(fills)) - set(optional) - set(built_for or {}),
        counted_with_step=counted_with_step,
        bound_together=bound_together,
        elementwise=True,
    )


ADAM = _per_step("exp_avg", "exp_avg_sq", "max_exp_avg_sq", built_if={"max_exp_avg_sq": "amsgrad"})
SGD = StateSchema(drop={"momentum_buffer"}, keep={MASTER_PARAM}, rebuilds_missing=True, dropped_by_group_if={"fused"})
LBFGS = StateSchema(
    drop={"func_evals", "n_iter", "d", "t", "old_dirs", "old_stps", "ro", "H_diag", "prev_flat_grad", "prev_loss", "al"},
    rebuilds_missing=True,
    indivisible=True,
    cached={"_numel_cache"},  # the parameters' total size, derived at its first step
)

SCHEMAS: dict[str, StateSchema] = {
    "Adam": ADAM,
    "AdamW": ADAM,
    "Adamax": _per_step("exp_avg", "exp_inf"),
    "NAdam": _per_step("exp_avg", "exp_avg_sq", fill={"mu_product": 1.0}, one_value=frozenset({"mu_product"}), counted_with_step=frozenset({"mu_product"})),
    "RAdam": _per_step("exp_avg", "exp_avg_sq"),
    "Adagrad": _per_step(fill={"sum": _initial_accumulator}, rebuilds_missing=False),  # built in __init__
    "Adadelta": _per_step("square_avg", "acc_delta"),
    "RMSprop": _per_step(
        "square_avg",
        "momentum_buffer",
        "grad_avg",
        built_if={"momentum_buffer": "momentum", "grad_avg": "centered"},
        bound_together=frozenset({"square_avg", "grad_avg"}),  # centered: sqrt(square_avg - grad_avg**2)
    ),
    "Rprop": _per_step("prev", fill={"step_size": _lr}, starts_at_first_step=True),
    "ASGD": _per_step(
        "ax", fill={"eta": _lr, "mu": 1.0}, starts_at_first_step=True, one_value=frozenset({"eta", "mu"}), counted_with_step=frozenset({"eta", "mu"})
    ),
    "SGD": SGD,
    "LBFGS": LBFGS,
    "SparseAdam": _per_step("exp_avg", "exp_avg_sq", step_type=StepType.INT),  # state["step"] = 0
    "Adafactor": _per_step(
        "row_var",
        "col_var",
        "variance",
        shape_of={"row_var": _rows, "col_var": _columns},
        built_for={"row_var": _factored, "col_var": _factored, "variance": _unfactored},
    ),
    "Muon": StateSchema(  # zeros_like the gradient, multiplied as a matrix
        zero={"momentum_buffer"}, keep={MASTER_PARAM}, rebuilds_missing=True, like_param={"momentum_buffer"}, like_grad={"momentum_buffer"}
    ),
}
"""By class name in ``torch.optim``; a class this torch lacks (Muon, Adafactor before
2.5) is skipped."""


def torch_classes() -> list[tuple[type, StateSchema]]:
    found = [(getattr(torch.optim, name, None), schema) for name, schema in SCHEMAS.items()]
    return [(cls, schema) for cls, schema in found if isinstance(cls, type)]
