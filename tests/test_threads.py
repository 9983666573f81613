"""Lookups and resets from many threads at once, and zeroing on worker threads."""

from __future__ import annotations

import sys
import threading
import timeit
import types
import warnings
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import torch

import opttree
from opttree import _zeroing
from opttree._dispatch import LazyDispatch, dotted_name
from tests.helpers import Refuse

T = TypeVar("T")

THREADS = 8
MODULE = "tests_threads_dynamic"
USERS = opttree.StateSchema(zero={"exp_avg"}, keep={"exp_avg_sq"}, step=opttree.StepLocation.PER_PARAMETER)
"""Unlike the built-in AdamW schema, keeps ``exp_avg_sq``: a reset shows which one was used."""


@pytest.fixture
def often_switching() -> Iterator[None]:
    """Threads switch every microsecond, so that a race window of a few bytecodes is hit."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


@pytest.fixture
def dynamic_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A module the classes of a test are defined in, as if the user had imported it."""
    module = types.ModuleType(MODULE)
    monkeypatch.setitem(sys.modules, MODULE, module)
    return module


def in_lockstep(rounds: int, threads: int, call: Callable[[int, int], T]) -> list[list[T | BaseException]]:
    """``call(round, thread)`` on each of ``threads`` threads, all of them starting each
    round together; the results by round and thread, an error standing for its result."""
    barrier = threading.Barrier(threads)
    results: list[list[T | BaseException]] = [[RuntimeError("not run")] * threads for _ in range(rounds)]

    def run(thread: int) -> None:
        for round_ in range(rounds):
            barrier.wait()
            try:
                results[round_][thread] = call(round_, thread)
            except Exception as error:  # noqa: BLE001 - the test reports it
                results[round_][thread] = error

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return results


def stepped(cls: type[torch.optim.AdamW], n_params: int = 2) -> torch.optim.AdamW:
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(n_params)]
    optimizer = cls(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    return optimizer


def fresh_adamw_subclass(module: types.ModuleType, name: str) -> type[torch.optim.AdamW]:
    cls = types.new_class(name, (torch.optim.AdamW,), exec_body=lambda ns: ns.update(__module__=module.__name__))
    cls.__qualname__ = name
    setattr(module, name, cls)
    return cls


@pytest.mark.usefixtures("often_switching")
def test_a_lazy_schema_wins_in_every_thread_that_meets_its_class_first(dynamic_module: types.ModuleType) -> None:
    """Each round, eight threads reset AdamW subclasses of two kinds no thread met before."""
    rounds = 40
    classes = [[fresh_adamw_subclass(dynamic_module, f"Lion{r}x{i}") for i in range(2)] for r in range(rounds)]
    for cls in (cls for pair in classes for cls in pair):
        opttree.register_schema(dotted_name(cls), USERS)
    optimizers = [[stepped(classes[r][t % 2]) for t in range(THREADS)] for r in range(rounds)]

    results = in_lockstep(rounds, THREADS, lambda r, t: opttree.reset(optimizers[r][t]))

    wrong = [(r, result) for r, row in enumerate(results) for result in row if not isinstance(result, opttree.ResetReport) or (result.tensors_zeroed, result.tensors_kept) != (2, 2)]
    assert wrong == []
    for optimizer in (o for row in optimizers for o in row):
        assert all(bool((s["exp_avg"] == 0).all() and (s["exp_avg_sq"] != 0).all()) for s in optimizer.state.values())


@pytest.mark.usefixtures("often_switching")
def test_a_table_resolves_each_lazy_class_once_while_others_register(dynamic_module: types.ModuleType) -> None:
    """Each round, six threads look up two lazily registered classes; two register a class
    of their own meanwhile, and ask whether one of the lazy ones is registered."""
    rounds = 300
    table: LazyDispatch[str] = LazyDispatch()
    table.register(torch.optim.AdamW, "built-in")
    classes = [[fresh_adamw_subclass(dynamic_module, f"Tbl{r}x{i}") for i in range(4)] for r in range(rounds)]
    for row in classes:
        for cls in row[:2]:
            table.register_lazy(dotted_name(cls), cls.__qualname__)

    def call(r: int, t: int) -> str | bool | None:
        if t < 6:
            return table.lookup(classes[r][t % 2])
        table.register(classes[r][t - 4], classes[r][t - 4].__qualname__)
        return table.is_registered(dotted_name(classes[r][0]))

    results = in_lockstep(rounds, THREADS, call)

    expected = [[*(classes[r][t % 2].__qualname__ for t in range(6)), True, True] for r in range(rounds)]
    assert [(r, row) for r, row in enumerate(results) if row != expected[r]] == []
    assert all(table.lookup(cls) == cls.__qualname__ for row in classes for cls in row)


def test_a_resolved_lookup_stays_cheap() -> None:
    table: LazyDispatch[str] = LazyDispatch()
    table.register(torch.optim.Optimizer, "any optimizer")
    table.register_lazy("apex.optimizers.fused_adam.FusedAdam", "apex")
    assert table.lookup(torch.optim.SGD) == "any optimizer"
    n = 10_000

    best = min(timeit.repeat(lambda: table.lookup(torch.optim.SGD), number=n, repeat=5)) / n

    assert best < 2e-6


# Zeroing on worker threads


@pytest.fixture
def threads_and_fresh_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """At least two intra-op threads, so that zeroing may be threaded, and no pool yet:
    whether the test made one shows whether it took the threaded path."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    monkeypatch.setattr(_zeroing, "_pool", None)
    yield
    if _zeroing._pool is not None:
        _zeroing._pool.shutdown()
    torch.set_num_threads(threads)


def force(monkeypatch: pytest.MonkeyPatch, threaded: bool) -> None:
    monkeypatch.setattr(_zeroing, "_THREADED_MIN_TENSORS", 0 if threaded else sys.maxsize)
    monkeypatch.setattr(_zeroing, "_THREADED_MAX_AVERAGE_BYTES", sys.maxsize if threaded else 0)


def history(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]


@pytest.mark.usefixtures("threads_and_fresh_pool")
@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_a_reset_is_the_same_with_or_without_threads(monkeypatch: pytest.MonkeyPatch, inference: bool) -> None:
    """Called inside inference mode or not (a rollout's reset), with or without threads."""
    reports = {}
    for threaded in (False, True):
        force(monkeypatch, threaded)
        optimizer = stepped(torch.optim.AdamW, 100)

        with torch.inference_mode(inference):
            reports[threaded] = opttree.reset(optimizer)

        assert (_zeroing._pool is not None) == threaded
        assert all(not t.any() for t in history(optimizer))
    assert reports[False] == reports[True]
    assert (reports[True].tensors_zeroed, reports[True].steps, reports[True].bytes_reset) == (200, 100, 200 * 12)


@pytest.mark.usefixtures("threads_and_fresh_pool")
def test_a_reset_in_inference_mode_zeroes_thousands_of_tensors() -> None:
    """The default thresholds thread this reset, whose workers once ran outside the
    caller's inference mode."""
    optimizer = stepped(torch.optim.AdamW, 2048)

    with torch.inference_mode():
        report = opttree.reset(optimizer)

    assert _zeroing._pool is not None
    assert (report.tensors_zeroed, report.steps) == (4096, 2048)
    assert all(not t.any() and not t.is_inference() for t in history(optimizer))


def quantized() -> torch.Tensor:
    """A tensor ``zero_`` has no kernel for, in any mode: the pre-flight refuses these, so
    only a direct call of the zeroing meets one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated
        return torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8)


@pytest.mark.usefixtures("threads_and_fresh_pool")
@pytest.mark.parametrize("threaded", [False, True], ids=["unthreaded", "threaded"])
@pytest.mark.parametrize("mode", ["grad", "no-grad", "inference"])
def test_zeroing_succeeds_and_fails_alike_in_every_mode(monkeypatch: pytest.MonkeyPatch, threaded: bool, mode: str) -> None:
    """Leaves that require grad and inference tensors are written in any mode, as zeroing
    runs in inference mode on every thread."""
    force(monkeypatch, threaded)
    with torch.inference_mode():
        inference = torch.ones(4)
    tensors = [torch.ones(4, requires_grad=True), inference, *(torch.ones(4) for _ in range(14))]
    caller = {"grad": torch.enable_grad, "no-grad": torch.no_grad, "inference": torch.inference_mode}[mode]

    with caller(), pytest.raises(NotImplementedError, match="QuantizedCPU"):
        _zeroing.zero_lists([[quantized(), *tensors]], total_bytes=16 * 17)
    with caller():
        _zeroing.zero_lists([tensors], total_bytes=16 * 16)

    assert all(not t.any() for t in tensors) and tensors[0].requires_grad


@pytest.mark.usefixtures("threads_and_fresh_pool")
def test_threaded_zeroing_raises_the_first_error_once_every_slice_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first list fails at once, and the last one too; the others keep the workers busy
    for a while."""
    force(monkeypatch, threaded=True)
    busy = [[torch.ones(4) for _ in range(4000)] for _ in range(6)]
    lists = [[quantized(), *busy[0]], *busy[1:], [*busy[0][:10], quantized()]]

    with pytest.raises(NotImplementedError, match="QuantizedCPU"):
        _zeroing.zero_lists(lists, total_bytes=16 * sum(map(len, lists)))

    assert all(not t.any() for tensors in busy[1:] for t in tensors)


@pytest.mark.usefixtures("often_switching", "threads_and_fresh_pool")
def test_threads_that_need_the_pool_at_once_share_one() -> None:
    made = []
    for _ in range(30):
        pools = {id(p): p for p in in_lockstep(1, THREADS, lambda r, t: _zeroing._workers())[0]}
        made.append(len(pools))
        for pool in pools.values():
            assert isinstance(pool, ThreadPoolExecutor)
            pool.shutdown()
        _zeroing._pool = None
    assert made == [1] * 30


@pytest.mark.parametrize("count", [2, 400])
def test_a_reset_under_a_dispatch_mode_runs_alike_on_every_thread(count: int) -> None:
    """Modes are per thread, and the zeroing threads have none: the calling thread runs a
    reset's reads and writes without its modes too, so the outcome is the same whether or
    not the state is large enough for threads (400 NAdam parameters are)."""
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(count)]
    optimizer = torch.optim.NAdam(params)
    for p in params:
        p.grad = torch.ones(3)
    optimizer.step()

    with Refuse():  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode is unannotated
        report = opttree.reset(optimizer)

    assert report.tensors_zeroed == 2 * count and report.tensors_filled == count
    entries = list(optimizer.state.values())
    assert all(not e["exp_avg"].any() and not e["step"].any() and e["mu_product"].item() == 1.0 for e in entries)
