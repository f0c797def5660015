"""Communicator recovery after losing one rank (ElasWave §6.1 / §7.4, Fig. 12b), side by side.

For N ranks laid out as PP=4 x DP=N/4 (one gloo group per stage's DP ranks, one two-worker group
per pipeline link between adjacent stages), one rank of stage 1 leaves and the survivors recover their communication groups three ways,
all measured in the same run:

* partial (the dynamic communicator): `apply_edit` rebuilds only the groups that contained the
  lost rank and reuses every other group object in place;
* full rebuild: the same survivors rebuild every group of the new membership (`mode="full"`);
* restart: new processes (fresh interpreters importing torch), `init_process_group` over the
  store, then every group built, as a torchrun-style restart would.

Times are the slowest survivor's (the job resumes when the last one is ready). All processes share
this machine's cores, so the absolute numbers say little; the ratios are the result.

    python -m bench.comm_recovery --ranks 8 16 32
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import time
from datetime import timedelta
from typing import Any

import torch

from executor.comm import Communicator, RebuildMode, groups_for_stages
from executor.comm.groups import physical_groups
from executor.store_server import StoreServer, connect_store

PP = 4
TIMEOUT_S = 120.0


def layout_for(n: int) -> tuple[list[list[int]], int]:
    if n % PP or n < 2 * PP:
        raise ValueError(f"--ranks must be multiples of {PP} and at least {2 * PP}, got {n}")
    dp = n // PP
    stages = [list(range(s * dp, (s + 1) * dp)) for s in range(PP)]
    return stages, stages[1][dp // 2]


def _barrier(store: Any, key: str, count: int) -> None:
    store.add(key, 1)
    deadline = time.monotonic() + TIMEOUT_S
    while store.add(key, 0) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {key} not reached by {count} workers")
        time.sleep(0.002)


def _check_groups(comm: Communicator) -> None:
    for name in comm.names():
        t = torch.ones(1)
        comm.all_reduce(name, t)
        if t.item() != len(comm.workers(name)):
            raise RuntimeError(
                f"group {name}: all-reduce gave {t.item()}, expected {len(comm.workers(name))}"
            )


def _edit_worker(worker: int, port: int, stages: list[list[int]], victim: int, results: Any) -> None:
    torch.set_num_threads(1)
    store = connect_store("127.0.0.1", port, TIMEOUT_S)
    comm = Communicator(store, worker, groups_for_stages(stages), timeout_s=TIMEOUT_S)
    n = sum(map(len, stages))
    _barrier(store, "built", n)
    if worker == victim:
        os._exit(0)
    new = groups_for_stages([[w for w in ws if w != victim] for ws in stages])
    _barrier(store, "partial", n - 1)
    t0 = time.perf_counter()
    report = comm.apply_edit(new)
    partial_s = time.perf_counter() - t0
    _check_groups(comm)
    _barrier(store, "full", n - 1)
    comm.mode = RebuildMode.FULL
    t0 = time.perf_counter()
    full = comm.apply_edit(new)
    full_s = time.perf_counter() - t0
    _check_groups(comm)
    results.put(
        (
            worker,
            partial_s,
            full_s,
            len(report.rebuilt),
            len(report.rebuilt) + len(report.reused),
            len(full.rebuilt),
        )
    )
    results.close()
    results.join_thread()
    os._exit(0)  # skip interpreter teardown of the groups


def _restart_worker(
    rank: int, worker: int, world: int, port: int, stages: list[list[int]], results: Any
) -> None:
    torch.set_num_threads(1)
    store = connect_store("127.0.0.1", port, TIMEOUT_S)
    torch.distributed.init_process_group(
        "gloo",
        store=torch.distributed.PrefixStore("restart/world", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    comm = Communicator(store, worker, groups_for_stages(stages), timeout_s=TIMEOUT_S, namespace="restart")
    _check_groups(comm)
    results.put((worker, time.time()))
    results.close()
    results.join_thread()
    os._exit(0)


def _gather(results: Any, count: int) -> list[Any]:
    out = []
    try:
        for _ in range(count):
            out.append(results.get(timeout=TIMEOUT_S))
    except queue.Empty:
        raise RuntimeError(f"only {len(out)} of {count} workers reported within {TIMEOUT_S}s") from None
    return out


def measure(n: int) -> dict[str, float]:
    stages, victim = layout_for(n)
    server = StoreServer.start()
    try:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "executor.comm"])
        results = ctx.Queue()
        procs = [
            ctx.Process(target=_edit_worker, args=(w, server.port, stages, victim, results)) for w in range(n)
        ]
        for p in procs:
            p.start()
        rows = _gather(results, n - 1)
        for p in procs:
            p.join(timeout=TIMEOUT_S)
        survivors = [[w for w in ws if w != victim] for ws in stages]
        flat = [w for ws in survivors for w in ws]
        sctx = mp.get_context("spawn")
        restart_results = sctx.Queue()
        t0 = time.time()
        rprocs = [
            sctx.Process(
                target=_restart_worker, args=(r, w, len(flat), server.port, survivors, restart_results)
            )
            for r, w in enumerate(flat)
        ]
        for rp in rprocs:
            rp.start()
        ready = _gather(restart_results, len(flat))
        restart_s = max(t for _, t in ready) - t0
        for rp in rprocs:
            rp.join(timeout=TIMEOUT_S)
    finally:
        server.stop()
    return {
        "partial_s": max(r[1] for r in rows),
        "full_s": max(r[2] for r in rows),
        "restart_s": restart_s,
        # per worker (the slowest survivor rebuilds the most), out of the job's physical groups
        "groups_rebuilt_partial": max(r[3] for r in rows),
        "groups_rebuilt_full": max(r[5] for r in rows),
        "groups_total": len(physical_groups(groups_for_stages(survivors), pp_links=True)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32])
    args = parser.parse_args(argv)
    for n in args.ranks:
        layout_for(n)
    print(
        f"# communicator recovery after losing 1 rank; PP={PP}, gloo on {os.cpu_count()} CPU cores, "
        "all ranks are local processes sharing them"
    )
    print(
        "| ranks | gloo groups in job | rebuilt per worker, partial / full | partial s | full rebuild s "
        "| restart s | full / partial | restart / partial |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in args.ranks:
        m = measure(n)
        print(
            f"| {n} | {m['groups_total']} | {m['groups_rebuilt_partial']} / {m['groups_rebuilt_full']} "
            f"| {m['partial_s']:.3f} "
            f"| {m['full_s']:.3f} | {m['restart_s']:.2f} | {m['full_s'] / m['partial_s']:.1f}x "
            f"| {m['restart_s'] / m['partial_s']:.0f}x |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
