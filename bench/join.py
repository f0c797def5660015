"""Join MTTR and throughput through a loss and a join (the growth issue's "Measure").

`python -m bench.join` runs the GPT example as PP=2 x DP=3 under the Core (real processes: Core,
store, agents, workers; the demo's story harness, `harness.demo_story`, with two chapters): rank 4
is killed and recovered in place, then a spare (`elaswave agent` without a rank, the worker with
`ELASWAVE_RANK=spare`) is started and taken in where rank 4 was. It prints

- the join itemised: start (the spare's process starts, its agent registers, its worker subscribes
  to plans: ready), plan (-> the plan that takes it in is published), group creation (the
  slowest worker's communicator edit), state transfer (the slowest worker's rebuild) with the
  bytes the joiner received beside the planner's prediction (`planners.zero.joiner_bytes`), and
  first step (the rest, up to the first step committed on the new layout);
- throughput (samples/s, median step) before the loss, after it, after the join, and the first
  step after the join, each as a ratio of the fault-free throughput measured before the loss.

`--spare warm cold` runs the story twice, with a warm spare (`executor.spare_warmup`: it warms up
before it tells the Core it is ready) and with a cold one (`ELASWAVE_SPARE_WARMUP=0`: it builds
its rank once the plan names it), and prints the spare's warm-up and its own build after the plan.
`--workers forked fresh` runs each with every worker and spare forked from the node's zygote (as
`elaswave run` starts them, the default) and with each a fresh interpreter (`--cold-workers`).

Also checked like the demo (state and losses against the fault-free run); a failed check is
printed. Timings are wall-clock on a shared machine: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

from executor.spare_warmup import WARM_UP_ENV
from harness.chaos import fault_free_run
from harness.demo_report import build_report, commit_times, durations, problems
from harness.demo_story import StoryConfig, StoryRecord, StoryRun, run_story
from planners.layout import Layout
from planners.zero import joiner_bytes


def layouts(record: StoryRecord) -> tuple[Layout, Layout]:
    """The layout before the join (after the loss) and after it, as the demo recorded them."""
    after = {e.kind: Layout.from_json(json.dumps(e.data["layout_after"])) for e in record.events}
    return after["kill"], after["join"]


def measure(record: StoryRecord, report: dict[str, Any]) -> dict[str, Any]:
    """The join's phases, bytes and the throughput ratios (module docstring)."""
    join = next(e for e in report["events"] if e["kind"] == "join")
    before, after = layouts(record)
    predicted = joiner_bytes(before, after)
    received = {
        rank: max((r.get("state_bytes_received", 0) for r in res["recoveries"]), default=0)
        for rank, res in record.results.items()
        if rank in predicted
    }
    thr = {r["kind"]: r for r in report["throughput"]["per_event"]}
    healthy = report["throughput"]["healthy_samples_per_s"]
    dur = durations(commit_times(record.results))
    first = join["resume_step"] + 1 if join["resume_step"] is not None else None
    first_rate = record.cfg.global_batch / dur[first] if first in dur else None
    spare = next((res for rank, res in record.results.items() if rank in predicted), {})
    return {
        # the joiner's own build once the plan named its rank, and its warm-up before it was ready
        "join_build_s": spare.get("join_build_s"),
        "warm_up": spare.get("warm_up"),
        "phases_s": join["phases"],
        "mttr_s": join["mttr_s"],
        "bytes": {
            str(r): {"received": received.get(r), "predicted": predicted[r]} for r in sorted(predicted)
        },
        "healthy_samples_per_s": healthy,
        "after_loss_samples_per_s": thr["kill"]["after_samples_per_s"],
        "after_join_samples_per_s": thr["join"]["after_samples_per_s"],
        "first_step_after_join_samples_per_s": first_rate,
    }


def print_result(m: dict[str, Any], checks: list[str]) -> None:
    names = {"start_s": "start (spare ready)", "plan_s": "plan", "communicator_s": "group creation"}
    names |= {"state_s": "state transfer", "replay_s": "first step"}
    print(f"join MTTR {m['mttr_s'] * 1e3:.0f} ms (spare started -> first step committed on the new layout)")
    for key, label in names.items():
        if key in m["phases_s"]:
            print(f"  {label:<20} {m['phases_s'][key] * 1e3:8.0f} ms")
    warm = m.get("warm_up")
    if warm:
        items = ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.0f}" for k, v in warm["seconds"].items())
        print(f"  spare warm-up before it said ready: {items} ms; {warm['prebuilt_units']} units prebuilt")
    else:
        print("  spare warm-up: off (cold spare: it builds its rank once the plan names it)")
    if m.get("join_build_s") is not None:
        print(f"  joiner's own build after the plan {m['join_build_s'] * 1e3:8.0f} ms")
    for rank, b in m["bytes"].items():
        print(f"  joiner rank {rank}: received {b['received']} bytes, planner predicted {b['predicted']}")
    healthy = m["healthy_samples_per_s"]
    for key, label in (
        ("after_loss_samples_per_s", "after the loss"),
        ("after_join_samples_per_s", "after the join"),
        ("first_step_after_join_samples_per_s", "first step after the join"),
    ):
        value = m[key]
        ratio = f"{value / healthy:.2f}x" if value and healthy else "-"
        print(f"  throughput {label:<26} {value or float('nan'):8.1f} samples/s = {ratio} of fault-free")
    print(f"  fault-free (before the loss)      {healthy:8.1f} samples/s")
    for problem in checks:
        print(f"  CHECK FAILED: {problem}")


def run_once(cfg: StoryConfig, spare: str, workers: str) -> tuple[dict[str, Any], list[str]]:
    """One story (a loss, then a join) with a warm or a cold spare, its processes forked or fresh;
    (measurements, failed checks)."""
    os.environ[WARM_UP_ENV] = "1" if spare == "warm" else "0"  # the spare's processes inherit it
    with tempfile.TemporaryDirectory(prefix="elaswave-join-") as tmp:
        run = StoryRun(Path(tmp), cfg)
        run.warm_workers = workers == "forked"
        try:
            record = run_story(run)
        finally:
            run.stop()
        ref_losses, ref_ckpt = fault_free_run(run)
        report = build_report(record, ref_losses, ref_ckpt)
    return measure(record, report) | {"spare": spare, "workers": workers}, problems(report, record)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument(
        "--spare",
        nargs="+",
        choices=("warm", "cold"),
        default=["warm"],
        help="run with a warm spare (the default), a cold one (ELASWAVE_SPARE_WARMUP=0), or both in turn",
    )
    parser.add_argument(
        "--workers",
        nargs="+",
        choices=("forked", "fresh"),
        default=["forked"],
        help="workers and spares forked from the node's zygote (the default), fresh interpreters, or both",
    )
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    args = parser.parse_args(argv)
    cfg = StoryConfig(steps=args.steps, chapters=("kill", "join"))
    cfg.check()
    print(f"# bench.join on {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    rows, failed = [], False
    for spare, workers in itertools.product(args.spare, args.workers):
        print(f"\n## {spare} spare, {workers} processes (load average {load_average()} before)")
        measured, checks = run_once(cfg, spare, workers)
        print_result(measured, checks)
        print(f"  load average after: {load_average()}")
        rows.append(measured)
        failed = failed or bool(checks)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
