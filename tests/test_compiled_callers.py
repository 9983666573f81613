"""The public functions called from code torch.compile traces run as they do eagerly."""

from __future__ import annotations

import torch

import opttree
from tests.helpers import model, train


def test_validate_describe_and_reset_inside_a_compiled_function_run_eagerly() -> None:
    """A compiled training step that resets, or logs describe, on a schedule: dynamo raised
    its own errors from all three (validate and describe never raise), where each now runs
    as plain Python and does what it does outside."""
    net = model()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    train(net, optimizer, 0, 3)
    expected_text = opttree.describe(optimizer)

    @torch.compile(backend="eager")
    def checked() -> tuple[tuple[opttree.Problem, ...], str]:
        return opttree.validate(optimizer), opttree.describe(optimizer)

    @torch.compile(backend="eager")
    def reset() -> opttree.ResetReport:
        return opttree.reset(optimizer)

    torch._dynamo.reset()
    assert checked() == ((), expected_text)
    report = reset()

    assert report.steps == len(optimizer.state) > 0
    assert all(not value.any() for entry in optimizer.state.values() for value in entry.values())


def test_the_visitors_entry_points_inside_a_compiled_function_run_eagerly() -> None:
    """ValidateVisitor.check, DescribeVisitor.render and ResetVisitor.reset take a tree as
    the functions do, and run as they do inside compiled code too."""
    net = model()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    train(net, optimizer, 0, 3)
    root = opttree.tree(optimizer)
    expected_text = opttree.DescribeVisitor().render(root)

    @torch.compile(backend="eager")
    def checked_and_reset() -> tuple[tuple[opttree.Problem, ...], str, opttree.ResetReport]:
        validator = opttree.ValidateVisitor()
        validator.check(root)
        return tuple(validator.problems), opttree.DescribeVisitor().render(root), opttree.ResetVisitor().reset(root)

    torch._dynamo.reset()
    problems, text, report = checked_and_reset()

    assert problems == () and text == expected_text and report.steps == len(optimizer.state) > 0
