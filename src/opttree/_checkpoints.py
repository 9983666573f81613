"""Megatron's sharded checkpoints at step 0, saved and loaded without patching Megatron.

megatron-core (0.16.1 and 0.19.2 measured) writes the step that ``FP32Optimizer`` and
``Float16OptimizerWithFloat16Params`` share across their parameters into
``sharded_state_dict`` only ``if step:``. Right after a reset every step is 0, so the
checkpoint holds none, and Megatron's own ``load_state_dict`` hands torch's Adam entries
without ``step``: torch raises ``KeyError: 'step'``. (A fresh optimizer, which has no
state yet, cannot be checkpointed this way at all: Megatron's load asks for history the
checkpoint does not hold.)

:func:`sharded_state_dict` returns Megatron's own sharded state dict with that zero step
put back, under ``common_step``, the key Megatron's load reads, so the checkpoint loads
with Megatron's own code. :func:`load_state_dict` loads a checkpoint that Megatron itself
saved at step 0: Megatron writes the step whenever it is not 0, so history without one
was saved at step 0, and the step given back is 0, of the type the leaf's optimizer
starts it as (a float tensor for torch's, an int for LaProp's: see ``StateSchema.step_type``).

Megatron's load writes the common step into every saved entry, an empty one too (a
parameter whose entry a read created before any step): torch's Adam takes an entry with a
step for built and raises ``KeyError`` for its history. :func:`load_state_dict` gives the
step only to entries that hold history, and leaves an empty one for the optimizer to
build whole, as a fresh optimizer does.

``DistributedOptimizer`` writes its step into the param groups whatever its value, and
leaves that count steps per group (TE and apex ``FusedAdam``) keep them in the param
groups too: neither needs anything. Its ``load_state_dict`` (megatron-core 0.16.1 and
0.19.2 measured) gives every parameter's state one step tensor, which torch's Adam then
advances once per parameter and step, and its ``dp_reshardable`` sharded load leaves in it
the loading optimizer's own step: :func:`load_state_dict` gives each entry a step tensor
of its own holding the step the saved param groups hold, as the optimizer that saved it held.

That ``dp_reshardable`` load copies the checkpoint into the main parameters outside
``torch.no_grad()`` (``_set_main_param_and_optimizer_states``; its other loads run
inside), and with fp32 weights those are views of the model's leaves, which require grad:
torch raises half-way. :func:`load_state_dict` runs Megatron's load inside
``torch.no_grad()``, as nothing in a load is for autograd.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from opttree._eager import eager
from opttree._preflight import torch_name
from opttree import _registry
from opttree._distributed import agreed
from opttree._trees import tree
from opttree._containers import malformed
from opttree._checkpoint_layouts import STEP_KEY, Load, check_history_apart, check_loading, check_saving, format_advice, layout_error, walk
from opttree._inspect import fresh_step_dtype
from opttree._nodes import LeafNode, Node, tree_nodes
from opttree._problems import Problem, ProblemKind
from opttree._schema import StepType
from opttree._selection import tree_leaves
from opttree._fields import kind_of

_Result = TypeVar("_Result")


def _leaf_steps(leaf: LeafNode) -> list[object]:
    return [entry["step"] for entry in leaf.optimizer.state.values() if isinstance(entry, dict) and "step" in entry]


def _is_zero(step: object) -> bool:
    if isinstance(step, torch.Tensor):
        return step.numel() == 1 and not bool(step)
    return step == 0


def _has_steps(entries: dict[object, object]) -> bool:
    """Whether a torch-format ``state`` keeps its steps per entry, as ``state_dict()`` does."""
    return any(isinstance(entry, dict) and "step" in entry for entry in entries.values())


def _megatron_root(optimizer: object) -> Node:
    """The stack's root, refused where it is not Megatron's or where a leaf's containers
    are malformed: Megatron's own code reads them, and raised half-way through a load or a
    loading sharded state dict, having changed the state before."""
    root = tree(optimizer)  # a tree passed in stands for its root's optimizer
    if isinstance(root, LeafNode) or not hasattr(root.optimizer, "sharded_state_dict"):
        problem = Problem(
            ProblemKind.CHECKPOINT_LAYOUT,
            root.path,
            type(root.optimizer).__qualname__,
            "not a Megatron optimizer: it has no sharded_state_dict (a torch optimizer's own state_dict and load_state_dict keep its steps as they are)",
        )
        raise problem.to_error()
    for leaf in (node for node in tree_nodes(root) if isinstance(node, LeafNode)):
        fault = malformed(leaf.optimizer)
        if fault is not None:
            raise layout_error(leaf, "param_groups" if fault.startswith("param") else "state", fault)
    return root


@eager
def sharded_state_dict(
    optimizer: object,
    model_sharded_state_dict: dict[str, object],
    *,
    is_loading: bool = False,
    metadata: Mapping[str, object] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, object]:
    """Megatron's ``optimizer.sharded_state_dict(...)``, with the step put back where
    Megatron drops a step of 0 (right after a reset), so that the checkpoint loads.

    Raises :class:`~opttree.UnsupportedCheckpoint` for a stack whose state dict layout
    opttree does not know, where a leaf counts its steps per parameter, or where Megatron's
    own ``sharded_state_dict`` raises. With a process group (collective: call it on every
    rank of ``group``), every rank raises where any rank could not build its state dict,
    naming that rank: the others would otherwise go on into Megatron's save and wait there
    for the rank that raised. The ranks agree twice: on opttree's own checks, before
    Megatron's ``sharded_state_dict`` runs anywhere (some of its formats gather over the
    data-parallel group, where a rank that raised first would leave the others waiting),
    and on what Megatron's gave each rank.
    """
    root, as_dict = agreed(group, lambda: _checked_saving(optimizer, model_sharded_state_dict, is_loading=is_loading, metadata=metadata))
    with _outside_inference():  # a load's sharded state dict builds the state the checkpoint is loaded into
        return agreed(group, lambda: _sharded_state_dict(root, model_sharded_state_dict, is_loading=is_loading, metadata=as_dict))


def _outside_inference() -> torch.inference_mode:
    """Megatron's state built or loaded outside ``torch.inference_mode()``, whatever the
    caller's mode (a rollout's): in it, Megatron's load and its loading sharded state dict
    make the state inference tensors, which no training step outside it can update and
    no reset takes."""
    return torch.inference_mode(False)


def _checked_saving(
    optimizer: object,
    model_sharded_state_dict: dict[str, object],
    *,
    is_loading: bool,
    metadata: Mapping[str, object] | None,
) -> tuple[Node, dict[str, object] | None]:
    """The stack's root and ``metadata`` as the dict Megatron takes, its arguments checked as
    Megatron takes them, and, for a save, the stack checked for what makes Megatron's save
    raise or write what no load takes."""
    root = _megatron_root(optimizer)
    given: tuple[object, object] = (model_sharded_state_dict, metadata)  # typed; checked for untyped callers
    if not isinstance(given[0], dict):
        what = type(given[0]).__qualname__
        raise layout_error(root, "model_sharded_state_dict", f"is a {what}, where Megatron takes the model's sharded state dict")
    if given[1] is not None and not isinstance(given[1], Mapping):
        raise layout_error(root, "metadata", f"is {kind_of(given[1])}, where Megatron takes a dict or None")
    try:
        as_dict = metadata if metadata is None or isinstance(metadata, dict) else dict(metadata)
    except Exception as error:  # noqa: BLE001  # a mapping's own code may raise anything
        raise layout_error(root, "metadata", f"cannot be read: {type(error).__name__}: {error}") from error
    if not isinstance(cast(object, is_loading), bool):
        raise layout_error(root, "is_loading", f"is {kind_of(is_loading)}, where Megatron takes True or False")
    if is_loading:
        check_loading(root)
    else:
        check_saving(root, as_dict)
    return root, as_dict


def _sharded_state_dict(
    root: Node,
    model_sharded_state_dict: dict[str, object],
    *,
    is_loading: bool,
    metadata: dict[str, object] | None,
) -> dict[str, object]:
    sharded_state_dict_of = getattr(root.optimizer, "sharded_state_dict")
    state: dict[str, object] = _megatrons(
        root,
        "sharded_state_dict",
        lambda: sharded_state_dict_of(model_sharded_state_dict, is_loading=is_loading, metadata=metadata),
        advice=lambda error: format_advice(root, metadata, error),
        loads=is_loading,
    )
    if is_loading:
        return state
    for leaf, leaf_state in walk(root, state, loading=None):
        entries = leaf_state["state"]
        steps = _leaf_steps(leaf)
        if isinstance(entries, dict) and STEP_KEY not in entries and steps and all(map(_is_zero, steps)):
            entries[STEP_KEY] = steps[0]  # as Megatron writes a step that is not 0
    return state


@eager
def load_state_dict(
    optimizer: object,
    state_dict: Mapping[str, object] | Mapping[int, object] | Sequence[Mapping[str, object]],
    *,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Megatron's ``optimizer.load_state_dict(state_dict)``, for a checkpoint that may have
    been saved by Megatron's own ``sharded_state_dict`` at step 0: each leaf state that
    holds history but no step is given the step 0 it was saved at. The common step of a
    sharded checkpoint is given to the entries that hold history, and not, as Megatron's
    own load gives it, to empty ones too.

    ``state_dict`` is what the stack's ``state_dict()`` returns or a sharded load gives
    back (by member index for a chain of several). Before anything is loaded or written it
    is checked as each wrapper kind's load reads it; one that any would trip on, or that
    Megatron would load only part of, raises :class:`~opttree.UnsupportedCheckpoint` with
    the stack and ``state_dict`` unchanged. An error Megatron's own load raises past those
    checks is given back as one too, saying that what it loaded before stays loaded.

    With a process group (collective: call it on every rank of ``group``), the ranks agree
    twice: on the checks, so that where any rank refuses its checkpoint no rank loads; and
    on Megatron's loads, so that where one raised past them every rank raises, naming it,
    and none trains on beside a rank that did not load."""
    root, checked, leaf_states = agreed(group, lambda: _checked(optimizer, state_dict))
    with _outside_inference():
        for leaf, leaf_state in leaf_states:
            entries = leaf_state["state"]
            if isinstance(entries, dict):
                _give_steps(leaf, entries)
        agreed(group, lambda: _load(root, state_dict, checked))


def _checked(
    optimizer: object, state_dict: Mapping[str, object] | Mapping[int, object] | Sequence[Mapping[str, object]]
) -> tuple[Node, Load, list[tuple[LeafNode, dict[object, object]]]]:
    """The stack's root, and the checkpoint checked as each wrapper kind's load reads it,
    with each leaf's part of it: every check before any write."""
    root = _megatron_root(optimizer)
    checked = Load()
    leaf_states = list(walk(root, state_dict, loading=checked))
    check_history_apart(root, checked)
    return root, checked, leaf_states


def _load(root: Node, state_dict: object, checked: Load) -> None:
    """Megatron's own load of a checked checkpoint, and the steps it leaves mended."""
    load = getattr(root.optimizer, "load_state_dict")
    with torch.no_grad():  # see the module doc: a DistributedOptimizer's dp_reshardable load of fp32 weights
        _megatrons(root, "load_state_dict", lambda: load(state_dict))
    loaded = tree(root.optimizer)  # built again: a HybridDeviceOptimizer's load builds new sub-optimizers
    _restore_group_steps(loaded, checked.group_steps)
    _unshare_steps(loaded)
    _drop_bucket_flags(loaded)


BUCKET_FLAGS = frozenset({"padding"})
"""Flags of the bucket state a ``DistributedOptimizer`` saves in its ``dp_reshardable``
format, which megatron-core 0.16's load writes into a ``HybridDeviceOptimizer``'s state
entries beside the history (0.19's skips values that are not tensors): no step reads
them, and a reset would refuse the key as one its leaf's schema does not know."""


def _drop_bucket_flags(root: Node) -> None:
    """Delete the :data:`BUCKET_FLAGS` Megatron's load left in state entries, where the
    leaf's schema does not name the key as its optimizer's own."""
    for optimizer in tree_leaves(root):
        schema = _registry.schema_for(type(optimizer))
        flags = BUCKET_FLAGS - (schema.actions.keys() if schema is not None else set())
        for entry in optimizer.state.values():
            for key in flags:
                if isinstance(entry, dict) and isinstance(entry.get(key), bool):
                    del entry[key]


def _restore_group_steps(root: Node, group_steps: dict[int, float]) -> None:
    """Give each state entry under a ``DistributedOptimizer`` a step tensor of its own
    holding the step its saved param groups hold: Megatron's load puts every parameter on
    one tensor, and its ``dp_reshardable`` load leaves in it the loading optimizer's own
    step (the 1 of its dummy-state init where 2 was saved, measured on 0.19.2). The tensor
    is of the dtype a fresh optimizer counts in (:func:`~opttree._inspect.fresh_step_dtype`),
    where its class builds its state as its built-in schema says: Megatron's load makes it
    float32 whatever torch's default dtype, and under a float64 default the loaded stack
    could then never be reset."""
    for node in tree_nodes(root):
        saved = group_steps.get(id(node.optimizer))
        if saved is None:
            continue
        for optimizer in tree_leaves(node):
            fresh = _fresh_step_dtypes(optimizer)
            for param, entry in optimizer.state.items():
                step = entry.get("step") if isinstance(entry, dict) else None
                if isinstance(step, torch.Tensor):
                    entry["step"] = torch.tensor(saved, dtype=fresh.get(id(param), step.dtype), device=step.device)


def _fresh_step_dtypes(optimizer: torch.optim.Optimizer) -> dict[int, torch.dtype]:
    """The dtype a fresh ``optimizer`` counts each parameter's step in, by the parameter's
    ``id``; none where its class does not build its state as its built-in schema says."""
    if not _registry.builds_as_its_schema_says(type(optimizer)):
        return {}
    return {id(param): fresh_step_dtype(group) for group in optimizer.param_groups for param in group["params"]}


def _give_steps(leaf: LeafNode, entries: dict[object, object]) -> None:
    """Give each saved entry that holds history the step it was saved at: the common step
    where Megatron wrote one, else 0 where no entry holds one (saved at step 0). Megatron's
    own load writes its common step into every entry, an empty one too, which torch's Adam
    then takes for built and raises ``KeyError`` at; an empty entry is left empty, for the
    optimizer to build whole, as a fresh one does."""
    step: Callable[[], object]
    if STEP_KEY in entries:
        step = functools.partial(copy.deepcopy, entries.pop(STEP_KEY))  # a copy each, as Megatron gives
    elif not _has_steps(entries):
        step = functools.partial(_fresh_step, leaf)
    else:
        return
    for entry in entries.values():
        if isinstance(entry, dict) and entry:
            entry["step"] = step()


def _unshare_steps(root: Node) -> None:
    """Give each state entry that a load left on an earlier entry's step tensor a copy of
    its own: one tensor counting several parameters' steps advances once per parameter."""
    seen: set[int] = set()
    for optimizer in tree_leaves(root):
        for entry in optimizer.state.values():
            step = entry.get("step") if isinstance(entry, dict) else None
            if not isinstance(step, torch.Tensor):
                continue
            if id(step) in seen:
                entry["step"] = step.detach().clone()
            else:
                seen.add(id(step))


def _megatrons(
    root: Node, method: str, call: Callable[[], _Result], *, advice: Callable[[Exception], str] | None = None, loads: bool = False
) -> _Result:
    """``call()``, Megatron's own ``method``; any error it raises past opttree's checks (its
    own ``CheckpointingException``, torch's, an out-of-memory error as it moves state to
    the device) is an :class:`~opttree.UnsupportedCheckpoint`, the original as its cause,
    with what ``advice`` says of it after Megatron's message. Megatron's loads are not
    all-or-nothing: anything it loaded before raising stays loaded, which the message
    says, whatever the error; so does a loading ``sharded_state_dict`` (``loads``), which
    runs a ``DistributedOptimizer``'s ``load_state_dict`` (a stack's step tensors shared,
    a HybridDeviceOptimizer's groups given a step) before it can raise."""
    try:
        return call()
    except Exception as error:
        after = ""
        if method == "load_state_dict":
            after = "; anything it loaded before raising stays loaded: load into a fresh stack"
        elif loads:
            after = (
                "; loading, it runs the optimizer's load_state_dict first, and what that loaded or built before it raised "
                "stays so (step tensors shared, group steps): load into a fresh stack"
            )
        said = "" if advice is None else advice(error)
        message = f"Megatron's own {method} raised {type(error).__name__}: {_error_text(error)}{said}{after}"
        raise layout_error(root, method, message) from error


def _error_text(error: Exception) -> str:
    """An error's message in one line: a ``KeyError`` for a tensor names its shape and
    dtype, where its own text is the tensor's values over many lines."""
    key = error.args[0] if isinstance(error, KeyError) and len(error.args) == 1 else None
    if isinstance(key, torch.Tensor):
        return f"a {type(key).__name__} of shape {tuple(key.shape)} {torch_name(key.dtype)} (a key it did not find)"
    text = str(error)
    return text.splitlines()[0] if text else ""


def _fresh_step(leaf: LeafNode) -> object:
    """A step of 0, as the leaf's optimizer creates its steps (its schema's ``step_type``)."""
    schema = _registry.schema_for(type(leaf.optimizer))
    if schema is not None and schema.step_type is StepType.INT:
        return 0
    return torch.tensor(0.0)  # torch's Adam starts from this; its load moves it
