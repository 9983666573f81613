"""``python -m opttree describe MODULE:FACTORY``, run as users run it."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

FACTORY = "tests.test_cli:chained_adamw"


def chained_adamw() -> object:
    from megatron.core.optimizer import ChainedOptimizer

    from opttree import testing
    from tests.megatron_parts import config, fp32

    testing.ensure_process_group()
    shared = config()
    members = [fp32(torch.optim.AdamW(torch.nn.Linear(3, 2).parameters()), shared) for _ in range(2)]
    return ChainedOptimizer(members)


def run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "opttree", "describe", FACTORY, *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=180,
    )
    return done.stdout


def test_describe_prints_the_tree() -> None:
    lines = run().splitlines()
    assert lines[0] == "ChainedOptimizer members=2  @ <root>"
    assert lines[1] == "  2 x FP32Optimizer  @ chained[0] .. chained[1]"
    assert lines[2].startswith("    AdamW params=2 (8 elements) state=empty  @ chained[0].optimizer")


def test_describe_json_is_machine_readable() -> None:
    payload = json.loads(run("--json"))
    root = payload["tree"]
    assert (root["kind"], root["class"], root["path"]) == ("chained", "ChainedOptimizer", "")
    assert [c["path"] for c in root["children"]] == ["chained[0]", "chained[1]"]
    leaf = root["children"][1]["children"][0]
    assert (leaf["kind"], leaf["path"]) == ("leaf", "chained[1].optimizer")
    assert payload["problems"] == []
