"""Step time with vs without per-step ring snapshots (ElasWave §7.3, Table 3), side by side.

A PP=2 x DP=3 gloo job of the engine's GPT model runs the same steps with the parameter fabric's
snapshots on and off (alternating runs, same seed), through the step protocol (commit point and
rollback copies in both). With snapshots each worker also sends its gradient shard to its ring
neighbour every step, and that neighbour applies AdamW to its host copy in a background thread.

On this CPU-only machine the "host" update competes with training for the same cores (on an
accelerator it runs on otherwise idle host cores), so the overhead measured here is an upper bound.

    python -m bench.snapshot_overhead --steps 10 --repeats 2
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import time
from typing import Any

import torch

from executor.comm import Communicator, groups_for_stages
from executor.fabric.trainer_state import FabricParticipant
from executor.model import ModelConfig, block_numel
from executor.step_protocol import StepProtocol
from executor.store_server import StoreServer, connect_store
from executor.trainer import TrainConfig, Trainer
from planners.layout import make_uniform_layout

CFG = TrainConfig(model=ModelConfig(hidden=64, num_heads=4, num_layers=4, seq_len=32))
WARMUP = 2
TIMEOUT_S = 120.0


def _worker(worker: int, port: int, snapshots: bool, steps: int, verify_every: int, results: Any) -> None:
    torch.set_num_threads(1)
    layout = make_uniform_layout(4, 2, 3, global_batch=12, num_micro_batches=2,
                                 layer_numel=(block_numel(CFG.model),) * 4)
    comm = Communicator(connect_store("127.0.0.1", port, TIMEOUT_S), worker,
                        groups_for_stages([s.ranks for s in layout.stages]), timeout_s=TIMEOUT_S)
    trainer = Trainer(CFG, layout, worker, comm)
    participant = FabricParticipant(trainer, comm, snapshots=snapshots, verify_every=verify_every)
    proto = StepProtocol(comm, participant, timeout_s=TIMEOUT_S)
    times = []
    for step in range(WARMUP + steps):
        t0 = time.perf_counter()
        proto.begin_step(step)
        trainer.train_step(step)
        if not proto.should_commit():
            raise RuntimeError(f"step {step} did not commit in a fault-free run")
        proto.commit()
        times.append(time.perf_counter() - t0)
    results.put((worker, times[WARMUP:]))
    results.close()
    results.join_thread()
    os._exit(0)


def run(snapshots: bool, steps: int, verify_every: int) -> list[float]:
    """Per-step time of the slowest worker (the job's step time)."""
    server = StoreServer.start()
    try:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "executor.trainer", "executor.fabric"])
        results = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(w, server.port, snapshots, steps, verify_every, results)) for w in range(6)]
        for p in procs:
            p.start()
        per_worker = []
        try:
            for _ in procs:
                per_worker.append(results.get(timeout=TIMEOUT_S)[1])
        except queue.Empty:
            raise RuntimeError("a worker did not report in time") from None
        for p in procs:
            p.join(timeout=TIMEOUT_S)
    finally:
        server.stop()
    return [max(ts) for ts in zip(*per_worker, strict=True)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--verify-every", type=int, default=50, help="checksum snapshot vs live every N steps")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be positive")
    samples: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for snapshots in (False, True):  # alternate so drift in machine load hits both alike
            samples[snapshots].extend(run(snapshots, args.steps, args.verify_every))
    off, on = statistics.median(samples[False]), statistics.median(samples[True])
    print(f"# per-step snapshot overhead, PP=2 x DP=3 on gloo, {os.cpu_count()} shared CPU cores, "
          f"{args.repeats} x {args.steps} steps each, checksum every {args.verify_every} steps")
    print("| snapshots | median step s | samples/s | overhead |")
    print("|---|---|---|---|")
    print(f"| off | {off:.4f} | {12 / off:.1f} | - |")
    print(f"| on | {on:.4f} | {12 / on:.1f} | {100 * (on / off - 1):+.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
