"""``describe`` stays short however many leaves a tree holds, and its totals are exact.

The trees are real HybridDeviceOptimizers with one CPU AdamW per parameter, of varied
sizes, so that no two neighbouring leaves are alike enough to collapse as equals.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import opttree
from opttree._describe import DETAIL_LIMIT
from opttree._report import format_bytes
from tests.megatron_parts import hybrid, train_hybrid

pytestmark = pytest.mark.usefixtures("process_group")

ADAMW_STATE_BYTES_PER_ELEMENT = 8  # exp_avg and exp_avg_sq, float32
STEP_BYTES = 4  # torch AdamW's per-parameter float32 step tensor


def sizes(n: int) -> list[int]:
    return [1 + i % 7 for i in range(n)]


def state_bytes(elements: int, params: int) -> int:
    return ADAMW_STATE_BYTES_PER_ELEMENT * elements + STEP_BYTES * params


def test_a_long_run_of_leaves_prints_one_line_of_exact_totals() -> None:
    stack = hybrid(sizes(200))
    train_hybrid(stack, 0, 2)
    elements = sum(sizes(200))

    lines = opttree.describe(stack[0]).splitlines()

    assert lines == [
        "HybridDeviceOptimizer cpu_optimizers=200 gpu_optimizer=none offload_fraction=1  @ <root>",
        f"  200 x AdamW, in all: params=200 ({elements:,} elements) "
        f"state={format_bytes(state_bytes(elements, 200))} [float32@cpu {format_bytes(state_bytes(elements, 200))}] "
        "step=2  @ sub_optimizers[0] .. sub_optimizers[199]",
    ]


def test_a_short_run_is_described_leaf_by_leaf() -> None:
    stack = hybrid(sizes(DETAIL_LIMIT))
    train_hybrid(stack, 0, 1)

    lines = opttree.describe(stack[0]).splitlines()

    assert len(lines) == 1 + DETAIL_LIMIT
    assert lines[1] == f"  AdamW params=1 (1 elements) state={format_bytes(state_bytes(1, 1))} [float32@cpu 12 B] step=1  @ sub_optimizers[0]"


def test_totals_show_the_range_of_steps() -> None:
    optimizer, params, _ = stack = hybrid(sizes(20))
    train_hybrid(stack, 0, 2)
    opttree.reset(optimizer, params=params[::2], keys=["exp_avg", "exp_avg_sq", "step"])  # half start again

    text = opttree.describe(optimizer)

    assert "20 x AdamW, in all: params=20" in text
    assert "step=0..2  @ sub_optimizers[0] .. sub_optimizers[19]" in text


def test_the_gpu_sub_optimizer_is_never_totalled_with_the_cpu_ones() -> None:
    stack = hybrid(sizes(40), offload=0.5)
    train_hybrid(stack, 0, 1)
    optimizer = stack[0]
    assert optimizer.gpu_optimizer is not None
    gpu_params = optimizer.gpu_optimizer.param_groups[0]["params"]

    lines = opttree.describe(optimizer).splitlines()

    cpu = len(optimizer.cpu_optimizers)
    assert len(lines) == 3
    assert lines[1].startswith(f"  {cpu} x AdamW, in all: params={cpu} ")
    assert lines[2].startswith(f"  AdamW params={len(gpu_params)} ")
    assert lines[2].endswith(f"@ sub_optimizers[{cpu}]")


def test_the_gathered_tree_shape_counts_equal_neighbours() -> None:
    stack = hybrid(sizes(30))
    train_hybrid(stack, 0, 1)

    text = opttree.describe(stack[0], group=dist.group.WORLD)

    assert "HybridDeviceOptimizer[AdamW*30]" in text


def test_a_malformed_leaf_in_a_long_run_is_counted_beside_the_totals_of_the_rest() -> None:
    optimizer, _, _ = stack = hybrid(sizes(20))
    train_hybrid(stack, 0, 2)
    broken = optimizer.cpu_optimizers[3]
    broken.state[next(iter(broken.state))] = None
    elements = sum(sizes(20)) - sizes(20)[3]

    lines = opttree.describe(optimizer).splitlines()

    assert lines[1] == (
        f"  20 x AdamW, in all: params=19 ({elements:,} elements) "
        f"state={format_bytes(state_bytes(elements, 19))} [float32@cpu {format_bytes(state_bytes(elements, 19))}] "
        "step=2; 1 of 20 leaves malformed, the first: a state entry is a NoneType, expected a dict"
        "  @ sub_optimizers[0] .. sub_optimizers[19]"
    )


def test_state_is_totalled_by_its_own_device_and_nan_steps_are_counted() -> None:
    """A meta tensor, which reports no device index as a CPU one does, is shown as meta;
    NaN steps are counted apart from the range of the others."""
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(3)]
    optimizer = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones(4)
    optimizer.step()
    first, second, third = optimizer.state.values()
    first["exp_avg"] = torch.empty(4, device="meta")
    third["step"].fill_(float("nan"))

    text = opttree.describe(optimizer)

    assert "state=108 B [float32@cpu 92 B, float32@meta 16 B] step=1 (1 NaN)" in text
    for entry in (first, second):
        entry["step"].fill_(float("nan"))
    assert opttree.describe(optimizer).endswith("step=NaN  @ <root>")
