"""What mixed precision costs or saves per step, measured side by side (docs/accelerators.md).

CPU (the default): the GPT example trained in one process by the engine in fp32, bf16 and fp16,
the three interleaved round by round so machine noise hits them alike; prints seconds per step
and each precision's ratio to fp32. On a CPU, bf16 autocast adds casts around every matmul and
the kernels gain little, so the ratio says what the bf16 *path* costs, not what a GPU gains.

`bench_300m()` (used by `make gpu-check` (d)): a >= 300 M parameter GPT in bf16 on CUDA, the
engine's step time against a plain torch loop on the same model, batches and precision (autocast,
fp32 AdamW), and the per-step cost of staging each step's reduced gradient shard to pinned host
memory on a side stream (`executor.fabric.device_copy.HostStager`, what a ring snapshot copies
off the device): awaited by another thread, off the step, as the snapshot's updater does, and
awaited at the end of the step, as the commit did before, side by side.

    python -m bench.precision_cost [--hidden 128] [--layers 4] [--steps 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import threading
import time
from typing import Any, cast

import torch

from elaswave.device_map import host_threads, node_cpus
from examples.gpt.data import MarkovWindows
from examples.gpt.model import ModelConfig, gpt_units, per_sample_loss
from executor.devices import synchronize
from executor.fabric.device_copy import HostStager, StagedCopies
from executor.fabric.snapshot import MAX_UPDATE_LAG
from executor.optim import OptimizerConfig
from executor.precision import PrecisionConfig
from executor.reference import single_rank_trainer
from executor.trainer import Trainer, TrainSpec


def gpt_train_spec(
    cfg: ModelConfig, precision: str, device_kind: str = "cpu", tokens: int = 1 << 16
) -> TrainSpec:
    return TrainSpec(
        gpt_units(cfg),
        per_sample_loss,
        MarkovWindows(cfg.vocab_size, cfg.seq_len, num_tokens=tokens, seed=0),
        OptimizerConfig("adamw", lr=3e-4, weight_decay=0.01),
        precision=PrecisionConfig(precision),  # type: ignore[arg-type]
        device_kind=device_kind,
    )


def timed_steps(trainer: Trainer, first: int, steps: int) -> float:
    """Seconds per step of `steps` steps from `first` (device work included)."""
    synchronize(trainer.device)
    t0 = time.perf_counter()
    for step in range(first, first + steps):
        trainer.train_step(step)
    synchronize(trainer.device)
    return (time.perf_counter() - t0) / steps


def cpu_ratios(cfg: ModelConfig, batch: int, slots: int, steps: int, rounds: int) -> dict[str, float]:
    """Median seconds per step of each precision, measured in interleaved rounds."""
    trainers = {
        p: single_rank_trainer(gpt_train_spec(cfg, p), batch, slots) for p in ("fp32", "bf16", "fp16")
    }
    for t in trainers.values():
        timed_steps(t, 0, 1)  # warm-up: allocator, autocast caches
    times: dict[str, list[float]] = {p: [] for p in trainers}
    for r in range(rounds):
        for p, t in trainers.items():
            times[p].append(timed_steps(t, 1 + r * steps, steps))
    for t in trainers.values():
        t.data.close()
    return {p: statistics.median(v) for p, v in times.items()}


def _plain_torch_step_s(spec: TrainSpec, batch: int, steps: int) -> float:
    """The same model, batches and precision as a plain torch loop (the baseline of (d))."""
    dev = torch.device(spec.device_kind)
    model = torch.nn.ModuleList([spec.model.build(i, dev) for i in range(len(spec.model))])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    sampler = spec.sampler(batch)

    def step(s: int) -> None:
        rows = sampler.rows(s, 0, batch)
        x, y = (
            cast(torch.Tensor, rows.inputs).to(dev, non_blocking=True),
            rows.targets.to(dev, non_blocking=True),
        )
        with spec.precision.autocast(dev):
            for unit in model:
                x = unit(x)
            loss = per_sample_loss(x, y).float().sum() / batch
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(0)
    synchronize(dev)
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        step(s)
    synchronize(dev)
    return (time.perf_counter() - t0) / steps


def _host_replay_s(trainer: Trainer, grads: dict[str, torch.Tensor], steps: int = 2) -> tuple[float, int]:
    """Seconds per step of a backup holder's host replay of this shard's update (the whole model at
    DP = 1), on the threads `elaswave run` would give the only rank of this machine, and their
    number: whether a holder keeps up with the device (executor.fabric.snapshot, `max_lag`)."""
    threads = host_threads(node_cpus(), 1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        host = {k: g.detach().to("cpu", torch.float32) for k, g in grads.items()}
        params = {k: torch.zeros_like(g) for k, g in host.items()}
        moments = {k: (torch.zeros_like(g), torch.zeros_like(g)) for k, g in host.items()}
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            for k, g in host.items():
                trainer.update_slice(k, 0, params[k], g, *moments[k], step)
        return (time.perf_counter() - t0) / steps, threads
    finally:
        torch.set_num_threads(before)


def _wait_copies(updater: queue.Queue[StagedCopies | None]) -> None:
    """The snapshot updater's part in `bench_300m`: wait for each step's copies, in order."""
    while (copies := updater.get()) is not None:
        copies.wait()
        updater.task_done()


GPT_368M = ModelConfig(vocab_size=32000, seq_len=512, hidden=1024, num_heads=16, num_layers=24)


def bench_300m(
    steps: int = 6, batch: int = 16, cfg: ModelConfig = GPT_368M, device_kind: str = "cuda"
) -> dict[str, Any]:
    """(d) of `make gpu-check`; see the module docstring. 16 x 512 tokens a step keeps the GPU
    busy long enough that per-step host work does not dominate either loop. Each phase's end goes
    to stderr, so a run stopped by the check's budget still says how far it got. `cfg` and
    `device_kind` let the same code run small on the CPU (tests/test_gpu_check.py)."""
    started = time.perf_counter()

    def phase(what: str) -> None:
        print(f"bench_300m: {what} at {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)

    spec = gpt_train_spec(cfg, "bf16", device_kind, tokens=1 << 20)
    params = sum(p.numel for p in spec.unit_probes())
    phase(f"spec and probes ({params / 1e6:.0f} M parameters)")
    plain = _plain_torch_step_s(spec, batch, steps)
    phase(f"plain torch, {plain:.3f} s/step")
    if device_kind == "cuda":
        torch.cuda.empty_cache()
    trainer = single_rank_trainer(spec, batch, 1)
    timed_steps(trainer, 0, 2)
    phase("engine built and warmed")
    engine = timed_steps(trainer, 2, steps)
    phase(f"engine, {engine:.3f} s/step")
    stager = HostStager()
    staged_grads: dict[str, torch.Tensor] = {}
    # The copies as the snapshot stages them now: of a buffer of their own (as the received
    # gradients are), awaited by the updater's thread, not the step (executor.fabric.snapshot).
    # The old way, awaited at the step's end as the commit used to, is measured beside it.
    updater: queue.Queue[StagedCopies | None] = queue.Queue(maxsize=MAX_UPDATE_LAG)
    waiter = threading.Thread(target=_wait_copies, args=(updater,), daemon=True)
    waiter.start()

    def stage_all(_step: int, grads: dict[str, torch.Tensor]) -> None:
        staged_grads.update(grads)
        for g in grads.values():
            stager.stage(g.clone() if off_step else g)

    trainer.set_grad_hook(stage_all)
    first, staged = 2 + steps, {}
    for off_step in (False, True):
        synchronize(trainer.device)
        t0 = time.perf_counter()
        for s in range(first, first + steps):
            trainer.train_step(s)
            if off_step:
                updater.put(stager.take())
            else:
                stager.wait()
        updater.join()
        synchronize(trainer.device)
        staged[off_step] = (time.perf_counter() - t0) / steps
        first += steps
        phase(
            f"engine with staging awaited {'off the step' if off_step else 'at its end'}, "
            f"{staged[off_step]:.3f} s/step"
        )
    updater.put(None)
    # The copies alone, nothing else on the GPU: what the staging costs at this link's speed.
    copied = sum(g.numel() * g.element_size() for g in staged_grads.values())
    t0 = time.perf_counter()
    for g in staged_grads.values():
        stager.stage(g)
    stager.wait()
    copy_s = time.perf_counter() - t0
    phase(f"{copied / 1e9:.2f} GB staged alone in {copy_s:.3f} s")
    replay_s, threads = _host_replay_s(trainer, staged_grads)
    phase(f"host replay of the update on {threads} threads, {replay_s:.3f} s/step")
    trainer.data.close()
    return {
        "params": params,
        "plain_step_s": plain,
        "engine_step_s": engine,
        "engine_vs_torch": plain / engine,
        "snapshot_staging_overhead": max(0.0, staged[True] - engine) / engine,
        "staging_awaited_overhead": max(0.0, staged[False] - engine) / engine,
        "staged_bytes": copied,
        "staging_alone_s": copy_s,
        "host_replay_s": replay_s,
        "host_threads": threads,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)  # as a launched worker runs
    cfg = ModelConfig(
        vocab_size=256, seq_len=args.seq, hidden=args.hidden, num_heads=4, num_layers=args.layers
    )
    params = sum(p.numel for p in gpt_train_spec(cfg, "fp32").unit_probes())
    med = cpu_ratios(cfg, args.batch, args.slots, args.steps, args.rounds)
    print(
        f"GPT {params / 1e6:.2f} M params, batch {args.batch} x seq {args.seq}, {args.slots} micro-batches, "
        f"1 thread, median of {args.rounds} interleaved rounds of {args.steps} steps"
    )
    print("| precision | s/step | vs fp32 |\n|---|---|---|")
    for prec, s in med.items():
        print(f"| {prec} | {s:.4f} | {s / med['fp32']:.2f}x |")


if __name__ == "__main__":
    main()
