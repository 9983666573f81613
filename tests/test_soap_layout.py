"""SOAP and REKLS build their moments in their parameter's shape in float32, and their
Kronecker factors ``L``/``R`` and eigenbases ``Q_L``/``Q_R`` square in the parameter's
rows and columns, in torch's default dtype (``StateSchema.shape_of`` and ``dtype_of``).
State of another shape or dtype (a hand-edited state, a checkpoint of another layout,
history cast by a load) would stay so through a reset in place, where a fresh optimizer
builds it so: refused, with nothing changed. A correct state resets exactly (the
catalogue tests prove that)."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

import opttree
from tests.helpers import snapshot, unchanged

pytestmark = pytest.mark.skipif(importlib.util.find_spec("emerging_optimizers") is None, reason="no emerging-optimizers in this lane")


def stepped(name: str) -> tuple[torch.optim.Optimizer, torch.nn.Parameter]:
    from tests.test_emerging_catalogue import BUILD, _registry, params, train

    ps = params()  # (4, 4) and (4, 6)
    optimizer = BUILD[name](_registry()[name], ps)
    train(optimizer, ps, range(2))
    return optimizer, ps[1]


@pytest.mark.parametrize("name", ["soap", "rekls"])
@pytest.mark.parametrize(
    ("key", "wrong", "expected"),
    [
        ("L", torch.zeros(6, 6), r"history of shape \(6, 6\) float32 where its parameter is shape \(4, 6\) float32 \(built as shape \(4, 4\) float32 for it; "),
        ("Q_R", torch.eye(4), r"history of shape \(4, 4\) float32 where its parameter is shape \(4, 6\) float32 \(built as shape \(6, 6\) float32 for it; "),
        ("exp_avg", torch.zeros(6, 4), r"history of shape \(6, 4\) float32 where its parameter is shape \(4, 6\) float32 \(built as shape \(4, 6\) float32"),
        ("exp_avg_sq", torch.zeros(4, 6, dtype=torch.bfloat16), r"history of shape \(4, 6\) bfloat16 where its parameter is shape \(4, 6\) float32 \(built as shape \(4, 6\) float32"),
        ("L", torch.zeros(4, 4, dtype=torch.float64), r"history of shape \(4, 4\) float64 where"),
    ],
    ids=["L-columns", "Q_R-rows", "exp_avg-transposed", "exp_avg_sq-bfloat16", "L-float64"],
)
def test_soap_state_of_another_layout_is_refused(name: str, key: str, wrong: torch.Tensor, expected: str) -> None:
    optimizer, param = stepped(name)
    assert opttree.validate(optimizer) == ()
    optimizer.state[param][key] = wrong
    before = snapshot(optimizer)

    problems = opttree.validate(optimizer)

    assert [(p.kind, p.key) for p in problems] == [(opttree.ProblemKind.UNSUPPORTED_STATE, key)]
    with pytest.raises(opttree.UnsupportedOptimizerState, match=rf"key '{key}': " + expected):
        opttree.reset(optimizer)
    assert unchanged(optimizer, before)


@pytest.mark.parametrize("name", ["soap", "rekls"])
def test_soap_over_a_column_major_weight_is_reset_exactly(name: str) -> None:
    """Each step replaces SOAP's moments with their rotations, row-major whatever the
    weight's layout: over a column-major weight they are not laid out as ``zeros_like``
    the weight, and an untouched SOAP was refused as if its weight had been laid out anew.
    Zeros rotate to the same zeros in any layout: reset, it trains as a fresh one."""
    from tests.test_emerging_catalogue import BUILD, _registry

    def column_major() -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)).t())

    def train(optimizer: torch.optim.Optimizer, weight: torch.nn.Parameter, steps: range) -> None:
        for k in steps:
            weight.grad = torch.sin(weight.detach() * 1.3 + k)
            optimizer.step()

    weight = column_major()
    optimizer = BUILD[name](_registry()[name], [weight])
    train(optimizer, weight, range(3))
    assert weight.stride() == (1, 4) and optimizer.state[weight]["exp_avg"].stride() == (6, 1)

    assert opttree.validate(optimizer) == ()
    opttree.reset(optimizer)
    twin = column_major()
    with torch.no_grad():
        twin.copy_(weight)
    fresh = BUILD[name](_registry()[name], [twin])
    train(optimizer, weight, range(3, 8))
    train(fresh, twin, range(3, 8))
    assert torch.equal(weight, twin)


def test_moments_cast_by_torchs_load_are_refused_naming_the_load() -> None:
    """torch's ``load_state_dict`` casts floating-point state to its parameter's dtype:
    SOAP's float32 moments (and its factors and bases, in the default dtype) of a bfloat16
    weight come back bfloat16, where a fresh SOAP builds them float32. Refused, and the message names the load, not only a cast of the
    weight, which never changed."""
    from tests.test_emerging_catalogue import BUILD, _registry

    weight = torch.nn.Parameter(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
    trained = BUILD["soap"](_registry()["soap"], [weight])
    weight.grad = torch.ones_like(weight)
    trained.step()
    loaded = BUILD["soap"](_registry()["soap"], [weight])
    loaded.load_state_dict(trained.state_dict())
    assert loaded.state[weight]["exp_avg"].dtype is torch.bfloat16

    problems = opttree.validate(loaded)

    assert {p.key for p in problems} == {"exp_avg", "exp_avg_sq", "L", "R", "Q_L", "Q_R"}
    assert all("or torch's load_state_dict cast it to the parameter's dtype" in p.message for p in problems)
    assert not any("load_state_dict" in p.message for p in opttree.validate(trained))


def test_soaps_kronecker_factors_follow_torchs_default_dtype() -> None:
    """SOAP builds its factors and eigenbases in torch's default dtype, its moments in
    float32: with the default switched to float64 after they were built, a fresh SOAP would
    build float64 factors, so the float32 ones are refused while the default is float64."""
    optimizer, _ = stepped("soap")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        keys = sorted({p.key or "" for p in opttree.validate(optimizer)})
    finally:
        torch.set_default_dtype(previous)

    assert keys == ["L", "Q_L", "Q_R", "R"]
    assert opttree.validate(optimizer) == ()


def test_dtype_of_names_keys_whose_layout_is_checked() -> None:
    with pytest.raises(opttree.RegistrationError, match=re.escape("dtype_of names ['m'], which are neither like_param nor shape_of keys")):
        opttree.StateSchema(zero={"m"}, dtype_of={"m": lambda dtype: torch.float32})
    with pytest.raises(opttree.RegistrationError, match="the dtype_of of 'm' is a str: expected"):
        opttree.StateSchema(zero={"m"}, like_param={"m"}, dtype_of={"m": "float32"})  # type: ignore[dict-item]
    schema = opttree.StateSchema(zero={"m"}, identity={"q"}, like_param={"m"}, shape_of={"q": lambda s: (s[0], s[0])}, dtype_of={"m": lambda dtype: torch.float32})
    assert schema.built_dtype("m", torch.bfloat16) is torch.float32 and schema.built_dtype("q", torch.bfloat16) is torch.bfloat16
    assert schema.built_shape("q", (3, 5)) == torch.Size((3, 3))


def test_a_registered_dtype_of_that_fails_is_a_problem_not_a_crash() -> None:
    class Odd(torch.optim.SGD):
        pass

    opttree.register_schema(
        Odd,
        opttree.StateSchema(zero={"momentum_buffer"}, like_param={"momentum_buffer"}, dtype_of={"momentum_buffer": lambda dtype: "float32"}),  # type: ignore[dict-item,return-value]
    )
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = Odd([param], lr=0.1, momentum=0.9)
    optimizer.state[param]["momentum_buffer"] = torch.ones(3)

    problems = opttree.validate(optimizer)

    assert [(p.kind, p.key) for p in problems] == [(opttree.ProblemKind.UNSUPPORTED_STATE, "momentum_buffer")]
    assert "its schema's dtype_of raised TypeError: it gave a str, expected a torch.dtype" in problems[0].message


def test_a_soap_checkpoint_with_a_factor_of_another_shape_is_refused_where_megatron_loads_it() -> None:
    """Megatron's own load (torch's) keeps a saved tensor's shape: a Kronecker factor of
    another shape loads, and the next step raises inside SOAP; opttree's load refuses it."""
    import copy

    from opttree import testing

    if "soap" not in testing.available():
        pytest.skip("this megatron-core's factory builds no SOAP (its emerging-optimizer registry came in 0.18)")
    stack = testing.build("soap")
    stack.train(0, 2)
    with stack.device:
        state = copy.deepcopy(stack.optimizer.state_dict())
    members = state if isinstance(state, list) else [state]  # a chain of several saves a list
    first = next(entry for member in members for entry in member["state"].values() if isinstance(entry, dict) and "L" in entry)
    rows = first["L"].shape[0]
    first["L"] = torch.zeros(rows + 1, rows + 1)

    def fresh() -> testing.MegatronStack:
        built = testing.build("soap")
        built.copy_weights_from(stack)
        return built

    megatrons = fresh()
    with megatrons.device:
        megatrons.optimizer.load_state_dict(copy.deepcopy(state))
    with pytest.raises(RuntimeError):
        megatrons.train(2, 1)

    ours = fresh()
    with ours.device, pytest.raises(opttree.UnsupportedCheckpoint, match=rf"its 'L' has shape \({rows + 1}, {rows + 1}\), where SOAP builds it in shape \({rows}, {rows}\)"):
        opttree.load_state_dict(ours.optimizer, state)


@pytest.mark.parametrize("name", ["soap", "rekls"])
def test_a_partial_reset_of_the_eigenbases_keeping_the_moments_held_in_them_is_refused(name: str) -> None:
    """SOAP keeps its moments in the eigenbases' coordinates (``expressed_in``): the bases
    reset alone, the kept first moment, read in the identity basis, stands for another
    momentum in the parameter's space. Refused with nothing changed; the bases with the
    moments, or the moments alone (zero in any basis), reset."""
    optimizer, param = stepped(name)
    entry = optimizer.state[param]
    before = snapshot(optimizer)

    with pytest.raises(opttree.PartialResetRefused, match=r"key 'exp_avg': its exp_avg is held in the basis its Q_L, Q_R hold, and keys names Q_L, Q_R without it"):
        opttree.reset(optimizer, keys=["Q_L", "Q_R"])
    with pytest.raises(opttree.PartialResetRefused, match=r"its exp_avg_sq is held in the basis its Q_L, Q_R hold, and keys names Q_R without it"):
        opttree.reset(optimizer, keys=["Q_R", "exp_avg"])
    assert unchanged(optimizer, before)

    in_parameter_space = entry["Q_L"] @ entry["exp_avg"] @ entry["Q_R"].T
    kept = opttree.reset(optimizer, keys=["exp_avg_sq", "L", "R"])  # moments' second alone: its basis kept
    assert kept.tensors_zeroed > 0 and torch.equal(entry["Q_L"] @ entry["exp_avg"] @ entry["Q_R"].T, in_parameter_space)
    opttree.reset(optimizer, keys=["Q_L", "Q_R", "exp_avg", "exp_avg_sq"])
    assert not entry["exp_avg"].any() and torch.equal(entry["Q_L"], torch.eye(4))


def test_the_first_moment_kept_beside_bases_reset_by_hand_moves_in_the_parameters_space() -> None:
    """The other side: the bases reset by hand, the kept first moment read in them no longer
    stands for the momentum it held."""
    optimizer, param = stepped("soap")
    entry = optimizer.state[param]
    in_parameter_space = entry["Q_L"] @ entry["exp_avg"] @ entry["Q_R"].T
    with torch.no_grad():
        entry["Q_L"].copy_(torch.eye(4))
        entry["Q_R"].copy_(torch.eye(6))
    assert not torch.allclose(entry["Q_L"] @ entry["exp_avg"] @ entry["Q_R"].T, in_parameter_space)


def test_expressed_in_maps_history_to_other_history_holding_its_basis() -> None:
    def schema(expressed_in: dict[str, set[str]]) -> opttree.StateSchema:
        return opttree.StateSchema(zero={"m", "Q"}, step=opttree.StepLocation.PER_PARAMETER, expressed_in=expressed_in)

    wrongs: list[dict[str, set[str]]] = [{"m": {"m"}}, {"m": {"X"}}, {"m": set()}]
    for wrong in wrongs:
        with pytest.raises(opttree.RegistrationError, match="expressed_in maps 'm' to"):
            schema(wrong)
    with pytest.raises(opttree.RegistrationError, match="state keys are given as a set of names, got 'Q'"):
        opttree.StateSchema(zero={"m", "Q"}, expressed_in={"m": "Q"})  # type: ignore[dict-item]
    assert schema({"m": {"Q"}}).expressed_in == (("m", frozenset({"Q"})),)
