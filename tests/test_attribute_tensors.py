"""Tensors a leaf holds in instance attributes beyond torch's bookkeeping: a reset keeps
them, so unless the leaf's schema names them they are refused, never kept by accident."""

from __future__ import annotations

import collections
import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch

import opttree
from tests.helpers import clone_model, model, refused_in_place, train, weights_equal
from tests.standins import TEFusedAdam

ADAMW = opttree.schema_for(torch.optim.AdamW)
assert ADAMW is not None


class WarmingAdamW(torch.optim.AdamW):
    """Warms its lr up over three steps, counted in a tensor of its own."""

    def __init__(self, params: Any, **options: Any) -> None:
        super().__init__(params, **options)
        self.warmed = torch.zeros(())
        self.peak = float(self.defaults["lr"])

    def step(self, closure: Any = None) -> Any:
        self.warmed += 1
        for group in self.param_groups:
            group["lr"] = self.peak * min(1.0, float(self.warmed) / 3)
        return super().step(closure)


class UnnamedWarmingAdamW(WarmingAdamW):
    pass


class NamedWarmingAdamW(WarmingAdamW):
    pass


opttree.register_schema(UnnamedWarmingAdamW, ADAMW)
opttree.register_schema(NamedWarmingAdamW, attrs.evolve(ADAMW, step_attributes={"warmed"}))


def test_a_counter_of_its_own_that_its_schema_does_not_name_is_refused_with_nothing_changed() -> None:
    net = model()
    optimizer = UnnamedWarmingAdamW(net.parameters(), lr=1e-2)
    train(net, optimizer, 0, 4)

    problem = refused_in_place(optimizer, "warmed", "register a schema that names them")

    assert "holds 1 tensor(s) in its attribute 'warmed' (the first at warmed)" in problem.message
    assert float(optimizer.warmed) == 4


def test_a_counter_its_schema_names_is_zeroed_in_place_and_trains_as_fresh() -> None:
    net = model()
    optimizer = NamedWarmingAdamW(net.parameters(), lr=1e-2)
    train(net, optimizer, 0, 4)
    warmed = optimizer.warmed

    opttree.reset(optimizer)

    assert optimizer.warmed is warmed and float(warmed) == 0
    twin = clone_model(net)
    fresh = NamedWarmingAdamW(twin.parameters(), lr=1e-2)
    train(net, optimizer, 4, 4)
    train(twin, fresh, 4, 4)
    assert weights_equal(net, twin)


def test_tensors_deeper_in_containers_are_found_and_named() -> None:
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train(net, optimizer, 0, 2)
    vars(optimizer)["extra"] = {"ema": [torch.zeros(3)], "note": "kept by the caller"}

    problems = opttree.validate(optimizer)

    assert [(p.kind, p.key) for p in problems] == [(opttree.ProblemKind.UNSUPPORTED_STATE, "extra")]
    with pytest.raises(opttree.UnsupportedOptimizerState, match="'extra'"):
        opttree.reset(optimizer)


def test_its_own_parameters_and_state_held_again_are_no_state_of_their_own() -> None:
    """LBFGS keeps its parameters in ``_params``; a wrapper may keep its history's tensors
    where it reads them: neither is state a reset keeps beside the state it resets."""
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train(net, optimizer, 0, 2)
    vars(optimizer)["tracked"] = list(net.parameters())
    vars(optimizer)["moments"] = tuple(entry["exp_avg"] for entry in optimizer.state.values())
    twin = clone_model(net)
    fresh = torch.optim.AdamW(twin.parameters(), lr=1e-2)

    assert not opttree.validate(optimizer)
    opttree.reset(optimizer)

    train(net, optimizer, 2, 3)
    train(twin, fresh, 2, 3)
    assert weights_equal(net, twin)
    lbfgs = torch.optim.LBFGS(net.parameters())
    assert not opttree.validate(lbfgs)


def test_a_schema_names_each_attribute_once() -> None:
    with pytest.raises(opttree.RegistrationError, match=r"attributes \['flag'\] are named in both step_attributes and known_attributes"):
        opttree.StateSchema(zero={"m"}, step=opttree.StepLocation.PER_GROUP, step_attributes={"flag"}, known_attributes={"flag"})
    with pytest.raises(opttree.RegistrationError, match=r"attributes \['masters'\] are named in both known_attributes and master_groups"):
        opttree.StateSchema(zero={"m"}, master_groups="masters", known_attributes={"masters"})
    with pytest.raises(opttree.RegistrationError, match=r"attributes \['_cache'\] are named in both known_attributes and cached"):
        opttree.StateSchema(zero={"m"}, known_attributes={"_cache"}, cached={"_cache"})


@dataclasses.dataclass
class Record:
    count: torch.Tensor


class Holder:
    def method(self) -> None:
        pass


def _holders() -> dict[str, Callable[[torch.Tensor], object]]:
    def bound(tensor: torch.Tensor) -> object:
        holder = Holder()
        vars(holder)["count"] = tensor  # an object's own attribute is not looked into: its bound method is
        return (holder.method, [tensor])

    return {
        "deque": lambda t: collections.deque([t]),
        "set": lambda t: {t},
        "frozenset": lambda t: frozenset([t]),
        "dict key": lambda t: {t: "count"},
        "namespace": lambda t: types.SimpleNamespace(count=t),
        "dataclass": lambda t: Record(t),
        "partial": lambda t: functools.partial(torch.add, t),
        "bound method": bound,
    }


@pytest.mark.parametrize("holder", sorted(_holders()))
def test_tensors_are_looked_for_where_optimizers_are(holder: str) -> None:
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train(net, optimizer, 0, 2)
    vars(optimizer)["kept"] = _holders()[holder](torch.zeros(()))

    problem = refused_in_place(optimizer, "kept", "'kept'")

    assert "(the first at kept" in problem.message


class SlottedFusedAdam(TEFusedAdam):
    """Holds TE's overflow flag and range map in slots, where no ``__dict__`` entry shows
    them; registered with TE's schema, as opttree asks of a subclass with slots of its own."""

    __slots__ = ("_dummy_overflow_buf", "dtype_to_range_map")


TE_SCHEMA = opttree.schema_for(TEFusedAdam)
assert TE_SCHEMA is not None
opttree.register_schema(SlottedFusedAdam, TE_SCHEMA)



def test_attributes_a_schema_names_are_read_from_slots_too() -> None:
    net = model()
    optimizer = SlottedFusedAdam(list(net.parameters()), lr=1e-2, capturable=True)
    assert "_dummy_overflow_buf" not in vars(optimizer)
    flag = optimizer._dummy_overflow_buf
    flag.fill_(1)  # as an overflowed last step leaves it

    opttree.reset(optimizer)

    assert int(flag) == 0
