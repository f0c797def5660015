"""The demo's report, shown: the summary table on stdout and the figure (PNG, matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _f(value: float | None, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value * scale)


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The table: one row per event, then consistency, throughput and restarts."""
    head = (
        f"{'event':<10} {'step':>4} {'policy':<9} {'mttr ms':>8} {'detect':>7} {'plan':>6} {'comm':>6} "
        f"{'state':>6} {'replay':>7} {'pred s':>7} {'meas s':>7} {'thr before':>10} {'thr after':>9} {'LSE':>5}"
    )
    lines = [head, "-" * len(head)]
    rows = {r["kind"]: r for r in report["throughput"]["per_event"]}
    for e in report["events"]:
        p, t = e["phases"], rows.get(e["kind"], {})
        lines.append(
            f"{e['kind']:<10} {_f(e['step']):>4} {e['policy'] or '-':<9} {_f(e['mttr_s'], 1e3):>8} "
            f"{_f(p.get('detect_s', p.get('start_s')), 1e3):>7} {_f(p.get('plan_s'), 1e3):>6} {_f(p.get('communicator_s'), 1e3):>6} "
            f"{_f(p.get('state_s'), 1e3):>6} {_f(p.get('replay_s'), 1e3):>7} "
            f"{_f(e['predicted_step_s'], fmt='{:.3f}'):>7} {_f(e['measured_step_s'], fmt='{:.3f}'):>7} "
            f"{_f(t.get('before_samples_per_s')):>10} {_f(t.get('after_samples_per_s')):>9} "
            f"{_f(e['lse'], fmt='{:.2f}'):>5}"
        )
    for p in report["pending"]:
        lines.append(f"{p['kind']:<10} not run: {p['why']}")
    for e in report["events"]:
        for reason in e.get("migration", []) + e.get("dvfs", []):
            lines.append(f"{e['kind']:<10} {reason}")
    c = report["consistency"]
    cpus, ranks = report["job"].get("cpus") or 0, report["job"]["ranks"]
    if cpus and cpus < ranks:
        lines.append(
            f"{ranks} ranks share {cpus} CPU cores here: with fewer ranks each runs faster, so LSE can exceed 1"
        )
    lines += [
        f"healthy throughput {_f(report['throughput']['healthy_samples_per_s'])} samples/s; phases in ms "
        "(detect, or for a join the spares starting until ready; plan, communicator edit, state "
        "remap/migration/transfer, replay to the first commit); "
        "clocks: simulated (CPU)",
        f"consistency vs the fault-free run: params equal {c['params_equal_after_recovery']} (max |diff| "
        f"{_f(c['max_param_abs_diff'], fmt='{:.1e}')}, max rel. state diff {_f(c['max_state_rel_diff'], fmt='{:.1e}')}); "
        f"mean rel. loss dev. {_f(c['loss_rel_dev_mean'], fmt='{:.1e}')} over {c['loss_steps_compared']} steps; "
        f"samples identical {c['samples_identical']}; restarts {report['restarts']}",
    ]
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    """Throughput, live workers and loss over time, events marked, the fault-free run beside."""
    import matplotlib  # noqa: PLC0415 - only when the demo draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    tl = report["timeline"]
    steps = tl["steps"]
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    thr = [(s["t_s"], s["samples_per_s"]) for s in steps if s["samples_per_s"]]
    axes[0].plot([t for t, _ in thr], [v for _, v in thr], ".-", lw=1, label="elastic job")
    healthy = report["throughput"]["healthy_samples_per_s"]
    if healthy:
        axes[0].axhline(healthy, ls="--", color="grey", lw=1, label="healthy (before the first event)")
    axes[0].set_ylabel("samples/s")
    live = tl["live_workers"]
    axes[1].step([w["t_s"] for w in live], [w["live"] for w in live], where="post", label="elastic job")
    axes[1].axhline(report["job"]["ranks"], ls="--", color="grey", lw=1, label="fault-free run's layout")
    axes[1].set_ylabel("live workers")
    loss = [(s["t_s"], s["loss"]) for s in steps if s["loss"] is not None]
    ref = [(s["t_s"], s["fault_free_loss"]) for s in steps if s["fault_free_loss"] is not None]
    axes[2].plot(
        [t for t, _ in ref],
        [v for _, v in ref],
        "-",
        color="grey",
        lw=3,
        alpha=0.5,
        label="fault-free run, same seed (at the same step)",
    )
    axes[2].plot([t for t, _ in loss], [v for _, v in loss], ".", ms=4, label="elastic job")
    axes[2].set_ylabel("loss")
    axes[2].set_xlabel("seconds since the first committed step")
    for ax in axes:
        for mark in tl["events"]:
            ax.axvline(mark["t_s"], color="red", lw=0.8, alpha=0.6)
        ax.legend(loc="best", fontsize=7)
    for mark in tl["events"]:
        axes[0].annotate(
            mark["kind"],
            (mark["t_s"], 1.0),
            xycoords=("data", "axes fraction"),
            fontsize=8,
            color="red",
            rotation=90,
            va="top",
            ha="right",
        )
    fig.suptitle(
        f"ElasWave demo: GPT example, PP={report['job']['pp']} x DP={report['job']['dp']} "
        "(CPU; clocks simulated)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
