"""Clipping's sum of squares on one host core: the cache-sized fp64 pieces against the whole slice.

`executor.zero.sum_of_squares` (fp64 pieces of `SQUARES_CHUNK` elements, each squared and added
with `torch.dot`) against what `ShardedOptimizer._clip` ran before, `t.double().pow(2).sum()`
(two fp64 temporaries of the whole slice), alternated, on an owned gradient slice of each size.
Both square exactly and add in fp64, and must agree to fp64 round-off (checked). Prints the best
of `--repeats` rounds, main-thread CPU milliseconds per call, and the ratio.

The whole slice's cost depends on the allocator: glibc maps an allocation above its mmap
threshold afresh (and faults its pages in) on every call, and raises the threshold, up to 32 MB,
each time it frees a larger mapped block. A long-running worker has freed large blocks, so the
sizes run largest first, as in that worker: fp64 temporaries of 32 MB and more (4 M elements)
are mapped on every call whatever came before; smaller ones come from the heap.

    python -m bench.clip_norm
    python -m bench.clip_norm --elements 400000 1600000 8000000
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time
from collections.abc import Callable

import torch

from executor.zero import sum_of_squares

AGREEMENT_REL = 1e-12  # fp64 round-off of the two summation orders, far below fp32's 6e-8


def whole_slice(t: torch.Tensor) -> float:
    """The expression `_clip` used before: the slice converted and squared whole."""
    return float(t.double().pow(2).sum())


def _cpu_ms(fn: Callable[[torch.Tensor], float], t: torch.Tensor, calls: int) -> float:
    c0 = time.thread_time()
    for _ in range(calls):
        fn(t)
    return (time.thread_time() - c0) / calls * 1e3


def measure(numel: int, repeats: int) -> tuple[float, float]:
    """(whole-slice ms, pieces ms) per call, best of `repeats` alternated rounds."""
    t = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    old, new = whole_slice(t), sum_of_squares(t)
    if not math.isclose(old, new, rel_tol=AGREEMENT_REL, abs_tol=0.0):
        raise RuntimeError(f"{numel} elements: the two sums disagree ({old!r} vs {new!r})")
    calls = max(3, 20_000_000 // max(numel, 1))
    best = {"whole": math.inf, "pieces": math.inf}
    for _ in range(repeats):
        best["whole"] = min(best["whole"], _cpu_ms(whole_slice, t, calls))
        best["pieces"] = min(best["pieces"], _cpu_ms(sum_of_squares, t, calls))
    return best["whole"], best["pieces"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--elements",
        type=int,
        nargs="+",
        default=[200_000, 800_000, 1_600_000, 8_000_000],
        help="owned slice sizes (elements)",
    )
    parser.add_argument("--repeats", type=int, default=7, help="rounds, each method alternated")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if any(n < 1 for n in args.elements):
        parser.error(f"--elements must be positive, got {args.elements}")
    torch.set_num_threads(1)  # a worker's clip runs on one thread
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; torch {torch.__version__}, 1 thread"
    )
    print(f"{'elements':>10} {'whole ms':>9} {'pieces ms':>10} {'whole/pieces':>13}")
    for numel in sorted(args.elements, reverse=True):  # largest first: the module docstring
        whole, pieces = measure(numel, args.repeats)
        print(f"{numel:>10} {whole:>9.3f} {pieces:>10.3f} {whole / pieces:>12.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
