"""MTTR under the failures clusters see, itemised (issue: survive what clusters do).

`python -m bench.mttr` runs the GPT example under the Core (real processes: Core, store, agents,
workers; `harness.chaos`) once per case and configuration, and prints, per case, the time from
the fault to the first step committed on every survivor, split into: detect (fault -> the Core
marks the last victim LOST), plan (-> the recovering plan is published, at the Core's tick),
deliver (-> the last survivor starts applying it: the Core's planning and write after its tick,
the stream, the survivor's own wait for its failed step), communicator (the
slowest survivor's group edit), state (its remap from ring snapshots, migration or checkpoint
restore), and replay (the rest: the replayed step and its commit, and any wait for a newer plan
when a recovery was restarted). Each run is also checked like the chaos suite (loss and final
state against the fault-free run); a failed check is printed with the row.

Cases: one kill; two kills in one step (different stages); a node of 2 and of 4 ranks (worker
and agent killed; ranks spread over nodes as `planners.placement` spreads them, so a node holds
DP-alternate ranks); a kill during the recovery from another (50 ms later); a whole stage (its
node: its shards are backed up on other nodes, in the neighbouring stage, and its blocks move
there in place); the rendezvous store (the workers move to its standby); a stage lost with its
backups (each rank of the stage its own node, so the ring copies die with it: restored in place
from the latest checkpoint). Configurations PP=2 x DP=4 and PP=4 x DP=2.
`--quick` runs the first configuration only. Timings are wall-clock on a shared machine: compare
rows of one run, not runs. `--repeats N` runs every case N times and adds a table of medians
per case, with issue 23's goal for it: MTTR <= 0.2 s + one fault-free step (the median of that
case's steps before the fault), the first step after the recovery <= 1.5x a later one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.chaos import ChaosOutcome, ChaosScenario, Fault, run_scenario

PHASES = ("detect", "plan", "deliver", "communicator", "state", "replay")


def cases(pp: int, dp: int) -> list[tuple[str, ChaosScenario]]:
    """(case, scenario) for a PP x DP job; ranks are stage-major (stage p: p*dp .. p*dp+dp-1)."""

    def rank(stage: int, index: int) -> int:
        return stage * dp + index

    def job(
        name: str, fault: Fault, checkpoint_every: int = 0, nodes: tuple[tuple[int, ...], ...] = ()
    ) -> ChaosScenario:
        return ChaosScenario(
            f"{name} (PP={pp} x DP={dp})",
            pp=pp,
            dp=dp,
            global_batch=16,
            steps=8,
            checkpoint_every=checkpoint_every,
            faults=(fault,),
            nodes=nodes,
        )

    last = pp - 1
    stage_last = tuple(rank(last, i) for i in range(dp))
    node4 = tuple(rank(s, i) for s in range(pp) for i in range(0, dp, 2))[:4]
    return [
        ("one kill", job("one kill", Fault("kill", 2, (rank(last, 1),)))),
        ("two kills at once", job("two kills", Fault("kill", 2, (rank(0, 1), rank(last, 0))))),
        ("node of 2 ranks", job("node of 2", Fault("node", 2, (rank(0, 0), rank(last, 0))))),
        ("node of 4 ranks", job("node of 4", Fault("node", 2, node4))),
        ("kill during recovery", job("during", Fault("kill", 2, (rank(last, 0), rank(0, 1)), gap_s=0.05))),
        ("whole stage", job("whole stage", Fault("node", 3, stage_last), nodes=(stage_last,))),
        ("the store", job("store", Fault("store", 2, ()))),
        (
            "stage + its backups",
            job("stage and backups", Fault("node", 3, stage_last), checkpoint_every=2),
        ),
    ]


def survivor_results(workdir: Path) -> list[dict[str, Any]]:
    """The survivors' result files: a killed rank wrote none, or a partial one (a node's agent)."""
    results = (json.loads(f.read_text()) for f in sorted(workdir.glob("rank-*.json")))
    return [res for res in results if "committed_unix" in res]


def latest_commits(results: list[dict[str, Any]], before: float | None = None) -> dict[int, float]:
    """Step -> its latest commit time over the ranks (only commits before `before`, if given)."""
    per_step: dict[int, float] = {}
    for res in results:
        for s, t in res["committed_unix"].items():
            if before is None or t < before:
                per_step[int(s)] = max(per_step.get(int(s), 0.0), t)
    return per_step


def first_step(outcome: ChaosOutcome, results: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(first step after the recovery, median fault-free step) in seconds, from the survivors'
    results: the first step runs from the slowest survivor's end of the plan's apply to the
    last survivor's commit after it; a fault-free step is the job's commit-to-commit interval
    (latest commit of step s - latest of step s - 1) over the later steps on the same layout, so
    the ratio is what the first step's cold start costs."""
    record = outcome.faults[0]
    applied = [
        r["applied_unix"]
        for res in results
        for r in res.get("recoveries", [])
        if r.get("epoch") in record.epochs
    ]
    if not applied or not results:
        return None, None
    ready = max(applied)
    firsts = [min((t for t in res["committed_unix"].values() if t > ready), default=None) for res in results]
    done = [t for t in firsts if t is not None]
    first = max(done) - ready if done else None
    per_step = latest_commits(results)
    later = [
        per_step[s] - per_step[s - 1]
        for s in sorted(per_step)
        if s - 1 in per_step and done and per_step[s - 1] >= max(done)
    ]
    return first, statistics.median(later) if later else None


def pre_fault_step(outcome: ChaosOutcome, results: list[dict[str, Any]]) -> float | None:
    """The median step before the fault (commit to commit, the latest commit of each step over
    the survivors): the fault-free step of issue 23's MTTR goal. The later steps run on the
    recovered layout, with fewer workers, and are slower."""
    per_step = latest_commits(results, before=outcome.faults[0].fired_unix)
    steps = [per_step[s] - per_step[s - 1] for s in sorted(per_step) if s - 1 in per_step]
    return statistics.median(steps) if steps else None


def shape_after(results: list[dict[str, Any]]) -> list[int]:
    """Ranks per stage of the layout the survivors ended on (stage order): which shape the plan
    chose, beside what a step on it cost."""
    per_stage: dict[int, int] = {}
    for res in results:
        stages = res.get("stage_of_step") or {}
        if stages:
            last = stages[max(stages, key=int)]
            per_stage[last] = per_stage.get(last, 0) + 1
    return [per_stage[s] for s in sorted(per_stage)]


def row(case: str, outcome: ChaosOutcome, workdir: Path) -> dict[str, Any]:
    record = outcome.faults[0]
    results = survivor_results(workdir)
    first, fault_free = first_step(outcome, results)
    return {
        "shape_after": shape_after(results),
        "first_step_s": first,
        "fault_free_step_s": fault_free,
        "pre_fault_step_s": pre_fault_step(outcome, results),
        "case": case,
        "config": f"PP={outcome.scenario.pp} x DP={outcome.scenario.dp}",
        "mttr_s": record.mttr_s,
        "phases": {k: max(0.0, v) for k, v in record.phases.items()},
        "modes": record.modes,
        "epochs": record.epochs,
        "steps_lost": record.steps_lost,
        "loss_rel_dev_mean": outcome.loss_rel_dev_mean,
        "problems": outcome.problems,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'config':<14} {'case':<22} {'MTTR':>7} "
        + " ".join(f"{p:>12}" for p in PHASES)
        + f" {'1st step':>9} {'step':>7} {'ratio':>6} {'after/before':>12}  plan"
    )
    print(head)
    for r in rows:
        mttr = "-" if r["mttr_s"] is None else f"{r['mttr_s'] * 1e3:5.0f}ms"
        phases = " ".join(f"{r['phases'].get(p, 0.0) * 1e3:10.0f}ms" for p in PHASES)
        how = "/".join(r["modes"]) + (f", {r['steps_lost']} steps lost" if r["steps_lost"] else "")
        flag = "  CHECK FAILED: " + "; ".join(r["problems"]) if r["problems"] else ""
        first, step = r["first_step_s"], r["fault_free_step_s"]
        steps = (
            f" {first * 1e3:7.0f}ms {step * 1e3:5.0f}ms {first / step:5.2f}x"
            if first is not None and step
            else f" {'-':>9} {'-':>7} {'-':>6}"
        )
        before = r["pre_fault_step_s"]
        # A later step on the new layout over a step before the fault: what the chosen shape costs.
        kept = f" {step / before:11.2f}x" if step and before else f" {'-':>12}"
        shape = f" stages of {r['shape_after']} ranks" if r["shape_after"] else ""
        print(f"{r['config']:<14} {r['case']:<22} {mttr:>7} {phases}{steps}{kept}  {how}{shape}{flag}")


MTTR_GOAL_FIXED_S = 0.2  # issue 23: MTTR <= 0.2 s + one fault-free step
FIRST_STEP_GOAL = 1.5  # issue 23: the first step after a recovery <= 1.5x a fault-free step


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (config, case), in first-seen order: the median of every figure over its runs, and
    whether the medians meet issue 23's goals (None where a figure is missing)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["config"], r["case"]), []).append(r)
    out = []
    for (config, case), runs in groups.items():
        mttr = _median([r["mttr_s"] for r in runs])
        step = _median([r["pre_fault_step_s"] for r in runs])
        ratios = [
            r["first_step_s"] / r["fault_free_step_s"]
            for r in runs
            if r["first_step_s"] is not None and r["fault_free_step_s"]
        ]
        ratio = _median(list(ratios))
        unrecovered = sum(1 for r in runs if r["mttr_s"] is None)
        out.append(
            {
                "config": config,
                "case": case,
                "runs": len(runs),
                "failed_checks": sum(1 for r in runs if r["problems"]),
                "unrecovered": unrecovered,  # runs with no MTTR: the goal is not met if any
                "mttr_s": mttr,
                "phases": {p: _median([r["phases"].get(p) for r in runs]) for p in PHASES},
                "pre_fault_step_s": step,
                "first_step_ratio": ratio,
                "mttr_goal_s": None if step is None else MTTR_GOAL_FIXED_S + step,
                "mttr_goal_met": None
                if mttr is None or step is None
                else not unrecovered and mttr <= MTTR_GOAL_FIXED_S + step,
                "first_step_goal_met": None if ratio is None else ratio <= FIRST_STEP_GOAL,
            }
        )
    return out


def print_medians(summary: list[dict[str, Any]]) -> None:
    print(
        f"\nmedians per case; goals: MTTR <= {MTTR_GOAL_FIXED_S * 1e3:.0f} ms + one step before "
        f"the fault, the first step after it <= {FIRST_STEP_GOAL}x a later one"
    )
    print(
        f"{'config':<14} {'case':<22} {'runs':>4} {'MTTR':>7} "
        + " ".join(f"{p:>12}" for p in PHASES)
        + f" {'step':>7} {'goal':>7} {'met':>4} {'ratio':>6} {'met':>4}"
    )

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f}ms"

    def yes(v: bool | None) -> str:
        return "-" if v is None else "yes" if v else "no"

    for m in summary:
        phases = " ".join(f"{ms(m['phases'][p]):>12}" for p in PHASES)
        ratio = "-" if m["first_step_ratio"] is None else f"{m['first_step_ratio']:.2f}x"
        failed = f"  {m['failed_checks']} CHECKS FAILED" if m["failed_checks"] else ""
        failed += f"  {m['unrecovered']} NOT RECOVERED" if m["unrecovered"] else ""
        print(
            f"{m['config']:<14} {m['case']:<22} {m['runs']:>4} {ms(m['mttr_s']):>7} {phases} "
            f"{ms(m['pre_fault_step_s']):>7} {ms(m['mttr_goal_s']):>7} {yes(m['mttr_goal_met']):>4} "
            f"{ratio:>6} {yes(m['first_step_goal_met']):>4}{failed}"
        )


def _shape(parser: argparse.ArgumentParser, text: str) -> tuple[int, int]:
    pp, _, dp = text.partition("x")
    if not (pp.isdigit() and dp.isdigit() and int(pp) >= 1 and int(dp) >= 1):
        parser.error(f"--config takes PPxDP with positive integers, e.g. 4x2; got {text!r}")
    return int(pp), int(dp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="PP=2 x DP=4 only")
    parser.add_argument(
        "--config", nargs="+", default=None, metavar="PPxDP", help="only these shapes, e.g. 4x2 (8 workers)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--case", nargs="+", default=None, metavar="CASE", help="only these cases (by name)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per case (issue 23's goals are medians of 5)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    configs = [(2, 4)] if args.quick else [(2, 4), (4, 2)]
    if args.config is not None:
        configs = [_shape(parser, c) for c in args.config]
    print(
        f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, {os.cpu_count()} cores, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at start; "
        f"python {platform.python_version()}"
    )
    rows = []
    for pp, dp in configs:
        for case, scenario in cases(pp, dp):
            if args.case is not None and case not in args.case:
                continue
            for _ in range(args.repeats):
                with tempfile.TemporaryDirectory() as tmp:
                    rows.append(row(case, run_scenario(scenario, Path(tmp)), Path(tmp)))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print_table(rows)
    done = [r["mttr_s"] for r in rows if r["mttr_s"] is not None]
    if done:
        print(f"MTTR median {statistics.median(done) * 1e3:.0f} ms, worst {max(done) * 1e3:.0f} ms")
    summary = medians(rows) if args.repeats > 1 else []
    if summary:
        print_medians(summary)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))  # every run; `medians(rows)` summarises
    return 1 if any(r["problems"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
