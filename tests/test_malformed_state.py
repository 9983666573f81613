"""validate and describe report malformed state instead of raising; reset refuses it
with an opttree error and changes nothing."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import TypeVar

import pytest
import torch

import opttree
from tests.helpers import model, refused_in_place, snapshot, stepped_adamw, stepped_lbfgs, train, unchanged
from tests.megatron_parts import hybrid, train_hybrid


def stepped(count: int = 4) -> torch.optim.AdamW:
    return stepped_adamw(count)


def none_entry(optimizer: torch.optim.Optimizer) -> None:
    optimizer.state[next(iter(optimizer.state))] = None


def tensor_entry(optimizer: torch.optim.Optimizer) -> None:
    optimizer.state[next(iter(optimizer.state))] = torch.ones(3)


def group_without_params(optimizer: torch.optim.Optimizer) -> None:
    del optimizer.param_groups[0]["params"]


def state_not_a_mapping(optimizer: torch.optim.Optimizer) -> None:
    optimizer.state = [1, 2]  # type: ignore[assignment]


def state_keyed_by_index(optimizer: torch.optim.Optimizer) -> None:
    optimizer.state = {0: {"exp_avg": torch.ones(3)}}  # type: ignore[assignment]


class RefusingIteration(Mapping[torch.Tensor, object]):
    """A state mapping whose own ``__iter__`` raises, as a lazily loaded one might."""

    def __init__(self, values: Mapping[torch.Tensor, object]) -> None:
        self.values_ = dict(values)

    def __getitem__(self, key: torch.Tensor) -> object:
        return self.values_[key]

    def __len__(self) -> int:
        return len(self.values_)

    def __iter__(self) -> Iterator[torch.Tensor]:
        raise RuntimeError("iteration refused")


def state_refusing_iteration(optimizer: torch.optim.Optimizer) -> None:
    optimizer.state = RefusingIteration(optimizer.state)  # type: ignore[assignment]


MALFORMED: dict[str, Callable[[torch.optim.Optimizer], None]] = {
    "none-entry": none_entry,
    "tensor-entry": tensor_entry,
    "group-without-params": group_without_params,
    "state-not-a-mapping": state_not_a_mapping,
    "state-keyed-by-index": state_keyed_by_index,
    "state-refusing-iteration": state_refusing_iteration,
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_state_is_reported_described_and_refused(name: str) -> None:
    optimizer = stepped()
    MALFORMED[name](optimizer)

    problems = opttree.validate(optimizer)
    text = opttree.describe(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizerState) as caught:
        opttree.reset(optimizer)

    assert [p.kind for p in problems] == [opttree.ProblemKind.MALFORMED_STATE]
    assert "AdamW malformed: " in text
    assert caught.value.problem == problems[0]


@pytest.mark.parametrize(("key", "named"), [("global_step", "'global_step', a str"), (7, "7, an int"), (None, "a NoneType"), (1.5, "a float")])
def test_a_state_key_that_is_not_a_tensor_is_named(key: object, named: str) -> None:
    optimizer = stepped()
    optimizer.state[key] = {"step": torch.tensor(2.0)}  # type: ignore[index]
    problems = opttree.validate(optimizer)
    assert [p.kind for p in problems] == [opttree.ProblemKind.MALFORMED_STATE]
    assert f"state is keyed by something other than tensors (by {named}: " in problems[0].message


def test_sparse_history_is_reported_and_described() -> None:
    optimizer = stepped()
    entry = next(iter(optimizer.state.values()))
    entry["exp_avg"] = entry["exp_avg"].to_sparse()

    (problem,) = opttree.validate(optimizer)

    assert problem.kind is opttree.ProblemKind.UNWRITABLE_STATE and "sparse" in problem.message
    assert "state=" in opttree.describe(optimizer)


class Entry(MutableMapping[str, object]):
    """A state entry that is a mapping but not a dict."""

    def __init__(self, values: dict[str, object]) -> None:
        self.values_ = dict(values)

    def __getitem__(self, key: str) -> object:
        return self.values_[key]

    def __setitem__(self, key: str, value: object) -> None:
        self.values_[key] = value

    def __delitem__(self, key: str) -> None:
        del self.values_[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.values_)

    def __len__(self) -> int:
        return len(self.values_)


class MappingHidingStep(Entry):
    """An entry whose ``__iter__`` passes over its step, which torch's step still reads."""

    def __iter__(self) -> Iterator[str]:
        return (key for key in self.values_ if key != "step")

    def __len__(self) -> int:
        return len(self.values_) - ("step" in self.values_)


class MappingListingNothing(Mapping[torch.Tensor, dict[str, object]]):
    """A state that lists no entries, while ``state[param]`` gives each one, as torch's step reads it."""

    def __init__(self, entries: Mapping[torch.Tensor, dict[str, object]]) -> None:
        self.entries = dict(entries)

    def __getitem__(self, param: torch.Tensor) -> dict[str, object]:
        return self.entries[param]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(())

    def __len__(self) -> int:
        return 0


def hiding_steps(optimizer: torch.optim.Optimizer) -> None:
    for param in list(optimizer.state):
        optimizer.state[param] = MappingHidingStep(optimizer.state[param])


def plain_mapping_entries(optimizer: torch.optim.Optimizer) -> None:
    for param in list(optimizer.state):
        optimizer.state[param] = Entry(optimizer.state[param])


def hiding_state(optimizer: torch.optim.Optimizer) -> None:
    optimizer.state = MappingListingNothing(optimizer.state)  # type: ignore[assignment]


MAPPINGS_NOT_DICTS = {
    "entries hiding their step": (hiding_steps, "a state entry is a MappingHidingStep, which reads its keys by its own __len__"),
    "entries showing every key": (plain_mapping_entries, "a state entry is a Entry, which reads its keys by its own __len__"),
    "a state listing no entries": (hiding_state, "state is a MappingListingNothing, which reads its entries by its own __len__"),
}


@pytest.mark.parametrize("name", MAPPINGS_NOT_DICTS)
def test_mappings_that_are_not_dicts_are_refused_as_reading_by_their_own_code(name: str) -> None:
    """A mapping that is not a dict lists its keys by its own code, which may pass over what
    torch's step reads by ``state[param]``: one hiding its step kept it (training unlike a
    fresh optimizer's) and one listing no entries was reset as a fresh optimizer's,
    changing nothing. Such mappings are refused, as dict subclasses with their own reads
    are, however they behave."""
    spoil, message = MAPPINGS_NOT_DICTS[name]
    optimizer = stepped(128)
    entries = list(optimizer.state.values())
    before = [{key: value.clone() for key, value in entry.items()} for entry in entries]
    spoil(optimizer)

    problems = opttree.validate(optimizer)
    assert [p.kind for p in problems] == [opttree.ProblemKind.MALFORMED_STATE]
    assert message in problems[0].message
    assert "AdamW" in opttree.describe(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizerState, match=f"AdamW at <root>: {message}"):
        opttree.reset(optimizer)
    assert all(torch.equal(entry[key], value) for entry, old in zip(entries, before, strict=True) for key, value in old.items())


class Unprintable:
    """A state key whose ``__repr__`` raises."""

    def __repr__(self) -> str:
        raise ValueError("no repr")


def test_an_unknown_key_that_cannot_be_printed_is_still_named() -> None:
    optimizer = stepped(2)
    next(iter(optimizer.state.values()))[Unprintable()] = torch.zeros(1)

    (problem,) = opttree.validate(optimizer)
    assert problem.kind is opttree.ProblemKind.UNSUPPORTED_STATE and problem.key == "<an Unprintable>"
    with pytest.raises(opttree.UnsupportedOptimizerState, match="key '<an Unprintable>'"):
        opttree.reset(optimizer)


K = TypeVar("K")
V = TypeVar("V")


def refusing(values: Mapping[K, V], name: str) -> dict[K, V]:
    """A dict whose own ``name`` method raises: what a lazily loaded container might do."""

    def refuse(self: object, *args: object) -> object:
        raise RuntimeError(f"{name} refused")

    cls: type[dict[K, V]] = type("Refusing", (dict,), {name: refuse})
    return cls(values)


def refuse_in_state(name: str) -> Callable[[torch.optim.Optimizer], None]:
    def apply(optimizer: torch.optim.Optimizer) -> None:
        optimizer.state = refusing(optimizer.state, name)  # type: ignore[assignment]

    return apply


def refuse_in_entry(name: str) -> Callable[[torch.optim.Optimizer], None]:
    def apply(optimizer: torch.optim.Optimizer) -> None:
        param = list(optimizer.state)[-1]
        optimizer.state[param] = refusing(optimizer.state[param], name)

    return apply


def refuse_in_group(name: str) -> Callable[[torch.optim.Optimizer], None]:
    def apply(optimizer: torch.optim.Optimizer) -> None:
        optimizer.param_groups[0] = refusing(optimizer.param_groups[0], name)

    return apply


PARTLY_BROKEN = {
    "state-__len__": refuse_in_state("__len__"),
    "entry-__getitem__": refuse_in_entry("__getitem__"),
    "entry-__iter__": refuse_in_entry("__iter__"),
    "group-__getitem__": refuse_in_group("__getitem__"),
}


@pytest.mark.parametrize("name", PARTLY_BROKEN)
def test_containers_whose_own_code_raises_are_malformed_state_alone_or_in_a_run(name: str) -> None:
    """Methods a container overrides run its own code, which may raise anywhere planning
    reads it: validate reports the leaf, reset refuses with nothing changed, describe
    describes. Alone, and as one leaf of a long run, which is first planned pooled."""
    alone = stepped()
    stack = hybrid([1 + i % 7 for i in range(12)])
    train_hybrid(stack, 0, 2)
    in_run = stack[0].cpu_optimizers[5]
    for optimizer, root in ((alone, alone), (in_run, stack[0])):
        PARTLY_BROKEN[name](optimizer)
        if root is not alone:  # the hybrid mirrors its sub-optimizers' entries, as after its next step
            stack[0]._sync_sub_optimizers_state_to_hdo()
        before = snapshot(optimizer)

        method = name.split("-")[1]
        problems = opttree.validate(root)
        with pytest.raises(opttree.UnsupportedOptimizerState, match=rf"{method} refused|reads its (entries|keys) by its own {method}"):
            opttree.reset(root)

        assert [p.kind for p in problems] == [opttree.ProblemKind.MALFORMED_STATE]
        # a state or entry that reads by its own code is refused before it is read; a group's raises where it is read
        assert f"by its own {method}" in problems[0].message or "reading its param groups or state raised RuntimeError" in problems[0].message
        assert unchanged(optimizer, before) and "AdamW" in opttree.describe(root)


@pytest.mark.parametrize("name", PARTLY_BROKEN)
def test_a_partial_reset_of_containers_whose_own_code_raises_is_refused_naming_the_leaf(name: str) -> None:
    """Choosing the state of some parameters reads the groups first: a group or state whose
    own code raises there is refused as a full reset refuses it, never raised raw."""
    optimizer = stepped()
    param = optimizer.param_groups[0]["params"][0]
    PARTLY_BROKEN[name](optimizer)
    before = snapshot(optimizer)

    method = name.split("-")[1]
    with pytest.raises(opttree.UnsupportedOptimizerState, match=rf"AdamW at <root>: (reading its param groups or state raised RuntimeError: {method} refused|.* by its own {method})"):
        opttree.reset(optimizer, params=[param])

    assert unchanged(optimizer, before)


class ReadOnlyEntry(dict[str, object]):
    """An entry that refuses to set or delete keys, as a mapping backed by a checkpoint
    file might."""

    def __setitem__(self, key: str, value: object) -> None:
        raise RuntimeError("read-only entry")

    def __delitem__(self, key: str) -> None:
        raise RuntimeError("read-only entry")


class ReadOnlyGroup(dict[str, object]):
    def __setitem__(self, key: str, value: object) -> None:
        raise RuntimeError("read-only group")


def int_steps_in_read_only_entries(optimizer: torch.optim.Optimizer) -> None:
    for param in list(optimizer.state):
        optimizer.state[param] = ReadOnlyEntry(optimizer.state[param])  # SparseAdam's int steps are set, not zeroed


def a_group_step_in_a_read_only_group(optimizer: torch.optim.Optimizer) -> None:
    optimizer.param_groups[0] = ReadOnlyGroup(optimizer.param_groups[0], step=5)


def momentum_in_read_only_entries(optimizer: torch.optim.Optimizer) -> None:
    for param in list(optimizer.state):
        optimizer.state[param] = ReadOnlyEntry(optimizer.state[param])


READ_ONLY: dict[str, tuple[Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], Callable[[torch.optim.Optimizer], None], str]] = {
    "int steps": (torch.optim.SparseAdam, int_steps_in_read_only_entries, "key 'step': a state entry is a ReadOnlyEntry"),
    "group step": (torch.optim.AdamW, a_group_step_in_a_read_only_group, "key 'step': param group 0 is a ReadOnlyGroup"),
    "dropped key": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), momentum_in_read_only_entries, "key 'momentum_buffer': a state entry"),
}


@pytest.mark.parametrize("name", READ_ONLY)
def test_keys_of_containers_that_write_by_their_own_code_are_refused_before_any_write(name: str) -> None:
    """A reset zeroes history, then sets and deletes keys: a container whose own
    ``__setitem__`` or ``__delitem__`` may raise is refused while planning, not half-way."""
    build, spoil, message = READ_ONLY[name]
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    optimizer = build(params)
    for param in params:
        param.grad = torch.ones(4).to_sparse() if isinstance(optimizer, torch.optim.SparseAdam) else torch.ones(4)
    optimizer.step()
    spoil(optimizer)
    before = snapshot(optimizer)

    (problem,) = opttree.validate(optimizer)
    with pytest.raises(opttree.UnsupportedOptimizerState, match=f"{message}.*sets and deletes keys by its own code"):
        opttree.reset(optimizer)

    assert problem.kind is opttree.ProblemKind.UNSUPPORTED_STATE
    assert unchanged(optimizer, before)


def test_an_entry_class_patched_after_a_reset_it_passed_is_refused_by_the_next() -> None:
    """Whether a class sets and deletes keys as a dict does is read afresh, not kept from
    the first reset: a ``__delitem__`` set on it later is refused while planning, where the
    reset raised it half-way."""

    class PatchedLater(dict[str, object]):
        pass

    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    train(net, optimizer, 0, 2)
    for param in list(optimizer.state):
        optimizer.state[param] = PatchedLater(optimizer.state[param])
    opttree.reset(optimizer)
    train(net, optimizer, 2, 2)
    setattr(PatchedLater, "__delitem__", ReadOnlyEntry.__delitem__)

    refused_in_place(optimizer, "momentum_buffer", "PatchedLater, which sets and deletes keys by its own code")


class ReadOnlyState(defaultdict[torch.Tensor, dict[str, object]]):
    """torch's defaultdict(dict), but refusing to set or delete entries."""

    def __setitem__(self, key: torch.Tensor, value: dict[str, object]) -> None:
        raise RuntimeError("read-only state")

    def __delitem__(self, key: torch.Tensor) -> None:
        raise RuntimeError("read-only state")


def test_a_release_from_a_state_that_deletes_by_its_own_code_is_refused() -> None:
    optimizer = stepped(3)
    optimizer.state = ReadOnlyState(dict, optimizer.state)
    count = len(optimizer.state)

    with pytest.raises(opttree.ReleaseRefused, match="its state is a ReadOnlyState, which sets and deletes keys by its own code"):
        opttree.reset(optimizer, release=True)

    assert len(optimizer.state) == count


def test_sparse_momentum_is_described_in_the_bytes_a_reset_reports() -> None:
    """SGD over a sparse embedding keeps a sparse momentum buffer: its indices and values,
    not its dense size, as the reset that drops it reports."""
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    optimizer = torch.optim.SGD(embedding.parameters(), lr=0.1, momentum=0.9)
    for i in range(3):
        optimizer.zero_grad()
        torch.autograd.backward(embedding(torch.tensor([i, 3 * i + 1])).pow(2).sum())
        optimizer.step()
    buffer = optimizer.state[embedding.weight]["momentum_buffer"]
    held = buffer._indices().nbytes + buffer._values().nbytes
    assert held < buffer.numel() * buffer.element_size()

    text = opttree.describe(optimizer)
    report = opttree.reset(optimizer)

    assert f"state={held} B" in text and report.bytes_reset == held


def test_empty_entries_a_read_made_in_a_hybrids_own_state_hold_nothing_to_keep() -> None:
    """``HybridDeviceOptimizer.state`` is a defaultdict that mirrors its sub-optimizers'
    entries: reading it for a tensor it holds no state for (monitoring code asking for
    ``exp_avg``) leaves an empty entry, which holds nothing a reset would keep."""
    stack = hybrid([2, 3, 4])
    train_hybrid(stack, 0, 2)
    optimizer = stack[0]
    assert optimizer.state[torch.zeros(1)].get("exp_avg") is None

    assert opttree.validate(optimizer) == ()
    assert opttree.reset(optimizer).tensors_zeroed == 6

    optimizer.state[torch.zeros(1)]["exp_avg"] = torch.ones(1)  # an entry that holds something is its own
    assert [p.kind for p in opttree.validate(optimizer)] == [opttree.ProblemKind.UNSUPPORTED_STATE]


class EmptyLooking(defaultdict):  # type: ignore[type-arg]
    """A state that says it is empty: torch's step reads ``state[param]`` all the same."""

    def __len__(self) -> int:
        return 0


class HidingStep(dict[str, object]):
    """An entry whose iteration leaves out the step it holds."""

    def __iter__(self) -> Iterator[str]:
        return (key for key in dict.__iter__(self) if key != "step")


@pytest.mark.parametrize("hide", ["state", "entry"])
def test_a_state_or_entry_that_hides_what_it_holds_from_its_reads_is_refused(hide: str) -> None:
    """A dict subclass reading its keys by code of its own: a state whose ``__len__`` said
    0 was taken for a fresh optimizer's and nothing reset; an entry whose ``__iter__`` left
    out its step kept it, with the history zeroed. Refused, with nothing changed."""
    optimizer = stepped()
    if hide == "state":
        optimizer.state = EmptyLooking(dict, optimizer.state)
    else:
        param = next(iter(optimizer.state))
        optimizer.state[param] = HidingStep(optimizer.state[param])
    before = snapshot(optimizer)

    (problem,) = opttree.validate(optimizer)
    assert problem.kind is opttree.ProblemKind.MALFORMED_STATE and "by its own" in problem.message
    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"reads its (entries by its own __len__|keys by its own __iter__)"):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)


def test_a_plain_dict_state_without_an_entry_for_a_parameter_is_a_warning() -> None:
    """Code that rebuilds ``optimizer.state`` by a comprehension leaves a plain dict: torch's
    step then raises KeyError for a parameter without an entry once it has a gradient,
    where a fresh optimizer's defaultdict builds one. The reset leaves that as it finds it
    (the step raises with or without it), so it is a warning, not a refusal."""
    net = model()
    optimizer = torch.optim.AdamW(net.parameters())
    frozen = list(net.parameters())[-1]
    frozen.requires_grad_(False)
    train(net, optimizer, 0, 2)
    optimizer.state = dict(optimizer.state)  # type: ignore[assignment]

    (problem,) = opttree.validate(optimizer)
    assert (problem.kind, problem.severity) == (opttree.ProblemKind.EMPTY_STATE, opttree.Severity.WARNING)
    assert "holds no entry for 1 of the 4 parameters its step reads one for" in problem.message and "KeyError" in problem.message
    assert opttree.reset(optimizer).tensors_zeroed == 6

    frozen.requires_grad_(True)
    with pytest.raises(KeyError):
        train(net, optimizer, 2, 1)


def test_a_plain_dict_state_with_every_entry_is_no_problem() -> None:
    optimizer = stepped()
    optimizer.state = dict(optimizer.state)  # type: ignore[assignment]

    assert opttree.validate(optimizer) == ()


def test_a_plain_dict_state_in_a_pooled_run_is_warned_of_at_its_leaf() -> None:
    stack = hybrid([1 + i % 7 for i in range(40)])
    train_hybrid(stack, 0, 2)
    subs: list[torch.optim.Optimizer] = stack[0].cpu_optimizers
    del stack[0].state[stack[1][17]]  # the wrapper's mirror of its entries
    subs[17].state = {}  # type: ignore[assignment]
    subs[18].state = dict(subs[18].state)  # type: ignore[assignment]

    problems = opttree.validate(stack[0])

    assert [(p.kind, p.path) for p in problems] == [(opttree.ProblemKind.EMPTY_STATE, "sub_optimizers[17]")]
    assert "no entry for 1 of the 1 parameters" in problems[0].message


def test_a_plain_dict_state_of_an_optimizer_keeping_one_state_under_its_first_parameter_is_no_problem() -> None:
    """LBFGS keeps its state under its first parameter only (``indivisible``) and reads
    no other entry: a plain dict holding that one is what its step needs."""
    net, optimizer = stepped_lbfgs()
    optimizer.state = dict(optimizer.state)  # type: ignore[assignment]
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))

    def closure() -> float:
        optimizer.zero_grad()
        torch.autograd.backward(net(x).pow(2).mean())
        return 0.0

    assert len(optimizer.state) == 1 < len(list(net.parameters()))
    assert opttree.validate(optimizer) == ()
    optimizer.step(closure)
