"""Reset and describe costs, as ratios measured in one run on this machine.

    .venv-current/bin/python benchmarks/reset_bench.py [--device cpu|cuda] [--quick]

Each timing is the best of several rounds in which the functions compared take turns,
with ``megatron.core.optimizer`` imported, as in training code: what it imports changes
the cost of some builtins (filelock's audit hook makes every ``id()`` a Python call).
Ratios compare opttree with the per-tensor loop hand-written resets use, with a bare
``torch._foreach_zero_`` over the same tensors, and with zeroing one flat buffer of the
same size.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import warnings
from collections.abc import Callable

import torch

import opttree
from opttree.testing import cuda_on_cpu

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # no TransformerEngine or apex here
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer


def best_of(*fns: Callable[[], object], repeats: int) -> list[float]:
    """The best time of each function over ``repeats`` rounds, the functions taking turns
    in each round, so that a ratio of two compares them under the same machine load."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


DEVICE = torch.device("cpu")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def stepped_adamw(n_params: int, numel: int) -> torch.optim.AdamW:
    params = [torch.nn.Parameter(torch.zeros(numel, device=DEVICE)) for _ in range(n_params)]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.AdamW(params, foreach=True, capturable=DEVICE.type == "cuda")
    optimizer.step()
    for p in params:
        p.grad = None
    return optimizer


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]


def per_tensor_loop(optimizer: torch.optim.Optimizer) -> None:
    for entry in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            entry[key].zero_()


def many_small(n_params: int, repeats: int) -> None:
    optimizer = stepped_adamw(n_params, 1024)
    tensors = state_tensors(optimizer)
    loop, bare, ours, checks = best_of(
        lambda: per_tensor_loop(optimizer),
        lambda: torch._foreach_zero_(tensors),
        lambda: opttree.reset(optimizer),
        lambda: opttree.validate(optimizer),
        repeats=repeats,
    )
    print(f"{n_params:,} AdamW params x 1,024 floats ({len(tensors):,} state tensors):")
    print(f"  per-tensor loop {loop * 1e3:8.2f} ms | bare foreach {bare * 1e3:8.2f} ms | opttree.reset {ours * 1e3:8.2f} ms")
    print(f"  (of which checking and planning, as opttree.validate does them: {checks * 1e3:.2f} ms)")
    print(f"  speed-up over the per-tensor loop: {loop / ours:.2f}x (target >= 1.3x)")
    print(f"  opttree.reset / bare foreach:      {ours / bare:.2f}x (target <= 1.25x)")


def few_large(n_params: int, numel: int, repeats: int) -> None:
    optimizer = stepped_adamw(n_params, numel)
    history_bytes = sum(t.numel() * t.element_size() for t in state_tensors(optimizer))
    flat = torch.empty(history_bytes // 4, device=DEVICE)
    ours, one = best_of(lambda: opttree.reset(optimizer), flat.zero_, repeats=repeats)
    print(f"{n_params} AdamW params x {numel:,} floats ({history_bytes / 2**30:.2f} GiB of state):")
    print(f"  opttree.reset {history_bytes / ours / 2**30:6.2f} GiB/s | one flat buffer {history_bytes / one / 2**30:6.2f} GiB/s")
    print(f"  bandwidth ratio: {one / ours:.2f} (target >= 0.9)")
    del flat


def resident_bytes() -> int:
    """This process's resident memory, from ``/proc/self/statm`` (Linux)."""
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def in_use() -> int:
    gc.collect()
    return torch.cuda.memory_allocated() if DEVICE.type == "cuda" else resident_bytes()


def released(n_params: int, numel: int) -> None:
    """``release=True`` frees the state it deletes: measured by the device's allocator on
    a GPU, and on the CPU by the process's resident memory, since tensors this large are
    mapped pages that go back to the system when freed (measured first: once glibc has
    freed a large mapping it serves blocks up to 32 MiB from its heap, which it keeps)."""
    optimizer = stepped_adamw(n_params, numel)
    before = in_use()
    report = opttree.reset(optimizer, release=True)
    freed = before - in_use()
    what = "allocated" if DEVICE.type == "cuda" else "resident"
    print(f"release=True over {n_params} AdamW params x {numel:,} floats:")
    print(
        f"  reported {report.bytes_released / 2**30:.2f} GiB in {report.entries_released} entries; "
        f"{what} memory fell by {freed / 2**30:.2f} GiB (target: at least 0.9 of the reported)"
    )


def allocated(reset: Callable[[], object]) -> int:
    """Bytes the device's allocator hands out during ``reset``."""
    if DEVICE.type == "cuda":
        sync()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        reset()
        sync()
        return torch.cuda.max_memory_allocated() - before
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        reset()
    return sum(max(e.cpu_memory_usage, 0) for e in prof.key_averages())


def reset_allocations(n_params: int) -> None:
    """A reset allocates no tensors: its checks work on Python lists of addresses."""
    optimizer = stepped_adamw(n_params, 1024)
    used = allocated(lambda: opttree.reset(optimizer))
    print(f"bytes allocated on {DEVICE.type} during a reset of {n_params:,} params: {used:,}")


def hybrid(n_params: int, repeats: int) -> None:
    """Parameters of seven sizes in turn, so that no two neighbouring leaves are equal."""
    device = cuda_on_cpu()
    params = [torch.nn.Parameter(torch.zeros(16 * (1 + i % 7))) for i in range(n_params)]
    device.mark_on_gpu(*params)
    with device:
        optimizer = HybridDeviceOptimizer(
            params,
            offload_fraction=1.0,
            cpu_optimizer_cls=torch.optim.AdamW,
            gpu_optimizer_cls=torch.optim.AdamW,
            overlap_cpu_optimizer_d2h_h2d=True,
            lr=1e-3,
        )
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
    text = opttree.describe(optimizer)
    model = torch.nn.ParameterList(params)
    describe, validate, masters, reset = best_of(
        lambda: opttree.describe(optimizer),
        lambda: opttree.validate(optimizer),
        lambda: opttree.validate(optimizer, model=model),
        lambda: opttree.reset(optimizer),
        repeats=repeats,
    )
    print(f"HybridDeviceOptimizer with {len(optimizer.cpu_optimizers):,} CPU sub-optimizers of 7 sizes:")
    print(f"  describe {describe * 1e3:7.1f} ms, {len(text.splitlines())} lines (targets < 100 ms, <= 60 lines)")
    print(f"  tree + validate {validate * 1e3:7.1f} ms (target < 100 ms)")
    print(f"  tree + validate with the stale-master check of {len(params):,} copies {masters * 1e3:7.1f} ms")
    print(f"  reset {reset * 1e3:7.1f} ms (tree, validation and zeroing)")


def scaling(counts: list[int], repeats: int) -> None:
    print("scaling of opttree.reset (AdamW, 3 state tensors per parameter, 64 floats each):")
    print(f"  {'state tensors':>14} {'ms':>9} {'us/tensor':>10}")
    for count in counts:
        optimizer = stepped_adamw(count // 3, 64)
        (seconds,) = best_of(lambda: opttree.reset(optimizer), repeats=repeats)
        print(f"  {count:>14,} {seconds * 1e3:9.2f} {seconds / count * 1e6:10.3f}")


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    DEVICE = torch.device(args.device)
    quick: bool = args.quick
    print(f"torch {torch.__version__}, device {DEVICE}, threads {torch.get_num_threads()}")
    released(4 if quick else 40, 1 << 20 if quick else 4 << 20)
    many_small(2_000 if quick else 20_000, 3 if quick else 7)
    few_large(4 if quick else 40, 1 << 20 if quick else 4 << 20, 3 if quick else 5)
    reset_allocations(1_000)
    hybrid(1_000 if quick else 10_000, 3 if quick else 5)
    scaling([1_000, 10_000] if quick else [1_000, 10_000, 100_000], 3 if quick else 5)


if __name__ == "__main__":
    main()
