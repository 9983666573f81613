"""What ``reset`` logs on the ``opttree`` logger, and when: after its writes, so that no
code of the caller's (a filter, a handler) runs between its last check and its writes, and
never as an error out of a reset carried out."""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator

import pytest
import torch

import opttree
from tests.helpers import on_one_step, stepped_adamw

LOGGER = logging.getLogger("opttree")


class RaisingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        raise RuntimeError("the caller's filter refuses")


class Watching(logging.Handler):
    """Records, with each message, the history's sums when it is logged."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(logging.DEBUG)
        self.optimizer = optimizer
        self.seen: list[tuple[str, list[float]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        sums = [float(entry["exp_avg"].abs().sum()) for entry in self.optimizer.state.values()]
        self.seen.append((record.getMessage(), sums))


@pytest.fixture
def logged() -> Iterator[logging.Logger]:
    level = LOGGER.level
    LOGGER.setLevel(logging.INFO)
    try:
        yield LOGGER
    finally:
        LOGGER.setLevel(level)


@pytest.fixture
def refusing(logged: logging.Logger) -> Iterator[logging.Logger]:
    """The ``opttree`` logger with a filter of the caller's that raises."""
    raising = RaisingFilter()
    logged.addFilter(raising)
    try:
        yield logged
    finally:
        logged.removeFilter(raising)


@pytest.mark.usefixtures("refusing")
def test_a_raising_filter_never_turns_a_reset_carried_out_into_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    optimizer = stepped_adamw(2)
    on_one_step(optimizer)  # a warning to log, besides the report

    report = opttree.reset(optimizer)

    assert report.steps == 1
    assert all(not entry["exp_avg"].any() and float(entry["step"]) == 0 for entry in optimizer.state.values())
    printed = capsys.readouterr().err
    assert printed.count("--- Logging error on the opttree logger") == 2  # the warning's and the report's
    assert printed.count("RuntimeError: the caller's filter refuses") == 2


def test_the_caller_s_handlers_run_after_the_writes(logged: logging.Logger) -> None:
    optimizer = stepped_adamw(2)
    on_one_step(optimizer)
    watching = Watching(optimizer)
    logged.addHandler(watching)
    try:
        opttree.reset(optimizer)
    finally:
        logged.removeHandler(watching)

    assert [message.split(":")[0] for message, _ in watching.seen] == ["warning", "reset 1 optimizers"]
    assert all(sums == [0.0, 0.0] for _, sums in watching.seen)


def test_a_refused_reset_logs_nothing(logged: logging.Logger) -> None:
    optimizer = stepped_adamw(2)
    next(iter(optimizer.state.values()))["exp_avg"] = "not a tensor"
    watching = Watching(optimizer)
    logged.addHandler(watching)
    try:
        with pytest.raises(opttree.UnsupportedOptimizerState):
            opttree.reset(optimizer)
    finally:
        logged.removeHandler(watching)

    assert watching.seen == []


@pytest.mark.usefixtures("refusing")
def test_a_closed_standard_error_swallows_the_report_of_a_raising_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    optimizer = stepped_adamw(2)

    report = opttree.reset(optimizer)

    assert report.steps == 2
