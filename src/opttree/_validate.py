"""Validation: every problem in a tree at once, gathered in the same pass that plans a reset."""

from __future__ import annotations

import enum
import operator
from collections.abc import Mapping, Sequence, Set as AbstractSet
from itertools import chain
from typing import Self, cast

import torch

from opttree._eager import eager
from opttree import _registry
from opttree._containers import PLAIN_STATES, malformed, own_writes, tensors_held
from opttree._dispatch import LazyDispatch, dotted_name, is_megatron_class, megatron_bases
from opttree._errors import OptTreeError
from opttree._shards import detached_shards
from opttree._held import Held, held_by_leaf, held_optimizers, only_bookkeeping, own_attributes, unknown_attribute_tensors
from opttree._hooks import surely_known_hooks, unknown_global_step_hook, unknown_step_hook
from opttree._identity import identity_key, identity_keys
from opttree._adapter import TreeBuilder
from opttree._inspect import BUFFERS, GRADIENTS, LeafInspector, held_gradients, key_label, step_numbers
from opttree._nodes import ChainedNode, HybridNode, LeafNode, Node, WrapperNode, tree_nodes
from opttree._paths import ROOT
from opttree._plan import ResetPlan, StateEntry
from opttree._preflight import Owner, duplicates, overlap, plain_torch, ranges, unique_ranges
from opttree._problems import Problem, ProblemKind, Severity
from opttree._scalers import SCALE, ScalerReset, held_scale, loss_scaler, plan_scaler
from opttree._trees import lenient_tree
from opttree._schema import GroupCounterStart, StateSchema, StepLocation
from opttree._runs import alike_runs, sibling_groups, visits_leaves_as
from opttree._selection import EVERYTHING, STEP_UNITS, Selection, inner_params_of, tree_leaves, tree_params
from opttree._visitor import TraverserVisitor
from opttree._fields import is_a, kind_of
from opttree._numbers import shown_value
from opttree._overrides import stored_attribute_names

_OPTIMIZER = operator.attrgetter("optimizer")

COPIES_GROUPS: LazyDispatch[bool] = LazyDispatch()
"""Wrappers whose step copies their own param groups' options into their inner
optimizers' groups first: ``HybridDeviceOptimizer``, and its subclasses, which a user
registers as wrappers of their own where they add methods."""
COPIES_GROUPS.register_lazy("megatron.core.optimizer.cpu_offloading.hybrid_optimizer.HybridDeviceOptimizer", True)


def _owner_text(owner: Owner) -> str:
    path, cls, key = owner
    what = "a parameter" if key is None else "a parameter's gradient" if key == GRADIENTS else "a buffer" if key == BUFFERS else repr(key)
    return f"{what} of {cls} at {path}"


class _ReachedLeaves(TraverserVisitor):
    """The leaves with a schema that ``selection`` reaches, once each."""

    def __init__(self, selection: Selection) -> None:
        self.selection = selection
        self.leaves: list[tuple[LeafNode, StateSchema]] = []

    def visit_leaf(self, node: LeafNode) -> None:
        schema = _registry.schema_for(type(node.optimizer))
        if node.shared_with is not None or schema is None or malformed(node.optimizer) is not None:
            return  # checked at its first path; refused as unsupported or malformed
        if self.selection.holds(node.optimizer):
            self.leaves.append((node, schema))


class ValidateVisitor(TraverserVisitor):
    """Checks each leaf against its schema, collecting ``problems`` and the reset ``plan``.

    A leaf reached a second time (``shared_with``) is checked once, at its first path.
    Runs of alike sibling leaves are planned in one pooled pass where that cannot change
    the outcome (:meth:`~opttree._inspect.LeafInspector.inspect_alike`), else leaf by leaf.
    :meth:`check` walks a tree and then runs the checks that need all of it: keys named
    for a partial reset, optimizers hidden in wrappers, and memory shared by state. A walk
    by ``root.accept(visitor)`` alone runs the checks of each node, not those.
    """

    def __init__(self, *, keep_loss_scale: bool = False, pooling: bool = True) -> None:
        """A visitor of the whole state; ``keep_loss_scale`` leaves fp16 loss scalers alone,
        and ``pooling=False`` inspects every leaf on its own (the reference pooling must equal)."""
        for name, flag in (("keep_loss_scale", keep_loss_scale), ("pooling", pooling)):
            if not isinstance(cast(object, flag), bool):  # keep_loss_scale="False" would keep the scale
                msg = f"{name} must be True or False, got {kind_of(flag)}"
                raise OptTreeError(msg)
        self._keep_loss_scale = keep_loss_scale
        self._pooling = pooling and visits_leaves_as(self, ValidateVisitor)
        self._selection = EVERYTHING
        self._restart()

    def _restart(self) -> None:
        """Forget what an earlier walk found, so that a visitor can check again."""
        self._passed = False
        """Whether :meth:`refusal` has just checked the whole tree and found no error: the
        plan may then be carried out, once."""
        self._pooled = False
        self.problems: list[Problem] = []
        """What :meth:`check` found, in the order it found it."""
        self._plan = ResetPlan()
        self._inspectors: dict[type, LeafInspector | None] = {}
        self._patches: dict[tuple[type, bool], str | None] = {}
        self._is_optimizer: dict[type, bool] = {}
        """Whether objects of a class are optimizers (or wrappers) opttree knows: read once
        a walk, as a registration between walks may change it."""
        self._mirrors: list[tuple[Node, set[int]]] = []
        """Wrappers whose own state holds their optimizers' entries, with those entries' identities."""
        self._contained: list[object] = []
        self._held: list[tuple[Node, Held]] = []
        self._release_refused = False
        self._megatron_above: list[str] = []
        """The classes of the Megatron wrappers above the node visited."""
        self._scalers_seen: list[object] = []
        self._scalers_decided: list[tuple[Node, bool]] = []
        """Each resettable loss scaler's wrapper, and whether the reset resets it."""
        self._stub_scalers: list[ScalerReset] = []
        """The loss scalers of Megatron stubs met by a partial reset: reset where the
        stack's other scalers all are, kept where they are kept."""

    def _forget_plan(self) -> None:
        """Drop the plan, and the inspectors that add to it, with every tensor they hold."""
        self._plan = ResetPlan()
        self._inspectors.clear()

    @classmethod
    def _selecting(cls, selection: Selection, *, keep_loss_scale: bool = False) -> Self:
        """A visitor of the part of the state ``selection`` takes."""
        visitor = cls(keep_loss_scale=keep_loss_scale)
        visitor._selection = selection
        return visitor

    @eager
    def refusal(self, root: Node) -> OptTreeError | None:
        """:meth:`check` the whole tree: the error a reset of it raises, or None."""
        self.check(root)
        return self._first_error()

    def _refusal_of_built(self, root: Node) -> OptTreeError | None:
        """:meth:`refusal`, for a tree opttree has just built or verified."""
        self._check_built(root)
        return self._first_error()

    def _first_error(self) -> OptTreeError | None:
        errors = [p for p in self.problems if p.severity is Severity.ERROR]
        if errors:
            self._forget_plan()  # the error's traceback holds this visitor: let the state go
            return errors[0].to_error(others=errors[1:])
        self._passed = True
        return None

    @eager
    def check(self, root: Node) -> None:
        """Check the tree ``root`` afresh, forgetting any earlier check: a tree built by
        hand that is not the one opttree builds for its root's optimizer is a problem
        (``foreign-tree``), as in :func:`opttree.validate`."""
        checked, problems = lenient_tree(root)
        self._restart()
        self.problems.extend(problems)
        self._walk(checked)

    def _check_built(self, root: Node) -> None:
        """:meth:`check`, for a tree opttree has just built or verified."""
        self._restart()
        self._walk(root)

    def _walk(self, root: Node) -> None:
        """Walk ``root`` and run the tree-wide checks, as plain torch calls (see
        :func:`~opttree._preflight.plain_torch`)."""
        with plain_torch():
            self._check_under(root)
            global_hook = unknown_global_step_hook()
            if global_hook is not None:
                self.problems.append(Problem(ProblemKind.UNSUPPORTED_OPTIMIZER, root.path, type(root.optimizer).__qualname__, global_hook))
            if root.under is not None:  # a subtree: its leaves are under that wrapper as in the whole stack
                self._megatron_above = [type(root.under[1]).__qualname__]
            self._contained.append(root.optimizer)
            root.accept(self)
            self._keep_model_weights(root)
            self._check_mirrors()
            self._check_loss_scales(root)
            self._check_keys(root)
            self._check_held()
            found = len(self.problems)
            self._check_memory()
            if self._pooled and len(self.problems) > found:
                self._check_leaf_by_leaf(root)

    def _check_mirrors(self) -> None:
        """A reset that deletes state entries (``release=True``, or a leaf whose entries start
        from its group's values at its first step) under a wrapper whose own state holds
        them (a mirror, as HybridDeviceOptimizer keeps of its sub-optimizers'): deleted from
        the optimizer only, they would live on in the mirror, their memory, their history
        and its next checkpoint's. Refused."""
        if not self._mirrors or not self._plan.state.release:
            return
        deleted: set[int] = set()
        for optimizer, held in self._plan.state.release:
            state = optimizer.state
            deleted.update(object.__hash__(state[param]) for param in held if param in state)
        for node, mirrored in self._mirrors:
            if not mirrored.isdisjoint(deleted):
                message = (
                    "its own state holds its optimizers' entries (a mirror of them), and this reset deletes some of them "
                    "from the optimizers only: the mirror would keep them, their memory and their history; "
                    "reset the optimizers directly, or without release"
                )
                self.problems.append(Problem(ProblemKind.UNRELEASABLE_STATE, node.path, type(node.optimizer).__qualname__, message))

    def _check_leaf_by_leaf(self, root: Node) -> None:
        """Check ``root`` again with every leaf on its own, and take its problems and plan:
        a problem the tree-wide memory check finds in a pooled run then names its leaf."""
        again = type(self)(keep_loss_scale=self._keep_loss_scale, pooling=False)
        again._selection = self._selection
        again._check_built(root)
        self.problems[:] = again.problems  # the inspectors hold this list
        self._plan = again._plan

    def _check_keys(self, root: Node) -> None:
        """Keys named for a partial reset must be history in at least one leaf that holds
        the selected parameters, and, where parameters are named, every leaf holding some
        must have one of them: a leaf whose selected parameters have none of the keys
        (Muon's matrices, asked for AdamW's ``exp_avg``) would be passed over in silence."""
        selection = self._selection
        if selection.keys is None:
            return
        named = selection.keys | ({"step"} if selection.steps else set())
        reached = _ReachedLeaves(selection)
        root.accept(reached)
        elsewhere = _ReachedLeaves(EVERYTHING)  # one answer on every rank, whichever holds the parameter
        for node in selection.elsewhere:
            node.accept(elsewhere)
        resettable = set().union(*(schema.resettable for _, schema in (*reached.leaves, *elsewhere.leaves)))
        unknown = sorted(named - resettable)
        holding = "in the tree" if selection.tensors is None else "holding the selected parameters"
        found = self._plan.state.found_keys
        if unknown:
            held = sorted(resettable.intersection(found))  # what the advice names is there to reset
            unbuilt = f"; {', '.join(sorted(resettable - set(held)))} only where options build them" if held and len(held) < len(resettable) else ""
            message = f"no optimizer {holding} has history {unknown} (resettable there: {', '.join(held or sorted(resettable)) or 'none'}{unbuilt})"
            self.problems.append(Problem(ProblemKind.UNKNOWN_KEY, root.path, type(root.optimizer).__qualname__, message))
        elif found and named.isdisjoint(found) and not selection.elsewhere:
            message = (
                f"no optimizer {holding} holds {sorted(named)} in its state (it holds {', '.join(sorted(map(str, found)))}): "
                "nothing would change; an optimizer builds some keys only with some options (Adam's "
                "max_exp_avg_sq with amsgrad=True)"
            )
            self.problems.append(Problem(ProblemKind.UNKNOWN_KEY, root.path, type(root.optimizer).__qualname__, message))
        if selection.tensors is None:
            return
        for leaf, schema in reached.leaves:
            if named.isdisjoint(schema.resettable):
                message = (
                    f"holds selected parameters but none of the keys {sorted(named)}: their state would be left "
                    f"as it is (its history: {', '.join(sorted(schema.resettable)) or 'none'})"
                )
                self.problems.append(Problem(ProblemKind.UNKNOWN_KEY, leaf.path, type(leaf.optimizer).__qualname__, message))

    def _counts_as_optimizer(self, cls: type) -> bool:
        found = self._is_optimizer.get(cls)
        if found is None:
            found = self._is_optimizer[cls] = issubclass(cls, torch.optim.Optimizer) or _registry.kind_for(cls) is not None
        return found

    def _record_held_by(self, leaf: LeafNode) -> None:
        """The optimizers a leaf holds beside its state (one a registered class steps too,
        an ``aux`` set on one), which must be nodes of the tree as a wrapper's must."""
        self._held.extend((leaf, held) for held in held_by_leaf(leaf.optimizer, self._counts_as_optimizer))

    def _check_held(self) -> None:
        """Every optimizer a wrapper holds must be a node of the tree: one it hides would
        keep its state through a reset."""
        contained = identity_keys(self._contained)
        for node, (label, objects, indexed) in self._held:
            hidden = identity_keys(objects) - contained
            if not hidden:
                continue
            index, first = next((i, o) for i, o in enumerate(objects) if identity_key(o) in hidden)
            where = f"{label}[{index}]" if indexed else label
            advice = (
                "register its class as a wrapper of its optimizers (opttree.register_wrapper(cls, children=...))"
                if isinstance(node, LeafNode)
                else "register the wrapper with opttree.register_wrapper(cls, children=...) naming all its optimizers"
            )
            message = f"holds {kind_of(first)} in {where} that the tree does not contain ({len(hidden)} such): a reset would keep its state; {advice}"
            self.problems.append(Problem(ProblemKind.HIDDEN_OPTIMIZER, node.path, type(node.optimizer).__qualname__, message))

    def _keep_model_weights(self, root: Node) -> None:
        """The parameters of ``model=``, frozen ones too, and its buffers are memory a reset
        leaves alone."""
        if self._selection.model is not None:
            cls, weights, buffers = self._selection.model
            inspector = LeafInspector(_NO_STATE, self._plan, self.problems, self._selection)
            inspector.plan_kept(root, ("model=", cls), weights, None, self._plan.state)
            inspector.plan_kept(root, ("model=", cls), buffers, BUFFERS, self._plan.state)

    def _check_memory(self) -> None:
        """Step tensors held for several parameters are counted once, with a warning;
        anything written that shares memory with other state or a parameter is refused, and
        so is a state entry reached twice."""
        plan = self._plan
        steps = plan.ranges("step_ranges")
        repeats, first = duplicates(steps)
        if repeats and first is not None:
            path, cls, key = steps.owner(first)
            message = (
                f"one step tensor counts the steps of several parameters ({repeats} repeats): each "
                "optimizer.step() advances it once per parameter; a reset zeroes it once and gives every "
                "other parameter a zero step tensor of its own, as a fresh optimizer holds"
            )
            self.problems.append(Problem(ProblemKind.SHARED_STEP, path, cls, message, key))
            plan.shared_steps = repeats
            plan.state.unshared = _sharing(plan.state.step_holders)
            odd = own_writes([entry for entry, _ in plan.state.unshared])
            if odd is not None:
                message = f"a state entry is a {odd.__qualname__}, which sets keys by its own code: opttree cannot tell that giving it a step tensor of its own succeeds"
                self.problems.append(Problem(ProblemKind.UNSUPPORTED_STATE, path, cls, message, key))
            steps = unique_ranges(steps)
        written = plan.ranges("written")
        written.extend(steps)
        clash = overlap(written, plan.ranges("kept_ranges"))
        if clash is not None:
            (path, cls, key), other = clash
            message = f"shares memory with {_owner_text(other)}: zeroing it would change that too"
            self.problems.append(Problem(ProblemKind.ALIASED_STATE, path, cls, message, key))
        entries = plan.ranges("entries")
        _, again = duplicates(entries)
        if again is not None:  # even where its values hold no memory to overlap (None, numbers)
            path, cls, _ = entries.owner(again)
            message = (
                "holds a state entry that the state of another parameter, or of another optimizer, holds too: "
                "resetting one would reset both, and a key dropped from it would be dropped twice"
            )
            self.problems.append(Problem(ProblemKind.ALIASED_STATE, path, cls, message))

    def _inspector_for(self, cls: type) -> LeafInspector | None:
        if cls in self._inspectors:
            return self._inspectors[cls]
        schema = _registry.schema_for(cls) if self._patch_of(cls) is None else None
        inspector = None if schema is None else LeafInspector(schema, self._plan, self.problems, self._selection)
        if inspector is not None:
            inspector.fresh_steps_known = _registry.builds_as_its_schema_says(cls)
        self._inspectors[cls] = inspector
        return inspector

    def _patch_of(self, cls: type, *, wrapper: bool = False) -> str | None:
        """Why a leaf class's built-in schema, or a wrapper class's built-in kind, does not
        apply, patched: read once a walk."""
        key = (cls, wrapper)
        if key not in self._patches:
            self._patches[key] = (_registry.patched_kind_reason if wrapper else _registry.patched_schema_reason)(cls)
        return self._patches[key]

    def _check_own_code(self, node: Node) -> None:
        """A wrapper that is a torch optimizer (a HybridDeviceOptimizer, a registered kind)
        runs its own step hooks around its inner optimizers' steps, as a leaf runs its own;
        and a wrapper of a built-in kind holding a method of its own on the instance (a
        ``step`` warming the lr up by a count of its own) may keep what its kind does not say."""
        cls = type(node.optimizer)
        hook = unknown_step_hook(node.optimizer)
        if hook is not None:
            self.problems.append(Problem(ProblemKind.UNSUPPORTED_OPTIMIZER, node.path, cls.__qualname__, hook))
        patched = self._patch_of(cls, wrapper=True)
        if patched is not None:
            self.problems.append(Problem(ProblemKind.UNKNOWN_WRAPPER, node.path, cls.__qualname__, patched))
        method = _registry.wrapper_instance_method(node.optimizer)
        if method is not None:
            message = (
                f"this {cls.__qualname__} holds its own {method} on the instance, otherwise than its class "
                f"{dotted_name(cls)}, a wrapper kind opttree knows: it may keep optimizers or state its kind does not "
                "say; set it on a subclass and register that with opttree.register_wrapper(cls, children=...)"
            )
            self.problems.append(Problem(ProblemKind.UNKNOWN_WRAPPER, node.path, cls.__qualname__, message))

    def _entering(self, node: Node) -> bool:
        """Whether ``node`` is to be visited: not where a tree built by hand nests deeper
        than a built one may (a problem, and no recursion into it). A walk after
        :meth:`refusal` adds to a plan it did not check: that plan is no longer carried out."""
        self._passed = False
        problem = self._too_deep(node)
        if problem is None:
            return True
        self.problems.append(problem)
        return False

    def visit_children(self, node: Node) -> None:
        """Record the children and the optimizers ``node`` holds, check the wrapper's own
        state, then visit runs of siblings."""
        self._passed = False  # called on its own, a walk after refusal() adds to a plan it did not check
        self._check_own_state(node)
        self._contained.extend(map(_OPTIMIZER, node.children))
        self._held.extend((node, held) for held in held_optimizers(node.optimizer, self._counts_as_optimizer))
        megatron = is_megatron_class(type(node.optimizer))
        if megatron:
            self._megatron_above.append(type(node.optimizer).__qualname__)
        try:
            with self._below():
                for siblings in sibling_groups(node):
                    self._visit_siblings(siblings)
        finally:
            if megatron:
                self._megatron_above.pop()

    def _check_own_tensors(self, node: Node) -> None:
        """A wrapper of a user's kind holding tensors in its attributes (a Lookahead's slow
        weights, at any depth its holders are searched for optimizers) that are neither
        parameters (those of the optimizers below it, and the parameters and copies the
        ``inner_params`` of the wrappers at or below it name: a model's weights under a
        mixed-precision stack), their gradients, nor state of the optimizers below it: its
        kind names only its optimizers, and a reset of them would keep those tensors,
        whatever they hold, where a fresh wrapper starts anew (a Lookahead reset so trained
        unlike a fresh one). Refused, as a leaf's are: an ``nn.Parameter`` no optimizer
        steps too, which may be a frozen weight or an EMA model's copy. Megatron's wrappers'
        own tensors are read by their kinds: of a user's subclass of one (registered, as its
        methods of its own require), only attributes Megatron's code never sets are its own
        (an EMA a ChainedOptimizer subclass keeps was kept in silence)."""
        cls = type(node.optimizer)
        if not isinstance(node, WrapperNode) or not _registry.registered_wrapper(cls):
            return
        megatrons = megatron_bases(cls)
        try:
            unknown = unknown_attribute_tensors(node.optimizer, lambda: _known_below(node), stored_attribute_names(tuple(megatrons)))
        except OptTreeError:
            return  # an inner_params function failed: the master checks report it
        for name, held in unknown:
            message = (
                f"{held}, neither parameters (a model's, or copies the optimizers below it step), their gradients, "
                "nor state of those optimizers: a reset of those would keep them, whatever they hold, where a fresh "
                "wrapper starts anew; reset its optimizers directly (their nodes in opttree.tree(wrapper)), and these "
                "tensors yourself (a model the wrapper holds is not searched: hold it, not a list of its frozen weights)"
            )
            self.problems.append(Problem(ProblemKind.UNSUPPORTED_STATE, node.path, cls.__qualname__, message, name))

    def _check_own_state(self, node: Node) -> None:
        """A wrapper that is a torch optimizer itself (a Lookahead, over the optimizer it
        steps) may keep state of its own: its kind names only the optimizers it holds,
        whose state a reset covers, so entries of its ``state`` that are not theirs (a
        HybridDeviceOptimizer's mirror its sub-optimizers') would be kept. Refused."""
        self._check_own_tensors(node)
        if not is_a(node.optimizer, torch.optim.Optimizer):
            return
        own = own_attributes(node.optimizer).get("state")  # Megatron's is a property over its inner optimizer's
        if own is None:
            return
        cls = type(node.optimizer).__qualname__
        if not isinstance(own, Mapping):
            message = f"its own state is {kind_of(own)}, expected a mapping"
            self.problems.append(Problem(ProblemKind.MALFORMED_STATE, node.path, cls, message))
            return
        if not own:
            return
        states = _states_under(node)
        if any(own is state for state in states):
            return
        theirs = set(map(object.__hash__, _all_values(states)))
        values = _values(own)
        mirrored = theirs.intersection(map(object.__hash__, values))
        if mirrored:
            self._mirrors.append((node, mirrored))
        if len(values) == len(own) and theirs.issuperset(map(object.__hash__, values)):
            return
        # an empty entry holds nothing to keep: a read of the wrapper's defaultdict made it
        kept = [entry for entry in values if object.__hash__(entry) not in theirs and not (isinstance(entry, Mapping) and not entry)]
        if not kept and len(values) == len(own):
            return
        keys = sorted({key_label(key) for entry in kept if isinstance(entry, Mapping) for key in entry})
        message = (
            f"holds state of its own ({len(kept)} of its {len(own)} entries are none of its optimizers'"
            f"{', with keys ' + ', '.join(keys) if keys else ''}), which a reset of the optimizers its kind names "
            "would keep: reset those optimizers directly, and the wrapper's own state yourself"
        )
        self.problems.append(Problem(ProblemKind.UNSUPPORTED_STATE, node.path, cls, message))

    def _visit_siblings(self, nodes: tuple[Node, ...]) -> None:
        for item in alike_runs(nodes):
            if isinstance(item, Node):
                item.accept(self)
                continue
            inspector = self._inspector_for(type(item[0].optimizer)) if self._pooling else None
            optimizers = list(map(_OPTIMIZER, item))
            pooled = inspector is not None and only_bookkeeping(optimizers) and surely_known_hooks(optimizers)
            if pooled and inspector is not None and inspector.inspect_alike(item):
                self._pooled = True  # none holds a method of its own or an optimizer beside its state
                continue
            for leaf in item:
                self.visit_leaf(leaf)

    def visit_chained(self, node: ChainedNode) -> None:
        """Check the chain's step unit, its own step hooks and a release under it, then its members."""
        if not self._entering(node):
            return
        self._check_own_code(node)
        self._check_step_unit(node)
        self._check_release(node)
        self._keep_stepped_params(node)
        self.visit_children(node)

    def visit_hybrid(self, node: HybridNode) -> None:
        """Check its own step hooks and a release under it, plan the steps its own param
        groups count, then its sub-optimizers."""
        if not self._entering(node):
            return
        self._check_own_code(node)
        self._check_release(node)
        self._check_copied_groups(node, node.optimizer, self._keep_stepped_params(node))
        self.visit_children(node)

    def _check_copied_groups(self, node: Node, optimizer: torch.optim.Optimizer, pairs: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]] | None) -> None:
        """Plan the steps a wrapper's own param groups count and check the options it
        copies into its inner optimizers' groups before each step, as
        ``HybridDeviceOptimizer`` does: of a subclass too, registered as a wrapper of
        the user's (its step is HybridDeviceOptimizer's, or calls it). ``pairs`` are its
        parameters and their copies (None where they cannot be read: reported)."""
        if pairs is None:
            return
        if self._selection.resets("step"):
            inspector = LeafInspector(_NO_STATE, self._plan, self.problems, self._selection)
            copies = {} if self._selection.tensors is None else {id(param): inner[0] for param, inner in pairs if inner}
            inspector.plan_copied_group_steps(node, optimizer, copies)
        self._check_synced_options(node, optimizer, pairs)

    def _check_synced_options(self, node: Node, optimizer: torch.optim.Optimizer, pairs: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]]) -> None:
        """``HybridDeviceOptimizer.step`` first copies its own param groups' options into
        its sub-optimizers' groups (``_sync_hdo_param_groups_to_sub_optimizers``, each
        sub-optimizer group from the group of its first parameter). An option a
        sub-optimizer's entries are built under (its schema's ``built_if``: Adam's
        ``amsgrad``) that differs there is not the one the next step uses, and the entries
        are checked against the sub-optimizer's own: refused. So is a counter a reset sets
        back (its schema's ``group_counters``) that the hybrid's group holds, but as its
        defaults hold what the counter starts as (see :func:`_copied_counter`).
        Options no entry depends on (``lr``, which a scheduler moves in the hybrid's groups
        between steps) may differ."""
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, (list, tuple)):
            return  # the hybrid's own groups are checked with its steps
        leaves = [child for child in node.children if isinstance(child, LeafNode)]
        copied = {key for group in groups if isinstance(group, Mapping) for key in group}
        watched = {cls: _watched_options(cls, self._selection.resets("step")) for cls in {type(leaf.optimizer) for leaf in leaves}}
        if all(copied.isdisjoint(options) for options in watched.values()):
            return  # as a hybrid's groups usually are: none names an option its sub-optimizers build entries under, nor a counter
        inner_of = {id(outer): inner[0] for outer, inner in pairs if inner}
        group_of = {
            id(inner_of[id(param)]): group
            for group in groups
            if isinstance(group, Mapping) and isinstance(group.get("params"), (list, tuple))
            for param in group["params"]
            if id(param) in inner_of
        }
        defaults = own_attributes(optimizer).get("defaults")
        for leaf in leaves:
            if malformed(leaf.optimizer) is None:  # else its own visit reports its containers
                self._check_copied_options(leaf, group_of, watched[type(leaf.optimizer)], defaults if isinstance(defaults, dict) else {})

    def _check_copied_options(
        self, leaf: LeafNode, group_of: Mapping[int, Mapping[str, object]], options: Mapping[str, GroupCounterStart | _Option], defaults: Mapping[str, object]
    ) -> None:
        """See :meth:`_check_synced_options`: ``group_of`` holds the hybrid's group of each
        sub-optimizer parameter, by ``id``; ``options`` the options watched in it, each an
        option entries are built under or what a counter starts as. A key the hybrid's
        group lacks is not copied."""
        cls = type(leaf.optimizer).__qualname__
        chosen = self._selection.tensors
        for sub_group in leaf.optimizer.param_groups:
            params = sub_group.get("params") if isinstance(sub_group, Mapping) else None
            hybrid_group = group_of.get(id(params[0])) if isinstance(params, (list, tuple)) and params else None
            taken = chosen is None or (isinstance(params, (list, tuple)) and any(id(param) in chosen for param in params))
            for option, start in sorted(options.items()):
                if hybrid_group is None or option not in hybrid_group:
                    continue
                ours, theirs = sub_group.get(option), hybrid_group[option]
                if not isinstance(start, _Option):
                    message = _copied_counter(option, theirs, start, defaults) if taken else None  # a group's steps the reset leaves
                elif not _same_option(ours, theirs):
                    message = (
                        f"its group option {option!r} is {shown_value(ours)} where HybridDeviceOptimizer's param group holds "
                        f"{shown_value(theirs)}, which it copies into this group at its next step: the entries cannot be "
                        "checked against the option that step uses (set the option in both, or step once first)"
                    )
                else:
                    message = None
                if message is not None:
                    self.problems.append(Problem(ProblemKind.UNSUPPORTED_STATE, leaf.path, cls, message, option))

    def _keep_stepped_params(self, node: Node) -> list[tuple[torch.Tensor, Sequence[torch.Tensor]]] | None:
        """The parameters a wrapper steps through copies or shards (a mixed-precision
        wrapper's fp16/bf16 model weights, the parameters a DistributedOptimizer shards),
        with those copies, as its inner-params function pairs them. The parameters are
        kept: history sharing their memory would zero model weights no leaf holds; so are
        copies that are no leaf's parameters (a registration naming history as the copies
        had them zeroed). None, with a problem, where the wrapper's pairs cannot be read."""
        inner_params = inner_params_of(node)
        if inner_params is None:
            return []
        cls = type(node.optimizer).__qualname__
        try:
            pairs = list(inner_params(node.optimizer, node.path))
        except OptTreeError as error:
            self.problems.append(error.problem or Problem(ProblemKind.MALFORMED_WRAPPER, node.path, cls, str(error)))
            return None
        inspector = LeafInspector(_NO_STATE, self._plan, self.problems, self._selection)
        params = [param for param, _ in pairs if isinstance(param, torch.Tensor)]  # anything else: see check_masters
        stepped = set(map(object.__hash__, tree_params(node)))  # kept by their leaves, which name them
        params += [copy for _, copies in pairs for copy in copies if isinstance(copy, torch.Tensor) and object.__hash__(copy) not in stepped]
        inspector.plan_kept(node, (node.path, cls), params, None, self._plan.state)
        grads = held_gradients(params)
        if grads:
            inspector.plan_kept(node, (node.path, cls), grads, GRADIENTS, self._plan.state)
        return pairs

    def _keep_own_tensors(self, node: WrapperNode, owned: list[tuple[str, torch.Tensor]]) -> None:
        """Record tensors a wrapper holds (its own attributes, its loss scaler's), each
        under its name, as kept memory: history sharing it would zero them."""
        inspector = LeafInspector(_NO_STATE, self._plan, self.problems, self._selection)
        owner = (node.path, type(node.optimizer).__qualname__)
        for name, tensor in owned:
            inspector.plan_kept(node, owner, [tensor], name, self._plan.state)

    def visit_wrapper(self, node: WrapperNode) -> None:
        """Check the wrapper's step unit, its own step hooks, loss scaler and a release under
        it, then its inner optimizers."""
        if not self._entering(node):
            return
        self._check_own_code(node)
        detached = detached_shards(node)
        if detached is not None:
            self.problems.append(detached)
        self._check_step_unit(node)
        self._check_release(node)
        self._check_loss_scale(node, self._selection.tensors, self._selection)
        pairs = self._keep_stepped_params(node)
        if COPIES_GROUPS.lookup(type(node.optimizer)) and isinstance(node.optimizer, torch.optim.Optimizer):
            self._check_copied_groups(node, node.optimizer, pairs)
        # Megatron's _scale_one, an FP32Optimizer's _scale: kept memory
        self._keep_own_tensors(node, [(name, value) for name, value in own_attributes(node.optimizer).items() if is_a(value, torch.Tensor)])
        self.visit_children(node)

    def _check_loss_scale(self, node: WrapperNode, chosen: AbstractSet[int] | None, counted: Selection) -> None:
        """An fp16 wrapper's loss scaler is reset with its steps: all of them, as the step
        unit check requires, so with none of its parameters ``chosen`` (by ``id``; None
        for all) it is left alone. A scaler met again (a wrapper twice in a chain, or above
        a subtree and again inside it) counts once. Its scale tensor is memory the reset
        writes or keeps, as history is: one sharing memory with a weight, or with history
        the reset zeroes, is refused; the scaler's other tensors (``min_scale``, its growth
        and backoff factors) are kept memory."""
        scaler = loss_scaler(node.optimizer)
        if scaler is None or any(scaler is seen for seen in self._scalers_seen):
            return
        self._scalers_seen.append(scaler)
        cls = type(node.optimizer).__qualname__
        planned = self._planned_scaler(node, chosen, counted)
        scale = planned.scale if planned is not None else held_scale(scaler)
        if scale is not None:
            into = self._plan.state.written if planned is not None else self._plan.state.kept_ranges
            into.extend(ranges([scale]).owned((node.path, cls, "grad_scaler")))
        others = [(f"grad_scaler.{name}", value) for name, value in own_attributes(scaler).items() if isinstance(value, torch.Tensor) and name != SCALE]
        self._keep_own_tensors(node, others)  # by name: a growth factor that is the scale tensor itself is kept memory too

    def _planned_scaler(self, node: WrapperNode, chosen: AbstractSet[int] | None, counted: Selection) -> ScalerReset | None:
        """The reset of ``node``'s loss scaler, or None where it is kept (counted where the
        reset reaches its wrapper: with ``keep_loss_scale``, or steps kept, as by a partial
        reset, ``prune`` and ``scale``) or a problem with it is reported. Whether the reset
        reaches the wrapper is decided by its parameters on every rank alike, where its
        inner params list them all (a DistributedOptimizer's shards of one parameter lie on
        some ranks only)."""
        planned = plan_scaler(node.optimizer)
        if planned is None:
            return None  # nothing to reset (a ConstantGradScaler), and nothing kept
        if self._keep_loss_scale or not self._selection.steps:
            if chosen is None or node.is_stub or _takes_any(node, chosen, counted):  # a stub follows the stack's others
                self._plan.scalers_kept += 1
            return None
        if isinstance(planned, str):
            cls = type(node.optimizer).__qualname__
            self.problems.append(Problem(ProblemKind.UNSUPPORTED_STATE, node.path, cls, planned, "grad_scaler"))
            return None
        if chosen is not None and node.is_stub:  # it holds no parameter to select: it follows the stack's other scalers
            self._stub_scalers.append(planned)
            return planned
        taken = chosen is None or _takes_any(node, chosen, counted)
        self._scalers_decided.append((node, taken))
        if not taken:
            return None
        self._plan.scalers.append(planned)
        return planned

    def _check_loss_scales(self, root: Node) -> None:
        """A Megatron stack scales its loss by one loss scaler (a ChainedOptimizer's and a
        MimoOptimizer's by their first member's), and each fp16 wrapper unscales its
        gradients by its own: a reset that resets some of the stack's scalers and keeps
        others leaves them unequal, and the gradients of the others' parameters scaled
        wrong from then on. A fresh stack's are all equal. Refused, naming both ways out."""
        decided = self._scalers_decided
        reset = [node for node, taken in decided if taken]
        if reset and len(reset) == len(decided):
            self._plan.scalers.extend(self._stub_scalers)  # a stub's, which the chain may scale its loss by, with the rest
        elif self._stub_scalers:
            self._plan.scalers_kept += len(self._stub_scalers)
        if not reset or len(reset) == len(decided):
            return
        kept = [node for node, taken in decided if not taken]
        message = (
            f"the reset takes the steps, and so the loss scalers, of {len(reset)} of the {len(decided)} fp16 wrappers "
            f"({', '.join(node.path for node in reset)}) and keeps those of the others ({', '.join(node.path for node in kept)}); "
            "the stack scales its loss by one of them and each wrapper unscales its gradients by its own, so unequal "
            "scales would scale the kept ones' gradients wrong: pass keep_loss_scale=True to keep every scaler, "
            "or select every wrapper's parameters"
        )
        path, holder = root.under if root.under is not None else (root.path, root.optimizer)
        self.problems.append(Problem(ProblemKind.PARTIAL_LOSS_SCALE, path, type(holder).__qualname__, message, "grad_scaler"))

    def _check_release(self, node: Node) -> None:
        """A release under a Megatron wrapper is refused, once, at the outermost one: an
        emptied state is one that Megatron cannot checkpoint until the next step."""
        if not self._selection.release or self._release_refused or not is_megatron_class(type(node.optimizer)):
            return
        self._release_refused = True
        message = (
            "Megatron cannot checkpoint an emptied optimizer state until the next step "
            "(DistributedOptimizer.state_dict() asserts one step over its state, and a sharded "
            "checkpoint of an empty FP32Optimizer or Float16OptimizerWithFloat16Params state fails to load): "
            "reset without release, which keeps the memory and every checkpoint path"
        )
        self.problems.append(Problem(ProblemKind.UNRELEASABLE_STATE, node.path, type(node.optimizer).__qualname__, message))

    def _check_under(self, root: Node) -> None:
        """A subtree that :func:`opttree.tree` built under a Megatron wrapper, which
        checkpoints its state whole: a release is refused, as under the whole stack, and a
        reset of steps is checked against every step unit of that wrapper's tree, and
        resets the loss scalers of the fp16 wrappers whose steps it takes (those above the
        subtree too), as a reset of the stack that selected the subtree's parameters would."""
        if root.under is None:
            self._check_factory_built(root)
            return
        selection = self._selection
        path, wrapper = root.under
        cls = type(root.optimizer).__qualname__
        if selection.release:
            message = (
                f"a subtree under {type(wrapper).__qualname__} at {path}: Megatron cannot checkpoint an emptied "
                "optimizer state until the next step; reset without release"
            )
            self.problems.append(Problem(ProblemKind.UNRELEASABLE_STATE, root.path, cls, message))
            return
        if not selection.steps:
            return
        outer = TreeBuilder(_registry.kind_for, []).build(wrapper, path)  # what it refuses outside the subtree is not the subtree's
        mine = set(map(id, tree_params(root)))
        chosen = mine if selection.tensors is None else mine & selection.tensors
        counted = _subtree_coverage(outer, root, chosen) if selection.tensors is None else EVERYTHING
        for node in tree_nodes(outer):
            if isinstance(node, WrapperNode):
                self._check_loss_scale(node, chosen, counted)
            split = _split_step_unit(node, chosen, counted)
            if split is not None:
                taken, total = split
                message = (
                    f"a subtree under {type(wrapper).__qualname__} at {path}, whose {type(node.optimizer).__qualname__} at "
                    f"{node.path} saves one step for {total} parameters, of which the reset takes {taken}: a checkpoint of "
                    "unequal steps fails to save or to load; reset all of them, or leave 'step' out of keys"
                )
                self.problems.append(Problem(ProblemKind.PARTIAL_STEP, root.path, cls, message, "step"))
                return

    def _check_factory_built(self, root: Node) -> None:
        """An optimizer that Megatron's factory built below the chain it returns (every param
        group of a leaf, or of a hybrid, holds the factory's :data:`_FACTORY_OPTIONS`), or a
        Megatron stub (built only as a chain's member), reached in a tree without passing
        that chain, sits under wrappers opttree cannot see from it: refused, for the stack,
        or the optimizer's node in its tree, to be passed instead. Without the chain, an fp16
        stack's inner optimizer kept the warmed-up loss scale and trained unlike a fresh
        stack; a release left a DistributedOptimizer that cannot save; a chain's member reset
        alone left the chain scaling its loss by one scale and unscaling by another, or a
        checkpoint that failed to load. That holds at any depth: passed alone, as a node
        built by hand, or held by a user's wrapper. The factory returns a chain (a
        ``ChainedOptimizer``, or a subclass: ``LayerWiseDistributedOptimizer``, or a user's
        registered with ``register_wrapper``), and what is below one is not refused; nor is a reset that keeps steps (``prune``, ``scale``,
        ``keys`` without ``"step"``), which touches none of those."""
        if not (self._selection.steps or self._selection.release):
            return  # history alone is its own
        nodes = [root]
        chained: set[int] | None = None  # the optimizers the tree reaches below a chain, read where one is needed
        while nodes:
            node = nodes.pop()
            if _is_chain(node) or (isinstance(node, LeafNode) and node.shared_with is not None):
                continue
            if isinstance(node, WrapperNode) and node.is_stub:
                what = "a Megatron stub (it holds no optimizer, and is built only as a member of a chain, whose loss scale it holds)"
            elif isinstance(node, (LeafNode, HybridNode)):
                groups = _readable_groups(node.optimizer)
                if not groups or not all(isinstance(group, dict) and _FACTORY_OPTIONS <= dict.keys(group) for group in groups):  # the factory's are dicts: read as one, not by a subclass's own keys()
                    continue
                chained = _below_chains(root) if chained is None else chained
                if object.__hash__(node.optimizer) in chained:
                    continue  # reached by another path below its chain too, whichever the tree met first
                what = f"its param groups are Megatron's factory's (they hold {', '.join(sorted(_FACTORY_OPTIONS))})"
            else:
                nodes.extend(reversed(node.children))
                continue
            message = (
                f"{what}: reached without the Megatron chain the factory built it under, a reset of its steps cannot "
                "see the loss scale, the steps saved as one or the checkpoints of the wrappers above it; pass the stack "
                "(params= selects this optimizer's parameters) or this optimizer's node in opttree.tree(stack) (a torch "
                "optimizer that loaded a Megatron checkpoint holds those options too: delete them from its groups, which "
                "only Megatron reads)"
            )
            self.problems.append(Problem(ProblemKind.WITHOUT_ITS_WRAPPER, node.path, type(node.optimizer).__qualname__, message))

    def _check_step_unit(self, node: Node) -> None:
        """A Megatron wrapper that saves one step for all its parameters (see
        :data:`~opttree._selection.STEP_UNITS`) fails to checkpoint unequal steps: a
        partial reset of steps must take all of its parameters that count them, or none;
        and steps already unequal (a hand-written reset of some of them) are warned of."""
        steps = unit_steps(node)
        if len(steps) > 1:
            message = (
                f"the steps it saves as one differ ({len(steps)} values, {min(steps):g} to {max(steps):g}): Megatron's "
                "checkpoint of it fails; a reset of all of its steps sets them equal"
            )
            self.problems.append(Problem(ProblemKind.UNEQUAL_STEPS, node.path, type(node.optimizer).__qualname__, message, "step"))
        chosen = self._selection.tensors
        split = _split_step_unit(node, chosen, self._selection) if chosen is not None and self._selection.steps else None
        if split is not None:
            taken, total = split
            message = (
                f"{taken} of the {total} parameters whose steps it saves as one are selected with 'step' "
                "in keys: Megatron saves one step for all of them, and a checkpoint of unequal steps fails "
                "to save or to load; select all of them, or leave 'step' out of keys"
            )
            self.problems.append(Problem(ProblemKind.PARTIAL_STEP, node.path, type(node.optimizer).__qualname__, message, "step"))

    def _check_deleted_under_megatron(self, node: LeafNode) -> None:
        """A leaf reached again, under a Megatron wrapper, whose first reach was planned
        outside any: a reset that deletes its entries is refused as under the wrapper,
        whichever path reached it first."""
        if not self._megatron_above or self._selection.release:
            return  # a release under a Megatron wrapper is refused at the wrapper
        inspector = self._inspector_for(type(node.optimizer))
        if inspector is not None and inspector.deletes_entries():
            inspector.deleted_under_megatron(node, self._megatron_above[-1])

    def visit_leaf(self, node: LeafNode) -> None:
        """Check and plan one leaf against its schema."""
        if not self._entering(node):
            return
        if node.shared_with is not None:
            self._plan.shared_leaves += 1
            self._check_deleted_under_megatron(node)
            return
        self._record_held_by(node)
        cls = type(node.optimizer)
        own_method = _registry.instance_builder(node.optimizer)
        reason = _registry.instance_builder_reason(node.optimizer, own_method) if own_method is not None else unknown_step_hook(node.optimizer)
        reason = reason or self._patch_of(cls)
        if reason is not None:
            self.problems.append(Problem(ProblemKind.UNSUPPORTED_OPTIMIZER, node.path, cls.__qualname__, reason))
            return
        inspector = self._inspector_for(cls)
        if inspector is None:
            self.problems.append(
                Problem(
                    ProblemKind.UNSUPPORTED_OPTIMIZER,
                    node.path,
                    cls.__qualname__,
                    _registry.unregistered_reason(cls),
                )
            )
            return
        inspector.megatron_above = self._megatron_above[-1] if self._megatron_above else None
        inspector.inspect(node)


_STATE_OF_LEAF = operator.attrgetter("optimizer.state")
_NO_STATE = StateSchema()
"""The schema a wrapper's own parts are planned with: its param groups' steps, the
parameters it keeps."""


def _takes_any(node: Node, chosen: AbstractSet[int], counted: Selection) -> bool:
    """Whether a reset takes any of ``node``'s parameters: as ``counted`` counts them on
    every rank alike, where it does (see :meth:`Selection.covered`)."""
    covered = counted.covered(node.optimizer)
    if covered is not None:
        return covered[0] > 0
    return any(id(p) in chosen for p in tree_params(node))


def _subtree_coverage(outer: Node, root: Node, chosen: AbstractSet[int]) -> Selection:
    """How much of each wrapper of ``outer`` that steps copies or shards the subtree
    ``root`` takes, told by the subtree's leaves, which every rank's tree holds alike, and
    not by this rank's shards (a rank may hold none of a wrapper's): all of its parameters
    where all its leaves lie in the subtree, none where none does, else some (this rank's
    count, kept between one and all but one)."""
    inside = identity_keys(cast(list[object], tree_leaves(root)))
    coverage: list[tuple[object, int, int]] = []
    for node in tree_nodes(outer):
        inner_params = inner_params_of(node)
        if inner_params is None:
            continue
        try:
            total = len({id(param) for param, _ in inner_params(node.optimizer, node.path)})
        except OptTreeError:  # its pairs cannot be read: reported where its own checks read them
            continue
        leaves = [identity_key(leaf) in inside for leaf in tree_leaves(node)]
        if all(leaves) and leaves:
            coverage.append((node.optimizer, total, total))
        elif not any(leaves):
            coverage.append((node.optimizer, 0, total))
        elif total > 1:
            local = sum(id(p) in chosen for p in tree_params(node))
            coverage.append((node.optimizer, min(max(local, 1), total - 1), total))
    return Selection(coverage=tuple(coverage))


def _split_step_unit(node: Node, chosen: frozenset[int] | set[int], selection: Selection = EVERYTHING) -> tuple[int, int] | None:
    """Where ``node`` is a Megatron step unit (see :data:`~opttree._selection.STEP_UNITS`)
    whose parameters counting steps ``chosen`` takes some but not all of: how many it
    takes, of how many."""
    counted = _unit_count(node, chosen, selection)
    if counted is None:
        return None
    taken, total = counted
    return (taken, total) if 0 < taken < total else None


def _unit_count(node: Node, chosen: frozenset[int] | set[int], selection: Selection) -> tuple[int, int] | None:
    """How many of the parameters whose steps a Megatron step unit saves as one ``chosen``
    takes, of how many; None where ``node`` is no unit. A wrapper whose parameters
    ``selection`` counts on every rank alike (see :meth:`Selection.covered`) counts so: a
    DistributedOptimizer saves one step for all of its ranks' shards. A ChainedOptimizer
    counts its members that save their steps per group too: a DistributedOptimizer's
    checkpoint writes its one step into each group, and the chain's load asserts those of
    all its members equal (``_synchronize_steps``)."""
    locations = STEP_UNITS.lookup(type(node.optimizer))
    if locations is None:
        return None
    covered = selection.covered(node.optimizer)
    if covered is not None:
        return covered
    if not isinstance(node, ChainedNode):
        params = tree_params(node, lambda leaf: _registry.step_location(type(leaf)) in locations)
        return sum(id(p) in chosen for p in params), len(params)
    taken = total = 0
    for member in node.children:
        inner = STEP_UNITS.lookup(type(member.optimizer))
        counted = _unit_count(member, chosen, selection) if inner is not None and StepLocation.PER_GROUP in inner else None
        if counted is None:
            params = tree_params(member, lambda leaf: _registry.step_location(type(leaf)) in locations)
            counted = (sum(id(p) in chosen for p in params), len(params))
        taken, total = taken + counted[0], total + counted[1]
    return taken, total


def unit_steps(node: Node) -> set[float]:
    """The distinct steps counted under ``node``, where it is a Megatron step unit (see
    :data:`~opttree._selection.STEP_UNITS`), where its leaves count them; none otherwise."""
    locations = STEP_UNITS.lookup(type(node.optimizer))
    if locations is None:
        return set()
    values: set[float] = set()
    for leaf in tree_leaves(node, lambda leaf: _registry.step_location(type(leaf)) in locations):
        if _registry.step_location(type(leaf)) is StepLocation.PER_PARAMETER:
            held = [entry.get("step") for entry in leaf.state.values()]
        else:
            held = [group.get("step") for group in leaf.param_groups]
        values.update(value for value in step_numbers(held) if value is not None)
    return values


def _states_under(node: Node) -> list[Mapping[object, object]]:
    """The ``state`` mappings of the leaves below ``node``; one that is not a mapping (which
    the leaf's own check reports) counts as holding nothing. Where every child is a leaf
    with a plain state (a hybrid's thousands of sub-optimizers), they are read at C speed."""
    if set(map(type, node.children)) == {LeafNode}:
        try:
            found = list(map(_STATE_OF_LEAF, node.children))
        except Exception:  # noqa: BLE001  # a missing attribute, or a property whose own code raises
            found = []
        if found and set(map(type, found)) <= PLAIN_STATES:
            return cast(list[Mapping[object, object]], found)
    states: list[Mapping[object, object]] = []
    pending = list(node.children)
    while pending:
        child = pending.pop()
        if isinstance(child, LeafNode):
            state = getattr(child.optimizer, "state", None)
            if isinstance(state, Mapping):
                states.append(state)
        pending.extend(child.children)
    return states


def _all_values(states: list[Mapping[object, object]]) -> list[object]:
    """The values of all ``states``: at C speed where all are plain dicts."""
    if set(map(type, states)) <= PLAIN_STATES:
        return list(chain.from_iterable(map(dict.values, cast(list[dict[object, object]], states))))
    return list(chain.from_iterable(map(_values, states)))


def _values(mapping: Mapping[object, object]) -> list[object]:
    """A mapping's values, or none where its own code fails to give them."""
    try:
        return list(mapping.values())
    except Exception:  # noqa: BLE001  # a mapping subclass's own code may raise anything
        return []


def _sharing(holders: list[tuple[str, list[StateEntry]]]) -> list[tuple[StateEntry, str]]:
    """The entries whose step tensor's memory an earlier entry's step tensor holds too."""
    seen: set[tuple[int, int]] = set()
    sharing: list[tuple[StateEntry, str]] = []
    for key, entries in holders:
        found = ranges([cast(torch.Tensor, entry[key]) for entry in entries])
        for entry, place in zip(entries, zip(found.starts, found.ends, strict=True), strict=True):
            if place in seen:
                sharing.append((entry, key))
            seen.add(place)
    return sharing


def _below_chains(root: Node) -> set[int]:
    """The identities of the optimizers ``root``'s tree reaches below a chain."""
    found: set[int] = set()
    nodes = [root]
    while nodes:
        node = nodes.pop()
        if _is_chain(node):
            found.update(map(object.__hash__, map(_OPTIMIZER, tree_nodes(node))))
        else:
            nodes.extend(node.children)
    return found


def _known_below(wrapper: Node) -> set[int]:
    """The identities of the tensors a wrapper may hold of the optimizers below it: their
    parameters, the parameters and copies the ``inner_params`` of the wrappers at or below
    it name, those tensors' gradients, and the optimizers' state. Raises the
    :class:`OptTreeError` an ``inner_params`` function fails with."""
    params: list[object] = list(tree_params(wrapper))
    for below in tree_nodes(wrapper):
        inner_params = inner_params_of(below)
        if inner_params is not None:
            params.extend(tensor for param, copies in inner_params(below.optimizer, below.path) for tensor in (param, *copies))
    weights = [param for param in params if isinstance(param, torch.Tensor)]
    return set(map(object.__hash__, chain(weights, held_gradients(weights), tensors_held(_all_values(_states_under(wrapper))))))


def _is_chain(node: Node) -> bool:
    """Whether ``node`` is a chain the factory returns: a ``ChainedOptimizer`` (or a
    subclass, a user's ``register_wrapper`` one too, whose members are its children)."""
    return isinstance(node, ChainedNode) or _registry.builtin_chain(type(node.optimizer))


_FACTORY_OPTIONS = frozenset({"is_expert_parallel", "max_lr", "min_lr"})
"""Options Megatron's ``get_megatron_optimizer`` gives every param group it makes (0.13 to
0.19), which torch's optimizers do not read."""


def _readable_groups(optimizer: object) -> list[object]:
    """``optimizer``'s param groups as its ``__dict__`` holds them, or none where they are
    not a list there (reported by the state checks)."""
    groups = own_attributes(optimizer).get("param_groups")
    return list(groups) if isinstance(groups, list) else []


class _Option(enum.Enum):
    BUILT_UNDER = "built under"
    """A watched option entries are built under (``built_if``), not a counter."""


def _watched_options(cls: type, resets_steps: bool) -> dict[str, GroupCounterStart | _Option]:
    """The group options of ``cls``'s schema that a hybrid's copy of its groups may
    spoil: those it builds entries under (``built_if``), and, where a reset takes the
    steps, its ``group_counters`` with what each starts as."""
    schema = _registry.schema_for(cls)
    if schema is None:
        return {}
    watched: dict[str, GroupCounterStart | _Option] = dict(schema.group_counters) if resets_steps else {}
    watched.update((option, _Option.BUILT_UNDER) for _, option in schema.built_if)
    return watched


def _copied_counter(name: str, held: object, start: GroupCounterStart, defaults: Mapping[str, object]) -> str | None:
    """Why a counter a HybridDeviceOptimizer's group holds spoils a reset of its
    sub-optimizer: it copies the counter over theirs at every step, so a sub-optimizer's
    set back would count on from the hybrid's. None where a fresh hybrid's group holds
    it too, as its defaults do (from its constructor's keyword arguments), as what the
    counter starts as, and it holds that still."""
    fresh = dict.get(defaults, name, _NOT_HELD) if isinstance(defaults, dict) else _NOT_HELD  # not a subclass's own get
    if start is not None and _same_option(fresh, start) and _same_option(held, start):
        return None
    return (
        f"HybridDeviceOptimizer's param group holds its counter {name!r} ({shown_value(held)}), which it copies into this "
        f"group at every step, over the counter a reset sets back (to {start!r}); a fresh one's groups hold it only as "
        "its defaults do: delete it from the hybrid's param groups, or reset with keys that leave out 'step'"
    )


_NOT_HELD = object()


def _same_option(first: object, second: object) -> bool:
    """Whether two values of a group option are one: False where they cannot be compared
    as one bool (an array or a tensor of several values, a meta tensor)."""
    if first is second:
        return True
    try:
        return bool(first == second)
    except Exception:  # noqa: BLE001  # a value's own __eq__ or __bool__ may raise anything
        return False
