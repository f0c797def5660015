"""Chaos runs: one elastic job under the Core, faults from a schedule, checked against the fault-free run.

Every process is real (the training demo's Core, store, agents and GPT workers, harness.training).
A scenario lists faults, each fired once every live worker has committed a given step:

- `kill`: SIGKILL of the workers of `ranks` (together, or `gap_s` apart: a second kill during the
  recovery from the first);
- `node`: SIGKILL of the workers *and their agents* (a node gone: nobody reports the exit, the
  Core learns it from the agents' leases or from the survivors' failed collectives);
- `collective`: the first attempt at the next step fails on `ranks` as a collective would with
  every process alive (executor fault injection, `ELASWAVE_INJECT_FAULT`);
- `store`: SIGKILL of the rendezvous store (the workers move to the standby store started with
  it; `ranks` is empty);
- `core`: SIGKILL of the leading Core of a two-Core control plane on etcd (`ChaosScenario.cores`;
  the standby takes over and plans the faults that follow).

The outcome says what a user would check: the job finished with no process restarted; every step
committed (the last commit of each is the one that counts) with its samples processed exactly
once per stage; the loss curve against the fault-free run of the same script and seed; the final
parameters and optimizer moments against the fault-free run's final checkpoint; and the time
from each fault to the next committed step, with the plans that recovered it.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from harness.control_plane import HTTP_TIMEOUT_S, states, stop_processes
from harness.training import (
    TrainDemo,
    TrainDemoConfig,
    fault_free_losses,
    job_losses,
    last_step,
    launch_job,
    live_members,
)
from wire.worker_env import CHECKPOINT_EVERY_ENV, INJECT_FAULT_ENV

FaultKind = Literal["kill", "node", "collective", "store", "core"]


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    after_step: int  # fired once every live worker has committed this step
    ranks: tuple[int, ...]
    gap_s: float = 0.0  # between the kills of successive ranks (0: together)


@dataclass(frozen=True)
class ChaosScenario:
    name: str
    pp: int
    dp: int
    faults: tuple[Fault, ...]
    steps: int = 12
    layers: int = 4
    global_batch: int = 12
    micro_batches: int = 2
    checkpoint_every: int = 0  # 0: only the final checkpoint (kept for the end-state check)
    cores: int = 1  # 2: a leader and a standby on the etcd registry given to run_scenario
    # Ranks of each simulated node, as the layout tells the job (`Layout.rank_nodes`: shard
    # backups avoid a shard's own node); a rank listed nowhere is a node of its own.
    nodes: tuple[tuple[int, ...], ...] = ()

    @property
    def killed(self) -> tuple[int, ...]:
        return tuple(r for f in self.faults if f.kind in ("kill", "node") for r in f.ranks)


@dataclass
class FaultRecord:
    fault: Fault
    fired_unix: float
    missed: str = ""  # why the fault could not be fired as scheduled
    mttr_s: float | None = None  # fault -> the first step committed after it on every survivor
    epochs: list[int] = field(default_factory=list)  # plans applied to recover from it
    modes: list[str] = field(default_factory=list)
    steps_lost: int = 0
    # MTTR itemised (seconds): fault -> the Core marks the last victim LOST; -> the plan that
    # recovered is published; its apply on the slowest survivor (communicator edit, then remap,
    # migration or restore); -> the replayed step commits everywhere.
    phases: dict[str, float] = field(default_factory=dict)


@dataclass
class ChaosOutcome:
    scenario: ChaosScenario
    faults: list[FaultRecord]
    problems: list[str]
    loss_rel_dev_mean: float
    max_state_rel_diff: float
    plans: list[dict[str, Any]]
    final_states: dict[str, str]

    def summary(self) -> str:
        mttr = ", ".join(
            f"{r.fault.kind}{list(r.fault.ranks)}@{r.fault.after_step}: "
            + ("-" if r.mttr_s is None else f"{r.mttr_s * 1e3:.0f} ms")
            + (
                f" (epochs {r.epochs}, {'/'.join(r.modes)}"
                + (f", {r.steps_lost} steps lost" if r.steps_lost else "")
                + ")"
                if r.epochs
                else " (no plan needed)"
            )
            for r in self.faults
        )
        return (
            f"{self.scenario.name}: {'OK' if not self.problems else 'FAILED'}; MTTR {mttr}; "
            f"mean rel. loss dev. {self.loss_rel_dev_mean:.1e}; max rel. state diff {self.max_state_rel_diff:.1e}"
        )


class ChaosRun(TrainDemo):
    def __init__(
        self, workdir: Path, scenario: ChaosScenario, timeout_s: float, registry: str | None = None
    ) -> None:
        cfg = TrainDemoConfig(
            pp=scenario.pp,
            dp=scenario.dp,
            layers=scenario.layers,
            global_batch=scenario.global_batch,
            micro_batches=scenario.micro_batches,
            steps=scenario.steps,
            kill_after_step=0,
            victim_rank=0,
            checkpoint_dir=str(workdir / "checkpoints"),
        )
        super().__init__(workdir, cfg, timeout_s)
        self.scenario = scenario
        self.standbys = sum(f.kind == "store" for f in scenario.faults)
        self.registry = registry
        self.cores: list[tuple[subprocess.Popen[bytes], dict[str, Any], httpx.Client]] = []
        if scenario.cores > 1 and registry is None:
            raise ValueError(
                f"scenario {scenario.name!r} runs {scenario.cores} Cores: give it an etcd registry"
            )
        for rank in range(scenario.pp * scenario.dp):
            self.extra_env[rank] = {CHECKPOINT_EVERY_ENV: str(scenario.checkpoint_every)}
        self.rank_nodes = tuple((r, n) for n, ranks in enumerate(scenario.nodes) for r in ranks)
        # The highest step a live worker had committed when the last fault fired (-1: none yet).
        self.fired_at_step = -1
        for fault in scenario.faults:
            if fault.kind == "collective":
                for rank in fault.ranks:
                    self.extra_env[rank][INJECT_FAULT_ENV] = f"collective@{fault.after_step + 1}"

    def start_core(self) -> dict[str, Any]:
        """One Core (in-memory), or a leader and a standby on the etcd registry."""
        if self.scenario.cores == 1:
            return super().start_core()
        for i in range(self.scenario.cores):
            self.cores.append(self._start_ha_core(f"core-{i}"))
        self.core_addresses = [f"127.0.0.1:{info['grpc_port']}" for _p, info, _h in self.cores]
        self._follow_leader()
        return next(info for _p, info, http in self.cores if http is self.http)

    def _start_ha_core(self, name: str) -> tuple[subprocess.Popen[bytes], dict[str, Any], httpx.Client]:
        ready = self.workdir / f"{name}.json"
        cmd = [sys.executable, "-m", "elaswave.cli", "core", "--grpc-port", "0", "--http-port", "0"]
        cmd += ["--registry", str(self.registry), "--core-id", name, "--ready-file", str(ready)]
        cmd += ["--heartbeat-timeout", "2", "--lease-ttl", "2", "--leader-ttl", "2", "--log-level", "WARNING"]
        env = dict(os.environ, ELASWAVE_SCHEDULER_TOKEN=self.scheduler_token)
        proc = subprocess.Popen(cmd, env=env)
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"Core {name} exited with status {proc.returncode} before it was ready")
            self._check_time(f"Core {name} to start")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        return (
            proc,
            info,
            httpx.Client(base_url=f"http://127.0.0.1:{info['http_port']}", timeout=HTTP_TIMEOUT_S),
        )

    def _follow_leader(self) -> None:
        """Point the REST client at whichever live Core leads (after a takeover: the standby)."""
        while True:
            for proc, _info, http in self.cores:
                if proc.poll() is None:
                    try:
                        if http.get("/healthz").json().get("role") == "leader":
                            self.http = http
                            return
                    except httpx.HTTPError:
                        pass
            self._check_time("a Core to lead")
            time.sleep(0.05)

    def job(self) -> dict[str, Any]:
        if not self.cores:
            return super().job()
        try:
            return super().job()
        except httpx.HTTPError:
            self._follow_leader()
            return super().job()

    def stop(self) -> None:
        super().stop()
        stop_processes([proc for proc, _info, _http in self.cores])
        for _proc, _info, http in self.cores:
            http.close()

    def fire(self, fault: Fault) -> FaultRecord:
        """Wait until every live worker committed `fault.after_step` and, for a fault the harness
        fires, the Core knows the last recovery's backup copies are all re-seeded (no open
        re-protection window); then kill (collective faults fire by themselves inside the
        workers). A kill inside that window is planned as a RESTORE by design
        (core_service.backup_windows; its own test is tests/executor/test_reprotect_window.py):
        a schedule that fires at step boundaries must not hit it by the chance of a REPROTECTED
        report still in flight on a loaded machine.

        A fault also waits for a step committed after the previous fault fired: on a loaded
        machine the harness can fall steps behind an unpaced job, so a fault meant for step 2
        may fire at step 5, and the next one (meant for step 5) would then follow it at once,
        before the Core had even seen the first one's victims, as one larger fault."""
        # A collective fault fires inside the workers at its step whatever the harness waits
        # for: its record is the moment that step committed, not when a window closed later.
        reseeded = fault.kind != "collective"
        step = max(fault.after_step, min(self.fired_at_step + 1, self.scenario.steps - 1))
        job = self.wait_for(
            f"every live worker to commit step {step}"
            + (" and the copies to be re-seeded" if reseeded else ""),
            lambda j: (
                len(j["members"]) == self.workers
                and all(last_step(m) >= step for m in live_members(j))
                and (not reseeded or j.get("backup_window") is None)
            ),
        )
        fired = time.time()
        self.fired_at_step = max((last_step(m) for m in live_members(job)), default=step)
        if fault.kind == "collective":
            return FaultRecord(fault, fired)
        if fault.kind == "core":
            leader = next(proc for proc, _info, http in self.cores if http is self.http)
            leader.kill()
            leader.wait(timeout=10)
            self._follow_leader()
            return FaultRecord(fault, fired)
        if fault.kind == "store":
            live = [
                s for s in [self.store, *self.standby_stores] if s is not None and s.process.poll() is None
            ]
            live[0].process.kill()  # the one the workers use: the first still running
            return FaultRecord(fault, fired)
        pids = {m["worker_id"]: m["pid"] for m in job["members"]}
        for i, rank in enumerate(fault.ranks):
            if i and fault.gap_s:
                time.sleep(fault.gap_s)
            if fault.kind == "node":
                # The agent frozen first, killed last: nobody is left to report the worker's exit,
                # and a worker forked from the zygote (which kills it once its agent is gone) is
                # still there to be killed by this fault.
                self.agents[rank].send_signal(signal.SIGSTOP)
            try:
                os.kill(pids[f"rank-{rank}"], signal.SIGKILL)
            except ProcessLookupError:  # it finished first: the schedule was too short to hit it
                return FaultRecord(fault, fired, missed=f"rank {rank} had already exited")
            finally:
                if fault.kind == "node":
                    self.agents[rank].kill()
        return FaultRecord(fault, fired)

    def layout(self) -> Any:
        return super().layout().replace(rank_nodes=self.rank_nodes)


def run_scenario(
    scenario: ChaosScenario, workdir: Path, timeout_s: float = 240.0, registry: str | None = None
) -> ChaosOutcome:
    """Run `scenario` end to end and check it (see the module docstring); `registry`: the etcd
    URL a two-Core scenario keeps its state in."""
    workdir.mkdir(parents=True, exist_ok=True)
    run = ChaosRun(workdir, scenario, timeout_s, registry)
    # Cold workers: a schedule fires at step boundaries of an unpaced job of a dozen steps, and
    # workers forked warm finished such a job before the harness saw the step a fault waits for.
    run.warm_workers = False
    try:
        launch_job(run)
        records = [run.fire(f) for f in scenario.faults]
        survivors = [r for r in range(scenario.pp * scenario.dp) if r not in scenario.killed]
        results = run.wait_results(survivors)
        assert run.http is not None
        events = run.http.get("/api/v1/jobs/demo/events").json()["events"]
        final = states(run.job())
        phase = run.job()["phase"]
    finally:
        run.stop()
    reference = fault_free_run(run)
    return judge(scenario, records, results, events, final, phase, reference, workdir)


def fault_free_run(run: TrainDemo) -> tuple[list[float], Path]:
    """The same script and seed in one process: (losses by step, its final checkpoint)."""
    ckpt = run.workdir / "fault_free_checkpoint"
    return fault_free_losses(run, ckpt), ckpt


def judge(
    scenario: ChaosScenario,
    records: list[FaultRecord],
    results: dict[int, dict[str, Any]],
    events: list[dict[str, Any]],
    final: dict[str, str],
    phase: str,
    reference: tuple[list[float], Path],
    workdir: Path,
) -> ChaosOutcome:
    ref_losses, ref_ckpt = reference
    problems: list[str] = []
    for rank, res in sorted(results.items()):
        if res.get("fatal") or res["committed_steps"] != scenario.steps:
            problems.append(
                f"rank {rank} ended at step {res['committed_steps']}: {res.get('fatal', 'no error')}"
            )
        if res["checksum_mismatches"]:
            problems.append(f"rank {rank}: {res['checksum_mismatches']} snapshot checksum mismatches")
        if sorted(int(s) for s in res["committed_unix"]) != list(range(scenario.steps)):
            problems.append(f"rank {rank} committed steps {sorted(map(int, res['committed_unix']))}")
    losses = job_losses(results)
    devs = [abs(losses[s] - ref_losses[s]) / abs(ref_losses[s]) for s in range(scenario.steps) if s in losses]
    # The last stage reports the loss: where it was lost, the survivors have it from the recovery on.
    first = first_step_after(records, results, scenario.steps)
    if not set(range(first, scenario.steps)) <= set(losses):
        problems.append(f"losses of steps {sorted(set(range(first, scenario.steps)) - set(losses))} missing")
    dev_mean = sum(devs) / len(devs) if devs else math.inf
    if not dev_mean <= MAX_MEAN_REL_DEV:
        problems.append(f"mean relative loss deviation {dev_mean:.2e} > {MAX_MEAN_REL_DEV:g}")
    problems += check_samples(scenario, results, records)
    diff, why = compare_final_state(workdir / "checkpoints", ref_ckpt)
    if why:
        problems.append(why)
    elif not diff <= MAX_FINAL_STATE_REL_DIFF:
        problems.append(f"final parameters/moments differ from the fault-free run's by up to {diff:.2e}")
    killed = {f"rank-{r}" for r in scenario.killed}
    lost = {e["worker_id"] for e in events if e["kind"] == "worker_lost"}
    if killed - lost:
        problems.append(f"killed workers {sorted(killed - lost)} were never marked LOST")
    if lost - killed:
        problems.append(f"workers {sorted(lost - killed)} were marked LOST but never killed")
    # COMPLETED once every finished worker's Leave is stored; RUNNING if read just before that.
    if phase not in ("COMPLETED", "RUNNING"):
        problems.append(f"the job ended in phase {phase}")
    attribute(records, results)
    itemise(records, results, events)
    plans = [
        {"epoch": e["data"].get("epoch"), "detail": e["detail"], "time_unix": e["time_unix"]}
        for e in events
        if e["kind"] == "plan_published"
    ]
    for record in records:
        resumed = [
            e["data"].get("steps_lost", 0)
            for e in events
            if e["kind"] == "plan_resumed" and record.epochs and e["data"].get("epoch") == record.epochs[-1]
        ]
        if "restore" in record.modes and record.steps_lost and record.steps_lost not in resumed:
            problems.append(
                f"the Core's events do not say the restore cost {record.steps_lost} steps: {resumed}"
            )
        if record.missed:
            problems.append(f"fault {record.fault} not fired: {record.missed}")
        elif record.mttr_s is None:
            problems.append(f"no step committed after fault {record.fault}")
    return ChaosOutcome(scenario, records, problems, dev_mean, diff, plans, final)


MAX_MEAN_REL_DEV = 1e-6  # issue: the chaos suite's loss curve stays on the fault-free one
# Final state after recoveries vs one process, relative to each tensor's magnitude: only the DP
# reduction order differs (fp32 round-off, compounded over the steps after the change).
MAX_FINAL_STATE_REL_DIFF = 1e-4


def check_samples(
    scenario: ChaosScenario, results: dict[int, dict[str, Any]], records: list[FaultRecord]
) -> list[str]:
    """No sample twice in a stage at any step; from the last fault on, the survivors alone cover
    the whole global batch in every stage (before, the killed ranks' shares went with them)."""
    problems: list[str] = []
    last = first_step_after(records, results, scenario.steps)
    for step in range(scenario.steps):
        per_stage: dict[int, list[int]] = {}
        for res in results.values():
            stage = res["stage_of_step"].get(str(step))
            if stage is not None:
                per_stage.setdefault(int(stage), []).extend(res["samples"].get(str(step), []))
        for stage, ids in per_stage.items():
            if len(ids) != len(set(ids)):
                problems.append(f"step {step}, stage {stage}: samples processed twice")
            expected = list(range(step * scenario.global_batch, (step + 1) * scenario.global_batch))
            if step >= last and sorted(ids) != expected:
                problems.append(f"step {step}, stage {stage}: samples {sorted(ids)} != {expected}")
    return problems


def first_step_after(records: list[FaultRecord], results: dict[int, dict[str, Any]], steps: int) -> int:
    """The step replayed after the last recovery: from there on the survivors alone ran every step
    (steps committed while the kills were being made may hold the victims' shares)."""
    fired = max((r.fired_unix for r in records), default=0.0)
    resumed = [
        r["resume_at"] for res in results.values() for r in res["recoveries"] if r["applied_unix"] >= fired
    ]
    return max(resumed, default=steps)


def compare_final_state(job_ckpt: Path, ref_ckpt: Path) -> tuple[float, str]:
    """The largest relative difference ||a - b|| / ||b|| over every tensor of the two final
    checkpoints (each unit's parameters and Adam moments)."""
    from executor.checkpoint import CheckpointError, latest_checkpoint, load_unit_state, read_meta  # noqa: PLC0415

    try:
        ours, theirs = latest_checkpoint(job_ckpt), latest_checkpoint(ref_ckpt)
        meta, ref_meta = read_meta(ours), read_meta(theirs)
    except CheckpointError as exc:
        return math.inf, f"final checkpoint missing: {exc}"
    if (meta.next_step, meta.step_count) != (ref_meta.next_step, ref_meta.step_count):
        return (
            math.inf,
            f"final checkpoint at step {meta.next_step}, the fault-free one at {ref_meta.next_step}",
        )
    worst = 0.0
    for unit in meta.units:
        a, b = load_unit_state(ours, unit), load_unit_state(theirs, unit)
        pairs = [(value, b[0][key]) for key, value in a[0].items()] + [(a[1], b[1]), (a[2], b[2])]
        for x, y in pairs:
            if x.numel():
                scale = float(y.float().norm()) or 1.0
                worst = max(worst, float((x.float() - y.float()).norm()) / scale)
    return worst, ""


def attribute(records: list[FaultRecord], results: dict[int, dict[str, Any]]) -> None:
    """Per fault: the plans applied to recover from it (those applied before the next fault) and
    its MTTR, fault -> the first step every survivor committed after applying the last of them.
    (A step may commit just after a kill without any recovery, when the victim had voted already;
    the step after it is the one that fails and is replayed.)"""
    bounds = [r.fired_unix for r in records] + [math.inf]
    for i, record in enumerate(records):
        firsts = []
        recs: dict[int, dict[str, Any]] = {}
        for res in results.values():
            mine = [r for r in res["recoveries"] if record.fired_unix <= r["applied_unix"] < bounds[i + 1]]
            recs.update({r["epoch"]: r for r in mine})
            # A Core failover needs no plan: training goes on, the next commit is its "recovery".
            since = max((r["applied_unix"] for r in mine), default=None)
            if since is None and record.fault.kind == "core":
                since = record.fired_unix
            if since is not None:
                after = [t for t in res["committed_unix"].values() if t > since]
                if after:
                    firsts.append(min(after))
        record.mttr_s = max(firsts) - record.fired_unix if firsts else None
        record.epochs = sorted(recs)
        record.modes = [recs[e]["mode"] for e in record.epochs]
        record.steps_lost = max((recs[e].get("steps_lost", 0) for e in record.epochs), default=0)


def itemise(
    records: list[FaultRecord], results: dict[int, dict[str, Any]], events: list[dict[str, Any]]
) -> None:
    """Fill `FaultRecord.phases` from the Core's events and the survivors' recovery records:
    detect (fault -> the last victim LOST), plan (-> the plan's publication, as the Core's tick
    records it), deliver (-> the last survivor starts applying it), communicator and state (the
    slowest survivor's group edit and the rest of its apply), replay (the rest of the MTTR)."""
    for record in records:
        if record.mttr_s is None or not record.epochs:
            continue
        victims = {f"rank-{r}" for r in record.fault.ranks}
        lost = [e["time_unix"] for e in events if e["kind"] == "worker_lost" and e["worker_id"] in victims]
        final = record.epochs[-1]
        published = [
            e["time_unix"]
            for e in events
            if e["kind"] == "plan_published" and e["data"].get("epoch") == final
        ]
        recs = [r for res in results.values() for r in res["recoveries"] if r["epoch"] == final]
        phases: dict[str, float] = {}
        if lost:
            phases["detect"] = max(lost) - record.fired_unix
        if published:
            phases["plan"] = published[0] - record.fired_unix - phases.get("detect", 0.0)
        if recs and published:
            # the plan's way to the executors: the Core's planning and write after its tick, the
            # stream, and the last survivor reading it (its apply starts at once)
            phases["deliver"] = max(r["applied_unix"] - r["apply_s"] for r in recs) - published[0]
        if recs:
            phases["communicator"] = max(r["communicator_s"] for r in recs)
            phases["state"] = max(r["apply_s"] - r["communicator_s"] for r in recs)
        phases["replay"] = record.mttr_s - sum(phases.values())
        record.phases = phases


def random_scenario(seed: int, pp: int = 2, dp: int = 4, kills: int = 4, steps: int = 16) -> ChaosScenario:
    """A seeded schedule of `kills` rank losses on a PP x DP job: single kills, pairs killed
    together, pairs 50 ms apart (during the recovery), and whole simulated nodes of two ranks;
    one rank of stage 0 always survives so the job has somewhere to go."""
    rng = random.Random(seed)
    alive = list(range(pp * dp))
    keep = 0  # never killed
    faults: list[Fault] = []
    step, left = 1, kills
    while left > 0 and step < steps - 2:
        candidates = [r for r in alive if r != keep]
        if not candidates:
            break
        kind = (
            rng.choice(["kill", "pair", "during", "node"]) if left >= 2 and len(candidates) >= 2 else "kill"
        )
        ranks = tuple(rng.sample(candidates, 1 if kind == "kill" else 2))
        fault = Fault(
            "node" if kind == "node" else "kill",
            step,
            ranks,
            gap_s=0.05 if kind == "during" else 0.0,
        )
        faults.append(fault)
        alive = [r for r in alive if r not in ranks]
        left -= len(ranks)
        step += rng.randint(2, 3)
    return ChaosScenario(
        f"random-{seed}", pp=pp, dp=dp, global_batch=16, steps=steps, checkpoint_every=2, faults=tuple(faults)
    )
