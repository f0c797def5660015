"""Simulator output: summary table (stdout + CSV), timeline CSV and a throughput PNG."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from planners.chameleon.state import MttrModel
from simulator.engine import PolicyRun, base_mttr

SUMMARY_FIELDS = (
    "policy",
    "time_avg_samples_per_s",
    "vs_fault_free",
    "mean_lse",
    "min_lse",
    "recovery_s",
    "stalled_s",
    "changes",
    "mttr_assumption_s",
)


def summary_rows(runs: Sequence[PolicyRun], mttr: MttrModel) -> list[dict[str, object]]:
    rows = []
    for run in runs:
        lses = run.lse_after_changes
        rows.append(
            {
                "policy": run.policy,
                "time_avg_samples_per_s": round(run.time_averaged_throughput, 4),
                "vs_fault_free": round(run.time_averaged_throughput / run.fault_free_throughput, 4),
                "mean_lse": round(sum(lses) / len(lses), 4) if lses else "",
                "min_lse": round(min(lses), 4) if lses else "",
                "recovery_s": round(run.recovery_s, 1),
                "stalled_s": round(run.downtime_s - run.recovery_s, 1),
                "changes": run.plan_changes,
                "mttr_assumption_s": base_mttr(
                    "reparallelise" if run.policy == "chameleon" else run.policy, mttr
                ),
            }
        )
    return sorted(rows, key=lambda r: -float(r["time_avg_samples_per_s"]))


def format_table(rows: Sequence[dict[str, object]]) -> str:
    widths = {f: max(len(f), *(len(str(r[f])) for r in rows)) for f in SUMMARY_FIELDS}
    lines = ["  ".join(f.ljust(widths[f]) for f in SUMMARY_FIELDS)]
    lines += ["  ".join(str(r[f]).ljust(widths[f]) for f in SUMMARY_FIELDS) for r in rows]
    return "\n".join(lines)


def write_outputs(runs: Sequence[PolicyRun], mttr: MttrModel, out_dir: Path, title: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(runs, mttr)
    summary = out_dir / "summary.csv"
    with summary.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
        w.writeheader()
        w.writerows(rows)
    timeline = out_dir / "timeline.csv"
    with timeline.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["policy", "start_s", "end_s", "samples_per_s", "alive_devices", "lse", "reason"])
        for run in runs:
            for s in run.segments:
                w.writerow(
                    [
                        run.policy,
                        round(s.start_s, 3),
                        round(s.end_s, 3),
                        round(s.throughput, 5),
                        s.alive_devices,
                        "" if s.lse is None else round(s.lse, 4),
                        s.reason,
                    ]
                )
    return [summary, timeline, plot(runs, out_dir / "throughput.png", title)]


def plot(runs: Sequence[PolicyRun], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for run in runs:
        xs, ys = [], []
        for s in run.segments:
            xs += [s.start_s / 3600, s.end_s / 3600]
            ys += [s.throughput, s.throughput]
        ax.plot(xs, ys, label=f"{run.policy} (avg {run.time_averaged_throughput:.2f})", linewidth=1.2)
    ax.set_xlabel("hours")
    ax.set_ylabel("samples / s")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
