"""Tensors a leaf holds in instance attributes beyond torch's bookkeeping: a reset keeps
them, so unless the leaf's schema names them they are refused, never kept by accident."""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any, cast

import attrs
import pytest
import torch
from megatron.core.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params, MegatronOptimizer

import opttree
from opttree import testing
from tests.helpers import clone_model, model, refused_in_place, snapshot, train, trains_as_fresh_stack, unchanged, weights_equal
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


class Lookahead:
    """Lookahead over an inner optimizer: every second step (by the inner optimizer's own
    count) the weights move halfway to slow copies it keeps, and take their place; a fresh
    one copies the weights."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        self.slow = [p.detach().clone() for group in inner.param_groups for p in group["params"]]

    def weights(self) -> list[torch.Tensor]:
        return [p for group in self.inner.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        if int(self.inner.state[self.weights()[0]]["step"]) % 2:
            return
        for slow, weight in zip(self.slow, self.weights(), strict=True):
            slow.add_(weight - slow, alpha=0.5)
            weight.copy_(slow)


def _lookahead_inner(wrapper: Lookahead) -> list[tuple[str, object]]:
    return [("inner", wrapper.inner)]


opttree.register_wrapper(Lookahead, children=_lookahead_inner)


def lookahead_over(net: torch.nn.Module) -> Lookahead:
    return Lookahead(torch.optim.AdamW(net.parameters(), lr=1e-2))


def train_lookahead(net: torch.nn.Module, wrapper: Lookahead, start: int, steps: int) -> None:
    for i in range(start, start + steps):
        wrapper.inner.zero_grad()
        torch.autograd.backward(net(torch.randn(4, 6, generator=torch.Generator().manual_seed(i))).pow(2).mean())
        wrapper.step()


def test_tensors_a_registered_wrapper_holds_beside_its_optimizers_are_refused() -> None:
    """A wrapper's kind names its optimizers: tensors it keeps of its own (Lookahead's slow
    weights) were kept through a reset, validate said nothing, and it trained unlike a
    fresh Lookahead. Refused with nothing changed, as a leaf's are; the way out the
    refusal names, its optimizer reset directly and the slow weights by hand, is exact."""
    net = model()
    wrapper = lookahead_over(net)
    train_lookahead(net, wrapper, 0, 3)
    slow, inner = [s.clone() for s in wrapper.slow], snapshot(wrapper.inner)

    problems = opttree.validate(wrapper)

    assert [(p.kind, p.path, p.key) for p in problems] == [(opttree.ProblemKind.UNSUPPORTED_STATE, "<root>", "slow")]
    assert "holds 4 tensor(s) in its attribute 'slow' (the first at slow[0])" in problems[0].message
    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"Lookahead at <root>: key 'slow': .*reset its optimizers directly"):
        opttree.reset(wrapper)
    assert unchanged(wrapper.inner, inner) and all(map(torch.equal, wrapper.slow, slow))

    twin = clone_model(net)
    opttree.reset(wrapper.inner)  # what the reset did: the slow weights kept
    fresh = lookahead_over(twin)
    train_lookahead(net, wrapper, 3, 3)
    train_lookahead(twin, fresh, 3, 3)
    assert not weights_equal(net, twin)

    twin = clone_model(net)
    opttree.reset(wrapper.inner)
    with torch.no_grad():
        for kept, weight in zip(wrapper.slow, wrapper.weights(), strict=True):
            kept.copy_(weight)
    fresh = lookahead_over(twin)
    train_lookahead(net, wrapper, 6, 3)
    train_lookahead(twin, fresh, 6, 3)
    assert weights_equal(net, twin)


class Trainer:
    """A training loop's wrapper: its optimizer, and the model's parameters and their
    gradients, kept for clipping."""

    def __init__(self, optimizer: object, params: list[torch.nn.Parameter]) -> None:
        self.optimizer = optimizer
        self.params = params
        self.grads = [p.grad for p in params if p.grad is not None]


def _trainer_optimizer(trainer: Trainer) -> list[tuple[str, object]]:
    return [("optimizer", trainer.optimizer)]


opttree.register_wrapper(Trainer, children=_trainer_optimizer)


def test_a_registered_wrapper_keeping_the_models_parameters_and_gradients_is_not_refused() -> None:
    """The parameters its optimizers step and their gradients are no state of the
    wrapper's own; nor, under a mixed-precision stack, are the model weights whose fp32
    copies its optimizers step (each was refused once the wrapper's tensors were checked).
    An ``nn.Parameter`` no optimizer steps is refused: a frozen weight cannot be told from
    an EMA model's copy, which a reset would keep."""
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train(net, optimizer, 0, 3)
    trainer = Trainer(optimizer, list(net.parameters()))
    assert trainer.grads

    assert opttree.validate(trainer) == ()
    opttree.reset(trainer)
    twin = clone_model(net)
    fresh = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    train(net, optimizer, 3, 3)
    train(twin, fresh, 3, 3)
    assert weights_equal(net, twin)

    for name in ("bf16", "dist_fp16"):
        stack = testing.build(name)
        stack.train(0, 3)
        trainer = Trainer(stack.optimizer, list(stack.model.parameters()))
        assert opttree.validate(trainer) == ()
        opttree.reset(trainer)
        assert trains_as_fresh_stack(stack, testing.build(name), 3, 3)

    averaged = Trainer(optimizer, [*net.parameters(), *copy.deepcopy(net).parameters()])  # an EMA model's weights beside them
    problems = opttree.validate(averaged)
    assert [(p.key, p.path) for p in problems] == [("params", "<root>")] and "holds 4 tensor(s) in its attribute 'params'" in problems[0].message
    with pytest.raises(opttree.UnsupportedOptimizerState, match="hold it, not a list of its frozen weights"):
        opttree.reset(averaged)


class EmaChain(ChainedOptimizer):
    """A chain keeping an average of its members' weights, moved after every step: state
    of its own, which a fresh chain starts anew."""

    ema: list[torch.Tensor]

    def step(self) -> Any:
        stepped = super().step()
        with torch.no_grad():
            for average, weight in zip(self.ema, chain_weights(self), strict=True):
                average.lerp_(weight, 0.1)
        return stepped


class LoggingFloat16(Float16OptimizerWithFloat16Params):
    """A mixed-precision wrapper with a method of its own that keeps nothing."""

    def logged_scale(self) -> float:
        return float(self.get_loss_scale())


def chain_weights(chain: ChainedOptimizer) -> list[torch.Tensor]:
    return [p for member in chain.chained_optimizers for p in cast(MegatronOptimizer, member).get_parameters()]


opttree.register_wrapper(EmaChain, children=lambda chain: [(f"chained[{i}]", m) for i, m in enumerate(chain.chained_optimizers)])
opttree.register_wrapper(LoggingFloat16, children=lambda wrapper: [("optimizer", wrapper.optimizer)])


def test_tensors_a_registered_subclass_of_a_megatron_wrapper_holds_of_its_own_are_refused() -> None:
    """A user's subclass of a Megatron wrapper, registered as its own method requires, was
    not searched for tensors (Megatron's own are read by their kinds): the average a chain
    subclass keeps was kept through a reset in silence. Its attributes that Megatron's code
    never sets on an instance are its own (not those it only reads, or sets on other
    objects: an average kept as ``data`` passed as Megatron's), refused as any registered
    wrapper's; Megatron's own tensors (the fp16 wrapper's overflow flag and unit scale, its
    groups of model weights) are not."""
    stack = testing.build("fp16")
    stack.train(0, 3)
    chain = stack.optimizer
    chain.__class__ = EmaChain
    assert isinstance(chain, EmaChain)
    chain.ema = [weight.detach().clone() for weight in chain_weights(chain)]
    leaf = cast(Float16OptimizerWithFloat16Params, chain.chained_optimizers[0]).optimizer
    assert leaf is not None
    before = snapshot(leaf)

    problems = opttree.validate(chain)

    assert [(p.kind, p.path, p.key) for p in problems] == [(opttree.ProblemKind.UNSUPPORTED_STATE, "<root>", "ema")]
    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"EmaChain at <root>: key 'ema': holds 4 tensor\(s\)"):
        opttree.reset(chain)
    assert unchanged(leaf, before)
    vars(chain)["data"] = vars(chain).pop("ema")  # a name Megatron's code sets on other objects (param.data) only
    assert [(p.kind, p.key) for p in opttree.validate(chain)] == [(opttree.ProblemKind.UNSUPPORTED_STATE, "data")]

    logged = testing.build("fp16")
    logged.train(0, 3)
    cast(ChainedOptimizer, logged.optimizer).chained_optimizers[0].__class__ = LoggingFloat16
    assert opttree.validate(logged.optimizer) == ()
    opttree.reset(logged.optimizer)
    assert trains_as_fresh_stack(logged, testing.build("fp16"), 3, 3)
