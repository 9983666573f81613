"""``opttree describe MODULE:FACTORY`` and ``python -m opttree``, run as users run them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
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


class Homegrown(torch.optim.Optimizer):
    """An optimizer no schema describes."""

    def __init__(self, params: object) -> None:
        super().__init__(params, {"lr": 0.1})  # type: ignore[arg-type]


def homegrown() -> object:
    return Homegrown(torch.nn.Linear(3, 2).parameters())


def run(*args: str, factory: str = FACTORY, command: tuple[str, ...] = (sys.executable, "-m", "opttree")) -> str:
    done = subprocess.run(
        [*command, "describe", factory, *args],
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
    assert (root["kind"], root["class"], root["path"]) == ("chained", "ChainedOptimizer", "<root>")
    assert [c["path"] for c in root["children"]] == ["chained[0]", "chained[1]"]
    leaf = root["children"][1]["children"][0]
    assert (leaf["kind"], leaf["path"]) == ("leaf", "chained[1].optimizer")
    assert payload["problems"] == []


def test_describe_json_gives_problems_as_objects() -> None:
    payload = json.loads(run("--json", factory="tests.test_cli:homegrown"))
    (problem,) = payload["problems"]
    assert problem == {
        "kind": "unsupported-optimizer",
        "severity": "error",
        "path": "<root>",
        "class": "Homegrown",
        "key": None,
        "message": "no state schema is registered for tests.test_cli.Homegrown",
        "rank": None,
    }


class Talkative:
    """A wrapper whose registered children function prints, as the tree is built."""

    def __init__(self, inner: object) -> None:
        self.inner = inner


def _talkative_children(wrapper: Talkative) -> list[tuple[str, object]]:
    print("listing the children")
    return [("inner", wrapper.inner)]


def talkative() -> object:
    import os

    import opttree

    opttree.register_wrapper(Talkative, children=_talkative_children)
    print("building the optimizer")
    os.write(1, b"below Python\n")
    return Talkative(homegrown())


@pytest.mark.parametrize("command", ["describe", "validate"])
def test_json_is_all_of_stdout_whatever_the_factory_prints(command: str) -> None:
    """What a factory prints, through Python or below it, and what registered functions
    print as the tree is built, go to stderr with ``--json``: they came before the JSON on
    stdout, which then did not parse."""
    done = subprocess.run(
        [sys.executable, "-m", "opttree", command, "tests.test_cli:talkative", "--json"], capture_output=True, text=True, check=False, timeout=180
    )
    assert done.returncode == (1 if command == "validate" else 0)
    assert [p["kind"] for p in json.loads(done.stdout)["problems"]] == ["unsupported-optimizer"]
    assert all(line in done.stderr for line in ("building the optimizer", "below Python", "listing the children"))
    assert "building the optimizer" in run(factory="tests.test_cli:talkative")  # printed as it was without --json


def test_the_console_script_and_the_module_print_the_version() -> None:
    import opttree

    script = Path(sys.executable).parent / "opttree"
    for command in ((str(script),), (sys.executable, "-m", "opttree")):
        done = subprocess.run([*command, "--version"], capture_output=True, text=True, check=True, timeout=60)
        assert done.stdout.strip() == f"opttree {opttree.__version__}"
    assert run(factory="tests.test_cli:homegrown", command=(str(script),)).startswith("Homegrown")


def test_help_shows_the_commands_as_a_shell_user_types_them() -> None:
    """The help text is the module's docstring, whose reST quotes argparse printed as they were."""
    from opttree._cli import parser

    text = parser().format_help()
    assert "opttree describe MODULE:FACTORY [--json] (or python -m opttree)" in text
    assert "``" not in text
