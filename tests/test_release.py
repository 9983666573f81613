"""``reset(..., release=True)``: state entries deleted to free their memory, exact where the
optimizer builds them again, and refused, with nothing changed, everywhere else.

Exactness per class is proven in the catalogue tests (torch.optim and emerging-optimizers,
each with ``release=True``); here are what is freed, the selection, and the refusals,
including both sides of the refusal under Megatron's wrappers: Megatron itself cannot
checkpoint an emptied state.
"""

from __future__ import annotations

import collections
import gc
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import opttree
from opttree import testing
from tests import helpers, megatron_parts
from tests.helpers import clone_model, model, on_one_step, train, weights_equal
from tests.test_checkpoints import fresh_like, load, save


def stepped_adamw() -> tuple[torch.nn.Module, torch.optim.AdamW]:
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train(net, optimizer, 0, 3)
    return net, optimizer


def tensors_of(optimizer: torch.optim.Optimizer) -> dict[tuple[int, str], torch.Tensor]:
    return {(i, k): v.clone() for i, e in enumerate(optimizer.state.values()) for k, v in e.items() if isinstance(v, torch.Tensor)}


def unchanged(optimizer: torch.optim.Optimizer, before: dict[tuple[int, str], torch.Tensor]) -> bool:
    return tensors_of(optimizer).keys() == before.keys() and all(torch.equal(v, before[k]) for k, v in tensors_of(optimizer).items())


def test_released_memory_is_freed_and_training_equals_a_fresh_optimizer() -> None:
    net, optimizer = stepped_adamw()
    history = [weakref.ref(v) for e in optimizer.state.values() for v in e.values()]
    expected = sum(v.numel() * v.element_size() for e in optimizer.state.values() for v in e.values())
    twin = clone_model(net)
    fresh = torch.optim.AdamW(twin.parameters(), lr=1e-2)

    report = opttree.reset(optimizer, release=True)
    gc.collect()

    assert report.entries_released == 4 and report.bytes_released == expected and report.tensors_zeroed == 0
    assert "released 4 state entries" in str(report) and report.to_dict()["bytes_released"] == expected
    assert not optimizer.state and all(ref() is None for ref in history)
    train(net, optimizer, 3, 3)
    train(twin, fresh, 3, 3)
    assert weights_equal(net, twin)


@pytest.mark.parametrize("share", [lambda step: step, lambda step: step.view(())], ids=["one-tensor", "views-of-one-tensor"])
def test_a_step_tensor_several_entries_share_is_released_once(share: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """The report counts memory, not the entries holding it: one step tensor for three
    parameters (Megatron's CPU load path), or views of its one memory, is 4 bytes, as
    ``steps`` counts it one step."""
    optimizer = helpers.stepped_adamw(3, numel=3)
    on_one_step(optimizer, share)

    report = opttree.reset(optimizer, release=True)

    assert report.entries_released == 3 and report.bytes_released == 3 * (12 + 12) + 4


def test_a_release_after_resets_frees_the_tensors() -> None:
    """Nothing of the resets before it holds the tensors a release deletes."""
    params = [torch.nn.Parameter(torch.ones(8)) for _ in range(100)]
    optimizer = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    opttree.reset(optimizer)
    assert opttree.reset(optimizer).tensors_zeroed == 200
    history = [weakref.ref(v) for e in optimizer.state.values() for v in e.values()]

    assert opttree.reset(optimizer, release=True).entries_released == 100
    gc.collect()

    assert all(ref() is None for ref in history)


def test_a_release_of_some_parameters_deletes_only_their_entries() -> None:
    net, optimizer = stepped_adamw()
    first, *rest = net.parameters()

    report = opttree.reset(optimizer, params=[first], release=True)

    assert report.entries_released == 1
    assert first not in optimizer.state and all(p in optimizer.state for p in rest)
    assert all(optimizer.state[p]["exp_avg"].any() for p in rest)


def test_release_with_keys_is_refused_with_nothing_changed() -> None:
    _, optimizer = stepped_adamw()
    before = tensors_of(optimizer)
    with pytest.raises(opttree.ReleaseRefused, match="leave keys out"):
        opttree.reset(optimizer, keys=["exp_avg"], release=True)
    assert unchanged(optimizer, before)


def test_entries_that_keep_state_are_not_released() -> None:
    net, optimizer = stepped_adamw()
    param = next(iter(net.parameters()))
    optimizer.state[param]["master_param"] = param.detach().float().clone()
    before = tensors_of(optimizer)

    with pytest.raises(opttree.ReleaseRefused, match="deleting its entry would lose it") as raised:
        opttree.reset(optimizer, release=True)

    assert raised.value.problem is not None and raised.value.problem.key == "master_param"
    assert unchanged(optimizer, before)
    assert opttree.reset(optimizer).tensors_kept == 1  # a reset in place keeps it, as ever


def test_capturable_optimizers_are_not_released() -> None:
    _, optimizer = stepped_adamw()
    optimizer.param_groups[0]["capturable"] = True  # as on a GPU, where CUDA graphs capture addresses
    before = tensors_of(optimizer)
    with pytest.raises(opttree.ReleaseRefused, match="capturable"):
        opttree.reset(optimizer, release=True)
    assert unchanged(optimizer, before)


def test_a_users_registered_wrapper_allows_a_release() -> None:
    from tests.test_registration import LoraChain

    _, optimizer = stepped_adamw()
    report = opttree.reset(LoraChain({"a": optimizer}), release=True)
    assert report.entries_released == 4 and not optimizer.state


class MirroringWrapper(torch.optim.Optimizer):
    """A registered wrapper that steps an inner Adam and keeps its entries in its own
    ``state`` after each step (the same dicts), as HybridDeviceOptimizer mirrors its
    sub-optimizers'; a load puts them back into the inner optimizer."""

    def __init__(self, params: list[torch.nn.Parameter], inner: Callable[..., torch.optim.Optimizer] = torch.optim.Adam) -> None:
        super().__init__(params, {"lr": 1e-2})
        self.inner = inner(params, lr=1e-2)
        self.param_groups = self.inner.param_groups
        self.register_load_state_dict_post_hook(MirroringWrapper._push)

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        self.inner.step(closure)
        self.state = collections.defaultdict(dict, self.inner.state)

    @staticmethod
    def _push(wrapper: torch.optim.Optimizer) -> None:
        assert isinstance(wrapper, MirroringWrapper)
        wrapper.inner.state = collections.defaultdict(dict, wrapper.state)


opttree.register_wrapper(MirroringWrapper, children=lambda wrapper: [("inner", wrapper.inner)])


@pytest.mark.parametrize(("inner", "release"), [(torch.optim.Adam, True), (torch.optim.Rprop, False)], ids=["release", "rprop"])
def test_a_deletion_of_entries_under_a_wrapper_mirroring_them_is_refused_with_nothing_changed(
    inner: type[torch.optim.Optimizer], release: bool
) -> None:
    """Deleted from the inner optimizer only (by ``release=True``, or by any reset of an
    Rprop, whose entries start from its group's values), the entries lived on in the
    mirror: their memory was not freed, and a checkpoint saved right after resumed the
    old history."""
    net = model()
    wrapper = MirroringWrapper(list(net.parameters()), inner)
    train(net, wrapper, 0, 3)
    entries = len(wrapper.inner.state)

    with pytest.raises(opttree.ReleaseRefused, match="a mirror of them"):
        opttree.reset(wrapper, release=release)
    assert len(wrapper.inner.state) == entries
    if inner is torch.optim.Adam:
        opttree.reset(wrapper)  # in place, the mirror's entries are the ones reset
        assert all(not value.any() for entry in wrapper.state.values() for value in entry.values())


@pytest.mark.parametrize("name", [n for n in ("fp32", "bf16", "dist_bf16", "moe", "offload_0.75") if n in testing.available()])
def test_under_megatron_wrappers_a_release_is_refused_with_nothing_changed(name: str) -> None:
    stack = testing.build(name)
    stack.train(0, 2)
    before = [tensors_of(leaf) for leaf in stack.leaves()]

    with pytest.raises(opttree.ReleaseRefused, match="Megatron cannot checkpoint an emptied optimizer state") as raised:
        opttree.reset(stack.optimizer, release=True)

    assert raised.value.problem is not None and raised.value.problem.path == "<root>"
    assert all(unchanged(leaf, b) for leaf, b in zip(stack.leaves(), before, strict=True))


@pytest.mark.skipif("dist_bf16" not in testing.available(), reason="needs the dist_bf16 recipe")
def test_a_users_registered_subclass_of_a_megatron_wrapper_still_refuses_a_release() -> None:
    """Registering a wrapper kind for a subclass of Megatron's (as ``UnknownWrapper``
    advises for unknown ones) does not make its checkpoints Megatron's no longer."""
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    class LoggingDistributedOptimizer(DistributedOptimizer):
        """A user's subclass with Megatron's layout."""

    def inner(wrapper: object) -> list[tuple[str, object]]:
        assert isinstance(wrapper, DistributedOptimizer)
        return [("optimizer", wrapper.optimizer)]

    opttree.register_wrapper(LoggingDistributedOptimizer, children=inner)
    stack = testing.build("dist_bf16")
    stack.train(0, 2)
    root = stack.optimizer
    distributed = root.chained_optimizers[0] if isinstance(root, ChainedOptimizer) else root
    assert isinstance(distributed, DistributedOptimizer)
    distributed.__class__ = LoggingDistributedOptimizer
    before = [tensors_of(leaf) for leaf in stack.leaves()]

    with pytest.raises(opttree.ReleaseRefused, match="Megatron cannot checkpoint an emptied optimizer state"):
        opttree.reset(root, release=True)
    with pytest.raises(opttree.UnsupportedOptimizer, match="reached without the Megatron chain the factory built it under"):
        opttree.reset(distributed, release=True)  # the chain's member alone

    assert all(unchanged(leaf, b) for leaf, b in zip(stack.leaves(), before, strict=True))


def test_megatron_itself_cannot_checkpoint_an_emptied_state(tmp_path: Path) -> None:
    """The other side of the refusal: the state a release would leave, built by hand."""
    stack = testing.build("fp32")
    stack.train(0, 2)
    for leaf in stack.leaves():
        leaf.state.clear()
    save(stack, tmp_path, with_opttree=False)
    with pytest.raises(CheckpointException, match="not in state dict"):
        load(fresh_like(stack), tmp_path, with_opttree=True)
    with pytest.raises(opttree.UnsupportedCheckpoint, match="holds none of the exp_avg, exp_avg_sq it builds with every entry"):
        save(stack, tmp_path, with_opttree=True)  # opttree's save refuses to write it

    distributed = testing.build("dist_bf16")
    distributed.train(0, 2)
    for leaf in distributed.leaves():
        leaf.state.clear()
    with distributed.device, pytest.raises(AssertionError):
        distributed.optimizer.state_dict()


class Pair:
    """A wrapper of the user's own, over two optimizers (Megatron's refuse a release)."""

    def __init__(self, first: torch.optim.Optimizer, second: torch.optim.Optimizer) -> None:
        self.first, self.second = first, second


opttree.register_wrapper(Pair, children=lambda pair: [("first", pair.first), ("second", pair.second)] if isinstance(pair, Pair) else [])


def test_a_release_one_leaf_refuses_is_refused_before_any_other_leaf_is_released() -> None:
    first, second = stepped_adamw()[1], stepped_adamw()[1]
    second.state = dict(second.state)  # type: ignore[assignment]  # not torch's defaultdict(dict)

    with pytest.raises(opttree.ReleaseRefused, match="second: its state is a dict, not torch's defaultdict"):
        opttree.reset(Pair(first, second), release=True)
    assert len(first.state) > 0


def test_a_release_from_a_plain_dict_state_is_refused() -> None:
    """torch's optimizers build a missing entry because their state is a defaultdict(dict):
    from a plain dict, the next step would raise KeyError for each released entry."""
    net = model()
    optimizer = torch.optim.AdamW(net.parameters())
    train(net, optimizer, 0, 2)
    optimizer.state = dict(optimizer.state)  # type: ignore[assignment]  # as a loader may leave it
    count = len(optimizer.state)

    with pytest.raises(opttree.ReleaseRefused, match="its state is a dict, not torch's defaultdict\\(dict\\)"):
        opttree.reset(optimizer, release=True)

    assert len(optimizer.state) == count
    assert opttree.reset(optimizer).tensors_zeroed == 2 * count


class _StrictState(collections.defaultdict[torch.Tensor, dict[str, object]]):
    """A defaultdict(dict) whose own ``__missing__`` raises, as a state that must hold
    every parameter's entry might."""

    def __missing__(self, key: torch.Tensor) -> dict[str, object]:
        msg = "no state for this parameter"
        raise KeyError(msg)


def test_a_release_from_a_defaultdict_that_does_not_build_entries_is_refused() -> None:
    """A defaultdict(dict) whose subclass's ``__missing__`` does not build an empty entry
    would raise on the next step for each released entry: refused, with nothing deleted."""
    net = model()
    optimizer = torch.optim.AdamW(net.parameters())
    train(net, optimizer, 0, 2)
    strict = _StrictState(dict)
    strict.update(optimizer.state)
    optimizer.state = strict
    count = len(optimizer.state)

    with pytest.raises(opttree.ReleaseRefused, match="its state is a _StrictState, not torch's defaultdict\\(dict\\)"):
        opttree.reset(optimizer, release=True)

    assert len(optimizer.state) == count
    train(net, optimizer, 2, 3)  # each entry still there: the step reads them all


@pytest.mark.usefixtures("process_group")
def test_an_rprop_under_a_megatron_wrapper_is_refused_rather_than_emptied() -> None:
    """Its entries start from the lr at its first step, so a reset deletes them, and
    Megatron cannot checkpoint an emptied state until the next step."""
    net = model()
    optimizer = torch.optim.Rprop(net.parameters(), lr=0.01)
    train(net, optimizer, 0, 2)
    wrapper = megatron_parts.fp32(optimizer)
    count = len(optimizer.state)

    with pytest.raises(opttree.ReleaseRefused, match="Rprop at optimizer: its entries start from its group's values .* under a FP32Optimizer"):
        opttree.reset(wrapper)
    with pytest.raises(opttree.ReleaseRefused, match="Rprop at optimizer: its entries start from its group's values .* under a FP32Optimizer"):
        opttree.reset(opttree.tree(wrapper).children[0])  # the subtree, as the tree built it

    assert len(optimizer.state) == count


class PathsToOne:
    """A wrapper of the user's naming one optimizer at two paths: directly, and inside a stack."""

    def __init__(self, named: list[tuple[str, object]]) -> None:
        self.named = named


opttree.register_wrapper(PathsToOne, children=lambda wrapper: list(wrapper.named))


@pytest.mark.usefixtures("process_group")
def test_an_rprop_reached_first_outside_a_megatron_wrapper_and_again_under_one_is_refused() -> None:
    """Its entries, which a reset deletes, were checked where the tree first reached it:
    reached directly first, then under an FP32Optimizer, the reset deleted them and left
    a state Megatron cannot checkpoint; reached in the other order, it was refused.
    Refused either way, with nothing changed."""
    net = model()
    optimizer = torch.optim.Rprop(net.parameters(), lr=0.01)
    train(net, optimizer, 0, 2)
    stack = megatron_parts.chained([megatron_parts.fp32(optimizer)])
    count = len(optimizer.state)

    for named in ([("direct", optimizer), ("stack", stack)], [("stack", stack), ("direct", optimizer)]):
        wrapper = PathsToOne(named)
        assert [p.kind for p in opttree.validate(wrapper)] == [opttree.ProblemKind.UNRELEASABLE_STATE]
        with pytest.raises(opttree.ReleaseRefused, match=r"Rprop at stack\.chained\[0\]\.optimizer: its entries start from its group's values .* under a FP32Optimizer"):
            opttree.reset(wrapper)
    assert len(optimizer.state) == count


def test_an_rprop_whose_entries_cannot_be_deleted_is_refused_saying_why_a_reset_would_delete_them() -> None:
    net = model()
    optimizer = torch.optim.Rprop(net.parameters(), lr=0.01)
    train(net, optimizer, 0, 2)
    optimizer.state = dict(optimizer.state)  # type: ignore[assignment]  # as a loader may leave it
    count = len(optimizer.state)

    with pytest.raises(opttree.ReleaseRefused, match="its state is a dict, .*a reset deletes its entries, .*cannot be reset exactly"):
        opttree.reset(optimizer)

    assert len(optimizer.state) == count
