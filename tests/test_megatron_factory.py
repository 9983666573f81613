"""The differential suite: every opttree.testing configuration, built by Megatron's factory.

Train k steps, reset, train k more; against a fresh optimizer built over the same model and
main (master) weights, trained the same k steps. Main weights must match bitwise.
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch

import opttree
from opttree import testing
from tests.helpers import outside_state, trains_as_fresh_stack

K = 3

def lion_through_the_registry() -> bool:
    """Whether the factory builds ``lion`` from its emerging-optimizer registry (0.18 on:
    Lion for matrices, chained with AdamW for the rest), not in its own path (0.17: Lion
    for every parameter)."""
    try:
        registry = importlib.import_module("megatron.core.optimizer.emerging_optimizers")
    except ImportError:
        return False
    return "lion" in getattr(registry, "_EMERGING_OPTIMIZERS", {})


EXPECTED_SHAPES = {
    "fp32": "ChainedOptimizer[FP32Optimizer[AdamW]]",
    "bf16": "ChainedOptimizer[Float16OptimizerWithFloat16Params[AdamW]]",
    "fp16": "ChainedOptimizer[Float16OptimizerWithFloat16Params[AdamW]]",
    "dist_fp32": "ChainedOptimizer[DistributedOptimizer[AdamW]]",
    "dist_bf16": "ChainedOptimizer[DistributedOptimizer[AdamW]]",
    "dist_fp16": "ChainedOptimizer[DistributedOptimizer[AdamW]]",
    "offload_0.75": "ChainedOptimizer[DistributedOptimizer[HybridDeviceOptimizer(cpu=2,gpu=1)[AdamW,AdamW,AdamW]]]",
    "offload_1.0": "ChainedOptimizer[DistributedOptimizer[HybridDeviceOptimizer(cpu=4,gpu=0)[AdamW,AdamW,AdamW,AdamW]]]",
    "sgd": "ChainedOptimizer[FP32Optimizer[SGD]]",
    "moe": "ChainedOptimizer[FP32Optimizer[AdamW],FP32Optimizer[AdamW]]",
    "frozen_fp16": "ChainedOptimizer[Float16OptimizerWithFloat16Params[],Float16OptimizerWithFloat16Params[AdamW]]",
    "frozen_dist_bf16": "ChainedOptimizer[DistributedOptimizer[],DistributedOptimizer[AdamW]]",
    "muon": "ChainedOptimizer[FP32Optimizer[TensorParallelMuon],FP32Optimizer[AdamW]]",
    "dist_muon": (
        "LayerWiseDistributedOptimizer[Float16OptimizerWithFloat16Params[TensorParallelMuon],"
        "Float16OptimizerWithFloat16Params[AdamW]]"
    ),
    "adaptive_muon": "ChainedOptimizer[FP32Optimizer[TensorParallelAdaptiveMuon],FP32Optimizer[AdamW]]",
    "lion": (  # see lion_through_the_registry
        "ChainedOptimizer[FP32Optimizer[Lion],FP32Optimizer[AdamW]]"
        if lion_through_the_registry()
        else "ChainedOptimizer[FP32Optimizer[Lion]]"
    ),
    "laprop": "ChainedOptimizer[FP32Optimizer[LaProp],FP32Optimizer[AdamW]]",
    "soap": "ChainedOptimizer[FP32Optimizer[SOAP],FP32Optimizer[AdamW]]",
    "rekls": "ChainedOptimizer[FP32Optimizer[REKLS],FP32Optimizer[AdamW]]",
}
ZEROED_KEYS = {"exp_avg", "exp_avg_sq", "momentum_buffer", "moment2_buffer", "L", "R"}
"""Moments, and SOAP's and REKLS's Kronecker factors."""
IDENTITY_KEYS = {"Q_L", "Q_R"}
"""SOAP's and REKLS's eigenbases, which a fresh optimizer starts as ``torch.eye``."""


class Shape(opttree.NodeVisitor[str]):
    """The tree as a one-line string of class names."""

    def inner(self, node: opttree.Node) -> str:
        return "[" + ",".join(c.accept(self) for c in node.children) + "]"

    def visit_chained(self, node: opttree.ChainedNode) -> str:
        return type(node.optimizer).__name__ + self.inner(node)

    def visit_hybrid(self, node: opttree.HybridNode) -> str:
        gpu = 0 if node.gpu is None else 1
        return f"{type(node.optimizer).__name__}(cpu={len(node.cpu)},gpu={gpu})" + self.inner(node)

    def visit_wrapper(self, node: opttree.WrapperNode) -> str:
        return type(node.optimizer).__name__ + self.inner(node)

    def visit_leaf(self, node: opttree.LeafNode) -> str:
        return type(node.optimizer).__name__


def test_every_named_configuration_has_an_expected_shape() -> None:
    assert set(EXPECTED_SHAPES) == set(testing.RECIPES)


def test_what_needs_nothing_beyond_the_factory_is_available_on_every_megatron_core() -> None:
    assert {"fp32", "bf16", "fp16", "sgd", "moe", "offload_0.75", "offload_1.0"} <= set(testing.available())


def test_what_available_leaves_out_megatron_cannot_build_or_train() -> None:
    """available() is honest the other way too: each configuration it leaves out has a
    reason, build() refuses it with that reason, and Megatron's factory, asked anyway,
    fails to build it or to take a step with it."""
    from opttree.testing import _megatron

    for name in set(testing.RECIPES) - set(testing.available()):
        reason = testing.missing_feature(name)
        assert reason, name
        with pytest.raises(testing.RecipeUnavailable, match=f"cannot be built here: {re.escape(reason)}"):
            testing.build(name)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_megatron, "missing_feature", lambda _: None)
            with pytest.raises(Exception):  # noqa: B017, PT011 - Megatron's own, of any type
                testing.build(name).step(0)


STEPS_TAKEN = {"frozen_fp16": K - 1}
"""Megatron's chain scales the loss by its first member's scaler, here the frozen dense
layers' stub, which sees no gradients and so no overflow, and grows; the expert member
unscales by its own, overflows at the third step and skips it."""


@pytest.fixture(params=testing.available())
def trained(request: pytest.FixtureRequest) -> testing.MegatronStack:
    name: str = request.param
    stack = testing.build(name)
    stack.train(0, K)
    return stack


def test_describe_and_validate_show_the_real_tree(trained: testing.MegatronStack) -> None:
    node = opttree.tree(trained.optimizer)

    assert node.accept(Shape()) == EXPECTED_SHAPES[trained.name]
    assert opttree.validate(trained.optimizer) == ()
    text = opttree.describe(trained.optimizer)
    assert text.splitlines()[0].startswith(type(trained.optimizer).__name__)
    adam_lines = [line for line in text.splitlines() if "AdamW params=" in line]
    assert all(f"step={STEPS_TAKEN.get(trained.name, K)} " in line for line in adam_lines)
    assert len(adam_lines) == EXPECTED_SHAPES[trained.name].count("AdamW") - text.count(" x AdamW")


def test_reset_then_train_matches_a_fresh_optimizer(trained: testing.MegatronStack) -> None:
    masters_before = [p.clone() for p in trained.main_params()]

    report = opttree.reset(trained.optimizer)

    # Master weights untouched, every history tensor zero, every step counter zero.
    assert all(torch.equal(a, b) for a, b in zip(masters_before, trained.main_params(), strict=True))
    for leaf in trained.leaves():
        for entry in leaf.state.values():
            assert not (set(entry) - ZEROED_KEYS - IDENTITY_KEYS - {"step", "master_param"})
            for key, value in entry.items():
                if key in ZEROED_KEYS:
                    assert isinstance(value, torch.Tensor) and not value.any(), key
                elif key in IDENTITY_KEYS:
                    assert isinstance(value, torch.Tensor) and torch.equal(value, torch.eye(len(value), dtype=value.dtype)), key
                elif key == "step":  # a tensor (torch's AdamW) or an int (emerging-optimizers)
                    assert not (value.any() if isinstance(value, torch.Tensor) else value), key
    assert report.tensors_zeroed + report.tensors_dropped > 0

    fresh = testing.build(trained.name)
    fresh.copy_weights_from(trained)
    trained.train(K, K)
    fresh.train(K, K)

    for a, b in zip(trained.main_params(), fresh.main_params(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(trained.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", testing.available())
def test_no_step_counts_outside_the_state_of_any_leaf(name: str) -> None:
    """As for the emerging-optimizers catalogue, through Megatron's own factory, whose
    leaves are Megatron's subclasses (``TensorParallelMuon``) with attributes of their own:
    training leaves every leaf's attributes and group options as built."""
    stack = testing.build(name)
    built = list(map(outside_state, stack.leaves()))
    stack.train(0, K)
    assert all(leaf.state for leaf in stack.leaves())
    assert list(map(outside_state, stack.leaves())) == built


def test_offload_keeps_master_params_and_reports_them() -> None:
    if "offload_0.75" not in testing.available():
        pytest.skip("no offload configuration in this lane")
    stack = testing.build("offload_0.75")
    stack.train(0, 2)

    report = opttree.reset(stack.optimizer)

    assert report.kept_keys == ("master_param",)
    assert report.tensors_kept == len(stack.main_params())


def test_a_recipe_of_ones_own_is_judged_by_its_optimizer_and_an_unknown_name_is_refused() -> None:
    import importlib.util

    assert testing.missing_feature(testing.Recipe("mine", "adam", bf16=True)) is None
    lion = testing.Recipe("mine", "lion")
    assert lion.needs_emerging and not testing.Recipe("mine", "sgd").needs_emerging
    if importlib.util.find_spec("emerging_optimizers") is None:
        assert testing.missing_feature(lion) == "emerging-optimizers is not installed"
    with pytest.raises(testing.UnknownRecipe, match=r"no configuration named 'nope': RECIPES has fp32, .*or pass a Recipe"):
        testing.build("nope")
    assert issubclass(testing.UnknownRecipe, opttree.OptTreeError) and issubclass(testing.RecipeUnavailable, opttree.OptTreeError)
    with pytest.raises(testing.UnknownRecipe, match="no configuration named 'nope'"):
        testing.missing_feature("nope")


@pytest.mark.skipif("dist_muon" not in testing.available(), reason="no layer-wise Muon in this lane")
def test_a_legacy_dist_optimizer_name_is_judged_as_the_factory_rewrites_it() -> None:
    """megatron-core 0.19's factory takes ``"dist_muon"`` as ``"muon"``, layer-wise: the
    recipe was called unavailable for a registry without that name. The factory builds it,
    and a reset trains on as a fresh stack."""
    recipe = testing.Recipe("legacy_dist_muon", "dist_muon", bf16=True)
    assert testing.missing_feature(recipe) is None
    stack = testing.build(recipe)
    stack.train(0, 2)
    assert type(stack.optimizer).__name__ == "LayerWiseDistributedOptimizer"
    opttree.reset(stack.optimizer)
    assert trains_as_fresh_stack(stack, testing.build(recipe), 2, 2)


@pytest.mark.skipif(not {"fp32", "bf16"} <= set(testing.available()), reason="needs the fp32 and bf16 recipes")
def test_copy_weights_from_a_stack_of_other_dtypes_is_refused_with_nothing_copied() -> None:
    """A copy from bf16 weights into fp32 ones casts: the weights would not be bitwise equal."""
    fp32, bf16 = testing.build("fp32"), testing.build("bf16", seed=1)
    before = [param.clone() for param in fp32.model.parameters()]

    with pytest.raises(opttree.OptTreeError, match="cannot make the 'fp32' stack's weights bitwise equal to the 'bf16' stack's: a weight of shape"):
        fp32.copy_weights_from(bf16)

    assert all(torch.equal(a, b) for a, b in zip(fp32.model.parameters(), before, strict=True))
    twin = testing.build("fp32", seed=1)
    twin.copy_weights_from(fp32)
    assert all(torch.equal(a, b) for a, b in zip(twin.model.parameters(), fp32.model.parameters(), strict=True))


def test_a_recipe_of_fields_megatron_cannot_take_is_refused_where_it_is_made() -> None:
    with pytest.raises(opttree.OptTreeError, match="Recipe.optimizer must be a str, got an int"):
        testing.Recipe("mine", 5)  # type: ignore[arg-type]
    with pytest.raises(opttree.OptTreeError, match="Recipe.offload_fraction must be None or a number from 0 to 1, got 2.0"):
        testing.Recipe("mine", "adam", offload_fraction=2.0)
    with pytest.raises(opttree.OptTreeError, match="Recipe.bf16 must be a bool, got a str"):
        testing.Recipe("mine", "adam", bf16="yes")  # type: ignore[arg-type]
    with pytest.raises(opttree.OptTreeError, match="Recipe.hidden must be a positive int, got 0"):
        testing.Recipe("mine", "adam", hidden=0)
    with pytest.raises(opttree.OptTreeError, match="Recipe.hidden must be a positive int, got True"):
        testing.Recipe("mine", "adam", hidden=True)
    with pytest.raises(opttree.OptTreeError, match="Recipe 'mine' is both bf16 and fp16"):
        testing.Recipe("mine", "adam", bf16=True, fp16=True)
    with pytest.raises(opttree.OptTreeError, match="Recipe 'mine' offloads without distributed=True"):
        testing.Recipe("mine", "adam", offload_fraction=0.5)
    with pytest.raises(testing.UnknownRecipe, match="a configuration is a name in RECIPES or a Recipe, got a list"):
        testing.build(["fp32"])  # type: ignore[arg-type]
    with pytest.raises(opttree.OptTreeError, match="copy_weights_from takes a MegatronStack, got an int"):
        testing.build("fp32").copy_weights_from(5)  # type: ignore[arg-type]
    assert testing.Recipe("mine", "adam", distributed=True, offload_fraction=1).offload_fraction == 1


def test_an_emerging_optimizer_layer_wise_without_bf16_is_unavailable_not_a_raw_error_at_its_first_step() -> None:
    """Megatron's factory builds it, unwrapped, and its first step raised a raw
    AttributeError (no ``prepare_grads``); Adam layer-wise in fp32, and Muon in bf16, train."""
    recipe = testing.Recipe("layer_wise_fp32_muon", "muon", layer_wise=True)
    if testing.missing_feature(testing.Recipe("layer_wise_bf16_muon", "muon", layer_wise=True, bf16=True)) is not None:
        pytest.skip("no layer-wise Muon in this lane")
    assert "no mixed-precision wrapper where bf16 is not set" in (testing.missing_feature(recipe) or "")
    with pytest.raises(testing.RecipeUnavailable, match="no mixed-precision wrapper"):
        testing.build(recipe)
    testing.build(testing.Recipe("layer_wise_fp32_adam", "adam", layer_wise=True)).train(0, 1)


@pytest.mark.parametrize(
    "recipe",
    [
        testing.Recipe("offload_sgd", "sgd", bf16=True, distributed=True, offload_fraction=0.5),
        testing.Recipe("offload_fp32", "adam", distributed=True, offload_fraction=0.5),
    ],
    ids=["sgd", "fp32"],
)
def test_a_recipe_megatron_refuses_to_build_is_an_opttree_error(recipe: testing.Recipe) -> None:
    """Megatron's config asserts that precision-aware offloading is Adam's, and its factory
    cannot offload fp32 weights: their AssertionError and ValueError escaped raw."""
    if testing.missing_feature(recipe) is not None:
        pytest.skip(f"this lane cannot build it anyway: {testing.missing_feature(recipe)}")
    with pytest.raises(testing.RecipeUnavailable, match="cannot be built: Megatron's"):
        testing.build(recipe)
