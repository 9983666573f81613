"""Validating a leaf's state and planning its reset, in the same pass.

The state is taken key by key: each key's values across the entries are gathered and
checked at once, and a wrong key is reported once per leaf. Every tensor the reset will
write is checked here (:mod:`opttree._preflight`) and its address range recorded for the
tree-wide aliasing check. Nothing is mutated while planning, so a reset that finds any
error changes nothing.
"""

from __future__ import annotations

import operator
from types import MemberDescriptorType
from numbers import Integral, Real
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence, Set as AbstractSet
from itertools import chain, compress, repeat
from typing import NamedTuple, TypeVar, cast

import torch

from opttree._dispatch import class_mro, class_namespace, static_attribute
from opttree._errors import OptTreeError
from opttree._held import instance_attributes, own_attributes, unknown_attribute_tensors
from opttree._nodes import LeafNode, Node
from opttree._containers import (
    builds_missing_entries,
    malformed_outline,
    malformed_state,
    own_writes,
    param_counts,
    pooled,
    reading_fault,
    tensors_held,
    tensors_in,
)
from opttree._master_groups import master_pairs
from opttree._plan import ResetPlan, StateEntry, StatePlan
from opttree._preflight import (
    _DTYPE,
    _IS_CONTIGUOUS,
    _NDIM,
    _SHAPE,
    Extents,
    bytes_once,
    identities,
    plain_dispatch,
    plain_reads,
    ranges,
    torch_name,
    unfillable_reason,
    unlike_layouts,
    unreadable_reason,
    writable_ranges,
)
from opttree._problems import Problem, ProblemKind
from opttree._schema import BuiltFor, KeyAction, MasterOf, ScaleLookup, StateSchema, StepLocation, StepType
from opttree._selection import EVERYTHING, Selection
from opttree._fields import article, kind_of
from opttree._numbers import real_number

Placement = tuple[torch.dtype | None, torch.device | None]

_DTYPE_AND_DEVICE = operator.attrgetter("dtype", "device")
_GRAD = cast(Callable[[torch.Tensor], "torch.Tensor | None"], torch._C.TensorBase.__dict__["grad"].__get__)
_IS_LEAF = cast(Callable[[torch.Tensor], bool], torch._C.TensorBase.__dict__["is_leaf"].__get__)

GRADIENTS = ".grad"
"""The key under which the gradients of a leaf's parameters are kept memory."""
BUFFERS = "buffers()"
"""The key under which the buffers of ``model=`` are kept memory."""
GROUP_OPTIONS = "param_groups"
"""The key under which the tensors a param group holds as options are kept memory."""
_OPTIMIZER = operator.attrgetter("optimizer")

_Param = TypeVar("_Param")
_Built = TypeVar("_Built")


_DIFFERENTIABLE = (
    "it is differentiable=True and its state carries autograd history, which zeroing in place keeps: "
    "gradients through its next steps would flow into the history a fresh optimizer does not have; "
    "reset it with release=True, which deletes its entries for its next step to build"
)


_DIFFERENTIABLE_OPTION = operator.methodcaller("get", "differentiable")


def _differentiable(groups: Iterable[Mapping[str, object]]) -> bool:
    return any(map(_DIFFERENTIABLE_OPTION, groups))


def _carries_history(state: Mapping[torch.Tensor, StateEntry], actions: Mapping[str, KeyAction]) -> bool:
    """Whether a tensor a reset writes in place takes part in autograd, as a differentiable
    optimizer's state does after a step under grad mode (one it drops takes its history along)."""
    written = [value for entry in state.values() for key, value in entry.items() if actions.get(key) not in _NOT_WRITTEN]
    return any(tensor.requires_grad for tensor in tensors_held(written))


_NOT_WRITTEN = (KeyAction.DROP, KeyAction.KEEP, None)

_ONE_COUNT = (
    ", where its optimizer counts steps in one real number: zeroed in place it would stay so, "
    "and the next step would not be a fresh optimizer's"
)


_NOT_EXACT_IN_PLACE = (
    "a reset deletes its entries, whose values it builds from its group's at its first step, and "
    "filled in place they would keep today's lr: it cannot be reset exactly"
)
"""What to do instead, where a reset of a ``starts_at_first_step`` leaf cannot delete its entries."""


class _ParamLayouts(NamedTuple):
    """The shape, dtype and contiguity of each parameter, as their C++ objects hold them."""

    params: list[torch.Tensor]
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    contiguous: list[bool]

    def having(self, present: list[bool]) -> _ParamLayouts:
        """Those of the parameters whose entries hold a key (``present``)."""
        return _ParamLayouts(
            list(compress(self.params, present)),
            list(compress(self.shapes, present)),
            list(compress(self.dtypes, present)),
            list(compress(self.contiguous, present)),
        )


def _dispatches_itself(cls: type) -> bool:
    """Whether a tensor class dispatches by code of its own (a DTensor, a float8 tensor)."""
    return not plain_dispatch(cls) and getattr(cls, "__torch_dispatch__", None) is not getattr(torch.Tensor, "__torch_dispatch__", None)


def _layouts(params: list[torch.Tensor]) -> _ParamLayouts:
    with plain_reads():
        return _ParamLayouts(params, list(map(_SHAPE, params)), list(map(_DTYPE, params)), list(map(_IS_CONTIGUOUS, params)))


def _layout_text(shape: torch.Size, dtype: torch.dtype) -> str:
    return f"shape {tuple(shape)} {torch_name(dtype)}"


def _placement(params: Sequence[torch.Tensor]) -> Placement:
    """The dtype and device of a leaf's first parameter, which its history follows."""
    if not params:
        return None, None
    with plain_reads():
        return params[0].dtype, params[0].device


def _held_for_own_params(
    optimizers: Sequence[torch.optim.Optimizer],
    states: Sequence[Mapping[torch.Tensor, StateEntry]],
    held: list[torch.Tensor],
    params: list[torch.Tensor],
    counts: Callable[[], list[int]],
) -> bool:
    """Whether each optimizer's state is held for parameters of its own groups, given
    all state keys (``held``) and all group parameters (``params``) in order, and
    ``counts`` to give each optimizer's number of parameters.

    Where there is state for every parameter, in order, as after a step that reached them
    all, this compares ``held`` with ``params`` at C speed, without ``id()``: it raises an
    audit event, a Python call per tensor wherever an audit hook is installed.
    """
    if (
        len(held) == len(params)
        and all(map(operator.is_, held, params))
        and (len(optimizers) == 1 or list(map(len, states)) == counts())
    ):
        return True
    owned = {(i, id(p)) for i, opt in enumerate(optimizers) for group in opt.param_groups for p in group["params"]}
    return {(i, id(p)) for i, state in enumerate(states) for p in state} <= owned


def _holding(entries: list[StateEntry], key: str, count: int) -> tuple[list[StateEntry], list[object]]:
    """The entries that hold ``key``, which ``count`` of them do, and their values of it."""
    having = entries if count == len(entries) else [entry for entry in entries if key in entry]
    return having, list(map(operator.itemgetter(key), having))


def step_number(value: object) -> float | None:
    """A step counter's value (the largest, for a tensor of several), or None if it is
    none or cannot be read as a real number (a meta or complex tensor, one whose storage
    was freed or shrunk under it, an int beyond a float, a number or tensor subclass whose
    own code refuses)."""
    if isinstance(value, torch.Tensor):
        if unreadable_reason(value) is not None:
            return None  # reading it would read memory it does not hold
        try:
            with plain_reads():
                if value.numel() == 1:
                    return float(value.item())
                return float(value.max()) if value.numel() else None
        except Exception:  # noqa: BLE001  # a subclass's __torch_dispatch__ may raise anything
            return None
    if isinstance(value, bool) or not isinstance(value, Real):
        return None
    try:
        return float(value)
    except Exception:  # noqa: BLE001  # an int beyond a float; a subclass's own __float__ may raise anything
        return None


def step_numbers(values: Sequence[object]) -> list[float | None]:
    """:func:`step_number` of each value: where all are plain one-value tensors whose memory
    is there (the usual per-parameter steps), read in one pass."""
    if values and set(map(type, values)) <= {torch.Tensor, torch.nn.Parameter}:
        tensors = cast(list[torch.Tensor], values)
        found = writable_ranges(tensors)
        if not isinstance(found, tuple) and not_one_real_value(found) is None:
            with plain_reads():
                return [float(number) for number in map(torch.Tensor.item, tensors)]
    return list(map(step_number, values))


def held_gradients(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients ``params`` hold for the next step: ``.grad`` of each leaf tensor (not
    of a view, whose ``.grad`` torch warns at reading where none is set), and ``main_grad``, the
    view of Megatron DDP's gradient buffer that a backward accumulates into and its
    optimizers read (a DistributedOptimizer's main shards' gradients are views of it too)."""
    with plain_reads():
        grads = [grad for grad in map(_GRAD, compress(params, map(_IS_LEAF, params))) if grad is not None]
    try:
        attributes = list(map(_TENSOR_DICT, params))  # torch's own reader: no subclass's __getattribute__ runs
    except Exception:  # noqa: BLE001  # a tensor subclass whose own __dict__ cannot be read
        attributes = list(map(own_attributes, params))
    mains = [grad for grad in map(dict.get, attributes, repeat("main_grad")) if isinstance(grad, torch.Tensor)]
    return grads + mains


_TENSOR_DICT = cast(Callable[[torch.Tensor], dict[str, object]], vars(torch.Tensor)["__dict__"].__get__)


_PLAIN_OPTIONS = frozenset({float, int, bool, str, type(None), type})
"""Kinds of option values that hold no tensor: numbers, names, None and classes (a
HybridDeviceOptimizer's groups name its optimizer classes)."""


def group_option_tensors(groups: Sequence[Mapping[str, object]]) -> list[torch.Tensor]:
    """The tensors param groups hold as options (``lr``, or ``betas`` as tensors, as
    capturable and compiled steps take them), in tuples and lists too: not their ``params``,
    kept as parameters, nor a group ``step``, which a reset zeroes."""
    values = [value for group in groups for key, value in group.items() if type(value) not in _PLAIN_OPTIONS and key != "params" and key != "step"]
    if not values:
        return []
    # Most are tuples of numbers (betas): only the rest can hold a tensor.
    return tensors_held([value for value in values if type(value) is not tuple or not _PLAIN_OPTIONS.issuperset(map(type, value))])


def key_label(key: object) -> str:
    """A state key as problems name it: a key that is not a string may fail to print."""
    if isinstance(key, str):
        return key
    try:
        return repr(key)
    except Exception:  # noqa: BLE001  # a key's own __repr__ may raise anything
        return f"<{kind_of(key)}>"


def _zero_like(value: object) -> int | float | None:
    """The zero that replaces a step counter kept as a number: the int 0 or the float 0.0
    a fresh optimizer starts from, whatever subclass of them, or NumPy scalar, it held."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return None
    return 0 if isinstance(value, Integral) else 0.0


def _which(bad: int, count: int, verb: str) -> str:
    """How a message names the tensors of a key it refuses: ``it is`` for one, else how
    many of them ``verb`` and that the first is the one described."""
    return "it is" if count == 1 else f"{bad} of its {count} {verb}; the first is"


_NOT_COUNTS = frozenset({torch.bool, torch.complex32, torch.complex64, torch.complex128})


_ITEMSIZE = operator.attrgetter("itemsize")


def not_one_real_value(found: Extents) -> tuple[int, str] | None:
    """How many of the tensors ``found`` describes (from :func:`writable_ranges`) do not
    hold one real value, as a step counter or a schema's ``one_value`` key does, and what
    the first is; None where all do. A reset in place would keep them so (a bool that no
    longer counts, two counters where the optimizer reads one)."""
    dtypes = found.dtypes
    spans = list(map(operator.sub, found.ends, found.starts))
    if spans == list(map(_ITEMSIZE, dtypes)) and _NOT_COUNTS.isdisjoint(dtypes):
        return None
    odd = [(span, dtype) for span, dtype in zip(spans, dtypes, strict=True) if span != dtype.itemsize or dtype in _NOT_COUNTS]
    span, dtype = odd[0]
    what = f"{article(torch_name(dtype))} tensor" if dtype in _NOT_COUNTS else f"{article(torch_name(dtype))} tensor of {span // dtype.itemsize} values"
    return len(odd), what


STEP_DTYPES = frozenset({torch.float32, torch.float64})
"""What torch's optimizers count a tensor step in (``_get_scalar_dtype``: float64 where it
is the default dtype; float32 for fused and capturable ones), and Megatron's loads too. Their
foreach and fused steps raise for any other (an int64 step tensor, which the single-tensor
step takes); a bfloat16 one stops counting at 256."""


GROUP_STEP_DTYPES = STEP_DTYPES | {torch.int32, torch.int64}
"""What a param group's step tensor may count in: no optimizer builds one (TE's and apex's
``FusedAdam`` count in a Python int), and one a subclass or a load left there is zeroed in
place, so it must count exactly as far as training goes, as a fresh one's int does (a
float32 one to 2**24 steps; an int16 one wraps at 32,768)."""


def _group_step(group: StateEntry) -> tuple[object, bool]:
    """A param group's ``step`` (None where it holds none), and whether it holds the key,
    read of a dict as the reset's ``del`` finds it, not by a subclass's own ``get`` or
    ``__contains__``: one whose ``__contains__`` answered yes for every key made the reset
    plan to delete a step the group did not hold, and raise after zeroing its history."""
    if isinstance(group, dict):
        return dict.get(group, "step"), dict.__contains__(group, "step")
    return group.get("step"), "step" in group


def scalar_dtype() -> torch.dtype:
    """The dtype torch's optimizers build one-value state in (``_get_scalar_dtype``)."""
    return torch.float64 if torch.get_default_dtype() is torch.float64 else torch.float32


def fresh_step_dtype(group: Mapping[str, object]) -> torch.dtype:
    """The dtype a torch optimizer builds a tensor step in, in ``group``: float32 where the
    group is fused (``_get_scalar_dtype(is_fused=True)``), else torch's scalar dtype
    (:func:`scalar_dtype`). A step of another dtype (a float64 one under a float32 default,
    loaded from a run of another default; a float32 one under a float64 default, as
    Megatron's loads give it whatever the default) makes a compiled or differentiable
    step, which computes bias correction with the step as a tensor, unlike a fresh one."""
    return torch.float32 if is_on(group.get("fused")) else scalar_dtype()


def is_on(option: object) -> bool:
    """Whether a group's flag is on, read as torch reads a bool (or a number) and without
    running an object's own ``__bool__``: any other value (a tensor of several values, an
    object whose truth raises) counts as off here, and is the checks' of the options to refuse."""
    return type(option) in (bool, int, float) and bool(option)


def unfresh_step_dtypes(
    dtypes: Sequence[torch.dtype], params: Callable[[], Sequence[torch.Tensor]], groups: Sequence[Mapping[str, object]]
) -> tuple[int, torch.dtype, torch.dtype] | None:
    """How many step tensors (of ``dtypes``, held for ``params``) are not of the dtype
    :func:`fresh_step_dtype` gives their parameter's group, and the first one's dtype and
    the fresh one; None where all are. ``params`` is called only where the groups differ."""
    fresh = set(map(fresh_step_dtype, groups))
    if len(fresh) == 1:
        (only,) = fresh
        if set(dtypes) <= fresh:
            return None
        expected: Sequence[torch.dtype] = [only] * len(dtypes)
    else:  # fused and unfused groups under a float64 default: each step by its own group
        by_param = {id(param): fresh_step_dtype(group) for group in groups for param in cast(Sequence[torch.Tensor], group["params"])}
        expected = [by_param.get(id(param), scalar_dtype()) for param in params()]
    wrong = [(dtype, want) for dtype, want in zip(dtypes, expected, strict=True) if dtype is not want]
    if not wrong:
        return None
    return len(wrong), *wrong[0]


def outside_dtypes(found: Extents, allowed: frozenset[torch.dtype]) -> tuple[int, torch.dtype] | None:
    """How many of the tensors ``found`` describes are of a dtype outside ``allowed``, and
    the first such dtype; None where none is."""
    if allowed.issuperset(found.dtypes):
        return None
    wrong = [dtype for dtype in found.dtypes if dtype not in allowed]
    return len(wrong), wrong[0]


_ANY_LAYOUT = frozenset({torch.float32, torch.float64, torch.complex64, torch.complex128})
"""The dtypes of parameters whose ``elementwise`` history steps alike in any layout
(torch's optimizers step complex ones as their real views, float32 and float64)."""

_NO_VALUE = object()
"""What a group or the defaults hold where they hold no value under a name."""


def own_setattr(cls: type) -> str | None:
    """The name of the class that gives ``cls`` a ``__setattr__`` or ``__delattr__`` of its
    own (whose writes opttree cannot vouch for), or None where it has object's."""
    for name in ("__setattr__", "__delattr__"):
        if static_attribute(cls, name) is not object.__dict__[name]:
            return next((klass.__qualname__ for klass in class_mro(cls) if name in class_namespace(klass)), cls.__qualname__)
    return None


class LeafInspector:
    """Plans the leaves of one optimizer class against its schema, recording every problem."""

    def __init__(
        self,
        schema: StateSchema,
        plan: ResetPlan,
        problems: list[Problem],
        selection: Selection = EVERYTHING,
    ) -> None:
        self.schema = schema
        self.plan = plan
        self.problems = problems
        self.selection = selection
        self.resets = selection.resets if selection.everything else schema.resets_with_step(selection.resets)
        """Whether the reset takes a key of this schema's: a partial one's keys, with those counted with a step it takes."""
        self.actions: dict[str, KeyAction] = schema.actions if selection.everything else schema.actions_for(self.resets)
        self.megatron_above: str | None = None
        self.fresh_steps_known = False
        """Whether the leaves' class builds its tensor steps as torch's optimizers do (see
        :meth:`unfresh_steps`): opttree's built-in schema applies to it unchanged."""
        """The class of the innermost Megatron wrapper above the leaf inspected, if any."""

    def problem(self, node: Node, kind: ProblemKind, message: str, key: str | None = None) -> None:
        cls = type(node.optimizer).__qualname__
        self.problems.append(Problem(kind, node.path, cls, message, key))

    def inspect(self, node: LeafNode) -> None:
        """Plan one leaf. A container whose own code raises while read (a mapping whose
        ``__len__`` refuses) is malformed state: planning writes nothing, and the error
        recorded makes a reset refuse whatever this leaf had planned so far."""
        try:
            self._inspect(node)
        except Exception as error:  # noqa: BLE001  # a container's own code may raise anything
            self.problem(node, ProblemKind.MALFORMED_STATE, reading_fault(error))

    def _inspect(self, node: LeafNode) -> None:
        optimizer = node.optimizer
        reason = malformed_outline(optimizer)
        if reason is not None:
            self.problem(node, ProblemKind.MALFORMED_STATE, reason)
            return
        state = optimizer.state
        plan = self.plan
        in_groups: list[torch.Tensor] = []
        for index, group in enumerate(optimizer.param_groups):
            params = list(group["params"])
            in_groups.extend(params)
            if self.schema.group_counters:
                self.plan_group_counters(node, index, group, params)
            step, held = _group_step(group)
            if step is None:
                if held and self.resets("step"):
                    self.plan_counterless_step(node, index, group, params)
                continue
            # Every step counter is reset, whatever the schema says: one kept silently
            # after zeroed moments is exactly a stale bias correction.
            if not self.resets("step") or not self.takes_group(node, index, params):
                if isinstance(step, torch.Tensor):  # kept: memory a reset must leave alone
                    self.plan_kept(node, (node.path, type(optimizer).__qualname__), [step], "step", plan.state)
            else:
                self.plan_group_step(node, index, group, params, step)
            if step_number(step) and not any(p in state for p in params):
                self.problem(node, ProblemKind.EMPTY_STATE, f"a group says step {step} but none of its parameters has state")
        self.unnamed_attribute_tensors(node, in_groups)
        self.plan_step_attributes(node, in_groups)
        self.plan_attribute_counters(node, in_groups)
        self.plan_cached(node)
        if self.schema.master_groups is not None:
            self.plan_master_groups(node, self.schema.master_groups)
        reason = malformed_state(state)
        if reason is not None:
            self.problem(node, ProblemKind.MALFORMED_STATE, reason)
            return
        self.missing_entries(node, state, in_groups)
        if not state:
            plan.leaves += self.selection.reaches(in_groups)
            return
        if self.schema.indivisible and self.takes_part(node, in_groups, state):
            return
        if self.schema.dropped_by_group_if and self.drops_part_of_group(node, optimizer.param_groups, state):
            return
        if self.counted_apart(node, state):
            return
        release = self.selection.release
        starts_again = not release and self.schema.starts_at_first_step and self.starts_again(node)
        deletes = release or starts_again  # entries deleted take their autograd history along
        if not deletes and _differentiable(optimizer.param_groups) and _carries_history(state, self.actions):
            self.problem(node, ProblemKind.UNWRITABLE_STATE, _DIFFERENTIABLE)
            return
        plan.leaves += self.selection.reaches(in_groups)
        if release:
            self.plan_release(node, plan.state)
        elif starts_again:
            self.plan_release(node, plan.state, _NOT_EXACT_IN_PLACE)
        else:
            self.inspect_state(node, in_groups, plan.state)

    def inspect_alike(self, leaves: Sequence[LeafNode]) -> bool:
        """Plan a run of leaves of this class in one pass over their pooled state.

        Pooling applies where it cannot change the outcome: plain containers, no per-group
        steps, no scales, fills or shapes from an optimizer's own settings (each leaf's
        may differ), every parameter of one dtype and device, and each leaf's state held
        for its own parameters. Where it does not apply, or the pass
        finds a problem, this changes nothing and returns False: the caller then inspects
        the leaves one by one, which names the leaf of each problem.
        """
        schema = self.schema
        if schema.scale_of is not None or schema.fill or schema.shape_with or self.selection.release or schema.indivisible:
            return False  # scales, fills and settings' shapes are looked up, releases and indivisible states planned, leaf by leaf
        if schema.step_attributes or schema.master_groups is not None or schema.group_counters or schema.attribute_counters:
            return False  # read from each leaf's own attributes and groups
        if schema.dropped_by_group_if and self.selection.tensors is not None:
            return False  # a partial drop checked group by group
        problems_before = len(self.problems)
        try:
            part = self._plan_alike(leaves)
        except Exception:  # noqa: BLE001  # as in inspect: leaf by leaf, the leaf is named
            part = None
        if part is None or len(self.problems) > problems_before:
            del self.problems[problems_before:]
            return False
        self.plan.state.merge(part)
        if self.selection.tensors is None:
            self.plan.leaves += len(leaves)
        else:
            self.plan.leaves += sum(self.selection.holds(leaf.optimizer) for leaf in leaves)
        return True

    def missing_entries(self, node: LeafNode, state: Mapping[torch.Tensor, StateEntry], in_groups: list[torch.Tensor]) -> None:
        """Warn of parameters without an entry in a ``state`` that does not build one when
        read (a plain dict, as code that rebuilds ``optimizer.state`` by a comprehension
        leaves it): torch's step reads ``state[param]`` for each parameter with a gradient and
        raises ``KeyError`` there, where a fresh optimizer's ``defaultdict(dict)`` builds the
        entry. A reset finds it so and leaves it so; a release is refused. An optimizer that
        keeps one state for all its parameters (``indivisible``: LBFGS, under its first) reads
        that one entry only."""
        read = in_groups[:1] if self.schema.indivisible else in_groups
        if len(state) >= len(read) or builds_missing_entries(state):
            return
        missing = sum(param not in state for param in read)
        if missing:
            message = (
                f"its state is {kind_of(state)}, not torch's defaultdict(dict), and holds no entry for {missing} of the "
                f"{len(read)} parameters its step reads one for: its step raises KeyError for such a parameter once it "
                "has a gradient, where a fresh optimizer builds the entry (a reset leaves this as it finds it)"
            )
            self.problem(node, ProblemKind.EMPTY_STATE, message)

    def _plan_alike(self, leaves: Sequence[LeafNode]) -> StatePlan | None:
        """The plan of a run of leaves pooled, or None where pooling does not apply."""
        optimizers = list(map(_OPTIMIZER, leaves))
        found = pooled(optimizers)
        if found is None:
            return None
        groups, params, states, held, entries = found
        if any(map(operator.contains, groups, repeat("step"))):
            return None
        if self.schema.master_of is not None:
            return None  # master_of is asked with each entry's own optimizer
        if _differentiable(groups):
            return None  # its state may carry autograd history: looked at leaf by leaf
        with plain_reads():
            if len(set(map(_DTYPE_AND_DEVICE, params))) > 1:
                return None
        if not _held_for_own_params(optimizers, states, held, params, lambda: param_counts(optimizers, groups)):
            return None
        if len(held) < len(params) and {getattr(state, "default_factory", None) for state in states} != {dict}:
            return None  # a state that builds no entry for a parameter without one is warned of leaf by leaf
        part = StatePlan()
        owner = (f"{leaves[0].path} .. {leaves[-1].path}", type(optimizers[0]).__qualname__)
        self.plan_entries(leaves[0], owner, held, list(entries), params, groups, part)
        self.plan_params(leaves[0], owner, params, groups, part)
        return part

    def starts_again(self, node: LeafNode) -> bool:
        """Whether a reset of a leaf whose entries start at its first step, from its group's
        values then (see ``StateSchema.starts_at_first_step``), deletes them for it to build
        again; a partial reset of some of its filled keys is refused, and one that leaves
        them alone planned as any other."""
        resettable = self.schema.resettable
        if not any(map(self.resets, self.schema.filled)):
            return False
        if not self.deletes_entries():
            named = ", ".join(repr(key) for key in sorted(resettable))
            message = (
                f"its {', '.join(sorted(self.schema.filled))} start from its group's values at its first step, and "
                f"a reset of them without all of {named} cannot delete its entries for it to build them again "
                f"(a partial reset keeps step counters unless keys names 'step'): pass keys=[{named}], "
                "or keys without its filled ones"
            )
            self.problem(node, ProblemKind.PARTIAL_GROUP, message)
            return False
        return not self.deleted_under_megatron(node, self.megatron_above)

    def deletes_entries(self) -> bool:
        """Whether the reset deletes the entries of a leaf whose entries start at its first
        step (see :meth:`starts_again`): it takes its filled keys and all the others."""
        return self.schema.starts_at_first_step and any(map(self.resets, self.schema.filled)) and all(map(self.resets, self.schema.resettable))

    def deleted_under_megatron(self, node: LeafNode, megatron_above: str | None) -> bool:
        """Whether entries a reset deletes (see :meth:`starts_again`) lie under a Megatron
        wrapper (``megatron_above``, its class's name), which is refused: the reset would
        leave a state Megatron cannot checkpoint until the next step. Asked again where the
        leaf is reached once more, under another wrapper, beside its first path."""
        if megatron_above is None:
            return False
        message = (
            f"its entries start from its group's values at its first step, so a reset deletes them, and "
            f"under a {megatron_above} that leaves a state Megatron cannot checkpoint until the next step"
        )
        self.problem(node, ProblemKind.UNRELEASABLE_STATE, message)
        return True

    def counted_apart(self, node: LeafNode, state: Mapping[torch.Tensor, StateEntry]) -> bool:
        """Whether a partial reset names keys counted with the step (``counted_with_step``)
        that the leaf's entries hold, without ``"step"``: refused."""
        counted, keys = self.schema.counted_with_step, self.selection.keys
        if not counted or keys is None or self.resets("step"):
            return False
        named = sorted(key for key in counted & keys if any(key in entry for entry in state.values()))
        if not named:
            return False
        message = (
            f"its {', '.join(named)} count with its step, and keys names them without 'step': reset apart, the "
            "two would stand for different steps, as no run leaves them; name 'step' too, or neither"
        )
        self.problem(node, ProblemKind.PARTIAL_GROUP, message, named[0])
        return True

    def read_in_another_basis(self, node: LeafNode, held: Counter[str]) -> bool:
        """Whether a partial reset takes a basis (``expressed_in``) that the entries hold
        (``held`` counts their keys) but keeps history they hold expressed in it: refused."""
        if self.selection.keys is None:
            return False
        for key, bases in self.schema.expressed_in:
            taken = sorted(basis for basis in bases if held[basis] and self.resets(basis))
            if taken and held[key] and not self.resets(key):
                message = (
                    f"its {key} is held in the basis its {', '.join(sorted(bases))} hold, and keys names "
                    f"{', '.join(taken)} without it: reset apart, the kept {key} would be read in the basis the reset "
                    f"starts anew, as no run leaves it; name {key!r} too, or keep the basis"
                )
                self.problem(node, ProblemKind.PARTIAL_GROUP, message, key)
                return True
        return False

    def drops_part_of_group(self, node: LeafNode, groups: Sequence[StateEntry], state: Mapping[torch.Tensor, StateEntry]) -> bool:
        """Whether a partial reset drops keys (or a release deletes entries holding them)
        for some of the parameters of a group whose options make the optimizer build them
        for the whole group at once (``dropped_by_group_if``): refused, since its next step
        would raise over the ones kept."""
        chosen = self.selection.tensors
        dropped = sorted(key for key in self.schema.drop if self.selection.release or self.resets(key))
        if chosen is None or not dropped:
            return False
        for index, group in enumerate(groups):
            options = sorted(option for option in self.schema.dropped_by_group_if if is_on(group.get(option)))
            if not options:
                continue
            params = cast(Sequence[torch.Tensor], group["params"])
            holding = [param for param in params if any(key in state.get(param, {}) for key in dropped)]  # a parameter never stepped holds none
            taken = sum(id(param) in chosen for param in holding)
            if not 0 < taken < len(holding):
                continue
            message = (
                f"param group {index} is {', '.join(options)}: {type(node.optimizer).__qualname__} builds its "
                f"{', '.join(dropped)} for all of such a group's parameters at once and steps none with some missing, and "
                f"{taken} of the {len(holding)} parameters holding them are selected: select all of them, or leave "
                f"{', '.join(dropped)} out of keys"
            )
            self.problem(node, ProblemKind.PARTIAL_GROUP, message, dropped[0])
            return True
        return False

    def bound_apart(self, node: LeafNode, held: Counter[str]) -> bool:
        """Whether a partial reset takes some of the keys that go together, and keeps the
        others, of those the entries hold (``held`` counts their keys): history whose values
        bound one another (``bound_together``: centered RMSprop's square_avg zeroed under its
        kept grad_avg made the next step write NaN), or dropped keys the optimizer builds
        again together (``rebuilt_together``: PSGDPro's next step built the L reported kept
        beside a dropped Q again). Refused."""
        if self.selection.keys is None:
            return False
        schema = self.schema
        for together, why in (
            (schema.bound_together, "bound one another (its schema's bound_together), and keys names {taken} without {kept}: changed apart, the bound can break and the next step write NaN"),
            (schema.rebuilt_together, "are built again together where any is missing (its schema's rebuilt_together), and keys names {taken} without {kept}: the next step would build {kept} again too, which keys leaves out"),
        ):
            keys = sorted(key for key in together if held[key])
            taken = [key for key in keys if self.resets(key)]
            if len(keys) < 2 or not taken or len(taken) == len(keys):
                continue
            kept = ", ".join(key for key in keys if key not in taken)
            message = f"its {', '.join(keys)} {why.format(taken=', '.join(taken), kept=kept)}; name them all, or none"
            self.problem(node, ProblemKind.PARTIAL_GROUP, message, taken[0])
            return True
        return False

    def takes_part(self, node: LeafNode, params: list[torch.Tensor], state: Mapping[torch.Tensor, StateEntry]) -> bool:
        """Whether a partial reset takes part of an indivisible state (some of the leaf's
        parameters, or some of the keys it holds), which is refused."""
        chosen = self.selection.tensors
        taken = len(params) if chosen is None else sum(id(p) in chosen for p in params)
        keys = {key for entry in state.values() for key in entry if key in self.schema.actions}
        picked = {key for key in keys if self.resets(key)}
        if 0 < taken < len(params):
            part = f"{taken} of its {len(params)} parameters are selected"
        elif taken and 0 < len(picked) < len(keys):
            part = f"keys names {len(picked)} of the {len(keys)} keys it holds"
        else:
            return False
        message = (
            f"it keeps one state for all its parameters, whose keys depend on one another, and {part}: "
            "reset all of it or none of it"
        )
        self.problem(node, ProblemKind.PARTIAL_GROUP, message)
        return True

    def plan_copied_group_steps(self, node: Node, optimizer: torch.optim.Optimizer, copies: Mapping[int, torch.Tensor]) -> None:
        """The step counters in the param groups of a wrapper that copies its groups into its
        inner optimizers' before every step (a HybridDeviceOptimizer, whose groups a
        Megatron load gives the step it saved): one kept there, or zeroed, would overwrite
        theirs at every step. A fresh one's groups have none, so the key is deleted.
        ``copies`` maps the ``id`` of each of its parameters to the copy its inner
        optimizers step, which a partial selection names."""
        reason = malformed_outline(optimizer)
        if reason is not None:
            self.problem(node, ProblemKind.MALFORMED_STATE, reason)
            return
        for index, group in enumerate(optimizer.param_groups):
            if "step" not in group:
                continue
            stepped = [copies.get(id(param), param) for param in group["params"]]  # what a selection names
            if self.takes_group(node, index, stepped):
                if self.written_by_own_code(node, [group], f"param group {index}", "step"):
                    return
                self.plan.state.drop.append((group, "step"))
                self.plan.state.steps += 1
                self.plan.state.found_keys.add("step")

    def plan_counterless_step(self, node: Node, index: int, group: StateEntry, params: list[torch.Tensor]) -> None:
        """A param group's ``step`` of None counts nothing: megatron-core 0.14's
        ``ChainedOptimizer`` writes it into every group of its members, at each save and
        load, where none of them holds a step. torch's step ignores it; TE's and apex's
        ``FusedAdam`` add one to it and raise. A fresh optimizer's groups hold no step, so
        a reset deletes it, where it takes the whole group (a partial one leaves it)."""
        chosen = self.selection.tensors
        if chosen is not None and not all(id(param) in chosen for param in params):
            return
        if not self.written_by_own_code(node, [group], f"param group {index}", "step"):
            self.plan.state.drop.append((group, "step"))

    def takes_group(self, node: Node, index: int, params: list[torch.Tensor], counted: str = "one step", key: str = "step") -> bool:
        """Whether the selection takes a group's step (or what else it ``counted`` under
        ``key``), which the group shares: all of its parameters or none; part of them is
        refused."""
        chosen = self.selection.tensors
        if chosen is None:
            return True
        taken = sum(id(p) in chosen for p in params)
        if 0 < taken < len(params):
            self.problem(
                node,
                ProblemKind.PARTIAL_GROUP,
                f"param group {index} counts {counted} for its {len(params)} parameters and "
                f"{taken} are selected: select the whole group, or leave 'step' out of keys",
                key,
            )
        return taken == len(params)

    def plan_group_counters(self, node: LeafNode, index: int, group: StateEntry, params: list[torch.Tensor]) -> None:
        """The options the schema's ``group_counters`` names, set back with the steps to
        what they start as in a fresh optimizer's group, or deleted where it holds none."""
        counters = sorted(self.schema.group_counters)
        names = [name for name, _ in counters]
        if not self.resets("step") or not self.takes_group(node, index, params, " and ".join(map(repr, names)), names[0]):
            return
        for name, start in counters:
            held = group.get(name, _NO_VALUE)
            if held is not _NO_VALUE and (isinstance(held, torch.Tensor) or real_number(held) is None):
                message = f"param group {index}'s counter {name!r} is {kind_of(held)}, expected a number: a reset sets it back to {start!r}"
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, name)
                return
            if self.written_by_own_code(node, [group], f"param group {index}", name):
                return
            if start is not None:
                self.plan.state.number_writes.append((group, name, start))
            elif held is not _NO_VALUE:
                self.plan.state.drop.append((group, name))
            else:
                continue
            self.plan.state.steps += 1
            self.plan.state.found_keys.add("step")  # what keys=["step"] takes

    def plan_group_step(
        self, node: Node, index: int, group: StateEntry, params: list[torch.Tensor], step: object
    ) -> None:
        """A per-group step is shared by the group: a partial reset must take all of it
        (see :meth:`takes_group`)."""
        state = self.plan.state
        if isinstance(step, torch.Tensor):
            checked = writable_ranges([step])
            if isinstance(checked, tuple):
                self.problem(node, ProblemKind.UNWRITABLE_STATE, f"param group {index}'s step counter is {checked[1]}", "step")
                return
            odd = not_one_real_value(checked)
            if odd is not None:
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, f"param group {index}'s step counter is {odd[1]}{_ONE_COUNT}", "step")
                return
            narrow = outside_dtypes(checked, GROUP_STEP_DTYPES)
            if narrow is not None:
                message = (
                    f"param group {index}'s step counter is {article(torch_name(narrow[1]))} tensor, which counts steps exactly "
                    "only so far (a uint8 one wraps to 0 at 256, a bfloat16 one stops at 256): zeroed in place it would stay so, "
                    "where a fresh optimizer counts on; make it an int, or a float32, float64, int32 or int64 tensor"
                )
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, "step")
                return
            state.zero_list(("group step", step.dtype, step.device)).append(step)
            state.step_ranges.extend(checked.owned((node.path, type(node.optimizer).__qualname__, "step")))
            state.step_holders.append(("step", [group]))
        else:
            zero = _zero_like(step)
            if zero is None:
                message = f"param group {index}'s step counter is {kind_of(step)}, expected a number or tensor"
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, "step")
                return
            if self.written_by_own_code(node, [group], f"param group {index}", "step"):
                return
            state.number_writes.append((group, "step", zero))
        state.steps += 1
        state.found_keys.add("step")

    def unnamed_attribute_tensors(self, node: LeafNode, params: list[torch.Tensor]) -> None:
        """Refuse tensors the leaf holds in instance attributes beyond torch's bookkeeping that
        its schema does not name (see ``StateSchema.known_attributes``), other than its
        parameters and its state's own tensors: read only where there are such attributes,
        which a torch optimizer has none of."""
        def known() -> set[int]:
            values = [value for entry in node.optimizer.state.values() if isinstance(entry, Mapping) for value in entry.values()]
            return set(map(object.__hash__, chain(params, tensors_held(values))))

        for name, held in unknown_attribute_tensors(node.optimizer, known, self.schema.attributes):
            message = (
                f"{held}, beyond its state and parameters, which its schema does not name: a reset would keep them, "
                "whatever they count, where a fresh optimizer starts anew; register a schema that names them "
                "(step_attributes, master_groups, known_attributes)"
            )
            self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, name)

    def plan_step_attributes(self, node: LeafNode, params: list[torch.Tensor]) -> None:
        """Zero the tensors the schema's ``step_attributes`` name along with the leaf's step
        counters: all of them, since one counts for every parameter; a reset that keeps the
        counters keeps them, as memory it must leave alone."""
        names = self.schema.step_attributes
        zeroes = self.takes_all_steps(node, names, params)
        if zeroes is None:
            return
        attributes = dict(instance_attributes(node.optimizer))  # its __dict__'s and its slots'
        owner = (node.path, type(node.optimizer).__qualname__)
        for name in sorted(names & attributes.keys()):  # a version of the class without it counts without it
            value = attributes[name]
            if not zeroes:
                if isinstance(value, torch.Tensor):
                    self.plan_kept(node, owner, [value], name, self.plan.state)
                continue
            if type(value) is not torch.Tensor:
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, f"its {name} is {kind_of(value)}, expected a tensor", name)
                continue
            checked = writable_ranges([value])
            if isinstance(checked, tuple):
                self.problem(node, ProblemKind.UNWRITABLE_STATE, f"its {name}, read in counting its steps, is {checked[1]}", name)
                continue
            state = self.plan.state
            state.zero_list((name, value.dtype, value.device)).append(value)
            state.written.extend(checked.owned((*owner, name)))
            state.zeroed += 1
            state.bytes_reset += checked.nbytes

    def takes_all_steps(self, node: LeafNode, names: AbstractSet[str], params: list[torch.Tensor]) -> bool | None:
        """Whether a reset takes the steps of all the leaf's ``params``, which attributes
        ``names`` count for together: False where it takes none, None where there are no
        such attributes or it takes some (refused)."""
        if not names:
            return None
        chosen = self.selection.tensors
        taken = len(params) if chosen is None else sum(id(p) in chosen for p in params)
        takes = self.resets("step") and (chosen is None or taken > 0)  # a full reset takes them over no parameters too
        if takes and taken < len(params):
            message = (
                f"its {', '.join(sorted(names))} takes part in counting the steps of all its {len(params)} parameters "
                f"and {taken} are selected: select all of them, or leave 'step' out of keys"
            )
            self.problem(node, ProblemKind.PARTIAL_GROUP, message, "step")
            return None
        return takes

    def plan_attribute_counters(self, node: LeafNode, params: list[torch.Tensor]) -> None:
        """Set back the numbers the schema's ``attribute_counters`` name, with the steps, to
        what they start as in a fresh optimizer, or delete them where it has none."""
        counters = dict(self.schema.attribute_counters)
        if not self.takes_all_steps(node, counters.keys(), params):
            return
        attributes = dict(instance_attributes(node.optimizer))
        cls = type(node.optimizer)
        for name, start in sorted(counters.items()):
            held = attributes.get(name, _NO_VALUE)
            declared = static_attribute(cls, name)
            if (declared is not None and not isinstance(declared, MemberDescriptorType)) or own_setattr(cls) is not None:
                what = f"{cls.__qualname__} declares {name!r} ({kind_of(declared)})" if declared is not None else f"{own_setattr(cls)} sets attributes by code of its own"
                message = f"{what}: opttree sets a counter back in the instance's own attributes only, and cannot tell that writing it succeeds"
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, name)
                return
            if held is not _NO_VALUE and (isinstance(held, torch.Tensor) or real_number(held) is None):
                message = f"its counter {name!r} is {kind_of(held)}, expected a number (a tensor counter is one of step_attributes): a reset sets it back to {start!r}"
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, name)
                return
            if start is not None or held is not _NO_VALUE:
                self.plan.state.attribute_writes.append((node.optimizer, name, start))
                self.plan.state.steps += 1
        self.plan.state.found_keys.add("step")  # what keys=["step"] takes

    def plan_cached(self, node: LeafNode) -> None:
        """Set back to None the attributes where the leaf caches what it derives from its
        parameters (the schema's ``cached``), as a fresh optimizer holds them."""
        names = self.schema.cached
        if names:
            attributes = dict(instance_attributes(node.optimizer))
            self.plan.state.cleared.extend((node.optimizer, name) for name in sorted(names & attributes.keys()) if attributes[name] is not None)

    def plan_master_groups(self, node: LeafNode, attribute: str) -> None:
        """Record the master copies kept beside the leaf's groups (``master_groups``) as memory
        a reset keeps; a layout there other than the schema's is refused."""
        pairs = master_pairs(node.optimizer, attribute)
        if isinstance(pairs, str):
            self.problem(node, ProblemKind.MALFORMED_STATE, pairs, attribute)
        elif pairs:
            self.plan_kept(node, (node.path, type(node.optimizer).__qualname__), [copy for _, copy in pairs], attribute, self.plan.state)

    def inspect_state(self, node: LeafNode, in_groups: list[torch.Tensor], into: StatePlan) -> None:
        """Plan one leaf's state, given the parameters of its groups in order."""
        state = node.optimizer.state
        held = list(state)
        if not _held_for_own_params([node.optimizer], [state], held, in_groups, lambda: [len(in_groups)]):
            grouped = set(map(id, in_groups))
            orphans = sum(id(param) not in grouped for param in held)
            if orphans:
                message = (
                    f"holds state for {orphans} tensor(s) in no param group (a parameter replaced, as a merge does), which its "
                    "step never reads: a reset zeroes it with the rest, but torch's state_dict() cannot save it (a KeyError, "
                    "before a reset as after); release=True deletes it, as a fresh optimizer holds none"
                )
                self.problem(node, ProblemKind.ORPHAN_STATE, message)
        owner = (node.path, type(node.optimizer).__qualname__)
        self.plan_entries(node, owner, held, list(state.values()), in_groups, node.optimizer.param_groups, into)
        self.plan_params(node, owner, in_groups, node.optimizer.param_groups, into)

    def plan_entries(
        self,
        node: LeafNode,
        owner: tuple[str, str],
        held: list[torch.Tensor],
        entries: list[StateEntry],
        in_groups: list[torch.Tensor],
        groups: Sequence[Mapping[str, object]],
        into: StatePlan,
    ) -> None:
        """Plan the state ``entries`` held for the tensors ``held``, key by key: each key's
        values are gathered and checked in one go, and reported once per leaf if wrong.
        ``owner`` is the path and class that the ranges recorded for aliasing name;
        ``in_groups`` the parameters of the groups of the leaves the entries are of, and
        ``groups`` those groups."""
        placement = _placement(in_groups)
        into.entries.extend(identities(entries).owned((*owner, None)))
        chosen = self.selection.tensors
        if chosen is not None:
            picked = [param_id in chosen for param_id in map(id, held)]
            self.plan_unselected(node, owner, list(compress(entries, map(operator.not_, picked))), into)
            held, entries = list(compress(held, picked)), list(compress(entries, picked))
        layouts: _ParamLayouts | None = None  # read at the first key built like them
        counts = Counter(chain.from_iterable(entries))
        into.found_keys.update(counts)
        if self.read_in_another_basis(node, counts) or self.bound_apart(node, counts):
            return
        if self.schema.step is StepLocation.PER_PARAMETER and counts["step"] < len(entries):
            self.stepless_entries(node, held, entries, in_groups)
        for key, option in self.schema.built_with_entry:
            if counts[key] < len(entries) and (option is None or any(map(operator.methodcaller("get", option), groups))):
                self.unbuilt_entries(node, key, option, held, entries, groups)
        for key, applies in self.schema.built_for:
            if counts[key] < len(entries):
                self.unbuilt_entries(node, key, None, held, entries, groups, applies)
        if self.schema.master_of is not None:
            self.plan_masters(node, owner, self.schema.master_of, held, entries, into)
        for key, count in counts.items():
            action = self.actions.get(key)
            if action is None:
                self.unknown_key(node, key)
                continue
            having, values = _holding(entries, key, count)
            if action is KeyAction.KEEP:
                kept = tensors_held(values)
                into.kept_keys.add(key)
                into.kept_tensors.update(map(object.__hash__, kept))
                into.kept_state.extend(self.plan_kept(node, owner, kept, key, into))
                continue
            if action is KeyAction.DROP:
                if self.written_by_own_code(node, having, "a state entry", key):
                    continue
                dropped = tensors_held(values)
                found = ranges(dropped)
                into.bytes_reset += found.nbytes
                into.written.extend(found.owned((*owner, key)))
                into.drop.extend((entry, key) for entry in having)
                into.dropped += len(dropped)
                continue
            tensors = tensors_in(values)
            if action is KeyAction.STEP:
                held_by = (lambda: held) if count == len(entries) else (lambda: list(compress(held, map(operator.contains, entries, repeat(key)))))
                self.plan_steps(node, owner, key, having, tensors, placement, into, held_by, groups)
                into.steps += count
                continue
            if len(tensors) < count:
                wrong = next(value for value in values if not isinstance(value, torch.Tensor))
                message = f"history is {kind_of(wrong)}, expected a tensor"
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, key)
                continue
            checked = writable_ranges(tensors)
            if isinstance(checked, tuple):
                self.unwritable(node, key, checked, count)
                continue
            if key in self.schema.built_like_param:
                if layouts is None:
                    layouts = _layouts(held)
                self.unlike_params(node, key, tensors, checked, layouts, entries, count)  # planned on, for what else is wrong
            if key in self.schema.one_value and self.not_one_value(node, key, checked, count):
                continue
            into.bytes_reset += checked.nbytes
            into.written.extend(checked.owned((*owner, key)))
            if action is KeyAction.FILL:
                self.plan_fills(node, key, held, entries, placement, into)
                continue
            if action is KeyAction.IDENTITY:
                self.plan_identities(node, key, tensors, placement, into)
                continue
            into.zero_list((key, *placement)).extend(tensors)
            into.zeroed += count
            scale_of = self.schema.scale_of
            if scale_of is not None:
                self.plan_scales(node, owner, scale_of, held, entries, key, into)

    def not_one_value(self, node: LeafNode, key: str, checked: Extents, count: int) -> bool:
        """Whether a ``one_value`` key's tensors are not what the optimizer builds: one real
        value in torch's scalar dtype (after a ``load_state_dict`` that cast it to a float64
        parameter's dtype, say); reported as a problem."""
        odd = not_one_real_value(checked)
        scalar = scalar_dtype()
        wrong = outside_dtypes(checked, frozenset({scalar}))
        advice = "reset it with release=True for its optimizer to build it again" if self.schema.rebuilds_missing else "rebuild the optimizer"
        if odd is not None:
            message = f"{_which(odd[0], count, 'tensors are')} {odd[1]}, where its optimizer keeps one real value: reset in place it would stay so"
        elif wrong is not None:
            message = (
                f"{_which(wrong[0], count, 'tensors are')} {torch_name(wrong[1])}, where its optimizer builds it in "
                f"{torch_name(scalar)}: filled in place it would stay so; {advice}"
            )
        else:
            return False
        self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, key)
        return True

    def stepless_entries(self, node: LeafNode, held: list[torch.Tensor], entries: list[StateEntry], in_groups: list[torch.Tensor]) -> None:
        """Entries that hold history but no step counter, where the optimizer builds them
        together: zeroed, their history would be read with a step they do not have (torch's
        Adam raises KeyError), where a fresh optimizer builds both. An entry holding only
        kept state (a master copy set up before the first step) is not yet built, and one
        held for a tensor in no param group is never stepped."""
        schema = self.schema
        history = schema.zero | schema.filled | schema.identity
        grouped = set(map(id, in_groups))
        stepless = sum(
            "step" not in entry and not history.isdisjoint(entry) and id(param) in grouped for param, entry in zip(held, entries, strict=True)
        )
        if not stepless:
            return
        message = (
            f"{stepless} of its {len(entries)} state entries hold history but no step counter, which its optimizer "
            "builds with it: its next step would not be a fresh optimizer's (torch's Adam raises KeyError); a sharded "
            "checkpoint megatron-core saved at step 0 holds no step: load it with opttree.load_state_dict"
        )
        self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, "step")

    def unbuilt_entries(
        self,
        node: LeafNode,
        key: str,
        option: str | None,
        held: list[torch.Tensor],
        entries: list[StateEntry],
        groups: Sequence[Mapping[str, object]],
        applies: BuiltFor | None = None,
    ) -> None:
        """Built entries that lack ``key``, which the optimizer builds with every entry, or
        where their group's ``option`` is now on (see ``StateSchema.built_with_entry``), or
        for a parameter of a shape that ``applies`` accepts (``StateSchema.built_for``): it
        reads it at every step, and builds it only with the entry, so the next step would
        raise where a fresh one's builds it."""
        schema = self.schema
        built = schema.zero | schema.filled | schema.identity | {"step"}
        params = [param for group in groups if option is None or group.get(option) for param in cast(list[torch.Tensor], group["params"])]
        if applies is not None:
            try:
                with plain_reads():
                    params = [param for param in params if bool(applies(tuple(_SHAPE(param))))]
            except Exception as error:  # noqa: BLE001  # a registered function (or what it returns) may raise anything
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, f"its schema's built_for raised {type(error).__name__}: {error}", key)
                return
        needing = set(map(id, params))  # an entry of a tensor in no group is an orphan, reported as such
        lacking = sum(
            key not in entry and not built.isdisjoint(entry) and id(param) in needing for param, entry in zip(held, entries, strict=True)
        )
        if not lacking:
            return
        when = f" where {option!r} is on, as it now is in their group" if option is not None else " for a parameter of its shape" if applies is not None else ""
        advice = "reset with release=True for its optimizer to build them again" if schema.rebuilds_missing else "rebuild the optimizer"
        message = (
            f"{lacking} of its {len(entries)} state entries lack it, which its optimizer builds with an entry and reads at "
            f"every step{when}: whatever is done to their history in place, "
            f"its next step would raise where a fresh optimizer builds it; {advice}"
        )
        self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, key)

    def plain_under_wrappers(self, node: LeafNode, key: str, params: list[torch.Tensor]) -> bool:
        """Plain history (the only kind a reset writes) of parameters of a tensor class with
        its own dispatch (a DTensor), which the optimizer builds as their class: a plain
        checkpoint loaded into a sharded stack leaves it so, and the next step fails on it
        as it did before. A problem, and True, where there is such a parameter."""
        wrapped = [param for param in params if _dispatches_itself(type(param))]
        if not wrapped:
            return False
        what = type(wrapped[0]).__qualname__
        message = (
            f"history of {len(wrapped)} {what} parameter(s) is a plain tensor, where the optimizer builds it as a {what} "
            "(zeros_like): not a state a fresh optimizer holds; reset with release=True, which deletes the entries"
        )
        self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, key)
        return True

    def unlike_params(
        self,
        node: LeafNode,
        key: str,
        tensors: list[torch.Tensor],
        checked: Extents,
        layouts: _ParamLayouts,
        entries: list[StateEntry],
        count: int,
    ) -> None:
        """History the optimizer builds like its parameter (of its shape, or of the shape
        ``shape_of`` or ``shape_with`` derives from it, and of its dtype; for ``like_param``
        keys, laid out in memory as it) that is built otherwise, as a problem: the parameter
        was cast, reshaped, swapped or laid out anew after it was built (or, for
        ``shape_with``, the optimizer's settings changed), and a fresh optimizer would build
        it as the parameter is now. ``tensors`` are the key's history in entry order, and
        ``checked`` their ranges, with their dtypes; ``layouts`` those of the parameters of
        all ``entries``."""
        if count != len(entries):
            layouts = layouts.having([key in entry for entry in entries])
        if not all(map(plain_dispatch, set(map(type, layouts.params)))) and self.plain_under_wrappers(node, key, layouts.params):
            return
        param_shapes, param_dtypes = layouts.shapes, layouts.dtypes
        dtypes = checked.dtypes
        schema = self.schema
        built = (
            param_shapes
            if key in schema.like_param
            else self.derived(node, key, schema.shape_field(key), lambda name, shape: schema.built_shape(name, shape, node.optimizer), list(map(tuple, param_shapes)))
        )
        built_dtypes = param_dtypes if key not in schema.typed else self.derived(node, key, "dtype_of", schema.built_dtype, param_dtypes)
        if built is None or built_dtypes is None:
            return
        with plain_reads():
            shapes = list(map(_SHAPE, tensors))
        if shapes == built and dtypes == built_dtypes:
            if key in schema.like_param and not (checked.contiguous and all(layouts.contiguous)):
                self.unlike_layouts(node, key, tensors, layouts.params, param_dtypes, count)
            return
        unlike = [i for i, (a, b, c, d) in enumerate(zip(shapes, dtypes, built, built_dtypes, strict=True)) if a != c or b is not d]
        first = unlike[0]
        derived = built is not param_shapes or built_dtypes is not param_dtypes
        as_built = f"built as {_layout_text(built[first], built_dtypes[first])} for it; " if derived else ""
        settings = schema.shape_field(key) == "shape_with"
        cast_by_load = dtypes[first] is param_dtypes[first] and built_dtypes[first] is not param_dtypes[first]
        message = (
            f"history of {_layout_text(shapes[first], dtypes[first])} where its parameter is "
            f"{_layout_text(param_shapes[first], param_dtypes[first])} ({as_built}{len(unlike)} of {count} such): the parameter was "
            "cast, reshaped or swapped after it was built"
            + (", or its optimizer's settings that shape it changed (a checkpoint of other settings loaded)" if settings else "")
            + (", or torch's load_state_dict cast it to the parameter's dtype, as it casts floating-point state" if cast_by_load else "")
            + f", and a fresh optimizer would build it as {'they are' if settings else 'the parameter is'} now; "
            + self.rebuild_advice()
        )
        self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, key)

    def unlike_layouts(
        self, node: LeafNode, key: str, tensors: list[torch.Tensor], params: list[torch.Tensor], dtypes: list[torch.dtype], count: int
    ) -> None:
        """``like_param`` history laid out in memory otherwise than ``zeros_like`` lays it out
        for its parameter now, as a problem: the parameter's memory format changed after the
        history was built (``model.to(memory_format=torch.channels_last)``, a transposed
        tensor swapped in through ``.data``). Zeroed in place it keeps its old layout, and an
        optimizer that draws random numbers ``like`` its history (PSGD's) or multiplies it
        as a matrix steps otherwise than a fresh one. An optimizer whose steps are
        ``elementwise`` steps each float32 and float64 element (and complex ones, whose
        real views it steps) alike in any layout (its
        elements apart, which the preflight checks), so only its fused groups are compared,
        whose kernels read history as ``zeros_like`` lays it out, and its parameters of
        other dtypes: torch's CPU loops round bfloat16 and float16 after each operation where
        operands are laid out unlike each other, and after the whole expression where they
        are alike (RMSprop's momentum with gaps, and Adadelta's history in a weight's old
        order, stepped bfloat16 weights unlike a fresh one's)."""
        if self.schema.elementwise:
            fused = {id(param) for group in node.optimizer.param_groups if is_on(group.get("fused")) for param in group["params"]}
            laid_out = [index for index, (param, dtype) in enumerate(zip(params, dtypes, strict=True)) if id(param) in fused or dtype not in _ANY_LAYOUT]
            tensors, params = [tensors[index] for index in laid_out], [params[index] for index in laid_out]
        unlike = unlike_layouts(tensors, params, from_grad=key in self.schema.like_grad)
        if not unlike:
            return
        _, strides, fresh = unlike[0]
        as_fresh = "in a layout torch cannot make for its parameter" if fresh is None else f"with strides {fresh}"
        message = (
            f"history laid out with strides {strides} where a fresh optimizer builds it {as_fresh}, as its "
            f"parameter is laid out now ({len(unlike)} of {count} such): the parameter's memory format changed after it "
            "was built (or the history was put in from elsewhere), and zeroed in place the history keeps its layout, in "
            "which a step that draws random numbers like it, multiplies it as a matrix or runs a fused kernel over it "
            "computes otherwise; " + self.rebuild_advice()
        )
        self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, key)

    def rebuild_advice(self) -> str:
        """How to have history built as a fresh optimizer builds it."""
        return "reset with release=True for it to build it so, or rebuild the optimizer" if self.schema.rebuilds_missing else "rebuild the optimizer"

    def derived(
        self, node: LeafNode, key: str, name: str, build: Callable[[str, _Param], _Built], of_params: list[_Param]
    ) -> list[_Built] | None:
        """What the schema's ``name`` (``shape_of``, ``shape_with``, ``dtype_of``) builds
        ``key`` as, through ``build``, for parameters of ``of_params``; None, with a problem,
        where the schema's function fails."""
        try:
            found = [build(key, param) for param in of_params]
        except Exception as error:  # noqa: BLE001  # a registered function may raise anything
            message = f"its schema's {name} raised {type(error).__name__}: {error}"
            self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, key)
            return None
        return found

    def plan_masters(
        self, node: LeafNode, owner: tuple[str, str], master_of: MasterOf, held: list[torch.Tensor], entries: list[StateEntry], into: StatePlan
    ) -> None:
        """Record the master copies the schema's ``master_of`` names as memory a reset keeps:
        history sharing it (a schema listing the master among the keys it zeroes) would
        zero the weights the next step writes back into the model."""
        kept: list[torch.Tensor] = []
        for param, entry in zip(held, entries, strict=True):
            try:
                master = master_of(node.optimizer, param, cast(Mapping[str, object], entry))
            except OptTreeError:
                continue  # an FP8 or scaled master, which the stale-master check does not compare; the others still count
            except Exception as error:  # noqa: BLE001  # a registered function may raise anything
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, f"its schema's master_of raised {type(error).__name__}: {error}")
                return
            if isinstance(master, torch.Tensor):
                kept.append(master)
        if kept:
            self.plan_kept(node, owner, kept, "master_of", into)

    def plan_unselected(self, node: LeafNode, owner: tuple[str, str], entries: list[StateEntry], into: StatePlan) -> None:
        """A partial reset keeps the state of the parameters it does not select: its memory
        counts as kept, so history shared with it (a step tensor held for a selected and an
        unselected parameter) is refused rather than reset for both."""
        for key, count in Counter(chain.from_iterable(entries)).items():
            tensors = tensors_held(_holding(entries, key, count)[1])
            if tensors:
                self.plan_kept(node, owner, tensors, key_label(key), into)

    def plan_params(
        self, node: Node, owner: tuple[str, str], params: list[torch.Tensor], groups: Sequence[Mapping[str, object]], into: StatePlan
    ) -> None:
        """Record the memory of a leaf's parameters, of their gradients and of the tensors
        its param groups hold as options, which a reset leaves alone: history sharing it
        would zero weights, the gradients of a step between backward and
        ``optimizer.step()``, or a tensor ``lr``, which no fresh optimizer's history shares."""
        self.plan_kept(node, owner, params, None, into)
        grads = held_gradients(params)
        if grads:
            self.plan_kept(node, owner, grads, GRADIENTS, into)
        options = group_option_tensors(groups)
        if options:
            self.plan_kept(node, owner, options, GROUP_OPTIONS, into)

    def plan_kept(
        self, node: Node, owner: tuple[str, str], tensors: Sequence[torch.Tensor], key: str | None, into: StatePlan
    ) -> Extents:
        """Record the memory of tensors a reset must leave alone (parameters, where ``key``
        is None), for the aliasing check, and return it; one whose memory cannot
        be read is refused, since nothing could then tell that zeroing leaves it alone."""
        kept = ranges(tensors)
        if kept.unseen:
            what = "parameter" if key is None else "tensor"
            message = (
                f"{kept.unseen} {what}(s) to keep have memory opttree cannot read (a tensor subclass that neither "
                "has storage nor says what it wraps): it cannot tell that zeroing history leaves them alone"
            )
            self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, key)
        into.kept_ranges.extend(kept.owned((*owner, key)))
        return kept

    def unknown_key(self, node: LeafNode, key: object) -> None:
        known = ", ".join(sorted(self.actions)) or "no keys"
        self.problem(node, ProblemKind.UNSUPPORTED_STATE, f"not in the schema ({known})", key_label(key))

    def plan_release(self, node: LeafNode, into: StatePlan, advice: str = "reset it without release") -> None:
        """Delete the selected entries, which the optimizer builds again on its next step as
        a fresh one builds them; refused where it would not, or where an entry keeps state,
        with ``advice`` on what to do instead."""
        optimizer = node.optimizer
        if not self.schema.rebuilds_missing:
            message = (
                "its schema does not say that it builds a missing state entry again on its next step "
                "(torch's Adagrad builds its state in __init__, and not every supported torch release builds a "
                "missing entry again): reset it without release"
            )
            self.problem(node, ProblemKind.UNRELEASABLE_STATE, message)
            return
        if any(group.get("capturable") for group in optimizer.param_groups):
            message = "it is capturable: a captured CUDA graph may hold its state's addresses, which must not move"
            self.problem(node, ProblemKind.UNRELEASABLE_STATE, message)
            return
        state: object = optimizer.state  # typed a defaultdict; an optimizer may hold any mapping
        if not isinstance(state, MutableMapping):
            message = f"its state is {kind_of(state)}, which has no entries to delete: {advice}"
            self.problem(node, ProblemKind.UNRELEASABLE_STATE, message)
            return
        if not builds_missing_entries(state):
            message = (
                f"its state is {kind_of(state)}, not torch's defaultdict(dict): its next step may not "
                f"build a deleted entry again as an empty dict; {advice}"
            )
            self.problem(node, ProblemKind.UNRELEASABLE_STATE, message)
            return
        chosen = self.selection.tensors
        held = [param for param in state if chosen is None or id(param) in chosen]
        entries = [state[param] for param in held]
        into.entries.extend(identities(entries).owned((node.path, type(optimizer).__qualname__, None)))
        problems_before = len(self.problems)
        actions = self.schema.actions  # what a full reset does: kept there is lost here
        for key in dict.fromkeys(chain.from_iterable(entries)):
            action = actions.get(key)
            if action is None:
                self.unknown_key(node, key)
            elif action is KeyAction.KEEP:
                message = f"is kept by a reset (not history): deleting its entry would lose it; {advice}"
                self.problem(node, ProblemKind.UNRELEASABLE_STATE, message, key_label(key))
        if len(self.problems) > problems_before or not held or self.written_by_own_code(node, [state], "its state", None, ProblemKind.UNRELEASABLE_STATE):
            return
        into.release.append((optimizer, held))
        into.found_keys.update(chain.from_iterable(entries))
        into.released += len(held)
        into.bytes_released += bytes_once(ranges(tensors_held([value for entry in entries for value in entry.values()])))

    def plan_fills(
        self,
        node: LeafNode,
        key: str,
        held: list[torch.Tensor],
        entries: list[StateEntry],
        placement: Placement,
        into: StatePlan,
    ) -> None:
        """History that starts at a value of its group's: listed by that value."""
        optimizer = node.optimizer
        group_of = {id(param): group for group in optimizer.param_groups for param in group["params"]}
        for param, entry in zip(held, entries, strict=True):
            if key not in entry:
                continue
            group = group_of.get(id(param))
            if group is None:
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, "held for a tensor in no param group, whose start is not known", key)
                return
            try:
                value = self.schema.fill_value(key, group, optimizer.defaults)
            except Exception as error:  # noqa: BLE001  # a registered fill function may raise anything
                message = f"its starting value cannot be worked out: {type(error).__name__}: {error}"
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, key)
                return
            tensor = cast(torch.Tensor, entry[key])
            with plain_reads():
                fault = unfillable_reason(value, tensor.dtype, tensor.device)
            if fault is not None:
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, f"its starting value cannot be written: {fault}", key)
                return
            into.fill_list((key, *placement), value).append(tensor)
            into.filled += 1

    def plan_identities(
        self, node: LeafNode, key: str, tensors: list[torch.Tensor], placement: Placement, into: StatePlan
    ) -> None:
        """History that starts as ``torch.eye``: zeroed with the rest, then its diagonal set."""
        with plain_reads():
            wrong = next((t for t in tensors if t.dim() != 2 or t.shape[0] != t.shape[1]), None)
            fault = next(filter(None, (unfillable_reason(1.0, t.dtype, t.device) for t in tensors)), None)
        if wrong is not None:
            message = f"starts as an identity matrix, but one is of shape {tuple(wrong.shape)}, not square"
            self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, key)
            return
        if fault is not None:
            self.problem(node, ProblemKind.UNSUPPORTED_STATE, f"starts as an identity matrix, whose diagonal cannot be written: {fault}", key)
            return
        into.zero_list((key, *placement)).extend(tensors)
        into.identities.extend((key, tensor) for tensor in tensors)
        into.filled += len(tensors)

    def plan_steps(
        self,
        node: LeafNode,
        owner: tuple[str, str],
        key: str,
        having: list[StateEntry],
        tensors: list[torch.Tensor],
        placement: Placement,
        into: StatePlan,
        params: Callable[[], list[torch.Tensor]],
        groups: Sequence[Mapping[str, object]],
    ) -> None:
        """Per-parameter step counters (held in ``having``, for ``params()``, of ``groups``):
        tensors are zeroed in place, Python numbers set to a zero of their own type,
        anything else refused. Where the optimizer starts its steps as ints
        (``StepType.INT``), every one becomes the int 0 a fresh one starts from: a tensor
        step (as some loaders leave it) would change its arithmetic. Where it starts them
        as tensors, each must be one as a fresh one builds: 0-d, in the dtype of
        :func:`fresh_step_dtype` (zeroed in place, one of another shape or dtype stays so,
        and a compiled or differentiable step computes with it unlike a fresh one)."""
        numbers = [] if len(tensors) == len(having) else [entry for entry in having if not isinstance(entry[key], torch.Tensor)]
        zeros: list[tuple[StateEntry, str, int | float]] = []
        for entry in numbers:
            zero = _zero_like(entry[key])
            if zero is None:
                message = f"step counter is {kind_of(entry[key])}, expected a number or tensor"
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, key)
                return
            zeros.append((entry, key, zero))
        if numbers and self.schema.step_type is StepType.TENSOR:
            message = (
                f"step counter is {kind_of(numbers[0][key])} ({len(numbers)} of {len(having)} entries) where "
                f"{type(node.optimizer).__qualname__} starts it as a tensor, which its step adds to in place (torch's "
                "raise for a number): a reset to 0 would not train as a fresh optimizer does; load the state "
                "through the optimizer's load_state_dict, which makes it a tensor"
            )
            self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, key)
            return
        if self.written_by_own_code(node, having if self.schema.step_type is StepType.INT else numbers, "a state entry", key):
            return
        if self.schema.step_type is StepType.INT:
            # replaced, not written; their ranges still show a step tensor shared by several
            into.step_ranges.extend(ranges(tensors).owned((*owner, key)))
            into.number_writes.extend((entry, key, 0) for entry in having)
            return
        if tensors:
            checked = writable_ranges(tensors)
            if isinstance(checked, tuple):
                self.unwritable(node, key, checked, len(having))
                return
            odd = not_one_real_value(checked)
            if odd is not None:
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, f"step counter: {_which(odd[0], len(tensors), 'are')} {odd[1]}{_ONE_COUNT}", key)
                return
            if self.unfresh_steps(node, key, tensors, checked, params, groups):
                return
            into.zero_list((key, *placement)).extend(tensors)
            into.step_ranges.extend(checked.owned((*owner, key)))
            into.step_holders.append((key, having if not numbers else [entry for entry in having if isinstance(entry[key], torch.Tensor)]))
        into.number_writes.extend(zeros)

    def unfresh_steps(
        self,
        node: LeafNode,
        key: str,
        tensors: list[torch.Tensor],
        checked: Extents,
        params: Callable[[], list[torch.Tensor]],
        groups: Sequence[Mapping[str, object]],
    ) -> bool:
        """Whether one-value step tensors (``checked``) are not as a fresh optimizer builds
        them (see :meth:`plan_steps`); reported as a problem."""
        known = self.fresh_steps_known  # else any of the dtypes torch builds steps in, and any shape of one value
        with plain_reads():
            shaped = [tensor for tensor in tensors if _NDIM(tensor)] if known and any(map(_NDIM, tensors)) else []
        wrong: tuple[int, torch.dtype, str] | None = None
        if known:
            unfresh = None if shaped else unfresh_step_dtypes(checked.dtypes, params, groups)
            wrong = None if unfresh is None else (unfresh[0], unfresh[1], torch_name(unfresh[2]))
        else:
            counted_in = frozenset({scalar_dtype(), torch.float32})
            outside = outside_dtypes(checked, counted_in)
            wrong = None if outside is None else (*outside, " or ".join(sorted(map(torch_name, counted_in))))
        if shaped:
            count, what, fresh = len(shaped), f"of shape {tuple(_SHAPE(shaped[0]))}", "a 0-d tensor"
            differs = "broadcast its updates to that shape, and raise over a 0-d parameter (a checkpoint saved by other code: torch's load keeps a step's shape)"
        elif wrong is not None:
            count, what, fresh = wrong[0], torch_name(wrong[1]), (
                f"a {wrong[2]} tensor (torch's default dtype is "
                f"{torch_name(torch.get_default_dtype())}; fused groups count in float32)"
            )
            differs = (
                "compute bias correction unlike a fresh one (a checkpoint saved under another default dtype, whose steps "
                "torch's load keeps as saved, or loaded by Megatron, which makes them float32)"
            )
        else:
            return False
        message = (
            f"step counter: {_which(count, len(tensors), 'are')} {what}, where a fresh {type(node.optimizer).__qualname__} "
            f"counts in {fresh}: zeroed in place it would stay so, and a step that computes with it as a tensor (a "
            f"compiled or differentiable one) would {differs}; " + self.rebuild_advice()
        )
        self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, key)
        return True

    def written_by_own_code(
        self, node: Node, containers: Sequence[object], what: str, key: str | None, kind: ProblemKind = ProblemKind.UNSUPPORTED_STATE
    ) -> bool:
        """Whether a reset would set or delete keys of a container whose own code does it
        (see :func:`~opttree._containers.own_writes`), which is then refused."""
        cls = own_writes(containers)
        if cls is None:
            return False
        message = f"{what} is {article(cls.__qualname__)}, which sets and deletes keys by its own code: opttree cannot tell that the reset's writes to it succeed"
        self.problem(node, kind, message, key)
        return True

    def unwritable(self, node: LeafNode, key: str, found: tuple[int, str], count: int) -> None:
        bad, reason = found
        message = (
            f"cannot be zeroed in place: {_which(bad, count, 'tensors cannot')} {reason}; a reset with release=True, which "
            "deletes the entries for the optimizer to build anew, writes none (a DTensor's FSDP2 state)"
        )
        self.problem(node, ProblemKind.UNWRITABLE_STATE, message, key)

    def plan_scales(
        self,
        node: LeafNode,
        owner: tuple[str, str],
        scale_of: ScaleLookup,
        held: list[torch.Tensor],
        entries: list[StateEntry],
        key: str,
        into: StatePlan,
    ) -> None:
        scales: list[torch.Tensor] = []
        for param, entry in zip(held, entries, strict=True):
            if key not in entry:
                continue
            try:
                scale: object = scale_of(node.optimizer, param, key)
            except OptTreeError as error:
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, str(error), key)
                return
            except Exception as error:  # noqa: BLE001  # a registered function may raise anything
                message = f"its schema's scale_of raised {type(error).__name__}: {error}"
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, key)
                return
            if scale is None:
                continue
            if not isinstance(scale, torch.Tensor):
                message = f"its schema's scale_of gave {kind_of(scale)}, expected the scale tensor to reset, or None"
                self.problem(node, ProblemKind.UNSUPPORTED_STATE, message, key)
                return
            scales.append(scale)
        checked = writable_ranges(scales)
        if isinstance(checked, tuple):
            self.unwritable(node, f"{key} scale", checked, len(scales))
            return
        with plain_reads():
            fault = next(filter(None, (unfillable_reason(1.0, scale.dtype, scale.device) for scale in scales)), None)
        if fault is not None:
            self.problem(node, ProblemKind.UNSUPPORTED_STATE, f"its scale cannot be set back to 1: {fault}", key)
            return
        into.scales.extend(scales)
        if scales:
            into.scaled_keys.add(key)
        into.written.extend(checked.owned((*owner, f"{key} scale")))
