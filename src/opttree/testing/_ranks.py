"""Several gloo ranks on loopback, one process each, with a bounded running time."""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import queue
import signal
import time
import traceback
from collections.abc import Callable
from typing import TypeVar, cast

import torch.distributed as dist

from opttree._errors import OptTreeError

R = TypeVar("R")


_Message = tuple[int, bool, object]


def _rank_main(fn: Callable[[], object], rank: int, world_size: int, port: int, results: multiprocessing.Queue[_Message]) -> None:
    os.setpgrp()  # a process group of its own, which run_ranks ends with every process the rank started
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        value = fn()
        pickle.dumps(value)  # the queue pickles in a thread of its own, where a failure is only printed
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _refuse_bad_arguments(world_size: object, timeout: object) -> None:
    """Refuse before spawning: a NaN or infinite timeout fails only once ranks run, and
    ``world_size`` 0 would return no results, as if every rank had passed."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size <= 0:
        msg = f"run_ranks' world_size must be a positive int, got {world_size!r}"
        raise OptTreeError(msg)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < math.inf:
        msg = f"run_ranks' timeout must be a positive, finite number of seconds, got {timeout!r}"
        raise OptTreeError(msg)


def _end_group(pid: int) -> None:
    """Kill the process group a rank leads (see :func:`_rank_main`), where any of it is left."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the rank and everything it started have ended


def run_ranks(fn: Callable[[], R], world_size: int, *, timeout: float = 180.0) -> list[R]:
    """Run ``fn`` on ``world_size`` gloo ranks and return each rank's result, in rank order.

    ``fn`` runs in a fresh process per rank (``spawn``) after ``init_process_group``, so it
    must be importable by name, and so must what it returns be picklable. A rank that
    raises or returns what cannot be pickled, or a run past ``timeout`` seconds in all,
    raises ``RuntimeError`` here, once every rank's process has ended: ranks still running
    then are killed, since they may wait for the failed one in a collective forever. The
    ranks are not daemonic, so that they may start processes of their own (Megatron's
    ``dist_checkpointing.save`` starts a ``multiprocessing.Manager``); each leads a process
    group, which this function kills before it returns or raises, so that neither a rank
    nor what it started outlives it.
    """
    from opttree.testing._megatron import free_port

    _refuse_bad_arguments(world_size, timeout)
    try:
        pickle.dumps(fn)
    except Exception as error:  # a lambda or a local function: spawn could not send it to the ranks
        msg = f"run_ranks' fn must be importable by name, as each rank runs it in a fresh process: pickling it raised {type(error).__name__}: {error}"
        raise OptTreeError(msg) from error
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[_Message] = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_rank_main, args=(fn, rank, world_size, port, results), daemon=False)
        for rank in range(world_size)
    ]
    collected: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    finished = False
    try:
        for process in processes:
            process.start()
        while len(collected) < world_size:
            try:
                rank, ok, value = results.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                msg = f"{world_size} ranks did not finish within {timeout:g} s"
                raise RuntimeError(msg) from None
            if not ok:
                msg = f"rank {rank} failed:\n{value}"
                raise RuntimeError(msg)
            collected[rank] = value
        finished = True
    finally:
        for process in processes:
            if process.pid is None:
                continue  # never started
            process.join(timeout=10 if finished else 0)
            _end_group(process.pid)  # the rank, where it still runs, and what it started (a Manager's server)
            if process.is_alive():
                process.kill()  # still starting: not yet the leader of a group of its own
            process.join()
    return [cast(R, collected[rank]) for rank in range(world_size)]
