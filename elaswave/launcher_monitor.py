"""What `elaswave run` shows while the job runs, how it asks the job to stop, and how it ends.

Progress comes from the Core's REST view of the job (`GET /api/v1/jobs/<job>`: every member's
state and last step metrics) and its event log (`GET /api/v1/jobs/<job>/events`). Every request
is bounded by the client's timeout; a Core that does not answer shows as such on the line and
never stalls the loop.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

# Events that say something happened to the job (per-step chatter and plan acks are left out).
NOTABLE_EVENTS = frozenset(
    {
        "worker_lost",
        "worker_left",
        "worker_finished",
        "worker_preempting",
        "worker_slow",
        "worker_rejoined",
        "plan_published",
        "decision_refuse",
        "worker_draining",
        "checkpoint_requested",
        "checkpoint_written",
        "job_failed",
        "job_stopped",
    }
)
RATE_WINDOW_S = 10.0
PROGRESS_DETAIL_CHARS = 120  # the progress line's last event: cut at a word, never mid-number


def last_step(member: dict[str, Any]) -> int:
    """The last step a member committed (-1 before its first)."""
    return int((member.get("last_step") or {}).get("step", -1))


def write_stop_file(path: Path, stop_after_step: int) -> None:
    """Atomically write the launcher's stop request (`ELASWAVE_STOP_FILE`) for the workers."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"stop_after_step": stop_after_step}))
    os.replace(tmp, path)


@dataclass
class Snapshot:
    """The job as last read from the Core."""

    members: list[dict[str, Any]] = field(default_factory=list)
    phase: str = ""
    plan_epoch: int = 0
    error: str = ""

    @property
    def live(self) -> list[dict[str, Any]]:
        return [m for m in self.members if m["state"] not in ("LOST", "LEFT")]

    def step(self, members: list[dict[str, Any]] | None = None) -> int:
        return max((last_step(m) for m in (self.members if members is None else members)), default=-1)

    def loss(self) -> float | None:
        """The loss of the latest step, from whichever rank reported one (the last stage's)."""
        best: tuple[int, float] | None = None
        for m in self.members:
            report = m.get("last_step") or {}
            if report.get("loss") is not None and (best is None or report["step"] > best[0]):
                best = (int(report["step"]), float(report["loss"]))
        return None if best is None else best[1]


@dataclass
class Monitor:
    """Polls the Core for one job and prints progress about once a second."""

    http: httpx.Client
    job: str
    world: int
    total_steps: int
    global_batch: int
    out: TextIO
    snapshot: Snapshot = field(default_factory=Snapshot)
    events: list[dict[str, Any]] = field(default_factory=list)
    _history: deque[tuple[float, int]] = field(default_factory=deque)
    _last_key: tuple[object, ...] = ()
    _last_print: float = 0.0

    def poll(self) -> Snapshot:
        """Refresh the job and new events from the Core (bounded by the client's timeout)."""
        try:
            response = self.http.get(f"/api/v1/jobs/{self.job}")
            response.raise_for_status()
            body = response.json()
            self.snapshot = Snapshot(body["members"], body["phase"], body["plan_epoch"])
            since = self.events[-1]["seq"] if self.events else 0
            new = self.http.get(f"/api/v1/jobs/{self.job}/events", params={"since": since}).json()["events"]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            self.snapshot.error = f"Core not answering ({type(exc).__name__})"
            return self.snapshot
        self.events.extend(new)
        for event in new:
            if event["kind"] in NOTABLE_EVENTS:
                self._print(f"event: {format_event(event)}")
        now = time.monotonic()
        self._history.append((now, self.snapshot.step()))
        while len(self._history) > 2 and now - self._history[0][0] > RATE_WINDOW_S:
            self._history.popleft()
        return self.snapshot

    def slowest_step_s(self) -> float | None:
        """The slowest live worker's last reported step time (None before any report)."""
        times = [
            m["last_step"]["step_time_s"]
            for m in self.snapshot.live
            if m.get("last_step") and m["last_step"].get("step_time_s")
        ]
        return max(times) if times else None

    def samples_per_s(self) -> float | None:
        if len(self._history) >= 2:
            (t0, s0), (t1, s1) = self._history[0], self._history[-1]
            if s1 > s0 and t1 > t0:
                return (s1 - s0) * self.global_batch / (t1 - t0)
        times = [
            m["last_step"]["step_time_s"]
            for m in self.snapshot.live
            if m.get("last_step") and m["last_step"].get("step_time_s")
        ]
        return self.global_batch / max(times) if times else None

    def progress_line(self) -> str:
        snap = self.snapshot
        step = snap.step()
        loss = snap.loss()
        rate = self.samples_per_s()
        parts = [
            f"step {step + 1}/{self.total_steps}" if step >= 0 else "starting",
            f"loss {loss:.4f}" if loss is not None else "loss -",
            f"{rate:.1f} samples/s" if rate is not None else "- samples/s",
            f"workers {len(snap.live)}/{self.world}",
        ]
        if snap.phase and snap.phase != "RUNNING":
            parts.append(f"phase {snap.phase}")
        last = next((e for e in reversed(self.events) if e["kind"] in NOTABLE_EVENTS), None)
        if last is not None:
            parts.append(f"last event: {format_event(last, most=PROGRESS_DETAIL_CHARS)}")
        if snap.error:
            parts.append(snap.error)
        return "  ".join(parts)

    def show(self, interval_s: float = 1.0) -> None:
        """Print the progress line when the job moved (step, workers, events; not the rate alone),
        at most once per `interval_s`."""
        now = time.monotonic()
        if now - self._last_print < interval_s:
            return
        snap = self.snapshot
        key = (snap.step(), len(snap.live), len(snap.members), snap.phase, snap.error, len(self.events))
        if key != self._last_key:
            self._print(self.progress_line())
            self._last_key = key
        self._last_print = now

    def _print(self, text: str) -> None:
        print(f"[elaswave] {text}", file=self.out, flush=True)


def format_event(event: dict[str, Any], most: int | None = None) -> str:
    """`kind worker (detail)`; with `most`, a longer detail is cut at a word boundary and marked
    with an ellipsis, never inside a number or a name (issue 27: lines cut mid-number)."""
    who = f" {event['worker_id']}" if event.get("worker_id") else ""
    detail = str(event.get("detail") or "")
    if most is not None and len(detail) > most:
        cut = detail.rfind(" ", 0, most)
        detail = detail[: cut if cut > 0 else most].rstrip(" ;,") + " ..."
    return f"{event['kind']}{who}{f' ({detail})' if detail else ''}"


# What `elaswave run` exits with (docs/api.md, "Exit codes of elaswave run"); a scheduler reads
# these, so each means one thing. A stop on request exits with the shell's 128 + signal.
EXIT_COMPLETED = 0  # the job completed: every worker finished, or finished with others planned around
EXIT_FAILED = 1  # the job failed (no worker finished; or the Core's phase is FAILED)
EXIT_LEFT_RUNNING_JOB = 3  # this node's workers left (preempted, drained, lost); the job goes on elsewhere
TERMINAL_PHASES = frozenset({"COMPLETED", "FAILED", "STOPPED"})


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    summary: str
    failed_ranks: tuple[int, ...]


def outcome(
    job: str,
    exit_codes: dict[int, int | None],
    events: list[dict[str, Any]],
    snapshot: Snapshot,
    total_steps: int,
    stop_signal: int | None,
    world: int | None = None,
    local_workers: frozenset[str] = frozenset(),
) -> Outcome:
    """How the job ended for this launcher, from its agents' exit statuses and the Core's view.

    - stopped on request (Ctrl-C, SIGTERM, another node's or an operator's stop): the shell's
      128 + signal when the workers left cleanly, else `EXIT_FAILED`;
    - `local_workers` (this node's) all left while the job, not terminal, goes on with workers
      elsewhere: `EXIT_LEFT_RUNNING_JOB` (the job is not done; this node is);
    - completed, unless the Core's phase is FAILED: every agent exited 0, or some worker finished
      its work (it commits its last step only with the whole job) and the others were lost on
      the way and planned around;
    - otherwise `EXIT_FAILED`, with the ranks that exited non-zero and the Core's reason.
    `world`: the job's workers, where this launcher runs only some (one node of several)."""
    finished = sorted({e["worker_id"] for e in events if e["kind"] == "worker_finished"})
    failed = tuple(sorted(r for r, c in exit_codes.items() if c != 0))
    lost = [f"{e['worker_id']} ({e['detail']})" for e in events if e["kind"] == "worker_lost"]
    step = snapshot.step()
    lost_note = f"; lost on the way and planned around: {', '.join(lost)}" if lost else ""
    if stop_signal is not None:
        if failed:
            return Outcome(
                EXIT_FAILED,
                f"job {job!r} stopped on request, but ranks {list(failed)} did not exit cleanly "
                f"(last committed step {step})",
                failed,
            )
        return Outcome(128 + stop_signal, f"job {job!r} stopped on request after step {step}{lost_note}", ())
    elsewhere = [m for m in snapshot.live if m["worker_id"] not in local_workers]
    # A worker of this node that finished committed the job's last step with everyone: done.
    local_finished = local_workers.intersection(finished)
    if local_workers and elsewhere and not local_finished and snapshot.phase not in TERMINAL_PHASES:
        return Outcome(
            EXIT_LEFT_RUNNING_JOB,
            f"this node's workers left job {job!r} after step {step}; the job goes on with "
            f"{len(elsewhere)} worker(s) elsewhere and is not finished (exit {EXIT_LEFT_RUNNING_JOB})",
            failed,
        )
    core_failed = snapshot.phase == "FAILED"
    if not core_failed and (not failed or finished):
        return Outcome(
            EXIT_COMPLETED,
            f"job {job!r} finished: {step + 1}/{total_steps} steps, {len(finished)} of "
            f"{world or len(exit_codes)} workers finished{lost_note}",
            failed,
        )
    where = f"after step {step}" if step >= 0 else "before its first step"
    parts = [] if finished else ["no worker finished"]
    if failed:
        codes = ", ".join(f"rank {r}: {exit_codes[r]}" for r in failed)
        parts.append(f"ranks {list(failed)} exited non-zero ({codes}); see their logs in the run directory")
    if core_failed:
        why = next((e["detail"] for e in reversed(events) if e["kind"] == "job_failed"), "see its events")
        parts.append(f"the Core ended the job FAILED: {why}")
    return Outcome(EXIT_FAILED, f"job {job!r} failed {where}: {'; '.join(parts)}", failed)
