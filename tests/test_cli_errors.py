"""``opttree describe`` and ``opttree validate`` on factories whose objects are refused in
part or whole, or that fail: what ``opttree.describe`` and ``opttree.validate`` report,
one line for a factory that gives no optimizer, and never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

import opttree
from opttree._cli import main
from tests.helpers import stepped_adamw
from tests.test_cli import homegrown

REFUSED_LINE = "  Linear (refused: not an optimizer: expected a torch.optim.Optimizer, a Megatron optimizer or a registered wrapper)  @ items[1]"


class Chain:
    """A registered wrapper whose second member is a module, not an optimizer."""

    def __init__(self, items: list[object]) -> None:
        self.items = items


def _chain_children(chain: object) -> Iterator[tuple[str, object]]:
    assert isinstance(chain, Chain)
    for i, item in enumerate(chain.items):
        yield f"items[{i}]", item


opttree.register_wrapper(Chain, children=_chain_children)


def chain_with_a_module() -> object:
    return Chain([stepped_adamw(1), torch.nn.Linear(2, 2)])


def adamw() -> object:
    return stepped_adamw(1)


def nothing() -> object:
    return None


def failing() -> object:
    raise ValueError("no optimizer today")


def exiting() -> object:
    """A training entry point that exits where it has nothing to do: a CI gate running
    ``opttree validate`` on it must fail, not pass having validated nothing."""
    sys.exit(0)


def closing_stdout() -> object:
    """A factory that closes ``sys.stdout`` (a script tidying up before it returns)."""
    sys.stdout.close()
    return stepped_adamw(1)


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message either")


def failing_unprintably() -> object:
    raise Unprintable


class ExitingMessage(Exception):
    def __str__(self) -> str:
        sys.exit(0)


def failing_with_an_exiting_message() -> object:
    """Its exception's message exits 0 when printed: the command must still fail."""
    raise ExitingMessage


class Aborted(BaseException):
    """A framework's own abort, not an Exception."""


def aborting() -> object:
    raise Aborted("stopped")


class ExitingChildren:
    """A registered wrapper whose children function exits, as a script's helper may."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner


def _exit_instead(wrapper: object) -> Iterator[tuple[str, object]]:
    sys.exit(0)


opttree.register_wrapper(ExitingChildren, children=_exit_instead)


def wrapper_whose_children_exit() -> object:
    return ExitingChildren(stepped_adamw(1))


def run(command: str, factory: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "opttree", command, factory], capture_output=True, text=True, check=False, timeout=180
    )


def test_describe_prints_a_refused_part_as_opttree_describe_does() -> None:
    done = run("describe", "tests.test_cli_errors:chain_with_a_module")

    assert done.returncode == 0 and "Traceback" not in done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "Chain  @ <root>" and lines[2] == REFUSED_LINE
    assert lines[3] == "error: Linear at items[1]: not an optimizer: expected a torch.optim.Optimizer, a Megatron optimizer or a registered wrapper"


def test_describe_json_gives_a_refused_part_as_a_childless_wrapper(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["describe", "tests.test_cli_errors:chain_with_a_module", "--json"]) == 0

    payload = json.loads(capsys.readouterr().out)
    refused = payload["tree"]["children"][1]
    assert (refused["kind"], refused["class"], refused["children"]) == ("wrapper", "Linear", [])
    assert [p["kind"] for p in payload["problems"]] == ["not-an-optimizer"]


@pytest.mark.parametrize("command", ["describe", "validate"])
@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("nothing", "tests.test_cli_errors:nothing() returned a NoneType, not an optimizer: expected a torch.optim.Optimizer"),
        ("failing", "tests.test_cli_errors:failing() raised ValueError: no optimizer today"),
        ("exiting", "tests.test_cli_errors:exiting() raised SystemExit(0) before returning an optimizer"),
        ("failing_unprintably", "tests.test_cli_errors:failing_unprintably() raised Unprintable (whose message cannot be printed)"),
        ("aborting", "tests.test_cli_errors:aborting() raised Aborted: stopped"),
        ("failing_with_an_exiting_message", "tests.test_cli_errors:failing_with_an_exiting_message() raised ExitingMessage (whose message cannot be printed)"),
    ],
)
def test_a_factory_that_gives_no_optimizer_is_one_line_and_a_failure(
    command: str, factory: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, f"tests.test_cli_errors:{factory}"])

    assert isinstance(exited.value.code, str) and exited.value.code.startswith(message)  # printed, exit status 1
    assert "\n" not in exited.value.code and capsys.readouterr().out == ""


def test_validate_prints_the_problems_and_fails_on_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "tests.test_cli_errors:adamw"]) == 0
    assert capsys.readouterr().out == ""

    assert main(["validate", "tests.test_cli_errors:chain_with_a_module"]) == 1
    assert capsys.readouterr().out.splitlines() == [str(p) for p in opttree.validate(chain_with_a_module())]

    assert main(["validate", "tests.test_cli:homegrown", "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == {"problems": [p.to_dict() for p in opttree.validate(homegrown())]}


def test_a_factory_that_exits_fails_the_command_in_a_shell() -> None:
    finished = run("validate", "tests.test_cli_errors:exiting")
    assert finished.returncode == 1 and finished.stdout == ""
    assert finished.stderr.strip() == "tests.test_cli_errors:exiting() raised SystemExit(0) before returning an optimizer"


def test_a_factory_that_closes_stdout_fails_in_one_line_where_there_is_something_to_print() -> None:
    """Where stdout cannot take what the command prints, it fails in one line on stderr
    (describe printed a traceback); a validation with nothing to report prints nothing
    and passes."""
    finished = run("describe", "tests.test_cli_errors:closing_stdout")
    assert (finished.returncode, finished.stdout) == (1, "") and "Traceback" not in finished.stderr
    assert finished.stderr.strip() == "opttree describe: cannot write to stdout: I/O operation on closed file."
    assert run("validate", "tests.test_cli_errors:closing_stdout").returncode == 0


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["text", "json"])
def test_a_command_started_with_stdout_closed_fails_in_one_line(json_flag: list[str]) -> None:
    """With file descriptor 1 closed at launch (``>&-``), Python sets ``sys.stdout`` to
    None: the command fails in one line on stderr, as for a stdout closed later (it printed
    a traceback)."""
    finished = subprocess.run(
        [sys.executable, "-m", "opttree", "describe", "tests.test_cli_errors:adamw", *json_flag],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False, timeout=180, preexec_fn=lambda: os.close(1),
    )
    assert finished.returncode == 1 and "Traceback" not in finished.stderr
    assert finished.stderr.strip().splitlines()[-1] == "opttree describe: cannot write to stdout: it is closed"


@pytest.mark.parametrize("command", [["validate"], ["describe"], ["describe", "--json"]])
def test_an_exit_in_a_registered_function_fails_the_command(command: list[str]) -> None:
    """opttree lets a ``sys.exit`` in a registered function through, as Python code
    expects; the command printed nothing and exited 0, as a clean validation does."""
    finished = subprocess.run(
        [sys.executable, "-m", "opttree", *command, "tests.test_cli_errors:wrapper_whose_children_exit"],
        capture_output=True,
        text=True,
        check=False,
        timeout=180,
    )
    assert finished.returncode == 1 and finished.stdout == ""
    assert finished.stderr.strip() == (
        f"opttree {command[0]}: a function called while checking tests.test_cli_errors:wrapper_whose_children_exit() "
        "(a registered one?) raised SystemExit(0): nothing was checked"
    )
