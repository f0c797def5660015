"""The demo's report: every figure measured from what the run left behind (README "The demo's report").

Sources, and nothing else: the workers' results files (commit times, losses, samples, recovery
records, and per step their own compute and injected stretch: when the straggler's slowdown took
effect), the Core's event log (detection, plans, departures) and the fault-free run of the same
script and seed (its losses and its final checkpoint). `build_report` returns the JSON object;
`problems` lists every check that failed (the demo exits non-zero on any).
"""

from __future__ import annotations

import math
import os
import re
import statistics
from pathlib import Path
from typing import Any

from harness.chaos import MAX_FINAL_STATE_REL_DIFF
from harness.demo_story import StoryEvent, StoryRecord
from harness.training import MAX_MEAN_REL_DEV, job_losses

REPORT_VERSION = 1
# How planners.elaswave_clocks words the DVFS planner's verdicts (up-clock, none, restore).
_CLOCK_REASONS = ("DVFS (", "no up-clock")
_PREDICTED = re.compile(r"^predicted step time ([0-9.eE+-]+) s ")


def commit_times(results: dict[int, dict[str, Any]]) -> dict[int, float]:
    """When each step was committed by the whole job: the last rank's commit (a replayed step's
    last commit, the one that counts)."""
    out: dict[int, float] = {}
    for res in results.values():
        for step, t in res["committed_unix"].items():
            out[int(step)] = max(out.get(int(step), 0.0), float(t))
    return out


def durations(times: dict[int, float]) -> dict[int, float]:
    return {s: times[s] - times[s - 1] for s in sorted(times) if s - 1 in times}


def samples_per_s(dur: dict[int, float], lo: int, hi: int, batch: int) -> float | None:
    """Global batch over the median step time of steps lo..hi-1 (None: no step there)."""
    window = [d for s, d in dur.items() if lo <= s < hi and d > 0]
    return batch / statistics.median(window) if window else None


def _epochs(ev: StoryEvent, until: float, results: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The recoveries applied for this event: plans applied after it fired, before the next one."""
    recs: dict[int, dict[str, Any]] = {}
    for res in results.values():
        for r in res["recoveries"]:
            if ev.fired_unix <= r["applied_unix"] < until:
                recs.setdefault(r["epoch"], r)
    return recs


def _mttr(ev: StoryEvent, until: float, results: dict[int, dict[str, Any]]) -> float | None:
    """Fired -> the first step every rank that applied its plan committed after applying it."""
    firsts = []
    for res in results.values():
        applied = [r["applied_unix"] for r in res["recoveries"] if ev.fired_unix <= r["applied_unix"] < until]
        if applied:
            after = [t for t in res["committed_unix"].values() if t > max(applied)]
            if after:
                firsts.append(min(after))
    return max(firsts) - ev.fired_unix if firsts else None


_DETECTED_BY = {
    "kill": "worker_lost",
    "node": "worker_lost",
    "straggler": "worker_slow",
    "preempt": "worker_preempting",
    "join": "spare_ready",  # a spare's worker subscribed to plans: it can be taken in now
}


def event_entry(
    ev: StoryEvent, until: float, rec: StoryRecord, dur: dict[int, float], windows: tuple[int, int]
) -> dict[str, Any]:
    """One event's row of the report (module docstring: where each figure comes from)."""
    recs = _epochs(ev, until, rec.results)
    epochs = sorted(recs)
    final = epochs[-1] if epochs else None
    published = next(
        (e for e in rec.core_events if e["kind"] == "plan_published" and e["data"].get("epoch") == final),
        None,
    )
    victims = {f"rank-{r}" for r in ev.ranks}
    if ev.kind == "join":  # the spares, by the worker ids they registered with
        victims = {e["worker_id"] for e in rec.core_events if e["kind"] == "spare_registered"}
    seen = [
        e["time_unix"]
        for e in rec.core_events
        if e["kind"] == _DETECTED_BY.get(ev.kind)
        and e["worker_id"] in victims
        and e["time_unix"] >= ev.fired_unix
    ]
    mttr = _mttr(ev, until, rec.results)
    phases: dict[str, float] = {}
    # A join has nothing to detect: its first phase is the spares starting (process, agent
    # registration, the worker subscribing to plans) until the last of them is ready.
    first = "start_s" if ev.kind == "join" else "detect_s"
    if seen:
        phases[first] = max(seen) - ev.fired_unix
    if published is not None:
        phases["plan_s"] = published["time_unix"] - ev.fired_unix - phases.get(first, 0.0)
    final_recs = [r for res in rec.results.values() for r in res["recoveries"] if r["epoch"] == final]
    if final_recs:
        phases["communicator_s"] = max(r["communicator_s"] for r in final_recs)
        phases["state_s"] = max(r["apply_s"] - r["communicator_s"] for r in final_recs)
    if mttr is not None:
        phases["replay_s"] = mttr - sum(phases.values())
    boundary = min((r["step"] for r in final_recs), default=None)
    resume = max((r["resume_at"] for r in final_recs), default=None)
    step = boundary
    if ev.kind == "straggler":  # the event is where the slowdown took effect, not the plan
        slowed = [t["step"] for t in rec.traces.get(ev.ranks[0], []) if t["slowed_s"] > 0]
        step = min(slowed, default=boundary)
    predicted = None
    reasons: list[str] = list((published or {}).get("data", {}).get("reasons", []))
    for reason in reasons:
        found = _PREDICTED.match(reason)
        if found:
            predicted = float(found.group(1))
    lo, hi = windows
    layout = ev.data.get("layout_after") or {}
    after_lo = (resume if resume is not None else hi) + 1
    entry: dict[str, Any] = {
        "kind": ev.kind,
        "ranks": list(ev.ranks),
        "detail": ev.detail,
        "step": step,
        "boundary_step": boundary,
        "resume_step": resume,
        "epochs": epochs,
        "policy": None if published is None else published["data"].get("policy"),
        "mode": None if published is None else published["data"].get("mode"),
        "plan": None if published is None else published["detail"],
        "reasons": reasons,
        # The DVFS planner's verdict (ElasWave §4.3) and Algorithm 1's (§4.2), as the plan words them.
        "dvfs": [
            r
            for r in reasons
            if r.startswith(_CLOCK_REASONS) or " keep their clock: " in r or " back to the nominal " in r
        ],
        "migration": [r for r in reasons if r.startswith("re-partition") or r.startswith("no unit moves")],
        "mttr_s": mttr,
        "phases": phases,
        "predicted_step_s": predicted,
        "live_ranks_after": sum(len(s["ranks"]) for s in layout.get("stages", [])),
        "frequencies_mhz_after": {str(r): mhz for r, mhz in layout.get("frequencies_mhz") or []},
        "window_before": [lo, step],
        "window_after": [after_lo, windows[1]],
    }
    if ev.kind == "straggler":
        entry["clock_controller"] = "simulated (CPU: agent.frequency.SimulatedController)"
        entry["slowdown"] = ev.data.get("slowdown")
    return entry


def build_report(rec: StoryRecord, ref_losses: list[float], ref_ckpt: Path) -> dict[str, Any]:
    cfg = rec.cfg
    times = commit_times(rec.results)
    dur = durations(times)
    done = sorted((e for e in rec.events if not e.skipped), key=lambda e: e.fired_unix)
    bounds = [e.fired_unix for e in done[1:]] + [math.inf]
    entries: list[dict[str, Any]] = []
    prev = 1  # step 0 carries the groups' set-up
    for i, ev in enumerate(done):
        entry = event_entry(ev, bounds[i], rec, dur, (prev, cfg.steps))
        entries.append(entry)
        prev = (entry["resume_step"] if entry["resume_step"] is not None else prev) + 1
    # Windows: before an event, from the end of the previous chapter to the event's step; after,
    # from the step after its replay to the next event's step (the last: to the end).
    for i, entry in enumerate(entries):
        if i + 1 < len(entries) and entries[i + 1]["step"] is not None:
            entry["window_after"][1] = entries[i + 1]["step"]
    total = cfg.pp * cfg.dp
    healthy = samples_per_s(dur, 1, entries[0]["step"] if entries else cfg.steps, cfg.global_batch)
    throughput: dict[str, Any] = {"healthy_samples_per_s": healthy, "per_event": []}
    for entry in entries:
        lo, hi = entry["window_before"]
        before = samples_per_s(dur, lo, hi if hi is not None else lo, cfg.global_batch)
        lo_after, hi_after = entry["window_after"]
        after = samples_per_s(dur, lo_after, hi_after, cfg.global_batch)
        row: dict[str, Any] = {
            "kind": entry["kind"],
            "before_samples_per_s": before,
            "after_samples_per_s": after,
        }
        if entry["kind"] == "straggler" and entry["step"] is not None and entry["boundary_step"] is not None:
            row["while_slow_samples_per_s"] = samples_per_s(
                dur, entry["step"], entry["boundary_step"], cfg.global_batch
            )
        throughput["per_event"].append(row)
        entry["measured_step_s"] = cfg.global_batch / after if after else None
        live = entry["live_ranks_after"] or total
        entry["lse"] = after / (healthy * live / total) if after and healthy else None
    return {
        "version": REPORT_VERSION,
        "job": {
            "script": "examples/gpt/train.py",
            "pp": cfg.pp,
            "dp": cfg.dp,
            "ranks": total,
            "steps": cfg.steps,
            "global_batch": cfg.global_batch,
            "micro_batches": cfg.micro_batches,
            "nodes": [list(n) for n in cfg.nodes],
            "clock_controller": "simulated",
            "cpus": os.cpu_count(),
        },
        "events": entries,
        "pending": [{"kind": e.kind, "why": e.skipped} for e in rec.events if e.skipped],
        "consistency": consistency(rec, ref_losses, ref_ckpt),
        "throughput": throughput,
        "restarts": restarts(rec),
        "timeline": timeline(rec, times, ref_losses),
    }


def consistency(rec: StoryRecord, ref: list[float], ref_ckpt: Path) -> dict[str, Any]:
    losses = job_losses(rec.results)
    devs = [abs(losses[s] - ref[s]) / abs(ref[s]) for s in sorted(losses) if s < len(ref)]
    state = compare_states(rec.workdir / "checkpoints", ref_ckpt)
    sample_problems = check_samples(rec)
    return {
        "params_equal_after_recovery": state["problem"] == ""
        and state["max_state_rel_diff"] <= MAX_FINAL_STATE_REL_DIFF,
        "max_param_abs_diff": state["max_param_abs_diff"],
        "max_state_rel_diff": state["max_state_rel_diff"],
        "state_problem": state["problem"],
        "loss_rel_dev_mean": sum(devs) / len(devs) if devs else None,
        "loss_rel_dev_max": max(devs, default=None),
        "loss_steps_compared": len(devs),
        "samples_identical": not sample_problems,
        "sample_problems": sample_problems[:5],
        "checksum_mismatches": sum(res["checksum_mismatches"] for res in rec.results.values()),
        "backup_checks": sum(len(res.get("verified_steps", [])) for res in rec.results.values()),
    }


def compare_states(job_ckpt: Path, ref_ckpt: Path) -> dict[str, Any]:
    """The job's final checkpoint against the fault-free run's: the largest absolute difference of
    any parameter, and the largest ||a - b|| / ||b|| over parameters and Adam moments."""
    from executor.checkpoint import CheckpointError, latest_checkpoint, load_unit_state, read_meta  # noqa: PLC0415

    out: dict[str, Any] = {"max_param_abs_diff": None, "max_state_rel_diff": math.inf, "problem": ""}
    try:
        ours, theirs = latest_checkpoint(job_ckpt), latest_checkpoint(ref_ckpt)
        meta, ref_meta = read_meta(ours), read_meta(theirs)
    except CheckpointError as exc:
        out["problem"] = f"final checkpoint missing: {exc}"
        return out
    if meta.next_step != ref_meta.next_step:
        out["problem"] = (
            f"final checkpoint at step {meta.next_step}, the fault-free one at {ref_meta.next_step}"
        )
        return out
    abs_diff, rel_diff = 0.0, 0.0
    for unit in meta.units:
        a, b = load_unit_state(ours, unit), load_unit_state(theirs, unit)
        for key, value in a[0].items():
            if value.numel():
                abs_diff = max(abs_diff, float((value.float() - b[0][key].float()).abs().max()))
        for x, y in [(v, b[0][k]) for k, v in a[0].items()] + [(a[1], b[1]), (a[2], b[2])]:
            if x.numel():
                rel_diff = max(
                    rel_diff, float((x.float() - y.float()).norm()) / (float(y.float().norm()) or 1.0)
                )
    out.update(max_param_abs_diff=abs_diff, max_state_rel_diff=rel_diff, step=meta.next_step)
    return out


def check_samples(rec: StoryRecord) -> list[str]:
    """No sample twice in a stage at any step; from the last loss's replay on (before it, the lost
    ranks' shares went with their results) every stage processed exactly the global batch."""
    gb = rec.cfg.global_batch
    last = max(
        (
            r["resume_at"]
            for ev in rec.events
            for res in rec.results.values()
            for r in res["recoveries"]
            if ev.kind in ("kill", "node") and not ev.skipped and r["applied_unix"] >= ev.fired_unix
        ),
        default=0,
    )
    problems = []
    for step in range(rec.cfg.steps):
        per_stage: dict[int, list[int]] = {}
        for res in rec.results.values():
            stage = res["stage_of_step"].get(str(step))
            if stage is not None:
                per_stage.setdefault(int(stage), []).extend(res["samples"].get(str(step), []))
        if step >= last and not per_stage:
            problems.append(f"step {step}: no rank reported its samples")
        for stage, ids in per_stage.items():
            if len(ids) != len(set(ids)):
                problems.append(f"step {step}, stage {stage}: a sample processed twice")
            elif step >= last and sorted(ids) != list(range(step * gb, (step + 1) * gb)):
                problems.append(f"step {step}, stage {stage}: samples {sorted(ids)}")
    return problems


def restarts(rec: StoryRecord) -> int:
    """Worker processes started again: re-registrations, or a worker id under a new pid."""
    rejoined = sum(e["kind"] == "worker_rejoined" for e in rec.core_events)
    changed = sum(
        1 for w, pid in rec.pids_after.items() if w in rec.pids_before and pid != rec.pids_before[w]
    )
    return rejoined + changed


def timeline(rec: StoryRecord, times: dict[int, float], ref: list[float]) -> dict[str, Any]:
    """Per step: commit time (s since the first commit), samples/s, loss and the fault-free loss;
    live workers from the Core's membership events; event times."""
    t0 = min(times.values(), default=rec.started_unix)
    losses = job_losses(rec.results)
    dur = durations(times)
    steps = [
        {
            "step": s,
            "t_s": times[s] - t0,
            "samples_per_s": rec.cfg.global_batch / dur[s] if dur.get(s) else None,
            "loss": losses.get(s),
            "fault_free_loss": ref[s] if s < len(ref) else None,
        }
        for s in sorted(times)
    ]
    live, workers = 0, []
    for e in rec.core_events:
        # a spare counts from the plan that takes it in (it trains from that plan on)
        delta = {
            "worker_joined": 1,
            "spare_joining": 1,
            "worker_lost": -1,
            "worker_left": -1,
            "worker_finished": -1,
        }.get(e["kind"], 0)
        if delta:
            live += delta
            # Registrations before the first commit count from t = 0 (training starts there).
            workers.append({"t_s": max(0.0, e["time_unix"] - t0), "live": live})
    marks = [{"kind": e.kind, "t_s": e.fired_unix - t0} for e in rec.events if not e.skipped]
    return {"steps": steps, "live_workers": workers, "events": marks}


def problems(report: dict[str, Any], rec: StoryRecord) -> list[str]:
    """Every promise the demo checks; empty when the run kept them all."""
    out: list[str] = []
    c = report["consistency"]
    if report["restarts"]:
        out.append(f"{report['restarts']} worker process(es) restarted")
    if not c["params_equal_after_recovery"]:
        out.append(
            f"final state differs from the fault-free run's: {c['max_state_rel_diff']:.2e} {c['state_problem']}"
        )
    if c["loss_rel_dev_mean"] is None or not c["loss_rel_dev_mean"] <= MAX_MEAN_REL_DEV:
        out.append(f"mean relative loss deviation {c['loss_rel_dev_mean']} > {MAX_MEAN_REL_DEV:g}")
    if not c["samples_identical"]:
        out.append(f"samples: {c['sample_problems']}")
    if c["checksum_mismatches"]:
        out.append(f"{c['checksum_mismatches']} snapshot checksum mismatches")
    if not c["backup_checks"]:
        out.append("no backup was checked against its shard (verify_every longer than the run?)")
    for entry in report["events"]:
        if entry["mttr_s"] is None:
            out.append(f"{entry['kind']}: no step committed after its plan was applied")
    killed = {f"rank-{r}" for e in rec.events if e.kind in ("kill", "node") for r in e.ranks}
    lost = {e["worker_id"] for e in rec.core_events if e["kind"] == "worker_lost"}
    if lost != killed:
        out.append(f"workers marked LOST {sorted(lost)}, killed {sorted(killed)}")
    for ev in rec.events:
        if ev.kind == "preempt" and not ev.skipped and rec.final_states.get(f"rank-{ev.ranks[0]}") != "LEFT":
            out.append(
                f"the preempted rank-{ev.ranks[0]} ended {rec.final_states.get(f'rank-{ev.ranks[0]}')}"
            )
    for rank, res in sorted(rec.results.items()):
        if res.get("fatal"):
            out.append(f"rank {rank}: {res['fatal']}")
    return out
