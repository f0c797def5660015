"""The optimizer update on one host core: the fused, padded AdamW against the single-tensor one.

`executor.optim.OptimizerConfig.update_slice` (torch's fused kernel over lengths padded to
`FUSED_PAD`) against the same config's single-tensor arithmetic (`_update` per decay run, what
it ran before), alternated, on half a unit's flat vector starting mid-vector, as a ZeRO-1 shard
lies: a `TransformerEncoderLayer` of width 64 and 256, with one decay run and with the usual
no-decay rule for norms and biases. Prints the best of `--repeats` rounds, microseconds per
update, and the ratio.

    python -m bench.optim_update
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

import torch
from torch import nn

from executor.optim import NoDecay, OptimizerConfig, no_decay_norms_and_biases


def _timed(update: Callable[[int], None], calls: int) -> float:
    t0 = time.perf_counter()
    for i in range(calls):
        update(i + 1)
    return (time.perf_counter() - t0) / calls * 1e6


def measure(hidden: int, no_decay: NoDecay | None, repeats: int) -> tuple[int, int, float, float]:
    """(elements, decay runs, single-tensor us, fused us) for half a block's vector."""
    block = nn.TransformerEncoderLayer(hidden, 4, 4 * hidden, batch_first=True)
    cfg = OptimizerConfig("adamw", lr=1e-3, weight_decay=0.1, no_decay=no_decay)
    segments = cfg.decay_segments(block.named_parameters())
    numel = sum(p.numel() for p in block.parameters())
    lo, hi = 1001, 1001 + numel // 2
    p, g, m, v = (
        t[lo:hi] for t in (torch.randn(numel), torch.randn(numel), torch.zeros(numel), torch.zeros(numel))
    )

    def single(step: int) -> None:
        for start, stop, wd in segments:
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                cfg._update(
                    p[a - lo : b - lo],
                    g[a - lo : b - lo],
                    m[a - lo : b - lo],
                    v[a - lo : b - lo],
                    step,
                    cfg.lr,
                    wd,
                )

    def fused(step: int) -> None:
        cfg.update_slice(p, g, m, v, step, segments, lo)

    calls = max(5, 2_000_000 // numel)
    best = {"single": float("inf"), "fused": float("inf")}
    for _ in range(repeats):
        for name, update in (("single", single), ("fused", fused)):
            best[name] = min(best[name], _timed(update, calls))
    runs = sum(1 for start, stop, _ in segments if max(lo, start) < min(hi, stop))
    return hi - lo, runs, best["single"], best["fused"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds, each method alternated")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    torch.set_num_threads(1)  # a worker's update runs on one thread
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; torch {torch.__version__}, 1 thread"
    )
    print(f"{'hidden':>6} {'elements':>9} {'runs':>5} {'single us':>10} {'fused us':>9} {'single/fused':>13}")
    for hidden in (64, 256):
        for no_decay in (None, no_decay_norms_and_biases):
            n, runs, single, fused = measure(hidden, no_decay, args.repeats)
            print(f"{hidden:>6} {n:>9} {runs:>5} {single:>10.0f} {fused:>9.0f} {single / fused:>12.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
