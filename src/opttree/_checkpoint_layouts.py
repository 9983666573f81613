"""Where Megatron's wrapper kinds keep their leaves' state in a (sharded) state dict, and,
for a load, whether a state dict is laid out as each kind's ``load_state_dict`` reads it.

Megatron's loads are not all-or-nothing: ``Float16OptimizerWithFloat16Params`` loads its
torch optimizer, then its loss scaler, then its master weights, and a ``KeyError`` or a
copy that fails in the last two leaves the first done. Its master copy also ``zip``s the
saved groups with its own, so a checkpoint with fewer master weights loads the rest
silently unchanged; and torch keeps a state entry for no known parameter under its saved
index. So before a load changes anything, every level is checked for what its kind reads,
and a checkpoint that any would trip on is refused whole.
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import cast

import torch
from attrs import define, field

from opttree import _registry
from opttree._adapter import instance_attribute, mapping_attribute, sequence_attribute
from opttree._dispatch import LazyDispatch
from opttree._fields import article, kind_of
from opttree._inspect import STEP_DTYPES, fresh_step_dtype, is_on, scalar_dtype, step_number
from opttree._nodes import HybridNode, LeafNode, Node, WrapperNode, tree_nodes
from opttree._numbers import real_number
from opttree._preflight import Extents, overlap, plain_reads, ranges, torch_name, unreadable_reason, unwritable_reason
from opttree._problems import Problem, ProblemKind
from opttree._schema import StateSchema, StepLocation, StepType
from opttree._selection import STEP_UNITS

STEP_KEY = "common_step"
"""Where Megatron's ``sharded_state_dict`` puts the step its parameters share."""

SHARDING_TYPES = frozenset({"dp_zero_gather_scatter", "fully_reshardable", "dp_reshardable", "fully_sharded_model_space"})
"""The ``param_state_sharding_type`` values ``DistributedOptimizer.load_state_dict`` loads
(megatron-core 0.16.1 and 0.19.2); it raises for another after loading everything else."""

StateDicts = Iterator[tuple[LeafNode, dict[object, object]]]


@define
class Load:
    """A load's checks of a whole state dict: the memory of the history every leaf's part
    holds, checked once all of it is read (:func:`check_history_apart`), since one tensor
    under two leaves' entries, as a saved aliased state holds it, loads as one."""

    history: Extents = field(factory=Extents)
    group_steps: dict[int, float] = field(factory=dict)
    """The step a ``DistributedOptimizer``'s saved param groups hold, by the ``id`` of the
    (live) wrapper: the step Megatron saved for every one of its parameters."""


Locate = Callable[[Node, object, Load | None], StateDicts]
"""A wrapper kind's layout: from its node, its part of a (sharded) state dict and, where
it is to be loaded, the :class:`Load` it is checked in as the kind's load reads it, each
leaf that counts steps per parameter with the torch-format state dict Megatron holds for it."""


def layout_error(node: Node, key: object, message: str) -> Exception:
    problem = Problem(ProblemKind.CHECKPOINT_LAYOUT, node.path, type(node.optimizer).__qualname__, message, str(key))
    return problem.to_error()


def _part(node: Node, state: object, key: object) -> object:
    """``state[key]``: a member's state dict from a dict, or, for a chain's in-memory
    ``state_dict()``, from the list it returns for several members."""
    if isinstance(state, list) and isinstance(key, int) and 0 <= key < len(state):
        return state[key]
    return _dict(node, state, key)[key]


def _dict(node: Node, state: object, key: object) -> dict[object, object]:
    """``state``, checked to be a dict holding ``key`` as Megatron writes it."""
    if not isinstance(state, dict) or key not in state:
        what = type(state).__qualname__
        raise layout_error(node, key, f"its state dict ({what}) has no {key!r}, as Megatron writes it")
    return state


def _first_key(node: Node, state: object, keys: tuple[str, ...]) -> tuple[dict[object, object], str]:
    """``state`` and the first of ``keys`` it holds: Megatron reads older names after newer."""
    if isinstance(state, dict):
        for key in keys:
            if key in state:
                return state, key
    return _dict(node, state, keys[0]), keys[0]


def walk(node: Node, state: object, loading: Load | None) -> StateDicts:
    if isinstance(node, LeafNode):
        return
    locate = _LAYOUTS.lookup(type(node.optimizer))
    if locate is not None:
        yield from locate(node, state, loading)
    elif _counts_per_parameter(node):
        cls = type(node.optimizer)
        message = f"where {cls.__module__}.{cls.__qualname__} keeps its leaves' state in a state dict is not known"
        raise layout_error(node, STEP_KEY, message)


def _counts_per_parameter(node: Node) -> bool:
    return _counting_per_parameter(node) is not None


def _counting_per_parameter(node: Node) -> type | None:
    """The class of the first leaf at or under ``node`` that counts its steps per parameter."""
    if isinstance(node, LeafNode):
        cls = type(node.optimizer)
        return cls if _registry.step_location(cls) is StepLocation.PER_PARAMETER else None
    return next(filter(None, map(_counting_per_parameter, node.children)), None)


def _torch_format(node: Node, state: object, loading: Load | None) -> StateDicts:
    """A wrapper whose state dict is its leaf's, in torch's format (``FP32Optimizer``)."""
    if not node.children:  # a stub on a rank without parameters
        return
    (inner,) = node.children
    if loading:
        _check_torch_format(node, inner, state, loading)
    if isinstance(inner, LeafNode) and _counts_per_parameter(inner):
        yield inner, _dict(node, state, "state")
    else:
        yield from walk(inner, state, loading)


def _check_torch_format(node: Node, inner: Node, state: object, load: Load) -> None:
    """What Megatron's pairing of param groups and torch's ``load_state_dict`` read, and,
    where ``inner`` is a leaf, its entries as its schema says the optimizer builds them."""
    entries = _dict(node, state, "state")["state"]
    groups = _dict(node, state, "param_groups")["param_groups"]
    if not isinstance(entries, dict):
        raise layout_error(node, "state", f"is {kind_of(entries)}, where Megatron writes a dict of entries by parameter index")
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise layout_error(node, "param_groups", "is not a list of param groups, each a dict with a list of 'params'")
    live = _groups(node)
    if len(groups) < len(live):
        raise layout_error(node, "param_groups", f"holds {len(groups)} param groups, and the optimizer has {len(live)}")
    for index, (saved, current) in enumerate(zip(groups, live)):
        if len(saved["params"]) != len(current["params"]):
            message = f"param group {index} holds {len(saved['params'])} parameters, and the optimizer's has {len(current['params'])}"
            raise layout_error(node, "param_groups", message)
        unhashable = next((param for param in saved["params"] if not _hashable(param)), None)
        if unhashable is not None:
            message = f"param group {index} names a parameter by {kind_of(unhashable)}, which torch's load cannot index its state by"
            raise layout_error(node, "param_groups", message)
    _check_pairing(node, live, groups)
    _check_options(node, inner, groups[: len(live)])
    _check_capturable(node, inner, groups[: len(live)])
    _check_group_steps(node, groups[: len(live)])
    loaded = {index for saved in groups[: len(live)] for index in saved["params"]}
    for index, entry in entries.items():
        if index == STEP_KEY:
            _check_common_step(node, inner, entry, groups[: len(live)])
            continue
        if index not in loaded:
            raise layout_error(node, index, "a state entry for no parameter of the param groups it loads (torch would keep it under that index)")
        if not isinstance(entry, dict):
            raise layout_error(node, index, f"a state entry that is {kind_of(entry)}, not a dict")
    if isinstance(inner, LeafNode):
        params = {index: param for saved, current in zip(groups, live) for index, param in zip(saved["params"], current["params"])}
        options = {index: saved for saved in groups[: len(live)] for index in saved["params"]}
        saved_entries = {index: cast(dict[object, object], entry) for index, entry in entries.items() if index != STEP_KEY}
        for index, entry in saved_entries.items():
            _check_entry(node, inner, index, entry, params[index], options[index])
        _check_steps_held(node, inner, saved_entries)
        _check_steps_equal(node, inner, saved_entries)
        _gather_history(node, inner, saved_entries, params, load.history)


def _value_kind(value: object) -> str:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True or False"
    if real_number(value) is not None:
        return "a real number"
    return kind_of(value)


def _items(value: object) -> list[object] | None:
    """The values of a sequence option (``betas``), read by the built-in class (a
    subclass's own ``__iter__`` may raise); None for any other option."""
    if isinstance(value, tuple):
        return list(tuple.__iter__(value))
    if isinstance(value, list):
        return list(list.__iter__(value))
    return None


def _option_kind(value: object) -> str:
    """What a param group option is, as far as an optimizer's step reads it: a sequence
    (``betas``) with the kinds of what it holds."""
    items = _items(value)
    if items is None:
        return _value_kind(value)
    return f"a sequence of {len(items)} values ({', '.join(map(_value_kind, items))})"


def _fits(default: object, given: object) -> bool:
    """Whether a saved option is of the kind of ``default``: anything where the default is
    None, in a sequence too (Adafactor's ``eps=(None, 1e-3)``)."""
    expected, saved = _items(default), _items(given)
    if expected is None or saved is None:
        return default is None or (expected is None and saved is None and _alike(default, given))
    return len(expected) == len(saved) and all(map(_alike, expected, saved))


def _alike(default: object, given: object) -> bool:
    """Whether a value is of the kind of ``default``, as a step reads it: a default of None
    stands for any, and a flag is read as a number (``amsgrad=0``)."""
    if default is None:
        return True
    if given is None:
        return False
    kinds = {_value_kind(default), _value_kind(given)}
    return len(kinds) == 1 or kinds == {"True or False", "a real number"}


_UNDECLARED = object()


def _fits_declared(cls: type, option: str, given: object) -> bool:
    declared = _declared(cls, option)
    return declared is not _UNDECLARED and _fits(declared, given)


def _declared(cls: type, option: str) -> object:
    """The default ``cls``'s constructor declares for ``option`` (Adafactor's
    ``eps=(None, 1e-3)``, which an instance built with ``eps=(1e-30, 1e-3)`` no longer
    shows), or :data:`_UNDECLARED`."""
    try:
        parameter = inspect.signature(cls).parameters.get(option)
    except (TypeError, ValueError):  # a class whose signature cannot be read
        return _UNDECLARED
    return _UNDECLARED if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def _check_options(node: Node, inner: Node, saved: list[dict[object, object]]) -> None:
    """The options the optimizer below ``node`` reads (its ``defaults``: a leaf's, or a
    HybridDeviceOptimizer's, which gives them to its sub-optimizers), as the saved groups
    hold them: torch's load takes a saved group whole, so ``betas`` saved as a str, or as
    two strs, or ``eps`` as a list would load and raise inside the next step. An option the
    optimizer holds as None takes anything, and so does a missing one: what the step reads
    cannot be told from ``defaults`` (a HybridDeviceOptimizer's hold its
    ``offload_fraction``, which no step reads), and a class's ``__setstate__`` fills some in
    at the load (RMSprop's ``momentum``, torch's ``foreach``)."""
    _check_copied(node, saved)
    defaults: object = getattr(inner.optimizer, "defaults", None)
    if not isinstance(defaults, dict):
        return
    cls = type(inner.optimizer).__qualname__
    for index, group in enumerate(saved):
        for option, default in defaults.items():
            if option not in group:
                continue
            if not _fits(default, group[option]) and not _fits_declared(type(inner.optimizer), option, group[option]):
                expected, given = _option_kind(default), _option_kind(group[option])
                message = f"param group {index} holds {given} as {option!r}, which {cls} reads as {expected}"
                raise layout_error(node, "param_groups", message)
            if _without_truth(group[option]):
                message = f"param group {index} holds {_option_kind(group[option])} as {option!r}, whose truth torch's load and {cls}'s step read"
                raise layout_error(node, "param_groups", message)


def _without_truth(value: object) -> bool:
    """Whether a tensor option has no truth to read (several values, or none): torch's load
    asks it of ``fused`` and ``capturable``, whose default of None takes anything else."""
    return isinstance(value, torch.Tensor) and value.numel() != 1


def _check_copied(node: Node, saved: list[dict[object, object]]) -> None:
    """The saved param groups copied as torch's load copies them (``copy.deepcopy``), group
    by group: one holding what cannot be copied (a generator) raised inside Megatron's
    load, after it had loaded the chain's members before."""
    for index, group in enumerate(saved):
        try:
            copy.deepcopy(group)
        except Exception as error:  # noqa: BLE001  # a saved object's own __deepcopy__ or __reduce__ may raise anything
            message = f"param group {index} cannot be copied as torch's load copies it: {type(error).__name__}: {error}"
            raise layout_error(node, "param_groups", message) from error


def _check_capturable(node: Node, inner: Node, saved: list[dict[object, object]]) -> None:
    """A saved group turning ``capturable`` on over a leaf whose parameters lie on a
    device torch's capturable steps do not run on (the CPU): torch's load takes it, and
    the next step raises."""
    defaults: object = getattr(inner.optimizer, "defaults", None)
    if not isinstance(inner, LeafNode) or not isinstance(defaults, dict) or "capturable" not in defaults:
        return
    supported = set(_capturable_devices())
    live = _groups(inner)
    for index, group in enumerate(saved[: len(live)]):
        flag = group.get("capturable")
        if not (flag if isinstance(flag, bool) else real_number(flag)):  # a number torch's step reads as a flag too (a 0-d tensor); other kinds are refused apart
            continue
        with plain_reads():
            devices = {param.device.type for param in live[index]["params"] if isinstance(param, torch.Tensor)}
        if not devices <= supported:
            message = (
                f"param group {index} turns 'capturable' on, which {type(inner.optimizer).__qualname__}'s step runs only on "
                f"{', '.join(sorted(supported))}, and its parameters lie on {', '.join(sorted(devices - supported))}: the next step would raise"
            )
            raise layout_error(node, "param_groups", message)


def _capturable_devices() -> list[str]:
    """The device types torch's capturable steps run on, as torch's own check lists them."""
    found: object = getattr(sys.modules.get("torch.optim.optimizer"), "_get_capturable_supported_devices", lambda: ["cuda"])()
    return [device for device in found if isinstance(device, str)] if isinstance(found, list) else ["cuda"]


def _check_kept_history(node: Node, inner: Node, saved: list[dict[object, object]]) -> None:
    """A DistributedOptimizer's state dict holds no history, and its ``param_state`` is
    copied into the tensors its optimizer's entries hold: the entries and their keys are
    kept. A saved group turning on an option that makes the step read history those
    entries lack (``amsgrad``'s ``max_exp_avg_sq``) loads, and the next step raises. (Over
    a HybridDeviceOptimizer, an inner node of its own, the load sets the keys it saved.)"""
    if not isinstance(inner, LeafNode):
        return
    schema = _registry.schema_for(type(inner.optimizer))
    if schema is None:
        return
    live = _groups(inner)
    state: object = getattr(inner.optimizer, "state", {})
    if not isinstance(state, Mapping):
        return
    for needed, option in schema.built_with_entry:
        if option is None:
            continue
        for index, group in enumerate(saved[: len(live)]):
            if not group.get(option) or live[index].get(option):
                continue
            entries = [state.get(param) for param in live[index]["params"]]
            lacking = sum(1 for entry in entries if isinstance(entry, Mapping) and entry and needed not in entry)
            if lacking:
                message = (
                    f"param group {index} turns {option!r} on, where the optimizer's is off and {lacking} of its entries, "
                    f"which this state dict does not replace, lack {needed!r}, which the step then reads: it would raise"
                )
                raise layout_error(node, needed, message)


def _check_group_steps(node: Node, saved: list[dict[object, object]]) -> None:
    """A step a saved param group holds (TE's ``FusedAdam`` counts there, in an int or an
    int tensor), which torch's load keeps: one whole count from 0, as ``reset`` takes one.
    None counts nothing (megatron-core 0.14 saves it where no group counts), as in ``reset``."""
    for index, group in enumerate(saved):
        value = group.get("step")
        if value is None:
            continue
        number = step_number(value)
        if number is None or not _whole_count(number):
            what = kind_of(value) if number is None else f"{number:g}"
            raise layout_error(node, "step", f"param group {index}'s step is {what}, where a step counts from 0 in one whole number")


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except Exception:  # noqa: BLE001  # a tuple holding a list raises TypeError; a class's own __hash__ anything
        return False
    return True


def _gather_history(
    node: Node, leaf: LeafNode, entries: dict[object, dict[object, object]], params: Mapping[object, object], into: Extents
) -> None:
    """The memory of the history tensors of a leaf's saved entries that torch's load keeps
    as they are (not those it copies to cast them to their parameter's dtype or device),
    by node path, entry and key."""
    schema = _registry.schema_for(type(leaf.optimizer))
    if schema is None:
        return
    history = schema.zero | schema.filled | schema.identity
    cls = type(leaf.optimizer).__qualname__
    for index, entry in entries.items():
        param = params.get(index)
        for key, value in entry.items():
            if key in history and isinstance(value, torch.Tensor) and not (isinstance(param, torch.Tensor) and _cast_at_load(value, param)):
                into.extend(ranges([value]).owned((f"state entry {index!r} at {node.path}", cls, str(key))))


def check_history_apart(root: Node, load: Load) -> None:
    """Saved history tensors that share memory (one tensor under two entries, keys or
    leaves): torch's load keeps a tensor of its parameter's dtype and device as it is, so
    the loaded optimizers would update one tensor as two histories, and opttree's reset
    would refuse it."""
    clash = overlap(load.history, Extents())
    if clash is not None:
        (first, cls, first_key), (second, _, second_key) = clash
        message = (
            f"the {first_key!r} of {first} shares memory with the {second_key!r} of {second}: torch's load keeps them one "
            f"tensor, which {cls} would then update as two histories"
        )
        raise layout_error(root, first_key, message)


def _counting(schema: StateSchema | None) -> tuple[StepType, str]:
    """How an optimizer of ``schema`` counts steps (its ``step_type``), and in words."""
    if schema is not None and schema.step_type is StepType.INT:
        return StepType.INT, "a Python int"
    return StepType.TENSOR, "one whole number: a float tensor of the dtype a fresh one counts in, or a number its load makes one"


def _check_common_step(node: Node, inner: Node, value: object, groups: Sequence[Mapping[object, object]]) -> None:
    """The step Megatron's load writes into every saved entry of the leaf below."""
    step_type, unit = _counting(_registry.schema_for(type(inner.optimizer)))
    fault = _step_fault(value, step_type)
    cls = type(inner.optimizer).__qualname__
    if fault is not None:
        message = f"is {fault}, which Megatron's load writes as the step of every entry, where {cls} counts steps from 0 in {unit}"
        raise layout_error(node, STEP_KEY, message)
    if isinstance(value, torch.Tensor):
        for group in groups:
            unfresh = _unfresh_loaded_step(type(inner.optimizer), value, group)
            if unfresh is not None:
                raise layout_error(node, STEP_KEY, f"is {unfresh[0]}, which Megatron's load writes as the step of every entry, {unfresh[1]}")


def _unfresh_loaded_step(cls: type, value: torch.Tensor, group: Mapping[object, object]) -> tuple[str, str] | None:
    """What a saved step tensor is, and why it is refused, where torch's load would leave a
    step that a reset refuses (see :meth:`~opttree._inspect.LeafInspector.unfresh_steps`):
    torch's load keeps a step tensor's shape and, but in a fused or capturable group, which
    it casts to float32, its dtype. Where ``cls`` builds its state as its built-in schema
    says, the step must be 0-d, in the dtype a fresh one counts in; else in torch's scalar
    dtype or float32. None where it is so."""
    options = {key: option for key, option in group.items() if isinstance(key, str)}
    with plain_reads():  # a subclass's own code does not run
        dtype, shape = value.dtype, tuple(value.shape)
    loaded = torch.float32 if is_on(options.get("fused")) or is_on(options.get("capturable")) else dtype
    known = _registry.builds_as_its_schema_says(cls)
    counted_in = {fresh_step_dtype(options)} if known else {scalar_dtype(), torch.float32}
    fresh = " or ".join(sorted(map(torch_name, counted_in)))
    then = (
        f"and a reset of the loaded optimizer is refused (a step computed with it as a tensor, compiled or "
        f"differentiable, would be unlike a fresh {cls.__qualname__}'s)"
    )
    if shape and known:
        return f"a tensor of shape {shape}", f"where a fresh {cls.__qualname__} counts in a 0-d tensor: torch's load keeps its shape, {then}"
    if loaded not in counted_in:
        return (
            f"{article(torch_name(dtype))} tensor",
            f"where a fresh {cls.__qualname__} counts in {fresh} (torch's default dtype is "
            f"{torch_name(torch.get_default_dtype())}; fused groups count in float32): torch's load keeps it "
            f"{torch_name(loaded)}, {then}",
        )
    return None


def _check_steps_held(node: Node, leaf: LeafNode, entries: dict[object, dict[object, object]]) -> None:
    """Where some saved entries hold a per-parameter step, every entry holding history must:
    torch's Adam raises KeyError at one without, after Megatron has loaded what comes before.
    (Where none holds one, the checkpoint was saved at step 0: see :mod:`opttree._checkpoints`.)"""
    if _registry.step_location(type(leaf.optimizer)) is not StepLocation.PER_PARAMETER:
        return
    stepless = [index for index, entry in entries.items() if entry and "step" not in entry]
    if stepless and len(stepless) < sum(1 for entry in entries.values() if entry):
        message = f"state entry {stepless[0]!r} holds history but no step, where other entries hold one ({len(stepless)} such)"
        raise layout_error(node, "step", message)


def _check_steps_equal(node: Node, leaf: LeafNode, entries: dict[object, dict[object, object]]) -> None:
    """A Megatron wrapper that saves one step for all its parameters (a step unit) cannot
    checkpoint a state whose steps differ: ``sharded_state_dict`` raises "The optimizer
    step differs per parameter". A checkpoint holding such steps is refused, as a reset
    that would leave them so is."""
    locations = STEP_UNITS.lookup(type(node.optimizer))
    if locations is None or StepLocation.PER_PARAMETER not in locations:
        return
    if _registry.step_location(type(leaf.optimizer)) is not StepLocation.PER_PARAMETER:
        return
    steps = {number for number in (step_number(entry["step"]) for entry in entries.values() if "step" in entry) if number is not None}
    if len(steps) > 1:
        message = (
            f"the saved steps differ ({len(steps)} values, {min(steps):g} to {max(steps):g}), where {type(node.optimizer).__qualname__} "
            "saves one step for all its parameters: loaded, the stack could no longer be checkpointed"
        )
        raise layout_error(node, "step", message)


def _step_fault(value: object, step_type: StepType) -> str | None:
    """What a saved per-parameter step is, where it is not one whole count from 0 (a
    Python, NumPy or one-element tensor number of a dtype that counts exactly, and no tensor
    where the optimizer counts in an int, whose bias correction a tensor changes): None
    where it is one."""
    if isinstance(value, torch.Tensor):
        with plain_reads():  # a subclass's own code does not run
            dtype, count = value.dtype, value.numel()
        if step_type is StepType.INT:
            return f"{article(torch_name(dtype))} tensor"
        if count != 1 or dtype not in STEP_DTYPES:
            return f"{article(torch_name(dtype))} tensor of {count} value{'s' if count != 1 else ''}"
    number = real_number(value)
    if number is None:
        return kind_of(value)
    return None if _whole_count(number) else f"{number:g}"


def _whole_count(number: float) -> bool:
    """Whether ``number`` counts steps: a whole number from 0, finite."""
    return math.isfinite(number) and number >= 0 and number.is_integer()


def _held_dtype(value: torch.Tensor, param: torch.Tensor) -> torch.dtype:
    """The dtype torch's load holds saved history in: its parameter's where that is a
    float, else its own."""
    with plain_reads():
        return param.dtype if param.is_floating_point() else value.dtype


def _cast_at_load(value: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether torch's load copies saved history to hold it: it casts it to its parameter's
    device and to :func:`_held_dtype`, and keeps one already so as it is."""
    with plain_reads():
        return value.device != param.device or _held_dtype(value, param) != value.dtype


def _check_entry(
    node: Node, leaf: LeafNode, index: object, entry: dict[object, object], param: object, group: dict[object, object]
) -> None:
    """One saved state entry, as the leaf's optimizer builds it for ``param`` in its saved
    param ``group`` (whose options torch's load takes): torch's load casts history to the
    parameter's dtype but keeps its shape, so history of another shape, history that is not
    a tensor, history an option of its group needs missing, a key the schema does not know
    or a step that is not one count would load, and be refused (or raise, or train to NaN)
    at the next reset or step."""
    schema = _registry.schema_for(type(leaf.optimizer))
    if schema is None or not isinstance(param, torch.Tensor):
        return  # a leaf without a schema is refused by validate and reset; a param group holding no tensor, by torch
    cls = type(leaf.optimizer).__qualname__
    history = schema.zero | schema.filled | schema.identity
    where = f"state entry {index!r}, of a parameter of shape {tuple(param.shape)}"
    if not (history | {"step"}).isdisjoint(entry):  # an empty entry is built whole at the next step
        for needed, option in schema.built_with_entry:
            if needed in entry or (option is not None and not group.get(option)):
                continue
            when = " builds with every entry and" if option is None else ""
            on = "" if option is None else f" where {option!r} is on, as its saved param group has it"
            message = f"{where} lacks {needed!r}, which {cls}{when} reads at every step{on}"
            raise layout_error(node, needed, message)
        for needed, applies in schema.built_for:
            if needed in entry:
                continue
            try:
                needs = bool(applies(tuple(param.shape)))
            except Exception as error:  # noqa: BLE001  # a registered function (or what it returns) may raise anything
                raise layout_error(node, needed, f"{where}: its schema's built_for raised {type(error).__name__}: {error}") from error
            if needs:
                raise layout_error(node, needed, f"{where} lacks {needed!r}, which {cls} builds with the entry of such a parameter and reads at every step")
    step_type, unit = _counting(schema)
    with plain_reads():  # a tensor subclass's own code does not run
        for key, value in entry.items():
            where = f"state entry {index!r}, of a parameter of shape {tuple(param.shape)}: its {key!r}"
            if key == "step" and schema.step is StepLocation.PER_PARAMETER:
                fault = _step_fault(value, step_type)
                if fault is not None:
                    raise layout_error(node, key, f"{where} is {fault}, where {cls} counts steps from 0 in {unit}")
                unwritable = unwritable_reason(value) if isinstance(value, torch.Tensor) else None
                if unwritable is not None:  # torch's load keeps a step tensor as it is, and the step adds to it in place
                    raise layout_error(node, key, f"{where} is {unwritable}, which {cls}'s step counts up in place")
                unfresh = _unfresh_loaded_step(type(leaf.optimizer), value, group) if isinstance(value, torch.Tensor) else None
                if unfresh is not None:
                    raise layout_error(node, key, f"{where} is {unfresh[0]}, {unfresh[1]}")
                continue
            if not isinstance(key, str) or key not in schema.actions:
                raise layout_error(node, key, f"{where} is not a key {cls} keeps (its schema has {', '.join(sorted(schema.actions))})")
            if key not in history:
                continue
            if not isinstance(value, torch.Tensor):
                hint = " (a sharded state dict is loaded by dist_checkpointing.load first)" if "Sharded" in type(value).__name__ else ""
                raise layout_error(node, key, f"{where} is {kind_of(value)}, where {cls} keeps a tensor{hint}")
            unwritable = unwritable_reason(value, copied=_cast_at_load(value, param))
            if unwritable is not None:
                raise layout_error(node, key, f"{where} is {unwritable}, which {cls}'s step updates in place")
            if key in schema.one_value and value.numel() != 1:
                raise layout_error(node, key, f"{where} holds {value.numel()} values, where {cls} keeps one")
            if key in schema.built_like_param:
                try:
                    expected = schema.built_shape(key, tuple(param.shape), leaf.optimizer)  # the loading optimizer's settings
                except Exception as error:  # noqa: BLE001  # a registered shape_of or shape_with may raise anything
                    raise layout_error(node, key, f"{where}: its schema's {schema.shape_field(key)} raised {type(error).__name__}: {error}") from error
                if value.shape != expected:
                    raise layout_error(node, key, f"{where} has shape {tuple(value.shape)}, where {cls} builds it in shape {tuple(expected)}")
                try:
                    built = schema.built_dtype(key, param.dtype)
                except Exception as error:  # noqa: BLE001  # a registered dtype_of may raise anything
                    raise layout_error(node, key, f"{where}: its schema's dtype_of raised {type(error).__name__}: {error}") from error
                held = _held_dtype(value, param)
                if held != built:
                    cast = " (torch's load casts history to its parameter's dtype)" if held != value.dtype else ""
                    raise layout_error(node, key, f"{where} would be held as {torch_name(held)}{cast}, where {cls} builds it in {torch_name(built)}")


def _groups(node: Node) -> list[dict[str, list[object]]]:
    groups: object = getattr(node.optimizer, "param_groups", [])
    if not isinstance(groups, list):
        raise layout_error(node, "param_groups", f"the optimizer's own param groups are {kind_of(groups)}")
    malformed = next((index for index, group in enumerate(groups) if not isinstance(group, dict) or not isinstance(group.get("params"), list)), None)
    if malformed is not None:
        raise layout_error(node, "param_groups", f"the optimizer's own param group {malformed} is not a dict holding a list of 'params'")
    return cast(list[dict[str, list[object]]], groups)


def _check_pairing(node: Node, live: list[dict[str, list[object]]], saved: list[dict[object, object]]) -> None:
    """Megatron's own pairing of saved param groups with the optimizer's (by their lr and
    weight-decay settings), run on copies, where the installed release has it."""
    pair: object = getattr(type(node.optimizer), "_filter_and_reorder_param_groups", None)
    if not callable(pair):
        return
    try:
        pair(live, [{"params": [], **group} for group in saved])  # DistributedOptimizer saves none
        marked = [{"params": [], **group, _MARK: index} for index, group in enumerate(saved)]
        paired = pair([dict(group) for group in marked], [dict(group) for group in marked])
    except Exception as error:  # noqa: BLE001  # Megatron's own, or a saved option's own __hash__ or __eq__
        message = f"Megatron pairs no saved param group with one of the optimizer's: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        raise layout_error(node, "param_groups", message) from error
    # Paired with themselves, saved groups Megatron cannot tell apart give the last of them
    # for each: it loads that one's options for every one, the others' lost in silence.
    for index, group in enumerate(paired):
        other = group.get(_MARK)
        if isinstance(other, int) and other != index and not _same_options(saved[index], saved[other]):
            message = (
                f"saved param groups {index} and {other} hold other options but the settings Megatron pairs groups by "
                f"alike: its load would give both the options of group {other}, {index}'s lost in silence"
            )
            raise layout_error(node, "param_groups", message)


_MARK = "opttree: saved group"
"""A key no optimizer uses, marking each saved group to see which one Megatron pairs."""


def _same_options(first: dict[object, object], second: dict[object, object]) -> bool:
    """Whether two saved groups hold the same options (their ``params`` aside), compared
    without a value's own ``==`` deciding by a tensor's truth or raising."""
    keys = set(first) - {"params"}
    if keys != set(second) - {"params"}:
        return False
    return all(_same_value(first[key], second[key]) for key in keys)


def _same_value(first: object, second: object) -> bool:
    if first is second:
        return True
    try:
        if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
            return isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor) and torch.equal(first, second)
        return type(first) is type(second) and bool(first == second)
    except Exception:  # noqa: BLE001  # a value's own __eq__, or tensors on two devices, may raise anything
        return False


def _check_scaler(node: Node, state: dict[object, object]) -> None:
    """The loss scaler's state, where Megatron loads it: the keys the live scaler writes,
    tensors where it holds tensors."""
    if "grad_scaler" not in state:
        return
    scaler: object = getattr(node.optimizer, "grad_scaler", None)
    if not scaler:
        return
    expected = getattr(scaler, "state_dict")()
    saved = state["grad_scaler"]
    if not isinstance(saved, dict) or not isinstance(expected, dict):
        raise layout_error(node, "grad_scaler", f"is {kind_of(saved)}, where the loss scaler writes a dict")
    for key, value in expected.items():
        if key not in saved:
            raise layout_error(node, "grad_scaler", f"has no {key!r}, which {type(scaler).__qualname__} loads")
        given = saved[key]
        if isinstance(value, torch.Tensor) != isinstance(given, torch.Tensor) or (
            isinstance(value, torch.Tensor) and isinstance(given, torch.Tensor) and value.is_floating_point() != given.is_floating_point()
        ):
            message = f"holds {_held_kind(given)} under {key!r}, where {type(scaler).__qualname__} holds {_held_kind(value)}"
            raise layout_error(node, "grad_scaler", message)
        fault = _scaler_fault(key, saved[key])
        if fault is None and isinstance(given, torch.Tensor):
            unwritable = unwritable_reason(given)
            fault = None if unwritable is None else f"{unwritable}, which Megatron's load keeps where it lies on the scaler's device"
        if fault is not None:
            raise layout_error(node, "grad_scaler", f"its {key!r} is {fault}")


def _held_kind(value: object) -> str:
    """A tensor by its dtype (``a float32 tensor``), anything else by its kind."""
    return f"{article(torch_name(value.dtype))} tensor" if isinstance(value, torch.Tensor) else kind_of(value)


def _scaler_fault(key: object, value: object) -> str | None:
    """What is wrong with a saved loss-scaler value, or None: the scale must be one positive
    finite number, the growth tracker a count from 0, and the hysteresis tracker a whole
    number: ``DynamicGradScaler.update`` lowers it at every overflow, below 0 too, and
    sets it back only when the scale grows, so a checkpoint saved after a run of overflows
    holds -1 or less."""
    number = real_number(value)
    what = kind_of(value) if number is None else f"{number:g}"
    if key == "scale":
        if number is None or not (math.isfinite(number) and number > 0):
            return f"{what}, where the loss scale is one positive finite number (a NaN one makes every later gradient NaN, a zero or infinite one skips every step)"
    elif key == "hysteresis_tracker":
        if number is None or not (math.isfinite(number) and number.is_integer()):
            return f"{what}, where it is a whole number, counted down at each overflow"
    elif number is None or not _whole_count(number):
        return f"{what}, where it counts steps from 0"
    return None


def _check_masters(node: Node, state: dict[object, object]) -> None:
    """The master weights ``Float16OptimizerWithFloat16Params`` copies in group by group,
    with ``zip``: every one must be there, shaped as the copy it replaces."""
    _, key = _first_key(node, state, ("fp32_from_fp16_params", "fp32_from_fp16"))
    saved = state[key]
    live = [group if isinstance(group, list) else [] for group in sequence_attribute(node.optimizer, "fp32_from_float16_groups", node.path)]
    if not isinstance(saved, list) or [len(group) if isinstance(group, list) else None for group in saved] != list(map(len, live)):
        message = (
            f"does not hold {len(live)} lists of {', '.join(str(len(group)) for group in live)} master weights, "
            "as the optimizer has (Megatron would load only some of them, or none)"
        )
        raise layout_error(node, key, message)
    for index, (saved_group, live_group) in enumerate(zip(saved, live)):
        for saved_param, live_param in zip(saved_group, live_group):
            if not isinstance(saved_param, torch.Tensor) or not isinstance(live_param, torch.Tensor) or saved_param.shape != live_param.shape:
                what = f"of shape {tuple(saved_param.shape)}" if isinstance(saved_param, torch.Tensor) else f"that is {kind_of(saved_param)}"
                raise layout_error(node, key, f"group {index} holds a master weight {what} where the optimizer's is of shape {tuple(getattr(live_param, 'shape', ()))}")
            unreadable = unreadable_reason(saved_param)
            if unreadable is not None:  # Megatron copies the masters in last, after loading its optimizer's state
                raise layout_error(node, key, f"group {index} holds a master weight that is {unreadable}")


def _float16(node: Node, state: object, loading: Load | None) -> StateDicts:
    """``Float16OptimizerWithFloat16Params``: its leaf's state dict under ``"optimizer"``
    (or ``"optimizer_state_dict"``, which Megatron's load still reads)."""
    if not node.children:
        return
    if not loading:
        yield from _torch_format(node, _part(node, state, "optimizer"), loading)
        return
    checked, key = _first_key(node, state, ("optimizer", "optimizer_state_dict"))
    _check_scaler(node, checked)
    _check_masters(node, checked)
    yield from _torch_format(node, checked[key], loading)


def _reads_every_group_step(node: Node) -> bool:
    """Whether a ``DistributedOptimizer``'s load reads the step of every saved param group:
    Megatron's does where neither TE nor apex is installed (its module's ``HAVE_APEX_OR_TE``);
    with one, only the steps the groups hold, none before a first step (over a
    HybridDeviceOptimizer). A module without the flag is taken to read them all."""
    for cls in type(node.optimizer).__mro__:  # a subclass's load is its Megatron base's, which reads its own module's
        module = sys.modules.get(cls.__module__)
        if hasattr(module, "HAVE_APEX_OR_TE"):
            return not getattr(module, "HAVE_APEX_OR_TE")
    return True


def _steps_in_groups(node: Node, state: object, loading: Load | None) -> StateDicts:
    """``DistributedOptimizer`` writes its step into the param groups, even a step of 0,
    and its load reads one step from them where its torch optimizer counts per parameter."""
    if not loading or getattr(getattr(node.optimizer, "ddp_config", None), "use_megatron_fsdp", False):
        return
    checked = _dict(node, state, "optimizer")
    groups = _dict(node, checked["optimizer"], "param_groups")["param_groups"]
    if not isinstance(groups, list) or not all(isinstance(group, dict) for group in groups):
        raise layout_error(node, "param_groups", "is not a list of param groups, each a dict")
    live = _groups(node)
    _check_pairing(node, live, groups)
    if node.children:
        _check_options(node, node.children[0], groups[: len(live)])
        _check_capturable(node, node.children[0], groups[: len(live)])
        _check_kept_history(node, node.children[0], groups[: len(live)])
    counting = _counting_per_parameter(node.children[0]) if node.children else None
    if counting is not None and (_reads_every_group_step(node) or any("step" in group for group in groups)):
        values = [group.get("step") for group in groups]
        steps = {step_number(value) for value in values}
        if len(steps) != 1 or not all(step is not None and math.isfinite(step) for step in steps):
            message = "its param groups do not hold one step (Megatron's load reads each parameter's step from them)"
            raise layout_error(node, "step", message)
        fault = _step_fault(values[0], StepType.TENSOR) if values else None  # the group step, a number whatever the leaf counts in
        if fault is not None:
            message = f"its param groups' step is {fault}, which Megatron's load gives each parameter, where {counting.__qualname__} counts steps from 0 in one whole number"
            raise layout_error(node, "step", message)
        saved_step = steps.pop()
        if saved_step is not None:  # checked above: one finite step
            loading.group_steps[id(node.optimizer)] = saved_step
    _check_scaler(node, checked)
    if "param_state" in checked:
        _check_sharding(node, _dict(node, checked, "param_state_sharding_type")["param_state_sharding_type"], checked["param_state"])
    yield from ()


WITHOUT_STEPS = frozenset({"dp_zero_gather_scatter", "fully_reshardable"})
"""The ``param_state`` formats whose load gives a parameter's state no ``step``."""


def _equal(saved: object, live: object) -> bool:
    """Whether plain values (Megatron's bucket sizes: lists of dicts of ints) are equal;
    False where comparing them raises (a tensor among them), as nothing then says they are."""
    try:
        return bool(saved == live)
    except Exception:  # noqa: BLE001  # a saved value's own __eq__ may raise anything
        return False


def _check_sharding(node: Node, sharding: object, param_state: object) -> None:
    """The format of a ``DistributedOptimizer``'s ``param_state``: one its load reads, and
    that it loads whole into this stack. Its load writes a step tensor into every state
    entry of an inner torch optimizer that counts per parameter, then copies the
    checkpoint's tensors into each tensor of every entry, and a ``fully_reshardable`` or
    ``dp_zero_gather_scatter`` checkpoint holds none for ``step``: Megatron raises
    ``KeyError: 'step'`` after loading the param groups, the steps and the loss scaler
    (megatron-core 0.16.1 and 0.19.2, without TE or apex; over a ``HybridDeviceOptimizer``
    it loads). A ``dp_reshardable`` one must hold as many elements in each bucket as the
    stack's, which Megatron's load asserts after loading the rest."""
    if not isinstance(sharding, str) or sharding not in SHARDING_TYPES:
        raise layout_error(node, "param_state_sharding_type", f"{sharding!r} is not one of {', '.join(sorted(SHARDING_TYPES))}")
    inner = _inner_counting_per_parameter(node)
    if sharding in WITHOUT_STEPS and inner is not None:
        message = (
            _without_steps(sharding, inner) + "Megatron's own load raises KeyError: 'step' half-way, its param groups, steps "
            "and loss scaler loaded and the history not; save in the dp_reshardable format, which it loads"
        )
        raise layout_error(node, "param_state_sharding_type", message)
    buckets = param_state.get("per_bucket_numel_unpadded") if sharding == "dp_reshardable" and isinstance(param_state, dict) else None
    live: object = getattr(node.optimizer, "per_bucket_numel_unpadded", None)
    if buckets is not None and live is not None and not _equal(buckets, live):
        message = (
            "its buckets hold other numbers of elements than this stack's (a checkpoint of another data-parallel "
            "size or bucket layout, which this format cannot reshard): Megatron's own load asserts they match, "
            "its param groups, steps and loss scaler loaded"
        )
        raise layout_error(node, "per_bucket_numel_unpadded", message)


def _chained(node: Node, state: object, loading: Load | None) -> StateDicts:
    """``ChainedOptimizer``: a single member's state dict as it is, else one per index (a
    dict by index sharded, a list in memory), one for each member."""
    members = node.children
    if len(members) == 1:
        yield from walk(members[0], state, loading)
        return
    if isinstance(state, (list, dict)) and len(state) != len(members):
        message = f"its state dict holds {len(state)} members' state dicts, and it has {len(members)} members"
        raise layout_error(node, len(state), message)
    for index, member in enumerate(members):
        yield from walk(member, _part(node, state, index), loading)


def _layer_wise(node: Node, state: object, loading: Load | None) -> StateDicts:
    """``LayerWiseDistributedOptimizer``: a chain whose load first turns each member's
    master weights, which a sharded load gives back by index in a dict, into the list
    ``Float16OptimizerWithFloat16Params`` loads; they are checked as that list. Several
    members' state dicts it reads from a dict by index (``.values()``): the list its own
    ``state_dict()`` gives makes its load raise AttributeError before it loads anything
    (megatron-core 0.16.1 and 0.19.2), so it is refused, with the dict it reads named."""
    if loading and len(node.children) > 1 and isinstance(state, list):
        message = (
            "its load_state_dict reads several members' state dicts from a dict by index (.values()), and this is the "
            "list its own state_dict() gives: Megatron's own load raises AttributeError before it loads anything; "
            "pass dict(enumerate(state_dict)), which it loads member by member in that order"
        )
        raise layout_error(node, "state_dict", message)
    if loading and len(node.children) == 1:
        state = _masters_listed(state)
    elif loading and isinstance(state, dict):
        state = {key: _masters_listed(member) for key, member in state.items()}
    yield from _chained(node, state, loading)


def _masters_listed(member: object) -> object:
    """A member's state dict with its master weights by index turned into their list, in a
    new top-level dict (what it holds, and any step written into it, stays shared)."""
    if not isinstance(member, dict) or not isinstance(by_index := member.get("fp32_from_fp16_params"), dict):
        return member
    if not all(isinstance(index, int) for index in by_index):
        return member
    return {**member, "fp32_from_fp16_params": [by_index[index] for index in sorted(by_index)]}


def _mimo(node: Node, state: object, loading: Load | None) -> StateDicts:
    """``MimoOptimizer``: one state dict per active module, by module name. A sharded one
    holds each module's param groups, loss scaler and sharding type under ``_mimo_``
    keys, which Mimo's load puts back where the module's kind reads them before loading
    it; they are checked as it puts them back (:func:`_mimo_restored`)."""
    infos = mapping_attribute(node.optimizer, "module_infos", node.path)
    held = [name for name, info in infos.items() if instance_attribute(info, "optimizer", node.path) is not None]
    for name, member in zip(held, node.children, strict=True):
        if getattr(infos[name], "is_active", True):
            part = _part(node, state, name)
            if loading:
                several = _chain_of_several(member)
                if several is None:
                    part = _mimo_restored(node, member, part)
                elif isinstance(part, dict):
                    part = {key: _mimo_restored(node, several[key], value) if key in range(len(several)) else value for key, value in part.items()}
            yield from walk(member, part, loading)


def check_loading(root: Node) -> None:
    """What makes Megatron's own loading ``sharded_state_dict`` raise a bare
    ``AssertionError``, found before it runs: a ``DistributedOptimizer`` whose inner torch
    optimizer holds no step on this rank (a fresh stack, none stepped). Megatron's reads its
    ``state_dict``, which asserts one step among the entries; with TE's or apex's Adam its
    ``init_state_fn`` builds the state first, and without them (on a CPU or an NPU) nothing
    does."""
    for node in tree_nodes(root):
        _refuse_stub(node)
        inner = _asserted_inner(node)
        if inner is not None and not _holds_a_step(inner):
            message = (
                f"its {type(inner.optimizer).__qualname__} holds no step on this rank (a fresh stack: no parameter "
                "stepped), and Megatron's own loading sharded_state_dict reads its state_dict, which asserts one (Megatron "
                "builds none without TE or apex): build its state first, as Megatron does for Megatron-FSDP, by one step with "
                "zero gradients (the DistributedOptimizer's _init_optimizer_states_with_dummy_values(), which moves weights "
                "by weight decay: load the model's weights after it)"
            )
            raise layout_error(node, STEP_KEY, message)


def _refuse_stub(node: Node) -> None:
    """A Megatron stub (the wrapper its factory builds, holding no optimizer, for frozen
    layers of a chain) cannot be checkpointed by Megatron: its own ``sharded_state_dict``
    and ``state_dict`` read the stub's optimizer, None, and raise ``AttributeError``."""
    if isinstance(node, WrapperNode) and node.is_stub:
        message = (
            "is a Megatron stub holding no optimizer (built for frozen layers), and Megatron's own sharded_state_dict "
            "and state_dict read its optimizer's state and raise AttributeError: Megatron cannot checkpoint a chain "
            "holding one (a stack whose dense layers are frozen), with opttree or without"
        )
        raise layout_error(node, "optimizer", message)


def _asserted_inner(node: Node) -> Node | None:
    """The inner optimizer of a ``DistributedOptimizer`` (or a wrapper of its layout), in
    whose ``state`` Megatron's ``state_dict`` asserts a step: a torch optimizer counting
    steps per parameter, or a ``HybridDeviceOptimizer`` (whose state mirrors its
    sub-optimizers') where Megatron found neither TE nor apex (with them it passes over
    sub-optimizers without state)."""
    if _LAYOUTS.lookup(type(node.optimizer)) is not _steps_in_groups or not node.children:
        return None
    inner = node.children[0]
    if isinstance(inner, LeafNode):
        return inner if _counts_per_parameter(inner) else None
    module = sys.modules.get("megatron.core.optimizer.distrib_optimizer")
    return inner if isinstance(inner, HybridNode) and getattr(module, "HAVE_APEX_OR_TE", True) is False else None


def _holds_a_step(inner: Node) -> bool:
    """Whether the inner optimizer's own ``state`` holds a step in an entry, as Megatron's
    ``DistributedOptimizer.state_dict`` asserts."""
    state = getattr(inner.optimizer, "state", None)
    return isinstance(state, Mapping) and any(isinstance(entry, Mapping) and "step" in entry for entry in state.values())


def check_saving(root: Node, metadata: Mapping[str, object] | None) -> None:
    """What makes Megatron's own ``sharded_state_dict`` raise, or save what no load takes,
    found before it runs (some of its formats gather over the data-parallel group, where a
    rank that raised first would leave the others waiting): a ``DistributedOptimizer``
    whose inner torch optimizer holds no step on this rank (its ``state_dict`` asserts one
    step among the entries: a rank whose shard is all padding), and a format that saves no
    per-parameter step over one that counts them (:func:`_check_sharding`'s load refuses
    it, and Megatron's raises half-way); and an ``FP32Optimizer`` or
    ``Float16OptimizerWithFloat16Params`` whose inner torch optimizer has not built the
    history it builds with every entry yet (no step taken): Megatron saves no history for
    it, and every load, which first builds that history to load into, finds none in the
    checkpoint and raises."""
    sharding = (metadata or {}).get("distrib_optim_sharding_type")
    for node in tree_nodes(root):
        _refuse_stub(node)
        if _LAYOUTS.lookup(type(node.optimizer)) in (_torch_format, _float16):
            _check_history_built(node)
            continue
        stepped = _asserted_inner(node)
        if stepped is not None and not _holds_a_step(stepped):
            message = (
                f"its {type(stepped.optimizer).__qualname__} holds no step on this rank (no parameter, or none stepped), "
                "and Megatron's own state_dict asserts one: it cannot be checkpointed until it holds state"
            )
            raise layout_error(node, STEP_KEY, message)
        inner = stepped if isinstance(stepped, LeafNode) else None  # the torch optimizer counting per parameter
        if inner is None:
            continue
        if not isinstance(sharding, str | None) or (sharding is not None and sharding not in SHARDING_TYPES):
            message = f"{sharding!r} is not one of {', '.join(sorted(SHARDING_TYPES))}"
            raise layout_error(node, "distrib_optim_sharding_type", message)
        if sharding in WITHOUT_STEPS:
            message = _without_steps(sharding, inner) + "no load takes it (Megatron's raises KeyError: 'step' half-way); save in the dp_reshardable format"
            raise layout_error(node, "distrib_optim_sharding_type", message)


DEFAULT_SHARDING = "fully_sharded_model_space"
"""The ``param_state`` format a ``DistributedOptimizer``'s ``sharded_state_dict`` writes
where ``metadata`` names none: flattened ranges of each parameter, which
``dist_checkpointing`` refuses from megatron-core 0.16 on (``ShardedTensor.flattened_range
is not supported``) and whose load asserts on 0.13 to 0.15."""


def format_advice(root: Node, metadata: Mapping[str, object] | None, error: Exception) -> str:
    """What to say where Megatron's own ``sharded_state_dict`` raised ``error`` for a stack
    holding a ``DistributedOptimizer`` in :data:`DEFAULT_SHARDING`, refusing its flattened
    ranges: the format it fell back to, and one that its load takes; empty otherwise (an
    error of another cause, a model state dict that maps no parameter, is not the format's)."""
    sharding = (metadata or {}).get("distrib_optim_sharding_type", DEFAULT_SHARDING)
    if "flattened_range" not in str(error) or sharding != DEFAULT_SHARDING or not any(_LAYOUTS.lookup(type(node.optimizer)) is _steps_in_groups for node in tree_nodes(root)):
        return ""
    why = (
        "as metadata asks"
        if metadata and "distrib_optim_sharding_type" in metadata
        else "Megatron's default, as metadata names no distrib_optim_sharding_type"
    )
    return (
        f" (its DistributedOptimizer writes {DEFAULT_SHARDING}, {why}: flattened ranges, which Megatron's "
        "dist_checkpointing refuses from megatron-core 0.16 on; pass the format your training saves in, at the save and at "
        "the load, as Megatron-LM's training does: metadata={'distrib_optim_sharding_type': 'dp_reshardable'}, its default, "
        "loads over torch's Adam)"
    )


def _check_history_built(node: Node) -> None:
    """See :func:`check_saving`: a wrapper whose inner optimizer holds parameters but no
    state entry, where its schema builds history with every entry."""
    inner = node.children[0] if node.children else None
    if not isinstance(inner, LeafNode):
        return
    schema = _registry.schema_for(type(inner.optimizer))
    if schema is None or not schema.always_built or inner.optimizer.state:
        return
    if not any(group.get("params") for group in inner.optimizer.param_groups if isinstance(group, Mapping)):
        return
    built = ", ".join(sorted(schema.always_built))
    message = (
        f"its {type(inner.optimizer).__qualname__} has not stepped yet and holds none of the {built} it builds with every "
        "entry: Megatron's sharded checkpoint of it holds none, and every load, which builds that history first to "
        "load into, raises for it; checkpoint it after its first step"
    )
    raise layout_error(node, "state", message)


def _inner_counting_per_parameter(node: Node) -> LeafNode | None:
    """A ``DistributedOptimizer``'s inner torch optimizer where it counts its steps per
    parameter (not a ``HybridDeviceOptimizer``'s sub-optimizers, whose load Megatron runs
    otherwise); None where there is none."""
    inner = node.children[0] if node.children else None
    return inner if isinstance(inner, LeafNode) and _counts_per_parameter(inner) else None


def _without_steps(sharding: str, inner: LeafNode) -> str:
    return f"a {sharding} checkpoint holds no per-parameter step, and {type(inner.optimizer).__qualname__} counts its steps per parameter: "


def _chain_of_several(node: Node) -> tuple[Node, ...] | None:
    """The members of a chain of more than one, whose state dicts a Mimo module's holds by
    index; None for any other node."""
    return node.children if _is_chain(node) and len(node.children) > 1 else None


def _is_chain(node: Node) -> bool:
    """Whether ``node`` is a ``ChainedOptimizer`` (a ``LayerWiseDistributedOptimizer`` too)."""
    return _LAYOUTS.lookup(type(node.optimizer)) in (_chained, _layer_wise)


_MIMO_KEYS = (("_mimo_param_groups", "param_groups"), ("_mimo_grad_scaler", "grad_scaler"), ("_mimo_param_state_sharding_type", "param_state_sharding_type"))


def _mimo_restored(mimo: Node, member: Node, state: object) -> object:
    """A Mimo module's sharded state dict as Mimo's load puts it back, in new dicts (what
    they hold, and any step written into it, stays shared): the saved param groups, which
    hold no parameters, given those of the member's torch optimizer in torch's numbering,
    and the loss scaler and sharding type under their own keys."""
    if not isinstance(state, dict) or not any(isinstance(key, str) and key.startswith("_mimo_") for key in state):
        return state
    restored = dict(state)
    for saved, key in _MIMO_KEYS:
        found = next((name for name in state if isinstance(name, str) and name.startswith(saved)), None)
        if found is None:
            continue
        value = restored.pop(found)
        if key != "param_groups":
            restored[key] = value
            continue
        while len(member.children) == 1 and _is_chain(member):
            member = member.children[0]
        live = getattr(member.optimizer, "optimizer", None)
        if not isinstance(value, list) or not isinstance(live, torch.optim.Optimizer):
            continue  # left out: the member's own check refuses it
        if len(value) != len(live.param_groups):
            message = f"its checkpoint holds {len(value)} param groups for {member.path}, whose optimizer has {len(live.param_groups)}"
            raise layout_error(mimo, found, message)
        first, groups = 0, []
        for group, own in zip(value, live.param_groups, strict=True):
            count = len(own["params"])
            groups.append({**group, "params": list(range(first, first + count))} if isinstance(group, dict) else group)
            first += count
        inner = restored.get("optimizer")
        restored["optimizer"] = {**(inner if isinstance(inner, dict) else {}), "param_groups": groups}
    return restored


_MEGATRON = "megatron.core.optimizer."
_LAYOUTS: LazyDispatch[Locate] = LazyDispatch()
for _dotted, _locate in {
    _MEGATRON + "optimizer.FP32Optimizer": _torch_format,
    _MEGATRON + "optimizer.Float16OptimizerWithFloat16Params": _float16,
    _MEGATRON + "distrib_optimizer.DistributedOptimizer": _steps_in_groups,
    _MEGATRON + "optimizer.ChainedOptimizer": _chained,
    _MEGATRON + "layer_wise_optimizer.LayerWiseDistributedOptimizer": _layer_wise,
    "megatron.core.models.mimo.optimizer.MimoOptimizer": _mimo,
}.items():
    _LAYOUTS.register_lazy(_dotted, _locate)
