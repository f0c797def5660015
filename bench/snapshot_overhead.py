"""Step time with vs without per-step ring snapshots (ElasWave §7.3, Table 3), side by side.

A PP=2 x DP=3 gloo job of the GPT example (examples/gpt, 4 blocks: 6 units) runs the same steps with the parameter fabric's
snapshots on and off (alternating runs, same seed), through the step protocol (commit point and
rollback copies in both). With snapshots each worker also sends its gradient shard to its ring
neighbour every step, and that neighbour applies the same AdamW update to its host copy in a background thread.

On this CPU-only machine the "host" update competes with training for the same cores (on an
accelerator it runs on otherwise idle host cores), so the overhead measured here is an upper bound.

The periodic checksum (snapshot vs live shard, §5.1) runs every `--verify-every` steps; the
engine's default is every 50 steps, longer than a short run, so this benchmark checks every 5 by
default (every `--steps` if fewer) and reports the cost of one check and that cost amortised over the engine's default
interval (`FabricParticipant.verify_every`), besides the median step times.

    python -m bench.snapshot_overhead --hidden 64 256 --steps 10 --repeats 2
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import multiprocessing as mp
import os
import queue
import statistics
import time
from typing import Any

import torch

from examples.gpt.data import MarkovWindows
from examples.gpt.model import ModelConfig, gpt_units, per_sample_loss
from executor.comm import Communicator, groups_for_stages
from executor.fabric.trainer_state import FabricParticipant
from executor.optim import OptimizerConfig
from executor.step_protocol import StepProtocol
from executor.store_server import StoreServer, connect_store
from executor.trainer import Trainer, TrainSpec
from planners.layout import make_uniform_layout


def train_spec(hidden: int) -> TrainSpec:
    cfg = ModelConfig(hidden=hidden, num_heads=4, num_layers=4, seq_len=32)
    return TrainSpec(
        gpt_units(cfg),
        per_sample_loss,
        MarkovWindows(cfg.vocab_size, cfg.seq_len, 1 << 14, seed=0),
        OptimizerConfig("adamw", lr=3e-3, weight_decay=0.01),
    )


WARMUP = 2
TIMEOUT_S = 120.0


def _worker(
    worker: int, port: int, hidden: int, snapshots: bool, steps: int, verify_every: int, results: Any
) -> None:
    torch.set_num_threads(1)
    spec = train_spec(hidden)
    numel = spec.unit_numels()  # embed, 4 blocks, head: stage 0 = embed + 2 blocks, stage 1 = 2 blocks + head
    layout = make_uniform_layout(len(numel), 2, 3, global_batch=12, num_micro_batches=2, layer_numel=numel)
    comm = Communicator(
        connect_store("127.0.0.1", port, TIMEOUT_S),
        worker,
        groups_for_stages([s.ranks for s in layout.stages]),
        timeout_s=TIMEOUT_S,
    )
    trainer = Trainer(spec, layout, worker, comm)
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
    snap = participant.snapshot
    stats = dataclasses.asdict(snap.stats) if snap is not None else None
    results.put((worker, times[WARMUP:], stats))
    results.close()
    results.join_thread()
    os._exit(0)


def run(
    hidden: int, snapshots: bool, steps: int, verify_every: int
) -> tuple[list[float], list[dict[str, float]]]:
    """Per-step time of the slowest worker (the job's step time), and each worker's snapshot stats."""
    server = StoreServer.start()
    try:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "executor.trainer", "executor.fabric"])
        results = ctx.Queue()
        procs = [
            ctx.Process(
                target=_worker, args=(w, server.port, hidden, snapshots, steps, verify_every, results)
            )
            for w in range(6)
        ]
        for p in procs:
            p.start()
        per_worker, stats = [], []
        try:
            for _ in procs:
                _w, times, st = results.get(timeout=TIMEOUT_S)
                per_worker.append(times)
                if st is not None:
                    stats.append(st)
        except queue.Empty:
            raise RuntimeError("a worker did not report in time") from None
        for p in procs:
            p.join(timeout=TIMEOUT_S)
    finally:
        server.stop()
    return [max(ts) for ts in zip(*per_worker, strict=True)], stats


ENGINE_VERIFY_EVERY = inspect.signature(FabricParticipant).parameters["verify_every"].default


def breakdown_ms(stats: list[dict[str, float]]) -> dict[str, float]:
    """Mean per worker per step, in ms, of each part of the snapshot's cost; the checksum as the
    mean cost of one check (`verify_per_check`), since it runs only every N steps."""
    steps = sum(st["steps"] for st in stats) or 1
    out = {k: 1e3 * sum(st[k] for st in stats) / steps for k in ("post_s", "finish_wait_s", "update_s")}
    checks = sum(st["verifies"] for st in stats)
    out["verify_per_check"] = 1e3 * sum(st["verify_s"] for st in stats) / checks if checks else float("nan")
    return out


def measure(
    hidden: int, steps: int, repeats: int, verify_every: int
) -> tuple[float, float, dict[str, float]]:
    samples: dict[bool, list[float]] = {False: [], True: []}
    stats: list[dict[str, float]] = []
    for _ in range(repeats):
        for snapshots in (False, True):  # alternate so drift in machine load hits both alike
            times, st = run(hidden, snapshots, steps, verify_every)
            samples[snapshots].extend(times)
            stats.extend(st)
    return statistics.median(samples[False]), statistics.median(samples[True]), breakdown_ms(stats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 256], help="model widths to measure")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--verify-every",
        type=int,
        default=None,
        help="checksum snapshot vs live every N steps, N <= --steps so checks run (default: min(5, --steps))",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or min(args.hidden) < 4:
        parser.error("--steps and --repeats must be positive and --hidden at least 4")
    if args.verify_every is None:
        args.verify_every = min(5, args.steps)
    if not 1 <= args.verify_every <= args.steps:
        parser.error(f"--verify-every must be in 1..--steps ({args.steps}), or no checksum would be measured")
    print(
        f"# per-step snapshot overhead, PP=2 x DP=3 on gloo, {os.cpu_count()} shared CPU cores, "
        f"{args.repeats} x {args.steps} steps each, checksum every {args.verify_every} steps"
    )
    print(
        "| hidden | median step s, off | on | overhead | post ms | wait before vote ms | background update ms "
        f"| one checksum ms | checksum ms per step, every {ENGINE_VERIFY_EVERY} |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for hidden in args.hidden:
        off, on, ms = measure(hidden, args.steps, args.repeats, args.verify_every)
        check = ms["verify_per_check"]
        print(
            f"| {hidden} | {off:.4f} | {on:.4f} | {100 * (on / off - 1):+.1f}% | {ms['post_s']:.2f} "
            f"| {ms['finish_wait_s']:.2f} | {ms['update_s']:.2f} | {check:.2f} | {check / ENGINE_VERIFY_EVERY:.3f} |"
        )
    print(
        "post, wait and the checksum are on the step's critical path (a checksum also waits for the "
        "queued background updates); the background update is not, but on this machine it shares the "
        "cores the training processes use. The median step times mostly miss the checksum steps."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
