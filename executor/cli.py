"""`elaswave train`: run the hybrid-parallel engine on CPU/gloo and compare it with the reference.

Prints one row per step: the engine's loss, the single-process reference's loss and their
difference, and (with `--move-at`) a pipeline-only layer move in the middle of the run, so the
bit-identical loss curve is visible. torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("train", help="run the DP x PP x ZeRO engine on CPU and compare with the reference")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks per stage")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--zero", choices=("interleaved", "contiguous"), default="interleaved")
    p.add_argument("--rng", choices=("placement_invariant", "per_rank"), default="placement_invariant")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--move-at", type=int, default=None,
                   help="before this step, move the last block of stage 0 to stage 1")
    p.add_argument("--migration", choices=("blocking", "nonblocking"), default="blocking")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from executor.launch import JobSpec, job_losses, run_job  # noqa: PLC0415 - keep the CLI light
    from executor.model import ModelConfig, block_numel  # noqa: PLC0415
    from executor.reference import run_reference  # noqa: PLC0415
    from executor.trainer import TrainConfig  # noqa: PLC0415
    from planners.layout import StageLayout, make_uniform_layout  # noqa: PLC0415

    cfg = TrainConfig(model=ModelConfig(num_layers=args.layers, dropout=args.dropout))
    try:
        layout = make_uniform_layout(args.layers, args.pp, args.dp, args.global_batch, args.micro_batches,
                                     (block_numel(cfg.model),) * args.layers, args.zero, args.rng)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    relayouts: tuple = ()
    if args.move_at is not None:
        s0, s1 = layout.stages[0], layout.stages[1] if args.pp > 1 else None
        if s1 is None or s0.num_layers < 2:
            print("error: --move-at needs at least 2 stages and 2 blocks on stage 0")
            return 2
        moved = (StageLayout(0, s0.layer_start, s0.layer_stop - 1, s0.ranks),
                 StageLayout(1, s1.layer_start - 1, s1.layer_stop, s1.ranks)) + layout.stages[2:]
        relayouts = ((args.move_at, layout.replace(stages=moved)),)
    print(f"engine: PP={args.pp} x DP={args.dp}, ZeRO {args.zero}, RNG {args.rng}, gloo on CPU, "
          f"{layout.num_stages * args.dp} processes")
    results = run_job(JobSpec(cfg, layout, args.steps, relayouts=relayouts, migration=args.migration))
    losses = job_losses(results)
    ref = run_reference(cfg, args.global_batch, args.micro_batches, args.steps).losses
    print(f"{'step':>4}  {'engine loss':>14}  {'reference':>14}  {'|diff|':>9}")
    for step, (a, b) in enumerate(zip(losses, ref, strict=True)):
        note = "  <- layer moved" if step == args.move_at else ""
        print(f"{step:>4}  {a:>14.9f}  {b:>14.9f}  {abs(a - b):>9.2e}{note}")
    for res in sorted(results.values(), key=lambda r: r.rank):
        for rep in res.migrations:
            print(f"rank {res.rank}: {rep['mode']} migration of {rep['moved_layers']}: {rep['transfers']} "
                  f"transfers, {rep['elements_sent']} elements sent, {rep['elements_received']} received, "
                  f"boundary stall {rep['seconds'] * 1e3:.1f} ms")
    return 0
