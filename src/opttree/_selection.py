"""Partial reset: which leaf tensors and which keys the user's selection reaches.

Users name parameters as their model knows them. Megatron's wrappers step other tensors:
fp32 main copies (``Float16OptimizerWithFloat16Params``), main-parameter shards
(``DistributedOptimizer``), fp32 or CPU copies (``HybridDeviceOptimizer``). Each such
wrapper kind has a registered *inner-params* function yielding ``(outer, inner tensors)``
pairs; a selection flows down the tree through them to the leaves. A wrapper without one
passes tensors through unchanged. A parameter that reaches no leaf and that no wrapper
claims is an error, never a silent skip; one a wrapper claims with no inner tensors (a
shard held by another rank) is selected with nothing to reset here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from typing import TypeVar, cast

import torch
from attrs import field, frozen

from opttree._adapter import is_pair, mapping_attribute, sequence_attribute, yielded_text
from opttree._containers import malformed, pooled
from opttree._dispatch import LazyDispatch
from opttree._errors import MalformedWrapper, OptTreeError, PartialResetRefused, UnmappedParameter
from opttree._nodes import ChainedNode, HybridNode, LeafNode, Node, WrapperNode, tree_nodes
from opttree._preflight import _REQUIRES_GRAD
from opttree._problems import Problem, ProblemKind
from opttree._schema import StepLocation
from opttree._visitor import TraverserVisitor
from opttree._fields import kind_of

InnerParams = Callable[[object, str], Iterable[tuple[torch.Tensor, Sequence[torch.Tensor]]]]
"""``(wrapper, path) -> (outer, inner tensors)`` pairs for the parameters it manages."""


@frozen
class Selection:
    """The leaf tensors (by ``id``) whose state a reset touches, the history keys, and
    whether step counters are reset; ``None``: all."""

    tensors: frozenset[int] | None = None
    keys: frozenset[str] | None = None
    steps: bool = True
    release: bool = False
    """Delete the selected state entries instead of resetting them in place."""
    elsewhere: tuple[Node, ...] = ()
    """Wrappers that step some selected parameters on other ranks only (a shard or a whole
    parameter another rank holds): what their leaves hold is what those ranks reset."""
    coverage: tuple[tuple[object, int, int], ...] = ()
    """Per wrapper whose inner params list every parameter it steps, through copies or
    shards (by the wrapper itself): how many of them are selected, of how many. Every rank
    lists the same parameters (a DistributedOptimizer every one of its grad buffers'), so
    what is decided by these counts is decided alike on every rank, where this rank's own
    shards would differ from another's."""

    model: tuple[str, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = field(default=None, eq=False)  # tensors compare by value
    """The class of ``model=`` and its parameters, frozen ones too, and buffers: memory a
    reset leaves alone, whichever optimizer steps it (history sharing a frozen weight's
    memory would zero a weight no leaf holds)."""

    def covered(self, wrapper: object) -> tuple[int, int] | None:
        """How many of ``wrapper``'s parameters are selected, of how many, on every rank
        alike; None where its inner params do not list them all (its leaves' parameters
        are its own, or some of them are)."""
        return next(((taken, total) for holder, taken, total in self.coverage if holder is wrapper), None)

    @property
    def everything(self) -> bool:
        """All state, reset in place."""
        return self.tensors is None and self.keys is None and self.steps and not self.release

    def reaches(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether the selection reaches a leaf of these parameters: every leaf, or, for a
        partial reset by parameters, one that holds a selected parameter."""
        chosen = self.tensors
        return chosen is None or any(id(param) in chosen for param in params)

    def holds(self, optimizer: torch.optim.Optimizer) -> bool:
        """:meth:`reaches`, for the parameters of ``optimizer``'s groups."""
        return self.reaches(chain.from_iterable(group["params"] for group in optimizer.param_groups))

    def resets(self, key: str) -> bool:
        if key == "step":
            return self.steps
        return self.keys is None or key in self.keys


EVERYTHING = Selection()


def paired(wrapper: object, path: str, outer: str, inner: str) -> Iterable[tuple[torch.Tensor, Sequence[torch.Tensor]]]:
    outer_groups, inner_groups = sequence_attribute(wrapper, outer, path), sequence_attribute(wrapper, inner, path)
    if len(outer_groups) != len(inner_groups):
        msg = f"{type(wrapper).__qualname__} at {path}: {outer} and {inner} differ in length"
        raise MalformedWrapper(msg)
    for outer_group, inner_group in zip(outer_groups, inner_groups):
        if not (isinstance(outer_group, list) and isinstance(inner_group, list) and len(outer_group) == len(inner_group)):
            msg = f"{type(wrapper).__qualname__} at {path}: {outer} does not pair with {inner}"
            raise MalformedWrapper(msg)
        for o, i in zip(outer_group, inner_group):
            yield o, (i,)


def float16_inner(wrapper: object, path: str) -> Iterable[tuple[torch.Tensor, Sequence[torch.Tensor]]]:
    """Float16OptimizerWithFloat16Params steps fp32 copies of its fp16/bf16 parameters."""
    return paired(wrapper, path, "float16_groups", "fp32_from_float16_groups")


def distributed_inner(wrapper: object, path: str) -> Iterable[tuple[torch.Tensor, Sequence[torch.Tensor]]]:
    """DistributedOptimizer steps this rank's shards: fp32 main shards of fp16/bf16
    parameters (or, precision-aware, the model shards themselves) and fp32 shards. It
    covers every parameter of its grad buffers, which every rank holds whole: one whose
    shard lives wholly on other ranks is claimed with nothing to reset here."""
    inner: dict[int, list[torch.Tensor]] = {}
    for outer_name, inner_name in (
        ("model_float16_groups", "shard_fp32_from_float16_groups"),
        ("model_float16_groups", "shard_float16_groups"),
        ("model_fp32_groups", "shard_fp32_groups"),
    ):
        for o, (i,) in paired(wrapper, path, outer_name, inner_name):
            inner.setdefault(id(o), []).append(i)
    local = list(cast(dict[torch.Tensor, object], mapping_attribute(wrapper, "model_param_gbuf_map", path)))
    covered = [param for buffer in sequence_attribute(wrapper, "buffers", path) for param in _buffer_params(buffer, wrapper, path)]
    for param in dict.fromkeys([*local, *covered]):  # in order, once each; hashed by identity
        yield param, inner.get(id(param), [])


def _buffer_params(buffer: object, wrapper: object, path: str) -> list[torch.Tensor]:
    params = getattr(buffer, "params", None)
    if not isinstance(params, (list, tuple, set)) or not all(isinstance(p, torch.Tensor) for p in params):
        msg = f"{type(wrapper).__qualname__} at {path}: a grad buffer's params are not a collection of tensors"
        raise MalformedWrapper(msg)
    return list(params)


def layer_wise_inner(wrapper: object, path: str) -> Iterable[tuple[torch.Tensor, Sequence[torch.Tensor]]]:
    """LayerWiseDistributedOptimizer gives each rank whole parameters to step, listed per
    rank (None with a single rank): those of other ranks are claimed with nothing to reset
    here; this rank's pass on to its members."""
    for name in ("dp_cp_params_list", "expt_dp_params_list"):
        per_rank = getattr(wrapper, name, None)
        if per_rank is None:
            continue
        if not isinstance(per_rank, list) or not all(isinstance(params, list) for params in per_rank):
            msg = f"{type(wrapper).__qualname__} at {path}: {name} is not a list of lists of parameters per rank"
            raise MalformedWrapper(msg)
        group_rank = _rank_in(wrapper, path, name)
        for owner, params in enumerate(per_rank):
            if owner != group_rank:
                yield from ((param, ()) for param in params)


def _rank_in(wrapper: object, path: str, name: str) -> int:
    """This process's rank in the group that the layer-wise list ``name`` divides its
    parameters over (in ``pg_collection``, megatron-core 0.16 and later)."""
    group_name = "dp_cp" if name == "dp_cp_params_list" else "expt_dp"
    group = getattr(getattr(wrapper, "pg_collection", None), group_name, None)
    try:
        return int(torch.distributed.get_rank(group))
    except (RuntimeError, ValueError) as error:
        msg = f"{type(wrapper).__qualname__} at {path}: this rank in its {name} group cannot be read: {error}"
        raise MalformedWrapper(msg) from error


def hybrid_inner(wrapper: object, path: str) -> Iterable[tuple[torch.Tensor, Sequence[torch.Tensor]]]:
    """HybridDeviceOptimizer steps fp32 or CPU copies of its parameters."""
    mapping = cast(dict[torch.Tensor, torch.Tensor], mapping_attribute(wrapper, "param_to_inner_param", path))
    return ((outer, (inner,)) for outer, inner in mapping.items())


def builtin_inner_params() -> LazyDispatch[InnerParams]:
    table: LazyDispatch[InnerParams] = LazyDispatch()
    prefix = "megatron.core.optimizer."
    table.register_lazy(prefix + "optimizer.Float16OptimizerWithFloat16Params", float16_inner)
    table.register_lazy(prefix + "distrib_optimizer.DistributedOptimizer", distributed_inner)
    table.register_lazy(prefix + "layer_wise_optimizer.LayerWiseDistributedOptimizer", layer_wise_inner)
    table.register_lazy(prefix + "cpu_offloading.hybrid_optimizer.HybridDeviceOptimizer", hybrid_inner)
    return table


INNER_PARAMS = builtin_inner_params()

def inner_params_of(node: Node) -> InnerParams | None:
    """The inner-params function of ``node``'s class, or None where it has none. A
    Megatron stub steps nothing: its ``__init__`` returns before building the groups its
    class's function reads (Megatron builds one for frozen parameters, or a rank without
    any, to take part in the gradient statistics' reductions)."""
    if isinstance(node, WrapperNode) and node.is_stub:
        return None
    return INNER_PARAMS.lookup(type(node.optimizer))


STEP_UNITS: LazyDispatch[frozenset[StepLocation]] = LazyDispatch()
"""Megatron wrappers that save one step for all their leaves' parameters, with the step
locations they unify: ``_extract_common_per_param_step`` for per-parameter steps in
``FP32Optimizer`` and the mixed-precision wrappers; ``DistributedOptimizer.state_dict`` and
``ChainedOptimizer._synchronize_steps`` assert one per-group step (TE and apex
``FusedAdam``) across their groups."""
for _dotted, _locations in {
    "megatron.core.optimizer.optimizer.FP32Optimizer": {StepLocation.PER_PARAMETER},
    "megatron.core.optimizer.optimizer.MixedPrecisionOptimizer": {StepLocation.PER_PARAMETER},
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer": {StepLocation.PER_PARAMETER, StepLocation.PER_GROUP},
    "megatron.core.optimizer.optimizer.ChainedOptimizer": {StepLocation.PER_GROUP},
}.items():
    STEP_UNITS.register_lazy(_dotted, frozenset(_locations))


def tree_leaves(node: Node, counts: Callable[[torch.optim.Optimizer], bool] = lambda _: True) -> list[torch.optim.Optimizer]:
    """The optimizers of the leaves under ``node`` that ``counts`` accepts, once each, with
    containers that can be read (see :func:`~opttree._containers.malformed`): checked for
    all of them at once where they are plain, as a validation's pooled pass does, and one
    by one otherwise (a wrapper's thousands of sub-optimizers are checked at C speed)."""
    leaves = [child.optimizer for child in tree_nodes(node) if isinstance(child, LeafNode) and child.shared_with is None]
    readable = leaves if pooled(leaves) is not None else [leaf for leaf in leaves if malformed(leaf) is None]
    return [leaf for leaf in readable if counts(leaf)]


def tree_params(node: Node, counts: Callable[[torch.optim.Optimizer], bool] = lambda _: True) -> list[torch.Tensor]:
    """The parameters of every leaf under ``node`` that ``counts`` accepts."""
    return [p for leaf in tree_leaves(node, counts) for group in leaf.param_groups for p in group["params"]]

def _stand_for(node: Node, copies: set[int]) -> bool:
    """Whether every parameter the leaves under ``node`` step stands for one of the
    parameters ``node`` lists: is one of their ``copies``, or a copy of those a wrapper
    further in steps (a HybridDeviceOptimizer's, under a DistributedOptimizer's shards),
    wrappers met outer first. Not where a leaf steps a parameter of its own past the list."""
    reached = set(copies)
    pending = list(node.children)
    while pending:
        child = pending.pop(0)
        inner_params = inner_params_of(child)
        if inner_params is not None:
            try:
                pairs = list(inner_params(child.optimizer, child.path))
            except OptTreeError:
                return False
            reached.update(id(tensor) for param, tensors in pairs if id(param) in reached for tensor in tensors)
        pending.extend(child.children)
    return reached.issuperset(map(id, tree_params(node)))


# id(tensor at this depth) -> (that tensor, indices of the user's parameters it stands for:
# several where one copy is stepped for several, a flat master)
_Flow = dict[int, tuple[torch.Tensor, frozenset[int]]]


class SelectVisitor(TraverserVisitor):
    """Carries the selected tensors down the tree, through each wrapper's inner params."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.flow: _Flow = {id(p): (p, frozenset({i})) for i, p in enumerate(params)}
        self.selected: set[int] = set()
        self.reached: set[int] = set()
        self.elsewhere: list[Node] = []
        self.coverage: list[tuple[object, int, int]] = []

    def through(self, node: Node) -> None:
        optimizer = node.optimizer
        inner_params = inner_params_of(node)
        if inner_params is None:
            self.visit_children(node)
            return
        outer = self.flow
        inner: _Flow = {}
        claimed: set[int] = set()
        listed: set[int] = set()
        copies: set[int] = set()
        unselected: set[int] = set()  # copies of parameters the reset does not select
        for param, inner_tensors in inner_params(optimizer, node.path):
            listed.add(id(param))
            copies.update(map(id, inner_tensors))
            found = outer.get(id(param))
            if found is None:  # a copy selected itself (a main copy from the leaf's param_groups) selects its parameter
                through_copies = [outer[id(tensor)] for tensor in inner_tensors if id(tensor) in outer]
                if through_copies:
                    found = (param, frozenset().union(*(indices for _, indices in through_copies)))
            if found is None:
                unselected.update(id(tensor) for tensor in inner_tensors if isinstance(tensor, torch.Tensor))  # not a None placeholder
                continue
            claimed.add(id(param))
            if not inner_tensors:  # stepped on another rank; copies it names are reached only where a leaf holds them
                self.reached.update(found[1])
                if not any(node is other for other in self.elsewhere):
                    self.elsewhere.append(node)
            for tensor in inner_tensors:
                earlier = inner.get(id(tensor))
                inner[id(tensor)] = (tensor, found[1] if earlier is None else earlier[1] | found[1])
        shared = unselected.intersection(inner)
        if shared:
            msg = (
                f"{type(optimizer).__qualname__} at {node.path} steps one copy for a selected parameter and one it does not "
                f"select ({len(shared)} such copies; a flat master of several parameters): its state would be reset for "
                "both; select every parameter of that copy, or reset all of them"
            )
            raise PartialResetRefused(msg)
        for key, (tensor, indices) in outer.items():
            if key not in claimed:  # passed on below; a copy selected beside its parameter stands for both
                earlier = inner.get(key)
                inner[key] = (tensor, indices if earlier is None else earlier[1] | indices)
        if _stand_for(node, copies):
            self.coverage.append((optimizer, len(claimed), len(listed)))
        self.flow = inner
        try:
            self.visit_children(node)
        finally:
            self.flow = outer

    def visit_chained(self, node: ChainedNode) -> None:
        self.through(node)

    def visit_wrapper(self, node: WrapperNode) -> None:
        self.through(node)

    def visit_hybrid(self, node: HybridNode) -> None:
        self.through(node)

    def visit_leaf(self, node: LeafNode) -> None:
        reason = malformed(node.optimizer)
        if reason is not None:  # its parameters cannot be read: a reset refuses it, as validation reports
            raise Problem(ProblemKind.MALFORMED_STATE, node.path, type(node.optimizer).__qualname__, reason).to_error()
        for group in node.optimizer.param_groups:
            for param in group["params"]:
                found = self.flow.get(id(param))
                if found is not None:
                    self.selected.add(id(param))
                    self.reached.update(found[1])


ParamsArg = Iterable[torch.Tensor] | Callable[[str], bool]


def check_model(model: torch.nn.Module) -> None:
    """Refuse a ``model=`` that is not a module, before it is needed."""
    if not isinstance(cast(object, model), torch.nn.Module):
        chunks = " (for Megatron's list of model chunks, pass torch.nn.ModuleList(chunks))" if isinstance(model, (list, tuple)) else ""
        msg = f"model must be a torch.nn.Module, got {kind_of(model)}{chunks}"
        raise OptTreeError(msg)


def model_parameters(model: torch.nn.Module, *, every_name: bool = False) -> list[tuple[str, torch.Tensor]]:
    """``model.named_parameters()``, or an error saying why they cannot be read. With
    ``every_name``, a parameter held under several names (a tied weight) comes under each."""
    check_model(model)
    try:
        named: list[object] = list(model.named_parameters(remove_duplicate=False) if every_name else model.named_parameters())
    except Exception as error:
        msg = f"the parameters of model= cannot be read: named_parameters() raised {type(error).__name__}: {error}"
        raise OptTreeError(msg) from error
    for item in named:
        if not (is_pair(item) and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)):
            msg = f"the parameters of model= cannot be read: named_parameters() gave {yielded_text(item)}, expected (name, tensor) pairs"
            raise OptTreeError(msg)
    return cast(list[tuple[str, torch.Tensor]], named)


def _accepted(predicate: Callable[[str], bool], name: str) -> bool:
    """The predicate's answer for ``name``: a bool, not read by truth (a string it returned
    selected every parameter, "no" as "yes"; a ``re.search`` match is ``bool(...)`` away)."""
    try:
        answer: object = predicate(name)
    except Exception as error:
        msg = f"the params predicate raised {type(error).__name__} for the parameter {name!r}: {error}"
        raise OptTreeError(msg) from error
    if not isinstance(answer, bool):
        msg = f"the params predicate returned {kind_of(answer)} for the parameter {name!r}, expected a bool (True selects it)"
        raise OptTreeError(msg)
    return answer


_Item = TypeVar("_Item")


def _listed(values: Iterable[_Item], what: str) -> list[_Item]:
    """The items of an iterable the user gave, or an error naming ``what`` where its own
    code (a generator's) raises while it is read."""
    try:
        return list(values)
    except Exception as error:
        msg = f"{what} cannot be read: iterating it raised {type(error).__name__}: {error}"
        raise OptTreeError(msg) from error


def model_weights(model: torch.nn.Module) -> tuple[str, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """``model``'s class, its parameters and its buffers, for :attr:`Selection.model`; an
    error saying why where they cannot be read."""
    params = tuple(param for _, param in model_parameters(model))
    try:
        buffers = [buffer for buffer in torch.nn.Module.buffers(model) if isinstance(cast(object, buffer), torch.Tensor)]  # Megatron's DDP shadows buffers
    except Exception as error:  # noqa: BLE001  # a module's own code may raise anything
        msg = f"the buffers of model= cannot be read: buffers() raised {type(error).__name__}: {error}"
        raise OptTreeError(msg) from error
    return type(model).__qualname__, params, tuple(buffers)


def resolve_params(params: ParamsArg, model: torch.nn.Module | None) -> list[torch.Tensor]:
    """The parameters ``params`` names: an iterable of them, or a predicate on the names
    ``model`` gives them."""
    if isinstance(params, (torch.Tensor, torch.nn.Module)):
        msg = f"params is one {type(params).__qualname__}: pass a list of parameters, such as params=[weight]"
        raise OptTreeError(msg)
    if callable(params):
        if model is None:
            msg = "selecting parameters by a predicate on their names needs model="
            raise OptTreeError(msg)
        return [p for name, p in model_parameters(model, every_name=True) if _accepted(params, name)]  # a tied weight by any of its names
    if not isinstance(cast(object, params), Iterable):
        msg = f"params must be a list of parameters or a predicate on their names, got {kind_of(params)}"
        raise OptTreeError(msg)
    chosen = _listed(params, "the parameters params gives")
    for p in chosen:
        if not isinstance(cast(object, p), torch.Tensor):
            msg = f"params must be tensors, got {kind_of(p)}"
            raise OptTreeError(msg)
    return chosen


def key_names(keys: Iterable[str]) -> frozenset[str]:
    """The state keys ``keys`` names: one key, or an iterable of them, as plain strings
    (a ``str`` subclass's own ``__hash__`` or ``__eq__`` never runs in a lookup)."""
    if isinstance(keys, str):
        return frozenset([str.__str__(keys)])
    if isinstance(cast(object, keys), (bytes, bytearray)) or not isinstance(cast(object, keys), Iterable):
        msg = f"keys must be a state key or a list of them, got {kind_of(keys)}"
        raise OptTreeError(msg)
    names = _listed(keys, "the state keys keys gives")
    for name in names:
        if not isinstance(cast(object, name), str):
            msg = f"keys must be names of state keys, got {kind_of(name)}"
            raise OptTreeError(msg)
    return frozenset(map(str.__str__, names))


def unnamed_param(param: torch.Tensor) -> str:
    """A parameter the model does not name, as messages name it: by its shape, or by its
    class where its own code cannot give one (a nested tensor has no sizes)."""
    try:
        return f"of shape {tuple(param.shape)}"
    except Exception:  # noqa: BLE001  # a tensor subclass's own code may raise anything
        return f"({kind_of(param)} whose shape cannot be read)"


def select(root: Node, params: ParamsArg | None, keys: Iterable[str] | None, model: torch.nn.Module | None) -> Selection:
    """Map the user's parameters to the leaf tensors they reach; raise for any that reach none.

    Step counters are reset by a full reset, and by a partial one only where ``keys``
    names ``"step"``: resetting some parameters' moments keeps their step (as ReLoRA and
    SPAM do), and Megatron checkpoints one step per optimizer.
    """
    weights = None if model is None else model_weights(model)
    key_set = None if keys is None else key_names(keys)
    if key_set == frozenset():
        raise PartialResetRefused("keys names no state key: nothing would change")
    steps = "step" in key_set if key_set is not None else params is None
    history = None if key_set is None else key_set - {"step"}
    if params is None:
        return Selection(None, history, steps, model=weights) if key_set is not None or weights is not None else EVERYTHING
    chosen = list({id(param): param for param in resolve_params(params, model)}.values())  # a tied weight named twice is one
    if not chosen:
        what = "the params predicate accepts none of the model's parameters" if callable(params) else "params is empty"
        raise PartialResetRefused(f"{what}: nothing would change")
    visitor = SelectVisitor(chosen)
    root.accept(visitor)
    missing = [i for i in range(len(chosen)) if i not in visitor.reached]
    if missing:
        names = {id(p): n for n, p in model_parameters(model)} if model is not None else {}
        first = chosen[missing[0]]
        name = names.get(id(first))
        label = unnamed_param(first) if name is None else name
        plain = [i for i in missing if not isinstance(chosen[i], torch.nn.Parameter)]
        frozen = [i for i in missing if i not in plain and not _REQUIRES_GRAD(chosen[i])]
        why = "".join(
            (
                f"; {len(plain)} of them tensors that are no parameter (a state_dict's values, .detach() or .data share a "
                "parameter's memory, but an optimizer holds the parameter): select the parameters themselves"
                if plain
                else "",
                f"; {len(frozen)} of them frozen (requires_grad=False), which Megatron's factory builds no optimizer for: "
                "select the trainable ones"
                if frozen
                else "",
            )
        )
        msg = (
            f"parameter {label} is held by no optimizer under {type(root.optimizer).__qualname__} at "
            f"{root.path} ({len(missing)} of {len(chosen)} selected parameters unmapped{why})"
        )
        raise UnmappedParameter(msg)
    return Selection(
        frozenset(visitor.selected), history, steps, elsewhere=tuple(visitor.elsewhere), coverage=tuple(visitor.coverage), model=weights
    )
