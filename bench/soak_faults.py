"""The soak's faults (`bench.soak`): drawn from a seeded generator, fired when the job can take
them, then every check of the run against the fault-free one.

The kinds come as a shuffled deck: each once, in the seed's order, before any comes again; a kind
the job cannot take now (a node kill with one node left, a join with no room) waits for a later
draw; when none left in the deck fits, one from outside it that fits comes in between. After each
fault the soak waits (bounded) for the job to commit steps past it.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.soak_cluster import Core, Node, SoakError, wait

KINDS = ("worker", "node", "store", "core", "preempt", "join")
JOB = "soak"
CHANGE_MEMBERS = ("worker", "node", "preempt", "join")  # the running members change after these
RECOVER_S = 180.0  # a fault's recovery: the job commits steps past it within this
PROGRESS_STEPS = 3
STORES_SETTLE_S = 10.0  # a store list this old is known to every worker (re-read every 8 commits)
MAX_NODES = 3  # launchers alive at once: a join waits while three nodes run
# fp32 round-off: a data-parallel change sums the batch in another order (relative differences)
LOSS_RTOL, STATE_RTOL = 1e-3, 1e-3


class Faults:
    def __init__(
        self,
        rng: random.Random,
        root: Path,
        cores: list[Core],
        nodes: list[Node],
        script: Path,
        add_node: Callable[[str], Node],
    ) -> None:
        self.rng, self.root, self.cores, self.nodes, self.script = rng, root, cores, nodes, script
        self.add_node = add_node
        self.records: list[str] = []
        self.seen: dict[int, str] = {}  # every worker process ever: pid -> worker id
        self._deck: list[str] = []
        self._stores_seen: list[str] = []  # the job's store list as last seen, since when
        self._stores_since = 0.0
        self.witness = ""
        self.fired = 0
        self.kinds: list[str] = []
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    # ---- the job as the leading Core sees it ----------------------------------------------
    def job(self) -> dict[str, Any]:
        for core in self.cores:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                response = httpx.get(f"{core.http_url}/api/v1/jobs/{JOB}", timeout=5)
                if response.status_code == 200:
                    return dict(response.json())
        raise SoakError("no Core answers for the job")

    def events(self) -> list[dict[str, Any]]:
        for core in self.cores:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                url = f"{core.http_url}/api/v1/jobs/{JOB}/events"
                response = httpx.get(url, params={"limit": 10_000}, timeout=10)
                if response.status_code == 200:
                    return list(response.json()["events"])
        raise SoakError("no Core answers for the job's events")

    @staticmethod
    def running(job: dict[str, Any]) -> list[dict[str, Any]]:
        return [m for m in job["members"] if m["state"] not in ("LOST", "LEFT", "SPARE") and m["rank"] >= 0]

    @staticmethod
    def step(job: dict[str, Any]) -> int:
        return max((int((m.get("last_step") or {}).get("step", -1)) for m in job["members"]), default=-1)

    def _watch(self) -> None:
        while not self._stop.wait(0.3):
            for node in list(self.nodes):
                self.seen.update(node.workers(self.script))

    # ---- the run ----------------------------------------------------------------------------
    def run(self, gap_s: float, deadline_s: float) -> None:
        """Fire faults about every `gap_s` until the job ends (at most `deadline_s` in all)."""
        end = time.monotonic() + deadline_s
        job = wait(
            lambda: len(self.running(j := self.job())) == 4 and self.step(j) >= 3 and j,
            300,
            "the job to train",
        )
        # One rank of the last stage is never a victim, so that one worker runs from the first
        # step to the last; every step's loss comes from the lines the last stage's workers
        # append as they commit (`losses`), compared with the fault-free run.
        last = job["layout"]["stages"][-1]["ranks"][0]
        self.witness = next(m["worker_id"] for m in job["members"] if m["rank"] == last)
        self._note(f"the job trains; {self.witness} (rank {last}, last stage) is never a victim")
        while not self._over():
            pause_until = time.monotonic() + gap_s * self.rng.uniform(0.7, 1.3)
            while time.monotonic() < pause_until and not self._over():
                time.sleep(0.5)
            if self._over():
                break
            if time.monotonic() > end:
                raise SoakError(f"the job did not finish within {deadline_s:g} s")
            self._fire_one()
        wait(
            lambda: not any(n.alive for n in self.nodes),
            max(60.0, end - time.monotonic()),
            "every launcher to exit",
        )
        self._stop.set()
        self._watcher.join(5)

    def _over(self) -> bool:
        try:
            return self.job()["phase"] in ("COMPLETED", "FAILED", "STOPPED")
        except SoakError:
            return False

    def _fire_one(self) -> None:
        if not self._deck:
            self._deck = list(KINDS)
            self.rng.shuffle(self._deck)
        job = self.job()
        for kind in list(self._deck):
            if self._fire(kind, job):
                self._deck.remove(kind)
                return
        # No kind left in the deck fits the job now (the losses want a third running worker and
        # the deck's join came already): a kind from outside it that fits comes in between (a
        # join, the store, a Core), so the faults go on instead of waiting for the job's end.
        for kind in self.rng.sample(KINDS, len(KINDS)):
            if kind not in self._deck and self._fire(kind, job):
                return

    def _fire(self, kind: str, job: dict[str, Any]) -> bool:
        fired = getattr(self, f"_{kind}")(job)
        if not fired:
            return False
        self.fired += 1
        self.kinds.append(kind)
        at = self.step(job)
        self._note(f"step {at}: {kind}: {fired}")
        if kind in CHANGE_MEMBERS:
            self._members_changed({m["worker_id"] for m in self.running(job)}, kind)
        self._recovered(at)
        return True

    def _note(self, line: str) -> None:
        line = f"{time.monotonic() - self._started:6.1f} s  {line}"
        self.records.append(line)
        print(f"[soak] {line}", flush=True)

    def _members_changed(self, before: set[str], kind: str) -> None:
        """Block until the Core's running members differ from `before` (a loss seen, a departure
        done, a spare taken in), or the job ended: a join's spares start for many seconds while
        the job steps on, and its plan must land before the next fault, not on top of it."""

        def on() -> bool:
            job = self.job()
            ended = job["phase"] in ("COMPLETED", "FAILED", "STOPPED")
            return ended or {m["worker_id"] for m in self.running(job)} != before

        wait(on, RECOVER_S, f"the Core to change the running members after the {kind}", 0.5)

    def _recovered(self, at: int) -> None:
        """Block until the job runs again and has committed PROGRESS_STEPS steps past `at` (or has
        ended): the next fault then hits a job that recovered from this one. Faults landing on a
        recovery still under way are the chaos tests' cascades; here a fault every few seconds on
        a job that is not stepping would only measure the schedule, not the system. A recovery
        slower than RECOVER_S fails the soak (SoakError)."""

        def on() -> bool:
            job = self.job()
            if job["phase"] in ("COMPLETED", "FAILED", "STOPPED"):
                return True
            return job["phase"] == "RUNNING" and self.step(job) >= at + PROGRESS_STEPS

        wait(on, RECOVER_S, f"the job to run again and commit {PROGRESS_STEPS} steps past step {at}", 0.5)

    # ---- the faults: each returns what it did, or "" when the job cannot take it now ----------
    def _victim(self, job: dict[str, Any]) -> dict[str, Any] | None:
        """A running worker whose stage keeps another running rank."""
        stage_of = {
            r: i for i, s in enumerate((job.get("layout") or {}).get("stages", [])) for r in s["ranks"]
        }
        running = self.running(job)
        if len(running) < 3:
            return None
        per_stage: dict[int, int] = {}
        for m in running:
            per_stage[stage_of.get(m["rank"], -1)] = per_stage.get(stage_of.get(m["rank"], -1), 0) + 1
        fit = [
            m
            for m in running
            if per_stage.get(stage_of.get(m["rank"], -1), 0) >= 2 and m["worker_id"] != self.witness
        ]
        return self.rng.choice(fit) if fit else None

    def _worker(self, job: dict[str, Any]) -> str:
        victim = self._victim(job)
        if victim is None:
            return ""
        for node in self.nodes:
            for pid, worker in node.workers(self.script).items():
                if worker == victim["worker_id"]:
                    psutil.Process(pid).kill()
                    return f"SIGKILL {worker} (pid {pid}) on {node.name}"
        return ""

    def _preempt(self, job: dict[str, Any]) -> str:
        victim = self._victim(job)
        if victim is None:
            return ""
        body = {"worker_ids": [victim["worker_id"]], "deadline_unix": time.time() + 30, "reason": "soak"}
        for core in self.cores:
            with contextlib.suppress(httpx.HTTPError):
                response = httpx.post(
                    f"{core.http_url}/api/v1/jobs/{JOB}/preempt",
                    json=body,
                    headers={"Authorization": f"Bearer {core.token}"},
                    timeout=10,
                )
                if response.status_code == 202:
                    return f"preempted {victim['worker_id']} (30 s deadline)"
        return ""

    def _node(self, job: dict[str, Any]) -> str:
        running = {m["worker_id"] for m in self.running(job)}
        for node in self.rng.sample(self.nodes, len(self.nodes)):
            mine = set(node.workers(self.script).values()) & running
            if (
                node.alive
                and mine
                and self.witness not in mine
                and len(running - mine) >= 2
                and self._stages_kept(job, running - mine)
            ):
                victims = node.agents() + [psutil.Process(p) for p in node.workers(self.script)]
                for proc in victims:
                    with contextlib.suppress(psutil.Error):
                        proc.send_signal(signal.SIGKILL)
                return f"SIGKILL {node.name}'s agents and workers ({', '.join(sorted(mine))})"
        return ""

    @staticmethod
    def _stages_kept(job: dict[str, Any], left: set[str]) -> bool:
        ranks = {m["rank"] for m in job["members"] if m["worker_id"] in left}
        return all(set(s["ranks"]) & ranks for s in (job.get("layout") or {}).get("stages", []))

    def _store(self, job: dict[str, Any]) -> str:
        """The job's store, once its list has a standby the workers have had time to learn
        (they re-read the list every few commits): two store losses before a new standby is
        known end a job (docs/limits.md), a double fault the soak does not claim to survive."""
        stores = list(job.get("stores", ()))
        if stores != self._stores_seen:
            self._stores_seen, self._stores_since = stores, time.monotonic()
        if len(stores) < 2 or time.monotonic() - self._stores_since < STORES_SETTLE_S:
            return ""
        port = int(stores[0].rsplit(":", 1)[1])
        for node in self.nodes:
            for proc in node.stores():
                with contextlib.suppress(psutil.Error):
                    if any(c.laddr.port == port for c in proc.net_connections("tcp")):
                        proc.kill()
                        return f"SIGKILL the job's store {stores[0]} on {node.name}"
        return ""

    def _core(self, job: dict[str, Any]) -> str:
        leader = next((c for c in self.cores if c.role() == "leader"), None)
        standby = next((c for c in self.cores if c is not leader and c.role() == "standby"), None)
        if leader is None or standby is None:
            return ""
        leader.kill()
        took = time.monotonic()
        wait(lambda: standby.role() == "leader", 60, f"{standby.name} to lead")
        took = time.monotonic() - took
        leader.start()  # the same ports: everyone knows it, as the standby now
        return f"SIGKILL the leading Core {leader.name}; {standby.name} led {took:.1f} s later, {leader.name} back as standby"

    def _join(self, job: dict[str, Any]) -> str:
        live = [m for m in job["members"] if m["state"] not in ("LOST", "LEFT")]
        if len(live) > 2 or sum(n.alive for n in self.nodes) >= MAX_NODES:
            return ""
        index = len(self.nodes)  # node-a, node-b, ...; past node-z, node-26, node-27, ...
        name = f"node-{chr(ord('a') + index)}" if index < 26 else f"node-{index}"
        self.add_node(name)
        return f"{name} joins the running job with 2 spares"

    # ---- the checks ----------------------------------------------------------------------------
    def check(self, steps: int, reference: tuple[dict[int, float], Path]) -> list[str]:
        problems: list[str] = []
        job = self.job()
        if job["phase"] != "COMPLETED":
            problems.append(f"the job ended {job['phase']}: {job.get('end_reason')}")
        workers: dict[str, set[int]] = {}
        for pid, worker in self.seen.items():
            workers.setdefault(worker, set()).add(pid)
        again = {w: sorted(p) for w, p in workers.items() if len(p) > 1}
        if again:
            problems.append(f"worker processes started again: {again}")
        self.plans = [e for e in self.events() if e["kind"] == "plan_published"]
        for plan in self.plans:
            mode = plan["data"].get("mode")
            if mode not in ("in_place", "restore") or (mode == "restore" and not plan["detail"]):
                problems.append(f"plan {plan['data'].get('epoch')}: mode {mode}, {plan['detail']!r}")
        ref_losses, ref_state = reference
        losses = self.losses()
        missing = sorted(set(range(steps)) - set(losses))
        if missing:
            problems.append(f"{len(missing)} steps have no loss recorded (first {missing[:5]})")
        worst = max(
            (
                abs(losses[s] - ref_losses[s]) / max(abs(ref_losses[s]), 1e-6)
                for s in losses
                if s in ref_losses
            ),
            default=0.0,
        )
        if worst > LOSS_RTOL:
            problems.append(f"a step's loss differs from the fault-free run by {worst:.2e} (relative)")
        self.state_diff, why = final_state_diff(self.root / "ckpt", ref_state, steps)
        if why or self.state_diff > STATE_RTOL:
            problems.append(
                why or f"final parameters differ from the fault-free run by {self.state_diff:.2e}"
            )
        self.loss_diff = worst
        return problems

    def losses(self) -> dict[int, float]:
        """Every committed step's loss: from the workers' result files and from the lines each
        last-stage worker appended as it committed (`--losses-log`; a worker killed later
        leaves no result file, and the witness may have served on another stage for a while)."""
        found: dict[int, float] = {}
        for path in sorted(self.root.glob(f"elaswave-run/{JOB}/node-*/*.json")):
            with contextlib.suppress(OSError, ValueError):
                for step, loss in json.loads(path.read_text()).get("losses", {}).items():
                    found.setdefault(int(step), float(loss))
        for path in sorted((self.root / "losses").glob("*.jsonl")):
            with contextlib.suppress(OSError):
                for line in path.read_text().splitlines():
                    with contextlib.suppress(ValueError, TypeError):
                        step, loss = json.loads(line)
                        found.setdefault(int(step), float(loss))
        return found

    def summary(self, took_s: float) -> None:
        plans = getattr(self, "plans", [])
        modes = [p["data"].get("mode") for p in plans]
        print(
            f"[soak] {self.fired} faults ({', '.join(self.kinds) or 'none'}) in {took_s:.0f} s; {len(plans)} plans "
            f"({modes.count('in_place')} in place, {modes.count('restore')} RESTORE); "
            f"{len(self.seen)} worker processes, none started again unless said above; final state vs "
            f"the fault-free run: loss {getattr(self, 'loss_diff', math.nan):.1e}, parameters "
            f"{getattr(self, 'state_diff', math.nan):.1e} (relative)",
            flush=True,
        )
        for plan in plans:
            if plan["data"].get("mode") == "restore":
                print(f"[soak]   RESTORE epoch {plan['data'].get('epoch')}: {plan['detail']}", flush=True)


def final_state_diff(ckpt: Path, reference: Path, steps: int) -> tuple[float, str]:
    """The largest ||a - b|| / ||b|| over the final checkpoint's parameters and the reference's,
    and what is wrong when they cannot be compared."""
    import torch  # noqa: PLC0415

    import elaswave  # noqa: PLC0415
    from executor.checkpoint import CheckpointError, latest_checkpoint, read_meta  # noqa: PLC0415

    try:
        meta = read_meta(latest_checkpoint(ckpt))
        final = elaswave.load_model_state(ckpt)
    except (CheckpointError, OSError, ValueError) as exc:
        return math.inf, f"no final checkpoint: {exc}"
    if meta.next_step != steps:
        return math.inf, f"the final checkpoint is at step {meta.next_step}, not {steps}"
    expected = torch.load(reference, weights_only=True)
    if final.keys() != expected.keys():
        return math.inf, f"the final checkpoint holds {sorted(final)}, the reference {sorted(expected)}"
    return max(float((final[k] - expected[k]).norm()) / (float(expected[k].norm()) or 1.0) for k in final), ""
