"""Process harness for the fault-tolerance tests: spawn workers, collect results, kill -9."""

from __future__ import annotations

import os
import queue
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

from executor.warm_runtime import warm_forkserver
from tests.executor.stores import start_store

# Workers are forked from a fork server that imported torch and the engine once and warmed the
# runtime (fast starts, no lazy import in a first backward, no state inherited from pytest).
CTX = warm_forkserver(["torch", "executor.trainer", "executor.comm", "executor.fabric"])


def run_worker(target: Callable[..., Any], worker: int, results: Any, *args: Any) -> None:
    """Entry point of every spawned worker: one torch thread, result (or traceback) to the parent."""
    import torch

    torch.set_num_threads(1)
    try:
        out: Any = ("ok", target(worker, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        out = ("error", traceback.format_exc())
    results.put((worker, out))
    results.close()
    results.join_thread()
    # Skip interpreter teardown: a gloo group with an abandoned op blocks its destructor until
    # the group timeout, and the test already has what it needs. Flush first: os._exit drops
    # what a worker printed into a pipe's buffer (make gpu-check keeps it in the check's log).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(target: Callable[..., Any], workers: list[int], *args: Any) -> tuple[dict[int, Any], Any]:
    results = CTX.Queue()
    procs = {}
    for w in workers:
        p = CTX.Process(target=run_worker, args=(target, w, results, *args), daemon=True)
        p.start()
        procs[w] = p
    return procs, results


def collect(procs: dict[int, Any], results: Any, expect: list[int], timeout_s: float) -> dict[int, Any]:
    """Results of the workers in `expect`; raises with the worker's traceback if one failed."""
    got: dict[int, Any] = {}
    try:
        while len(got) < len(expect):
            w, (status, value) = results.get(timeout=timeout_s)
            if status == "error":
                raise AssertionError(f"worker {w} failed:\n{value}")
            got[w] = value
    except queue.Empty:
        missing = sorted(set(expect) - set(got))
        raise AssertionError(f"workers {missing} sent no result within {timeout_s}s") from None
    finally:
        for p in procs.values():
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return got


def kill9(procs: dict[int, Any], worker: int) -> None:
    os.kill(procs[worker].pid, signal.SIGKILL)


def run_on_store(
    target: Callable[..., Any], workers: list[int], timeout_s: float, *args: Any
) -> dict[int, Any]:
    """`target(worker, store_port, *args)` in one process per worker on a fresh store: their
    results (`collect`), the store stopped whatever happens."""
    server = start_store()
    try:
        procs, results = spawn(target, workers, server.port, *args)
        return collect(procs, results, workers, timeout_s=timeout_s)
    finally:
        server.stop()
