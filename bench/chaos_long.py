"""`make chaos`: the long chaos run (not in CI), seeded random fault schedules until `--kills` ranks
have been killed, every run checked like the chaos suite (tests/chaos), MTTR percentiles at the end.

Each run is a PP=2 x DP=4 job of the GPT example under the Core (`harness.chaos.random_scenario`:
single kills, pairs killed together, pairs 50 ms apart, nodes of two ranks, one rank of stage 0
always kept); checkpoints every 2 steps so a schedule that empties a stage restores in place.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from harness.chaos import random_scenario, run_scenario


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="first seed; each run uses the next")
    args = parser.parse_args(argv)
    killed, seed, mttrs, failed, runs = 0, args.seed, [], 0, 0
    while killed < args.kills:
        scenario = random_scenario(seed, kills=min(4, args.kills - killed))
        with tempfile.TemporaryDirectory() as tmp:
            outcome = run_scenario(scenario, Path(tmp))
        runs += 1
        killed += len(scenario.killed)
        mttrs += [r.mttr_s for r in outcome.faults if r.mttr_s is not None]
        failed += bool(outcome.problems)
        print(f"[chaos] {outcome.summary()}", flush=True)
        for problem in outcome.problems:
            print(f"[chaos]   CHECK FAILED: {problem}", flush=True)
        seed += 1
    if mttrs:
        print(
            f"[chaos] {runs} runs, {killed} ranks killed in {len(mttrs)} faults, {failed} runs failed a check; "
            f"MTTR p50 {percentile(mttrs, 0.5) * 1e3:.0f} ms, p99 {percentile(mttrs, 0.99) * 1e3:.0f} ms, "
            f"max {max(mttrs) * 1e3:.0f} ms, mean {statistics.mean(mttrs) * 1e3:.0f} ms"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
