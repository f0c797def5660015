"""Simulator output: summary (stdout + CSV with the run's configuration), timeline CSV, and a PNG
with one throughput panel per policy, a live-devices panel, the events and the trace's end."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

from simulator.cluster import ClusterTimeline
from simulator.engine import PolicyRun
from simulator.policies import BASELINES

SUMMARY_FIELDS = (
    "policy",
    "samples_per_s",
    "vs_fault_free",
    "lse_time_weighted",
    "min_running_lse",
    "recovery_s",
    "stalled_s",
    "plan_changes",
    "restores",
)
TABLE_FIELDS = SUMMARY_FIELDS


def summary_rows(
    runs: Sequence[PolicyRun], cluster: ClusterTimeline, config: dict[str, object]
) -> list[dict]:
    avg = {r.policy: r.time_averaged_throughput for r in runs}
    rows = []
    for run in runs:
        low = run.min_running_lse
        row: dict[str, object] = {
            "policy": run.policy,
            "samples_per_s": round(avg[run.policy], 4),
            "vs_fault_free": round(avg[run.policy] / run.fault_free_throughput, 4),
            "lse_time_weighted": round(run.time_weighted_lse, 4),
            "min_running_lse": "" if low is None else round(low, 4),
            "recovery_s": round(run.seconds("recovery"), 1),
            "stalled_s": round(run.seconds("stalled"), 1),
            "plan_changes": run.plan_changes,
            "restores": run.restores,
        }
        for base in BASELINES:
            if base in avg and avg[base] > 0:
                row[f"vs_{base}"] = round(avg[run.policy] / avg[base], 4)
        row["recovery_cost_s"] = json.dumps({k: round(v, 1) for k, v in run.cost_totals().items()})
        row["preemptions_of_running"] = cluster.preemptions_of_running
        row["preemptions_absorbed_by_spares"] = cluster.absorbed_by_spares
        row["spares_used"] = cluster.spares_used
        rows.append(row | {f"config_{k}": v for k, v in config.items()})
    return sorted(rows, key=lambda r: -float(r["samples_per_s"]))


def format_table(rows: Sequence[dict]) -> str:
    fields = [f for f in rows[0] if not f.startswith("config_") and f != "recovery_cost_s"]
    widths = {f: max(len(f), *(len(str(r.get(f, ""))) for r in rows)) for f in fields}
    lines = ["  ".join(f.ljust(widths[f]) for f in fields)]
    lines += ["  ".join(str(r.get(f, "")).ljust(widths[f]) for f in fields) for r in rows]
    return "\n".join(lines)


def write_outputs(
    runs: Sequence[PolicyRun], cluster: ClusterTimeline, config: dict[str, object], out_dir: Path, title: str
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(runs, cluster, config)
    summary = out_dir / "summary.csv"
    with summary.open("w", newline="") as f:
        table = csv.DictWriter(f, fieldnames=list(rows[0]))
        table.writeheader()
        table.writerows(rows)
    timeline = out_dir / "timeline.csv"
    with timeline.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["policy", "start_s", "end_s", "kind", "samples_per_s", "alive_devices", "mode", "reason"])
        for run in runs:
            for s in run.segments:
                w.writerow(
                    [
                        run.policy,
                        round(s.start_s, 3),
                        round(s.end_s, 3),
                        s.kind,
                        round(s.throughput, 5),
                        s.alive_devices,
                        s.mode,
                        s.reason,
                    ]
                )
    events = out_dir / "events.csv"
    with events.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "time_s",
                "kind",
                "lost_slots",
                "joined_slots",
                "swapped_slots",
                "spares_waiting",
                "lost_devices",  # device events (`dev<i>`) only
                "joined_devices",
                "dead_devices",
            ]
        )
        for c in cluster.changes[1:]:
            w.writerow(
                [
                    round(c.time_s, 3),
                    c.kind,
                    list(c.lost_slots),
                    list(c.joined_slots),
                    list(c.swapped_slots),
                    c.spares_waiting,
                    list(c.lost_device_ids),
                    list(c.joined_device_ids),
                    len(c.dead_devices),
                ]
            )
    return [summary, timeline, events, plot(runs, cluster, out_dir / "throughput.png", title)]


EVENT_COLOURS = {"loss": "tab:red", "swap": "tab:orange", "join": "tab:green"}


def plot(runs: Sequence[PolicyRun], cluster: ClusterTimeline, path: Path, title: str) -> Path:
    import matplotlib  # noqa: PLC0415 - headless backend chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    n = len(runs)
    fig, axes = plt.subplots(n + 1, 1, figsize=(11, 1.3 * n + 2.2), sharex=True, squeeze=False)
    top = max(r.fault_free_throughput for r in runs) * 1.1
    horizon_h = runs[0].horizon_s / 3600
    for ax, run in zip(axes[:-1, 0], runs, strict=True):
        xs, ys = _steps(run)
        ax.fill_between(xs, ys, step="post", alpha=0.35)
        ax.plot(xs, ys, drawstyle="steps-post", linewidth=0.9)
        ax.axhline(run.fault_free_throughput, color="grey", linestyle=":", linewidth=0.8)
        ax.set_ylim(0, top)
        ax.set_ylabel("samples/s", fontsize=7)
        ax.text(
            0.005,
            0.08,
            f"{run.policy}: avg {run.time_averaged_throughput:.2f}, LSE {run.time_weighted_lse:.3f}",
            transform=ax.transAxes,
            fontsize=8,
            backgroundcolor="white",
        )
    live = axes[-1, 0]
    xs, ys = _steps(runs[0], alive=True)
    live.plot(xs, ys, drawstyle="steps-post", color="black", linewidth=1.0)
    live.set_ylabel("devices in\njob slots", fontsize=7)
    live.set_ylim(0, runs[0].num_devices * 1.1)
    live.set_xlabel("hours")
    for ax in axes[:, 0]:
        for c in cluster.changes[1:]:
            kind = c.kind.split("+")[0]
            ax.axvline(c.time_s / 3600, color=EVENT_COLOURS.get(kind, "grey"), alpha=0.55, linewidth=0.7)
        ax.axvline(cluster.trace_end_s / 3600, color="black", linestyle="--", linewidth=0.9)
        if horizon_h > cluster.trace_end_s / 3600:
            ax.axvspan(cluster.trace_end_s / 3600, horizon_h, color="grey", alpha=0.12)
        ax.grid(alpha=0.25)
        ax.tick_params(labelsize=7)
    handles = [plt.Line2D([], [], color=c, label=k) for k, c in EVENT_COLOURS.items()]
    handles.append(plt.Line2D([], [], color="black", linestyle="--", label="trace end"))
    axes[0, 0].legend(handles=handles, fontsize=7, loc="upper right", ncol=4)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _steps(run: PolicyRun, alive: bool = False) -> tuple[list[float], list[float]]:
    xs = [s.start_s / 3600 for s in run.segments] + [run.horizon_s / 3600]
    ys = [float(s.alive_devices if alive else s.throughput) for s in run.segments]
    return xs, ys + ys[-1:]
