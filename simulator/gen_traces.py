"""Regenerate the shipped Bamboo-format traces: `python -m simulator.gen_traces [DIR]`.

- `spot_a.txt`, `spot_b.txt`: the 12 nodes of the ElasWave Table 2 jobs for 6 hours, no spares
  (ElasWave §7.6 uses two real spot traces, "plateau-heavy" A and "shrink-heavy" B; these are
  synthetic stand-ins with the same character, `simulator.traces.spot_trace`, fixed seeds);
- `spot_gen_s<seed>.txt`: 16 nodes (12 job slots and 4 spares) for 11 hours from
  `simulator.traces.spot_cluster_trace`, whose bursts, replacement delays and cluster size follow
  Bamboo's spot measurements (see its docstring), one file per seed;
- `spot_burst_s<seed>.txt` (seeds 0-9): 16 nodes for 11 hours from
  `simulator.traces.bursty_cluster_trace`: bursts of 2-4 nodes reclaimed within a minute (issue 25).
"""

from __future__ import annotations

import sys
from pathlib import Path

from simulator.traces import bursty_cluster_trace, spot_cluster_trace, spot_trace, write_bamboo

TRACE_DIR = Path(__file__).resolve().parent / "traces"
SHIPPED = {
    # name: (nodes, hours, seed, preemptions per node-hour, mean outage hours)
    "spot_a.txt": (12, 6.0, 11, 0.04, 0.5),  # plateau-heavy: few, short outages
    "spot_b.txt": (12, 6.0, 7, 0.12, 3.0),  # shrink-heavy: outages pile up
}
GENERATED_SEEDS = (0, 1, 2)
BURSTY_SEEDS = tuple(range(10))


def generate(out_dir: Path = TRACE_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, (nodes, hours, seed, rate, outage) in SHIPPED.items():
        path = out_dir / name
        write_bamboo(spot_trace(nodes, hours, seed, rate, outage), path)
        paths.append(path)
    for seed in GENERATED_SEEDS:
        path = out_dir / f"spot_gen_s{seed}.txt"
        write_bamboo(spot_cluster_trace(seed), path)
        paths.append(path)
    for seed in BURSTY_SEEDS:
        path = out_dir / f"spot_burst_s{seed}.txt"
        write_bamboo(bursty_cluster_trace(seed), path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else TRACE_DIR):
        print(p)
