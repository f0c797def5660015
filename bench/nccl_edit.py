"""An NCCL group edit after a kill -9, and device memory across 20 more edits (`make gpu-check` (e)).

Needs two or more GPUs: worker w runs on cuda:w with one NCCL group over all workers. After an
all-reduce that works, the survivors block in an all-reduce the victim never joins; the victim is
killed (SIGKILL) and the parent flags the epoch aborted, as the Core does; every survivor gets
PeerFailure, edits its communicator to the survivors (the dropped group is aborted, executor.comm
.device_groups) and checks an all-reduce on the new group. Then 20 more edits in FULL mode (each
rebuilds the group and aborts the old one). Device memory (allocated, reserved by torch's caching
allocator, and used on the device as NVML/cudaMemGetInfo sees it, which includes NCCL's own
buffers) is read before the edit, after it, and after the 20.

    python -m bench.nccl_edit [--workers 4]
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from typing import Any

import torch

from executor.comm import Communicator, PeerFailure, groups_for_stages
from executor.comm.communicator import RebuildMode
from executor.store_server import StoreServer, connect_store
from tests.executor.ft_procs import collect, kill9, spawn

TIMEOUT_S = 60.0
EXTRA_EDITS = 20


def _used(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


def _worker(worker: int, port: int, n: int) -> dict[str, Any]:
    device = torch.device("cuda", worker)
    torch.cuda.set_device(device)
    store = connect_store("127.0.0.1", port)
    everyone = [list(range(n))]
    comm = Communicator(store, worker, groups_for_stages(everyone), timeout_s=TIMEOUT_S, backend="nccl")
    (name,) = comm.names()
    t = torch.ones(4, device=device)
    comm.all_reduce(name, t)
    assert float(t[0]) == n
    store.set(f"ready/{worker}", "1")
    if worker == n - 1:
        time.sleep(600)  # the victim: killed here
    out: dict[str, Any] = {
        "used_before": _used(device),
        "allocated_before": torch.cuda.memory_allocated(),
        "reserved_before": torch.cuda.memory_reserved(),
    }
    try:
        comm.all_reduce(name, torch.ones(4, device=device))  # the victim never joins
        out["failure"] = None
    except PeerFailure as exc:
        out["failure"] = f"{exc.group}: {exc.reason}"
    survivors = [list(range(n - 1))]
    t0 = time.perf_counter()
    comm.mode = RebuildMode.FULL  # every later edit rebuilds the group (and aborts the old one)
    comm.apply_edit(groups_for_stages(survivors))
    (name,) = comm.names()
    t = torch.ones(4, device=device)
    comm.all_reduce(name, t)
    torch.cuda.synchronize(device)
    out["edit_s"] = time.perf_counter() - t0
    sums = [float(t[0])]
    out["used_after_edit"] = _used(device)
    for _ in range(EXTRA_EDITS):
        comm.apply_edit(groups_for_stages(survivors))
        (name,) = comm.names()
        t = torch.ones(4, device=device)
        comm.all_reduce(name, t)
        sums.append(float(t[0]))
    torch.cuda.synchronize(device)
    out["used_after_20"] = _used(device)
    out["allocated_after_20"] = torch.cuda.memory_allocated()
    out["reserved_after_20"] = torch.cuda.memory_reserved()
    out["sums_ok"] = all(s == n - 1 for s in sums)
    return out


def nccl_edit_after_kill(n: int) -> dict[str, Any]:
    """Run the scenario on `n` GPUs; the survivors' worst figures."""
    if torch.cuda.device_count() < n or n < 2:
        raise ValueError(f"needs {n} >= 2 GPUs, {torch.cuda.device_count()} visible")
    server = StoreServer.start()
    try:
        procs, results = spawn(_worker, list(range(n)), server.port, n)
        store = server.connect()
        store.wait([f"ready/{w}" for w in range(n)], timedelta(seconds=TIMEOUT_S))
        time.sleep(0.5)  # the survivors enter their blocked all-reduce
        kill9(procs, n - 1)
        store.set("ew/e0/abort", f"parent: worker {n - 1} was killed")
        got = collect(procs, results, list(range(n - 1)), timeout_s=TIMEOUT_S * 3)
    finally:
        server.stop()
    return {
        "workers": n,
        "failures": [r["failure"] for r in got.values()],
        "edit_s": max(r["edit_s"] for r in got.values()),
        "used_before": max(r["used_before"] for r in got.values()),
        "used_after_edit": max(r["used_after_edit"] for r in got.values()),
        "used_after_20": max(r["used_after_20"] for r in got.values()),
        "allocated_before": max(r["allocated_before"] for r in got.values()),
        "allocated_after_20": max(r["allocated_after_20"] for r in got.values()),
        "reserved_before": max(r["reserved_before"] for r in got.values()),
        "reserved_after_20": max(r["reserved_after_20"] for r in got.values()),
        "sums_ok": all(r["sums_ok"] for r in got.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=min(4, torch.cuda.device_count()))
    args = p.parse_args()
    print(nccl_edit_after_kill(args.workers))


if __name__ == "__main__":
    main()
