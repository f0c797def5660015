"""Bandwidths at sizes where bytes, not fixed costs, set the time: a gloo send between two
processes and a reload of a `torch.save` file (what `bench.calibrate` writes as the simulator's
`link_bytes_per_s` and `storage_bytes_per_s`).

    python -m bench.link_bandwidth [--mib 256] [--repeats 3]

The recovery benchmarks move a few MB (`bench.join`: the joiner's state), so their time is the
transfer's fixed part (groups, the stage's model rebuilt), and bytes / time is no bandwidth to
move the GBs of a paper-scale rank at. Here one tensor of `--mib` MiB goes from rank 0 to rank 1
over gloo (TCP on this machine) `--repeats` times, and a file of the same size is written and read
back with `torch.load`; each figure is the median. Both are this machine's (loopback, the page
cache): they say what this implementation moves per second here, not what a cluster's links do.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pair(rank: int, port: int, numel: int, repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        buf = torch.ones(numel) if rank == 0 else torch.empty(numel)
        times = []
        for _ in range(repeats + 1):  # the first exchange sets the connection up: not timed
            dist.barrier()
            start = time.perf_counter()
            (dist.send if rank == 0 else dist.recv)(buf, 1 - rank)
            times.append(time.perf_counter() - start)
        if rank == 1:
            Path(out).write_text(json.dumps(times[1:]))
    finally:
        dist.destroy_process_group()


def link_bytes_per_s(mib: int = 256, repeats: int = 3) -> float:
    """Median bytes per second of a `mib` MiB gloo send from one process to another."""
    numel = mib * 2**20 // 4
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        mp.spawn(_pair, args=(_free_port(), numel, repeats, out), nprocs=2, join=True)
        times = json.loads(Path(out).read_text())
    return numel * 4 / statistics.median(times)


def storage_bytes_per_s(mib: int = 256, repeats: int = 3) -> float:
    """Median bytes per second of `torch.load` of a `mib` MiB file written by `torch.save`."""
    tensor = torch.ones(mib * 2**20 // 4)
    times = []
    with tempfile.TemporaryDirectory(prefix="link-bandwidth-") as tmp:
        path = Path(tmp) / "state.pt"
        torch.save({"state": tensor}, path)
        size = path.stat().st_size
        for _ in range(repeats):
            start = time.perf_counter()
            torch.load(path, weights_only=True)
            times.append(time.perf_counter() - start)
    return size / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.mib < 1 or args.repeats < 1:
        parser.error("--mib and --repeats must be >= 1")
    link = link_bytes_per_s(args.mib, args.repeats)
    storage = storage_bytes_per_s(args.mib, args.repeats)
    print(
        f"gloo send, {args.mib} MiB: {link / 1e6:.0f} MB/s; torch.load, {args.mib} MiB: {storage / 1e6:.0f} MB/s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
