"""What the backups' periodic check costs a launched job, by interval, side by side.

`elaswave run` of the GPT example (PP=2 x DP=3 on one machine) with the check of every backup
against its live shard (ElasWave §5.1: digests of both, exchanged on the step's critical path)
every `--intervals` committed steps, the intervals alternated run by run so that machine noise
hits them alike. Reports each interval's mean step (commit to commit, on the first rank of the
last stage, after `--warmup` steps) and its ratio to the longest interval's.

Until 2026-12-01 every launched job checked every 2 steps (`WorkerSettings`' default), where the
engine and the docs said 50; this measures what that cost.

    python -m bench.verify_interval [--intervals 2 50] [--repeats 2] [--hidden 256] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "gpt" / "train.py"
NPROC, PP = 6, 2


def mean_step_s(run_dir: Path, warmup: int) -> float:
    """Mean seconds per committed step after `warmup`, from the last stage's first rank."""
    last_stage_first = NPROC - NPROC // PP
    stamps = json.loads((run_dir / f"rank-{last_stage_first}.json").read_text())["committed_unix"]
    times = [stamps[str(s)] for s in sorted(map(int, stamps)) if s >= warmup]
    return (times[-1] - times[0]) / (len(times) - 1)


def one_run(interval: int, hidden: int, steps: int, warmup: int) -> float:
    with tempfile.TemporaryDirectory(prefix="ew-verify-") as tmp:
        cmd = [sys.executable, "-m", "elaswave.cli", "run", "--nproc-per-node", str(NPROC), "--pp", str(PP)]
        cmd += [str(SCRIPT), "--hidden", str(hidden), "--steps", str(steps), "--verify-every", str(interval)]
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        )
        subprocess.run(cmd, cwd=tmp, env=env, check=True, capture_output=True, timeout=600)
        return mean_step_s(Path(tmp) / "elaswave-run" / "train", warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--intervals", type=int, nargs="+", default=[2, 50])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=60)  # the 50-step interval checks once
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    load = os.getloadavg()
    print(
        f"# elaswave run, GPT hidden {args.hidden}, PP={PP} x DP={NPROC // PP} on {os.cpu_count()} cores, "
        f"{args.steps} steps, {args.repeats} alternated runs per interval; load average {load[0]:.1f} at the start"
    )
    times: dict[int, list[float]] = {k: [] for k in args.intervals}
    for _ in range(args.repeats):
        for k in args.intervals:
            times[k].append(one_run(k, args.hidden, args.steps, args.warmup))
    base = statistics.median(times[max(args.intervals)])
    print("| check every | mean step s (median of runs) | runs | vs every " + f"{max(args.intervals)} |")
    print("|---|---|---|---|")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"| {k} | {med:.4f} | {', '.join(f'{t:.4f}' for t in v)} | {med / base:.3f}x |")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
