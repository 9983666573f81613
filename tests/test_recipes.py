"""The README's recipes, run as they are written there, on real Megatron stacks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import opttree
from opttree import testing

README = Path(__file__).resolve().parent.parent / "README.md"


def recipes() -> dict[str, str]:
    """Each ``### title`` of the Recipes section, with its Python block."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Recipes\n", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"^### (.+?)\n.*?```python\n(.*?)```", section, flags=re.S | re.M)
    return {title: code for title, code in found}


def run(title: str, stack: testing.MegatronStack, **names: object) -> dict[str, object]:
    steps = iter(range(100, 200))
    namespace: dict[str, object] = {
        "opttree": opttree,
        "torch": torch,
        "optimizer": stack.optimizer,
        "model": stack.model,
        "train_step": lambda: stack.step(next(steps)),
        **names,
    }
    with stack.device:
        exec(compile(recipes()[title], f"README.md: {title}", "exec"), namespace)  # noqa: S102
    return namespace


def test_the_readme_has_the_three_recipes() -> None:
    assert list(recipes()) == [
        "A reset after each rollout (colocated RL)",
        "A ReLoRA merge: prune, then re-warm the learning rate",
        "Weights loaded without the optimizer",
    ]


def test_reset_after_each_rollout() -> None:
    stack = testing.build("dist_bf16")
    missing = [m for m in ("offload_to_cpu", "restore_from_cpu") if not hasattr(stack.optimizer, m)]
    if missing:
        pytest.skip(f"this megatron-core's {type(stack.optimizer).__name__} has no {'() or '.join(missing)}(), which the recipe calls")
    try:
        with stack.device:
            stack.optimizer.offload_to_cpu()
            stack.optimizer.restore_from_cpu()
    except NameError as e:  # megatron-core 0.15.3's offload_to_cpu() uses a module it never imports
        pytest.skip(f"this megatron-core's offload_to_cpu() fails wherever it runs: {e}")
    stack.train(0, 2)
    generated: list[int] = []
    names = run("A reset after each rollout (colocated RL)", stack, rollouts=2, generate=lambda: generated.append(1))
    report = names["report"]
    assert isinstance(report, opttree.ResetReport) and report.steps > 0 and generated == [1, 1]
    assert all(not v.any() for leaf in stack.leaves() for entry in leaf.state.values() for v in entry.values())


@pytest.mark.parametrize("name", ["fp32", "bf16", "dist_bf16"])
def test_relora_merge(name: str) -> None:
    """The merge survives the steps after it: a stack trained on after a merge of +0.01
    stays about 0.01 from one never merged (on bf16 and dist_bf16 it ended equal to it,
    its fp32 main weights never told of the merge, before the recipe synced them)."""
    stack, unmerged = (testing.build(name, lr=1e-6) for _ in range(2))
    for built in (stack, unmerged):
        built.train(0, 3)

    def merge_lora(model: torch.nn.Module) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)

    lrs = [group["lr"] for group in stack.optimizer.param_groups]
    names = run("A ReLoRA merge: prune, then re-warm the learning rate", stack, merge_lora=merge_lora, warmup_steps=2)
    run("A ReLoRA merge: prune, then re-warm the learning rate", unmerged, merge_lora=lambda model: None, warmup_steps=2)
    report = names["report"]
    assert isinstance(report, opttree.ResetReport) and report.steps == 0 and report.tensors_zeroed > 0
    assert [group["lr"] for group in stack.optimizer.param_groups] == lrs  # back at the peak
    for merged, plain in zip(stack.model.parameters(), unmerged.model.parameters(), strict=True):
        assert 0.009 < float((merged.float() - plain.float()).abs().mean()) < 0.011


@pytest.mark.parametrize("name", ["bf16", "offload_0.75"])
def test_weights_loaded_without_the_optimizer(name: str) -> None:
    stack = testing.build(name)
    stack.train(0, 2)
    new_weights = {k: v + 0.5 if v.is_floating_point() else v for k, v in stack.model.state_dict().items()}
    names = run("Weights loaded without the optimizer", stack, new_weights=new_weights)
    stale = names["stale"]
    assert isinstance(stale, tuple) and stale and all(p.kind is opttree.ProblemKind.STALE_MASTER for p in stale)
