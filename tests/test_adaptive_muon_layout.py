"""History whose shape depends on the optimizer's own settings (``StateSchema.shape_with``).

emerging-optimizers' AdaptiveMuon builds its ``moment2_buffer`` by the instance's
``moment2_method``: as its parameter (``adamuon``), one value per row or column
(``normuon``), or one value (``namo``), in its parameter's dtype. Torch's
``load_state_dict`` takes a checkpoint of another mode as it is, where a fresh optimizer
builds it otherwise: zeroed in place, the next step raises (or trains on a layout no fresh
optimizer has). Refused, with nothing changed; a state of its own mode resets exactly.

The schema language is shown first on a home-made optimizer, in both lanes.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import cast

import pytest
import torch

import opttree
from opttree import testing
from tests.helpers import HomeMade, refused_in_place, snapshot, unchanged

Shape = tuple[int, ...]


class Scaled(HomeMade):
    """A home-made adaptive optimizer: its second moment ``v`` is per element, or per row
    where the instance's ``rows`` is set, as AdaptiveMuon's is by its ``moment2_method``."""

    def __init__(self, params: object, lr: float = 1e-2, *, rows: bool = False) -> None:
        super().__init__(params, lr)
        self.rows = rows

    def build(self, state: dict[str, torch.Tensor], p: torch.Tensor) -> None:
        state["v"] = torch.zeros_like(p[..., :1] if self.rows else p)

    def update(self, state: dict[str, torch.Tensor], p: torch.Tensor, lr: float) -> None:
        grad = cast(torch.Tensor, p.grad)
        state["v"].mul_(0.9).add_(grad.square().mean(-1, keepdim=True) if self.rows else grad.square(), alpha=0.1)
        p.sub_(grad / (state["v"].sqrt() + 1e-8), alpha=lr)


def _second_moment(optimizer: torch.optim.Optimizer, shape: Shape) -> Shape:
    """What :class:`Scaled` builds ``v`` in, by its ``rows``."""
    assert isinstance(optimizer, Scaled)
    return (*shape[:-1], 1) if optimizer.rows else shape


SCALED = opttree.StateSchema(zero={"v"}, shape_with={"v": _second_moment}, always_built={"v"}, rebuilds_missing=True)
opttree.register_schema(Scaled, SCALED)


def grads(k: int, shapes: list[Shape]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + k)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def train(optimizer: torch.optim.Optimizer, steps: range) -> None:
    """Step ``k`` sees the same gradients in every run."""
    params: list[torch.Tensor] = [p for group in optimizer.param_groups for p in group["params"]]
    for k in steps:
        for p, grad in zip(params, grads(k, [tuple(p.shape) for p in params]), strict=True):
            p.grad = grad
        optimizer.step()


def trains_as_fresh(optimizer: torch.optim.Optimizer, build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], steps: range) -> bool:
    """Whether ``optimizer`` trains as ``build`` builds a fresh one over copies of its weights."""
    params: list[torch.Tensor] = [p for group in optimizer.param_groups for p in group["params"]]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = build(twins)
    train(optimizer, steps)
    train(fresh, steps)
    return all(torch.equal(a, b) for a, b in zip(params, twins, strict=True))


def scaled(rows: bool) -> Scaled:
    torch.manual_seed(0)
    optimizer = Scaled([torch.nn.Parameter(torch.rand(3, 2)), torch.nn.Parameter(torch.rand(2, 5))], rows=rows)
    train(optimizer, range(2))
    return optimizer


@pytest.mark.parametrize("rows", [False, True], ids=["elements", "rows"])
def test_history_shaped_by_the_optimizers_settings_resets_exactly(rows: bool) -> None:
    optimizer = scaled(rows)
    built = [entry["v"].shape for entry in optimizer.state.values()]
    params: list[torch.Tensor] = optimizer.param_groups[0]["params"]
    assert [SCALED.built_shape("v", tuple(p.shape), optimizer) for p in params] == built == ([(3, 1), (2, 1)] if rows else [(3, 2), (2, 5)])
    assert SCALED.shaped == SCALED.built_like_param == {"v"} and SCALED.shape_field("v") == "shape_with"
    with pytest.raises(TypeError, match="shaped by its optimizer's settings"):
        SCALED.built_shape("v", (3, 2))
    assert opttree.validate(optimizer) == ()

    assert opttree.reset(optimizer).tensors_zeroed == 2

    assert trains_as_fresh(optimizer, lambda ps: Scaled(ps, rows=rows), range(2, 5))


def test_history_of_other_settings_loaded_by_torch_is_refused_with_nothing_changed() -> None:
    """A checkpoint of a per-row optimizer loaded into a per-element one: torch takes it,
    and the next step raises; opttree reports it and refuses to reset it."""
    saved = scaled(rows=True).state_dict()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.rand(3, 2)), torch.nn.Parameter(torch.rand(2, 5))]
    optimizer, torchs = Scaled(params), Scaled([torch.nn.Parameter(p.detach().clone()) for p in params])
    optimizer.load_state_dict(saved)
    torchs.load_state_dict(copy.deepcopy(saved))

    reason = (
        r"key 'v': history of shape \(3, 1\) float32 where its parameter is shape \(3, 2\) float32 \(built as shape \(3, 2\) "
        r"float32 for it; 2 of 2 such\): .*or its optimizer's settings that shape it changed"
    )
    refused_in_place(optimizer, "v", reason)
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        train(torchs, range(2, 3))
    opttree.reset(optimizer, release=True)  # the optimizer builds it again, as its settings are now
    assert trains_as_fresh(optimizer, Scaled, range(2, 4))


def _raises(optimizer: torch.optim.Optimizer, shape: Shape) -> Shape:
    raise KeyError("rank")


def _gives_a_str(optimizer: torch.optim.Optimizer, shape: Shape) -> Shape:
    return "wide"  # type: ignore[return-value]  # as an untyped function may


def _gives_none(optimizer: torch.optim.Optimizer, shape: Shape) -> Shape:
    return None  # type: ignore[return-value]  # as an untyped function may


@pytest.mark.parametrize(
    ("function", "reason"),
    [
        (_raises, "its schema's shape_with raised KeyError: 'rank'"),
        (_gives_a_str, "its schema's shape_with raised TypeError: torch.Size() takes an iterable of 'int' (item 0 is 'str')"),
        (_gives_none, "its schema's shape_with raised TypeError: 'NoneType' object is not iterable"),
    ],
    ids=["raises", "gives-a-str", "gives-none"],
)
def test_a_shape_with_that_fails_is_reported_at_its_key(function: Callable[[torch.optim.Optimizer, Shape], Shape], reason: str) -> None:
    class Failing(Scaled):
        pass

    opttree.register_schema(Failing, opttree.StateSchema(zero={"v"}, shape_with={"v": function}))
    torch.manual_seed(0)
    optimizer = Failing([torch.nn.Parameter(torch.rand(3, 2))])
    train(optimizer, range(2))

    assert refused_in_place(optimizer, "v", re.escape(f"key 'v': {reason}")).message == reason


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        ({"zero": {"m"}, "shape_of": {"m": tuple}, "shape_with": {"m": _second_moment}}, r"state keys \['m'\] are named in both shape_of and shape_with"),
        ({"zero": {"m"}, "like_param": {"m"}, "shape_with": {"m": _second_moment}}, r"state keys \['m'\] are named in both like_param and shape_with"),
        ({"zero": {"m"}, "shape_with": {"n": _second_moment}}, r"shape_with names \['n'\], which are neither zeroed, filled nor identity"),
        ({"keep": {"m"}, "shape_with": {"m": _second_moment}}, r"shape_with names \['m'\], which are neither zeroed, filled nor identity"),
        ({"zero": {"m"}, "shape_with": {"m": 3}}, r"the shape_with of 'm' is an int: expected \(optimizer, param shape\) -> shape"),
        ({"zero": {"m"}, "shape_with": {"m"}}, r"shape_with maps state key names to functions \(optimizer, param shape\) -> shape, got \{'m'\}"),
        ({"zero": {"m"}, "shape_with": (("m", _second_moment), ("m", _second_moment))}, r"shape_with names \['m'\] more than once"),
    ],
    ids=["shape-of-too", "like-param-too", "unknown-key", "kept-key", "not-callable", "a-set", "twice"],
)
def test_a_shape_with_that_cannot_mean_anything_is_a_registration_error(arguments: dict[str, object], reason: str) -> None:
    with pytest.raises(opttree.RegistrationError, match=reason):
        opttree.StateSchema(**arguments)  # type: ignore[arg-type]  # as an untyped config may


def test_a_shape_with_key_may_be_identity_and_have_a_dtype_of_its_own() -> None:
    schema = opttree.StateSchema(identity={"q"}, shape_with={"q": _second_moment}, dtype_of={"q": lambda dtype: torch.float64})
    assert schema.built_like_param == {"q"} and schema.built_dtype("q", torch.float32) is torch.float64


# emerging-optimizers' AdaptiveMuon

MODES = ("adamuon", "normuon", "namo")
SHAPES: list[Shape] = [(8, 4), (4, 6)]
BUILT: dict[str, list[Shape]] = {"adamuon": [(8, 4), (4, 6)], "normuon": [(8, 1), (1, 6)], "namo": [(1,), (1,)]}
"""What AdaptiveMuon builds ``moment2_buffer`` in for :data:`SHAPES`, by mode."""


def adaptive_muon(mode: str, params: list[torch.nn.Parameter] | None = None, *, steps: int = 2) -> torch.optim.Optimizer:
    """An AdaptiveMuon of ``mode`` over ``params`` (new ones of :data:`SHAPES`, the same
    each time, where None), trained ``steps`` steps."""
    pytest.importorskip("emerging_optimizers", reason="no emerging-optimizers in this lane")
    from emerging_optimizers.orthogonalized_optimizers import AdaptiveMuon

    torch.manual_seed(0)
    given = params if params is not None else [torch.nn.Parameter(torch.rand(shape) + 0.1) for shape in SHAPES]
    optimizer = AdaptiveMuon(given, lr=1e-2, momentum=0.95, weight_decay=0.01, moment2_method=mode)  # type: ignore[arg-type]
    train(optimizer, range(steps))
    return optimizer


def moment2_shapes(optimizer: torch.optim.Optimizer) -> list[torch.Size]:
    return [entry["moment2_buffer"].shape for entry in optimizer.state.values()]


@pytest.mark.parametrize("mode", MODES)
def test_adaptive_muon_of_each_mode_resets_exactly(mode: str) -> None:
    optimizer = adaptive_muon(mode)
    schema = opttree.schema_for(type(optimizer))
    params: list[torch.Tensor] = optimizer.param_groups[0]["params"]
    assert schema is not None and schema.shape_field("moment2_buffer") == "shape_with"
    assert [schema.built_shape("moment2_buffer", tuple(p.shape), optimizer) for p in params] == moment2_shapes(optimizer) == BUILT[mode]
    control = adaptive_muon(mode)
    assert opttree.validate(optimizer) == ()

    assert opttree.reset(optimizer).tensors_zeroed == 4

    assert trains_as_fresh(optimizer, lambda ps: adaptive_muon(mode, ps, steps=0), range(2, 5))
    assert not trains_as_fresh(control, lambda ps: adaptive_muon(mode, ps, steps=0), range(2, 5))  # history that is not reset shows


RAISES = {("normuon", "adamuon"), ("namo", "adamuon"), ("namo", "normuon")}
"""The checkpoints of one mode loaded into another whose next step raises in torch; in the
others the history broadcasts (a row-constant full buffer) and trains on unnoticed."""


@pytest.mark.parametrize(("saved", "loading"), [(a, b) for a in MODES for b in MODES if a != b], ids=lambda mode: str(mode))
def test_a_checkpoint_of_another_mode_loaded_by_torch_is_refused_with_nothing_changed(saved: str, loading: str) -> None:
    state = adaptive_muon(saved).state_dict()
    optimizer, torchs = adaptive_muon(loading, steps=0), adaptive_muon(loading, steps=0)
    for loaded in (optimizer, torchs):
        loaded.load_state_dict(copy.deepcopy(state))
    assert moment2_shapes(optimizer) == BUILT[saved]

    reason = (
        rf"key 'moment2_buffer': history of shape {re.escape(str(BUILT[saved][0]))} float32 where its parameter is shape "
        rf"\(8, 4\) float32 \(built as shape {re.escape(str(BUILT[loading][0]))} float32 for it; 2 of 2 such\)"
    )
    refused_in_place(optimizer, "moment2_buffer", reason)
    if (saved, loading) in RAISES:
        with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
            train(torchs, range(2, 3))
    else:
        train(torchs, range(2, 3))
        assert moment2_shapes(torchs) == BUILT[saved]  # torch never says


@pytest.mark.parametrize("mode", MODES)
def test_a_moment2_buffer_of_another_dtype_is_refused_with_nothing_changed(mode: str) -> None:
    optimizer = adaptive_muon(mode)
    entry = next(iter(optimizer.state.values()))
    entry["moment2_buffer"] = entry["moment2_buffer"].double()

    refused_in_place(optimizer, "moment2_buffer", r"key 'moment2_buffer': history of shape .* float64 where its parameter is shape \(8, 4\) float32")
    assert entry["moment2_buffer"].dtype is torch.float64
    with pytest.raises(RuntimeError, match="expected dtype double"):
        train(optimizer, range(2, 3))


def test_an_unknown_moment2_method_is_refused_not_guessed() -> None:
    """AdaptiveMuon builds no ``moment2_buffer`` for a method it does not know (its step
    raises): the layout opttree would check against is unknown, so it is a problem."""
    optimizer = adaptive_muon("adamuon")
    setattr(optimizer, "moment2_method", "adam")

    reason = "its schema's shape_with raised ValueError: AdaptiveMuon builds it for no moment2_method 'adam'"
    assert refused_in_place(optimizer, "moment2_buffer", re.escape(reason)).message == reason


def _megatron_stack(mode: str) -> testing.MegatronStack:
    """The ``adaptive_muon`` recipe (Megatron's ``TensorParallelAdaptiveMuon``, chained with
    AdamW), its AdaptiveMuon of ``mode``."""
    if "adaptive_muon" not in testing.available():
        pytest.skip("no adaptive_muon recipe in this lane")
    stack = testing.build("adaptive_muon")
    (leaf,) = [leaf for leaf in stack.leaves() if type(leaf).__name__ == "TensorParallelAdaptiveMuon"]
    setattr(leaf, "moment2_method", mode)
    return stack


MEGATRON_LOADS = [
    ("normuon", "adamuon", "doesn't match the broadcast shape", r"its 'moment2_buffer' has shape \(32, 1\), where TensorParallelAdaptiveMuon builds it in shape \(32, 16\)"),
    ("adamuon", "normuon", None, r"its 'moment2_buffer' has shape \(32, 16\), where TensorParallelAdaptiveMuon builds it in shape \(32, 1\)"),
    ("adamuon", "adam", "Invalid second moment method", re.escape("its 'moment2_buffer': its schema's shape_with raised ValueError: TensorParallelAdaptiveMuon builds it for no moment2_method 'adam'")),
]
"""A checkpoint saved in one mode, loaded into a stack of another: what Megatron's own next
step raises after its load (None: it trains on), and opttree's refusal."""


@pytest.mark.parametrize(("saved", "loading", "raised", "refusal"), MEGATRON_LOADS, ids=[f"{a}-into-{b}" for a, b, _, _ in MEGATRON_LOADS])
def test_opttree_load_state_dict_refuses_a_checkpoint_of_another_mode(saved: str, loading: str, raised: str | None, refusal: str) -> None:
    from tests.test_checkpoint_layouts import same

    stack = _megatron_stack(saved)
    stack.train(0, 2)
    with stack.device:
        state = stack.optimizer.state_dict()
    given = copy.deepcopy(state)
    megatrons, ours = _megatron_stack(loading), _megatron_stack(loading)
    for loaded in (megatrons, ours):
        loaded.copy_weights_from(stack)

    with megatrons.device:
        megatrons.optimizer.load_state_dict(copy.deepcopy(state))
    if raised is None:
        megatrons.train(2, 1)  # Megatron never says
    else:
        with pytest.raises((RuntimeError, TypeError), match=raised):
            megatrons.train(2, 1)

    with ours.device, pytest.raises(opttree.UnsupportedCheckpoint, match=f"key 'moment2_buffer': state entry 0, of a parameter of shape \\(32, 16\\): {refusal}"):
        opttree.load_state_dict(ours.optimizer, state)
    assert same(state, given) and not any(leaf.state for leaf in ours.leaves())


class _Pair:
    """A user's wrapper stepping two optimizers: sibling leaves of one class, checked as a run."""

    def __init__(self, first: torch.optim.Optimizer, second: torch.optim.Optimizer) -> None:
        self.first, self.second = first, second


opttree.register_wrapper(_Pair, children=lambda pair: [("first", pair.first), ("second", pair.second)])


def test_sibling_leaves_of_other_settings_are_each_checked_against_their_own() -> None:
    """Two AdaptiveMuons side by side, the second holding a normuon checkpoint loaded into
    an adamuon one: checked as a run with the first's settings it once passed."""
    state = adaptive_muon("normuon").state_dict()
    pair = _Pair(adaptive_muon("normuon"), adaptive_muon("adamuon", steps=0))
    pair.second.load_state_dict(copy.deepcopy(state))
    before = snapshot(pair.second)

    (problem,) = opttree.validate(pair)
    assert problem.path == "second" and problem.key == "moment2_buffer"
    with pytest.raises(opttree.UnsupportedOptimizerState, match="key 'moment2_buffer'"):
        opttree.reset(pair)
    assert unchanged(pair.second, before)
