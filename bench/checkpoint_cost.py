"""What a layout-independent checkpoint costs a running job, and what resuming costs (docs/api.md).

A PP=2 x DP=2 gloo job of the GPT example (hidden `--hidden`, 4 blocks, seq 32, global batch 32
in 2 micro-batches) runs on the fault-tolerant path (dynamic communicator, ring snapshots, commit
vote), checkpointing every `--every` steps the way `elaswave run` does: the stage's state is
gathered to host memory inside the step (before the vote), written by a background thread after
the commit. Reported side by side from the same run:

- the stall: the median time of a checkpointing step minus the median of the others, as a
  fraction of a step, and the gather alone (the part the step waits for by design);
- the time to resume: a fresh PP=1 x DP=4 job (another layout) loading the latest checkpoint,
  as a fraction of a step, besides the time of its first step.

    python -m bench.checkpoint_cost --hidden 256 --steps 12 --every 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from examples.gpt.data import MarkovWindows
from examples.gpt.model import ModelConfig, gpt_units, per_sample_loss
from executor.comm import Communicator, groups_for_stages
from executor.fabric.trainer_state import FabricParticipant
from executor.optim import OptimizerConfig
from executor.step_protocol import StepProtocol
from executor.store_server import StoreServer, connect_store
from executor.trainer import Trainer, TrainSpec, checkpoint_payload, checkpoint_writer, load_checkpoint
from planners.layout import make_uniform_layout

TIMEOUT_S = 120.0
WARMUP = 2


def train_spec(hidden: int) -> TrainSpec:
    cfg = ModelConfig(hidden=hidden, num_heads=4, num_layers=4, seq_len=32, dropout=0.0)
    return TrainSpec(
        gpt_units(cfg),
        per_sample_loss,
        MarkovWindows(cfg.vocab_size, cfg.seq_len, 1 << 14, seed=0),
        OptimizerConfig("adamw", lr=3e-3, weight_decay=0.01),
    )


def _worker(rank: int, port: int, args: tuple[int, int, int, int, str, bool], results: Any) -> None:
    hidden, steps, every, pp, root, resume = args
    torch.set_num_threads(1)
    spec = train_spec(hidden)
    numel = spec.unit_numels()
    layout = make_uniform_layout(
        len(numel), pp, 4 // pp, global_batch=32, num_micro_batches=2, layer_numel=numel
    )
    comm = Communicator(
        connect_store("127.0.0.1", port, TIMEOUT_S),
        rank,
        groups_for_stages([s.ranks for s in layout.stages]),
        timeout_s=TIMEOUT_S,
    )
    trainer = Trainer(spec, layout, rank, comm)
    start, load_s = 0, 0.0
    if resume:
        t0 = time.perf_counter()
        start = load_checkpoint(trainer, root).next_step
        load_s = time.perf_counter() - t0
    proto = StepProtocol(
        comm, FabricParticipant(trainer, comm), timeout_s=TIMEOUT_S, committed_step=start - 1
    )
    writer = checkpoint_writer(spec, Path(root), layout.global_batch, "resume" if resume else "bench")
    plain: list[float] = []
    saving: list[float] = []
    gather: list[float] = []
    for step in range(start, start + steps):
        t0 = time.perf_counter()
        proto.begin_step(step)
        trainer.train_step(step)
        due = not resume and (step + 1) % every == 0
        payload = None
        if due:
            g0 = time.perf_counter()
            payload = checkpoint_payload(trainer)
            gather.append(time.perf_counter() - g0)
        if not proto.should_commit():
            raise RuntimeError(f"step {step} did not commit in a fault-free run")
        proto.commit()
        if payload is not None:
            writer.submit(payload)
        if step >= start + WARMUP or resume:
            (saving if due else plain).append(time.perf_counter() - t0)
    writer.wait(TIMEOUT_S)
    results.put((rank, plain, saving, gather, load_s))
    results.close()
    results.join_thread()
    os._exit(0)


def run(
    args: tuple[int, int, int, int, str, bool],
) -> list[tuple[int, list[float], list[float], list[float], float]]:
    server = StoreServer.start()
    try:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "executor.trainer", "executor.fabric"])
        results = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, server.port, args, results)) for r in range(4)]
        for p in procs:
            p.start()
        try:
            out = [results.get(timeout=TIMEOUT_S) for _ in procs]
        except queue.Empty:
            raise RuntimeError("a worker did not report in time") from None
        for p in procs:
            p.join(timeout=TIMEOUT_S)
    finally:
        server.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    args = parser.parse_args(argv)
    if args.every < 1 or args.steps < WARMUP + 2 * args.every:
        parser.error("need --every >= 1 and --steps >= 2 + 2 x --every (steps with and without a checkpoint)")
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as root:
        written = run((args.hidden, args.steps, args.every, 2, root, False))
        resumed = run((args.hidden, 3, args.every, 1, root, True))
        from executor.checkpoint import latest_checkpoint  # noqa: PLC0415

        size = sum(f.stat().st_size for f in latest_checkpoint(root).rglob("*.pt"))
    plain = statistics.median(t for _, p, _, _, _ in written for t in p)
    saving = statistics.median(t for _, _, s, _, _ in written for t in s)
    gather = statistics.median(t for _, _, _, g, _ in written for t in g)
    load = max(r[4] for r in resumed)
    first = max(r[1][0] for r in resumed)
    print(
        f"# checkpoint cost, GPT hidden {args.hidden} (4 blocks, seq 32, batch 32 in 2 micro-batches), "
        f"PP=2 x DP=2 on gloo, {os.cpu_count()} shared CPU cores, torch {torch.__version__}; "
        f"checkpoint of {size / 2**20:.1f} MiB every {args.every} steps"
    )
    print(
        "| step without | step with a checkpoint | stall | stall / step | gather (in step) | gather / step |"
    )
    print("|---|---|---|---|---|---|")
    print(
        f"| {plain * 1e3:.1f} ms | {saving * 1e3:.1f} ms | {(saving - plain) * 1e3:+.1f} ms | "
        f"{(saving - plain) / plain:+.2f} | {gather * 1e3:.1f} ms | {gather / plain:.2f} |"
    )
    print(
        f"resume on PP=1 x DP=4: loading the checkpoint {load * 1e3:.1f} ms = {load / plain:.2f} step; "
        f"first step after it {first * 1e3:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
