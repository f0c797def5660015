"""One rank of a launched job, driven by the Core (what `elaswave.train` runs under `elaswave run`).

It builds its rank of the PP x DP x ZeRO engine for the user's `TrainSpec` from the job's
layout, groups over the store that no training rank hosts (executor.store_server), and runs the
step-boundary protocol of `executor.step_protocol`. What the engine's tests do by hand, the Core
does here:

- a peer dies -> the survivors' collectives fail (a closed socket is seen in milliseconds), every
  survivor votes abort and rolls back to the last committed step;
- the agent beside the dead worker reports the exit, the Core plans (micro-batch resizing,
  ElasWave §4.1) and publishes the plan; the survivors receive it through
  `ExecutorService.SubscribePlans` (executor.plan_client), acknowledge RECEIVED, PAUSED and
  APPLIED, edit their groups in place, remap the lost shard from its ring snapshot, replay the
  step and acknowledge RESUMED after the first committed step under the new layout;
- a plan that arrives while a step is running aborts that step on every worker (the plan is the
  abort signal: it also releases survivors blocked on a hung rather than a dead peer);
- what clusters do beyond one clean kill (several ranks at once, a failure during the recovery,
  a whole stage or the store lost, a collective that fails with everyone alive) goes through the
  same loop: how a worker follows plans, restarts an interrupted recovery from the last committed
  state and moves to a standby store is `executor.worker_recovery`;
- a spare (`ELASWAVE_RANK=spare`, its agent registered without a rank) first warms up (device,
  store, the units' dry run, its units built and run once: `executor.spare_warmup`), then
  subscribes to plans with its own credential (the Core then knows it is ready), waits for a plan whose `joiners` names it,
  builds its rank for that plan's layout and applies the plan with everyone else: its groups are
  built at the plan's epoch and its state comes from the live owners (`executor.fabric.rebuild`);
  it then trains from the job's next step;
- a planned departure (scheduler preemption through the Core, or SIGTERM of the agent, which
  reports a PreemptionNotice) is the same plan: the leaving worker rolls back with everyone at
  the boundary, sees that its rank is gone and exits 0 (its agent then says Leave: LEFT, not
  LOST). SIGTERM of the worker itself (the agent forwards it; Slurm signals every process) never
  kills it mid-step: if its agent reported the preemption (a drain notice in the control file,
  wire.local_protocol) it keeps training until the Core's plan lets it go, so the survivors never see
  it vanish; otherwise (a plain stop), or with no such plan within `--timeout`, it stops at the
  next step boundary and exits 143, which the survivors handle as a fail-stop.

Each committed step is reported to the agent over the local metrics socket. Checkpoints
(executor.checkpoint) are gathered inside the step they capture, before the commit vote, and
written in the background once it commits; a stop request from the launcher (the stop file says
after which step) ends every worker at the same boundary with a final checkpoint. At the end the
worker writes its per-step losses, the samples it ran and its recovery timings as JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from executor.compute_clock import ComputeClock
from executor.step_phases import StepPhases
from executor.worker_recovery import PlanFollowing, PlanNotApplicable
from planners.backup import DEFAULT_VERIFY_EVERY
from wire.worker_env import EXIT_NO_PLAN, EXIT_PLAN_NOT_APPLICABLE, EXIT_TERMINATED, WorkerPlace

# Re-read the job's store list every this many committed steps (one store round trip).
STORE_LIST_EVERY = 8
# The per-step records a worker keeps in its results (sample ids, stage, commit time, compute):
# the most recent this many committed steps. Kept whole, a long job's grew without end, the
# sample ids alone by ~36 bytes per sample a rank feeds per step (1.2 GB over a million steps
# of 32 samples), and the results file with them. The losses are kept whole (`TrainResult`).
HISTORY_STEPS = 10_000


class RecentSteps(dict[int, Any]):
    """step -> value for the `capacity` steps most recently added (the oldest dropped first; a
    step replayed after a rollback keeps its place)."""

    def __init__(self, capacity: int = HISTORY_STEPS) -> None:
        if capacity < 1:
            raise ValueError(f"a step history keeps at least 1 step, got {capacity}")
        super().__init__()
        self.capacity = capacity

    def __setitem__(self, step: int, value: Any) -> None:
        super().__setitem__(step, value)
        while len(self) > self.capacity:
            del self[next(iter(self))]


@dataclass(frozen=True)
class WorkerSettings:
    """How long to train and what to keep; `place` is where this worker sits in the job."""

    place: WorkerPlace
    steps: int
    verify_every: int = DEFAULT_VERIFY_EVERY  # committed steps between checks of the backups
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0  # steps between checkpoints (0: only the final one)
    resume: Path | None = None
    stop_file: Path | None = None
    # unit -> fingerprint of its initial weights in the launcher's describe run: every process must
    # build the same model (wire.worker_env.ModelDescription.fingerprints)
    fingerprints: dict[str, str] | None = None
    # Called after every committed step with (step, loss or None), on every rank (the script's
    # `on_step`); `log_every`: the first rank of the last stage prints a progress line this often.
    on_step: Callable[[int, float | None], None] | None = None
    log_every: int = 0


class ModelMismatch(ValueError):
    """This process built its units with other weights than the describe run did."""


def check_fingerprints(units: dict[str, Any], expected: dict[str, str] | None) -> None:
    """Raise ModelMismatch naming the units whose initial weights differ from the describe run's."""
    from executor.units import fingerprint  # noqa: PLC0415

    if not expected:
        return
    differ = [n for n, u in units.items() if n in expected and fingerprint(u) != expected[n]]
    if differ:
        raise ModelMismatch(
            f"units {differ} were built with other initial weights in this process than in the "
            "launcher's describe run: build the model the same way in every process (seed it with "
            "torch.manual_seed before building it, or hand elaswave.Units a build_unit function, "
            "which the engine seeds by unit name)"
        )


def link_peer(group: str, rank: int) -> int | None:
    """The other worker of a pipeline-link group ("link/a-b"), the one a failed link op names."""
    kind, _, members = group.partition("/")
    if kind != "link":
        return None
    ends = [int(x) for x in members.split("-")]
    others = [r for r in ends if r != rank]
    return others[0] if len(others) == 1 else None


def read_stop_after(path: Path | None) -> int | None:
    """The step after which the launcher asked every worker to stop (None: no request)."""
    if path is None or not path.exists():
        return None
    try:
        return int(json.loads(path.read_text())["stop_after_step"])
    except (ValueError, KeyError, TypeError, OSError):
        return None  # half-written or foreign: read again at the next boundary


class CoreDrivenWorker(PlanFollowing):
    """One rank: engine + step protocol + plan subscription. See the module docstring."""

    def __init__(self, spec: Any, settings: WorkerSettings) -> None:
        import torch  # noqa: PLC0415 - keep imports of the light modules light

        from executor.checkpoint import CheckpointError, latest_checkpoint  # noqa: PLC0415
        from executor.comm import Communicator, groups_for_stages  # noqa: PLC0415
        from executor.devices import backend_for, intra_op_threads, shares_device  # noqa: PLC0415
        from executor.fabric.trainer_state import FabricParticipant  # noqa: PLC0415
        from executor.plan_acks import BackgroundAcks  # noqa: PLC0415
        from executor.plan_client import PlanClient  # noqa: PLC0415
        from executor.slow_injection import SlowInjection  # noqa: PLC0415
        from executor.spare_warmup import WarmSpare, warm_up, warm_up_enabled  # noqa: PLC0415
        from executor.step_protocol import StepProtocol  # noqa: PLC0415
        from executor.store_server import connect_first_answering, connect_store  # noqa: PLC0415
        from executor.trainer import Trainer, checkpoint_writer, load_checkpoint  # noqa: PLC0415
        from executor.warm_runtime import prepare_runtime  # noqa: PLC0415
        from planners.layout import Layout  # noqa: PLC0415
        from wire.local_protocol import (
            ControlReader,  # noqa: PLC0415
            StepMetricsClient,  # noqa: PLC0415
        )

        torch.set_num_threads(intra_op_threads(spec.device_kind))
        # Before anything a plan may later drop is built: torch's lazy imports of a backward and
        # a freeze of what the imports made, kept off the first step after a recovery.
        runtime_warmup = prepare_runtime()
        place = settings.place
        warm: WarmSpare | None = None  # a spare's warm start (before it says it is ready)
        plan_at = 0.0  # when the plan that takes a spare in arrived
        # Acks go out on a helper thread (executor.plan_acks): no step or apply waits on the Core.
        self.plans = BackgroundAcks(
            PlanClient(list(place.core), place.job, place.worker_id, place.token, on_plan=self._plan_arrived)
        )
        if place.joining:
            # A spare: its rank, layout and state come with the plan that takes it in (growth). It
            # subscribes with its own credential, which tells the Core it is ready to join.
            if not self.plans.wait_worker_credential(place.timeout_s):
                raise RuntimeError(
                    f"worker {place.worker_id}: its agent wrote no worker credential within "
                    f"{place.timeout_s:g} s; a spare needs it to be taken in"
                )
            # Warm first (executor.spare_warmup: device, store, dry run, units, one backward),
            # then subscribe: the Core plans a spare in only once it is ready, and a warm one
            # costs the survivors no cold start of its own.
            if warm_up_enabled():
                warm = warm_up(spec, _store_list(place.store), place.timeout_s)
            self.plans.start(after_epoch=0)
            join_plan = self._await_join_plan(place)
            plan_at = time.perf_counter()
            place = replace(place, rank=join_plan.rank_of_joiner(place.worker_id))
            layout = join_plan.new
        else:
            layout = Layout.from_json(place.layout_file.read_text())
        self.args, self.settings = place, settings
        # The store and its standbys, in the order every worker tries them (docs/architecture.md
        # ("Recovery")): a lost store is replaced by the next address that answers.
        self.store_addresses = _store_list(place.store)
        self._store_index = 0
        if warm is not None:
            store, self._store_index = warm.store, warm.store_index
        elif place.joining:  # the job runs: the stores before the first that answers are gone
            self._store_index, store = connect_first_answering(self.store_addresses, place.timeout_s)
        else:
            host, port = self.store_addresses[0].rsplit(":", 1)
            store = connect_store(host, int(port), timeout_s=place.timeout_s)
        world = spec.needs_world_group
        # This rank's device (the launcher's mapping; DeviceUnavailable before any step if the
        # process cannot see it) and the backend that goes with it.
        device = spec.local_device()
        backend = backend_for(device.type, shares_device())
        if place.joining:
            self.comm = Communicator.for_joiner(store, place.rank, timeout_s=place.timeout_s, backend=backend)
        else:
            self.comm = Communicator(
                store,
                place.rank,
                groups_for_stages([s.ranks for s in layout.stages], world=world),
                timeout_s=place.timeout_s,
                backend=backend,
            )
        prebuilt = None
        if warm is not None:
            stage = layout.stage_layout_of_rank(place.rank)
            prebuilt = warm.take_units(spec.model.names[stage.layer_start : stage.layer_stop])
        self.trainer = Trainer(spec, layout, place.rank, self.comm, device, prebuilt=prebuilt)
        check_fingerprints(dict(self.trainer.model.units.items()), settings.fingerprints)
        self.start_step, self.resumed_from = 0, None
        if settings.resume is not None and not place.joining:  # a joiner's state is the job's
            self.resumed_from = latest_checkpoint(settings.resume)  # once: `latest` may move
            self.start_step = load_checkpoint(self.trainer, self.resumed_from).next_step
        elif settings.resume is not None:
            # A joiner may be the first to name a RESTORE's source (`_restore_source`); a resume
            # checkpoint gone by then could not be loaded by any worker, so it is not an error here.
            with contextlib.suppress(CheckpointError):
                self.resumed_from = latest_checkpoint(settings.resume)
        self.participant = FabricParticipant(
            self.trainer,
            self.comm,
            verify_every=settings.verify_every,
            restore_source=self._restore_source,
            joining=place.joining,
            reprotect_steps=place.reprotect_steps,
        )
        self.proto = StepProtocol(
            self.comm,
            self.participant,
            timeout_s=place.timeout_s,
            committed_step=self.start_step - 1,
            joining=place.joining,
            world=world,
        )
        self.metrics = StepMetricsClient.from_env()
        self.control = ControlReader.from_env()
        self.slow = None if place.slow_file is None else SlowInjection(place.slow_file, self.control)
        self._checkpoints_reported = 0  # checkpoints written and told to the Core (step metrics)
        self._compute_s = 0.0  # the step in flight's own compute (wall time minus waiting on peers)
        self.writer = None
        if settings.checkpoint_dir is not None:
            # Every rank of this job holds the same job name and token; a resumed job is a new job.
            run_id = hashlib.sha256(f"{place.job}/{place.token}".encode()).hexdigest()[:16]
            self.writer = checkpoint_writer(spec, settings.checkpoint_dir, layout.global_batch, run_id)
        self.results: dict[str, Any] = {
            "rank": place.rank,
            "worker_id": place.worker_id,
            "losses": {},
            "samples": RecentSteps(),
            "stage_of_step": RecentSteps(),
            "committed_unix": RecentSteps(),
            "recoveries": [],
            "failures": [],
            "interrupted": [],
            "restores": [],
            "checkpoints": [],
            "start_step": self.start_step,
            "compute_s": RecentSteps(),  # committed step -> this rank's own compute (seconds)
            "slowed_s": RecentSteps(),  # committed step -> the injected stretch (ELASWAVE_INJECT_SLOW_FILE)
            "clock_factor": RecentSteps(),  # committed step -> the clock factor the stretch used
            "runtime_warmup": asdict(runtime_warmup),
        }
        if place.joining:
            # What building its rank still took once the plan came (the part of the join the
            # survivors wait on at the groups), and the warm-up before the spare said it was ready.
            self.results["join_build_s"] = time.perf_counter() - plan_at
            if warm is not None:
                self.results["warm_up"] = warm.as_dict() | {"prebuilt_units": len(prebuilt or {})}
        self.exit_code = 0
        self._applying: int | None = None  # epoch of the plan being applied
        self._fault_fired = False  # WorkerPlace.collective_fault_at fires once per process
        self.comm.interrupt = self._superseded
        self._sigterm_at: float | None = None  # monotonic time of the first SIGTERM
        self._payload: Any = None  # this step's checkpoint share, written once the step commits
        self.phases = StepPhases()  # the first steps after each plan, itemised (executor.step_phases)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        # A preemption notice, not a kill: the agent reports it and the Core's plan lets this
        # worker go at a step boundary (dying now would cost the survivors a fail-stop recovery).
        if self._sigterm_at is None:
            self._sigterm_at = time.monotonic()
            # os.write, not print: a handler that prints while the main thread prints raises there.
            os.write(
                2,
                f"worker {self.args.worker_id}: SIGTERM; leaving at a step boundary (with the Core's plan "
                f"if the agent reported a preemption, at most {self.args.timeout_s:g} s)\n".encode(),
            )

    def _leave_without_plan(self) -> bool:
        """After SIGTERM, whether to stop at this boundary with no plan: at once unless the agent
        reported a preemption (the Core then plans this worker out), else after `--timeout`."""
        if self._sigterm_at is None:
            return False
        try:
            reported = self.control is not None and self.control.draining is not None
        except ValueError:  # an unreadable control file: no report can be assumed
            reported = False
        return not reported or time.monotonic() - self._sigterm_at > self.args.timeout_s

    def _await_join_plan(self, place: WorkerPlace) -> Any:
        """A spare waits (at most `place.spare_wait_s`) for a plan that takes it in: one whose
        `joiners` names its worker id. Raises PlanTimeout when none comes."""
        deadline = time.monotonic() + place.spare_wait_s
        seen = 0
        print(f"worker {place.worker_id}: a spare; waiting for a plan that takes it in", flush=True)
        while True:
            plan = self.plans.wait_plan(seen, timeout_s=max(0.0, deadline - time.monotonic()))
            if plan.rank_of_joiner(place.worker_id) is not None:
                return plan
            seen = plan.epoch

    def _plan_arrived(self, plan: Any) -> None:
        # Runs on the subscription thread: a plan without some rank of the layout this worker
        # trains on aborts the step in flight everywhere (the plan is the abort signal: it also
        # frees workers blocked on a hung peer). One that loses none (a join, a pipeline-only
        # move) lets the step finish: every worker takes it at the next boundary, so the
        # survivors lose no work to it.
        proto = getattr(self, "proto", None)
        if proto is None or plan.epoch <= proto.plan_epoch or proto.step is None:
            return
        if set(self.trainer.layout.ranks()) - set(plan.new.ranks()):
            self.comm.signal_abort(f"Core published plan epoch {plan.epoch}")

    def _report_peer(self, exc: Any, step: int) -> None:
        """A link op that failed on its peer's side (not on the abort flag) names that peer: the
        Core's collective-failure path (docs/architecture.md ("The Core's decisions")) marks it lost if nothing else has, which is
        how a hung peer, one whose process and agent still look alive, gets planned out."""
        peer = link_peer(exc.group, self.args.rank)
        if peer is not None and " aborted: " not in str(exc):
            self.plans.report_peer_failure(peer, step, exc.group, exc.reason)

    def run(self) -> dict[str, Any]:
        from executor.comm import PeerFailure  # noqa: PLC0415
        from executor.plan_client import PlanTimeout  # noqa: PLC0415
        from executor.step_protocol import DecisionUnknown  # noqa: PLC0415

        signal.signal(signal.SIGTERM, self._on_sigterm)
        # Restart system calls the signal interrupts: a SIGTERM must never fail a collective.
        signal.siginterrupt(signal.SIGTERM, False)
        if not self.args.joining:
            self.plans.start(after_epoch=self.proto.plan_epoch)
        step, resumed_epoch = self.start_step, None
        if self.args.joining:
            joined_at = self._join()
            if joined_at is None:
                step = self.settings.steps  # not taken in after all: nothing to train
            else:
                step, resumed_epoch = joined_at, self.proto.plan_epoch
                self.phases.plan_applied(resumed_epoch)
        stop_after: int | None = None  # leave after committing this step (launcher or operator)
        save_at: set[int] = set()  # steps an operator asked to checkpoint
        try:
            while step < self.settings.steps:
                self.phases.begin()
                stop_after = self._poll_requests(stop_after, save_at, step)
                if stop_after is not None and step > stop_after:
                    self.results["stopped_after_step"] = step - 1
                    break  # the launcher's stop: every worker leaves at this same boundary
                if self._leave_without_plan():
                    self.results["left_at_step"], self.exit_code = step, EXIT_TERMINATED
                    break  # no plan let this worker go: leave anyway, the survivors recover as from a fail-stop
                started = time.perf_counter()
                self.phases.mark("boundary")
                self.proto.begin_step(step)
                self.phases.mark("begin")
                result = None
                try:
                    if self.plans.newest_epoch() > self.proto.plan_epoch:
                        # A plan is waiting: this step is the boundary where every worker takes it.
                        self.comm.signal_abort(f"plan epoch {self.plans.newest_epoch()} is waiting")
                    else:
                        self._maybe_inject_fault(step)
                        result = self._train_step(step)
                        self.phases.mark("train")
                        self._gather_checkpoint(step, stop_after, save_at)
                except PeerFailure as exc:
                    self.proto.report_failure(exc)
                    self.results["failures"].append(
                        {"step": step, "group": exc.group, "error": str(exc)[:300]}
                    )
                    self._report_peer(exc, step)
                undecided = False
                try:
                    decided = self.proto.should_commit()
                    self.phases.mark("vote")
                except DecisionUnknown as exc:  # the store went down: settled by the next plan
                    self.results["failures"].append({"step": step, "group": "store", "error": str(exc)[:300]})
                    decided, undecided = False, True
                if decided:
                    self.proto.commit()
                    self.phases.mark("commit")
                    for window in self.participant.take_closed_windows():
                        # Every moved backup copy is re-seeded: the window closed. Queued before
                        # the step's metrics, so the Core hears of it before it can see a later
                        # step (and plan a loss there as inside the window).
                        self.plans.ack(window.epoch, "REPROTECTED", 0.0, window=window)
                    self._committed(step, result, time.perf_counter() - started)
                    self._write_checkpoint()
                    self.phases.mark("report")
                    if resumed_epoch is not None:
                        lost = [
                            r["steps_lost"] for r in self.results["restores"] if r["epoch"] == resumed_epoch
                        ]
                        self.plans.ack(
                            resumed_epoch,
                            "RESUMED",
                            time.perf_counter() - started,
                            steps_replayed=max(0, lost[-1]) if lost else 0,
                        )
                        resumed_epoch = None
                        self.phases.mark("ack")
                    self.phases.committed(step)
                    step += 1
                    continue
                if not undecided:
                    self.proto.rollback()
                    self._payload = None  # the state it captured was rolled back
                try:
                    resume_at = self._recover(step)
                    if undecided and self.proto.committed_step >= step:  # the other workers had committed it
                        self._committed(step, result, time.perf_counter() - started)
                        self._write_checkpoint()
                    self._payload = None
                    if resume_at is None:
                        break  # this worker is not in the new layout: it leaves
                except PlanTimeout as exc:
                    # Nothing the Core saw changed the job (no member lost): without a plan there is
                    # no layout to replay on. Fail visibly, with results, rather than hang.
                    self.results["fatal"], self.exit_code = str(exc), EXIT_NO_PLAN
                    break
                except PlanNotApplicable as exc:
                    self.results["fatal"], self.exit_code = str(exc), EXIT_PLAN_NOT_APPLICABLE
                    self._finish_checkpoints()  # settle what was in flight before naming the latest
                    self._end_with_checkpoint(exc)
                    break
                resumed_epoch, step = self.proto.plan_epoch, resume_at
                self.phases.plan_applied(resumed_epoch)
        finally:
            self.plans.close()
            self.trainer.data.close()
        self._finish_checkpoints()
        self.results.update(
            steps_after_plan=self.phases.after_plan,
            committed_steps=step,
            plan_epoch=self.proto.plan_epoch,
            checksum_mismatches=self.participant.checksum_mismatches,
            backup_lag_wait_s=self.participant.backup_lag_wait_s,
            verified_steps=list(self.participant.verified_steps),
            reprotect_windows=[w.as_dict() for w in self.participant.windows],
        )
        return self.results

    def _train_step(self, step: int) -> Any:
        """One step; notes its own compute (`executor.compute_clock`: what the Core's fail-slow
        detector compares across a stage) and stretches it where a
        slowdown is injected (`executor.slow_injection`)."""
        clock, blocked = ComputeClock(cpu=self.trainer.device.type == "cpu"), self.comm.blocked_s
        clock.start()
        result = self.trainer.train_step(step)
        self._compute_s = clock.stop(self.comm.blocked_s - blocked)
        if self.slow is not None:
            extra, factor = self.slow.extra_s(self._compute_s)
            if extra > 0:
                time.sleep(extra)  # the slower device: its compute, stretched, before it votes
            self._compute_s += extra
            self.results["slowed_s"][step], self.results["clock_factor"][step] = extra, factor
        return result

    def _join(self) -> int | None:
        """Apply the plan that takes this spare in (or a newer one): its groups are built with
        everyone else's at the plan's epoch and its state is read from the live owners. The step
        it trains first, or None when the newest plan no longer takes it in."""
        from executor.plan_client import PlanTimeout  # noqa: PLC0415

        t0 = time.perf_counter()
        try:
            at = self._recover(0)
        except PlanTimeout as exc:
            self.results["fatal"], self.exit_code = str(exc), EXIT_NO_PLAN
            return None
        if at is not None:
            self.results["recoveries"][-1]["step"] = at  # the boundary it joined at
            self.results["start_step"] = self.start_step = at
            self.results["joined"] = {
                "epoch": self.proto.plan_epoch,
                "step": at,
                "join_s": time.perf_counter() - t0,
            }
        return at

    def _poll_requests(self, stop_after: int | None, save_at: set[int], step: int) -> int | None:
        """Read the launcher's stop file and the operator's checkpoint request (control file) at the
        boundary before `step`; returns the step to stop after (None: keep going) and adds to
        `save_at`. The Core joins a second request to the first (same step), so a request seen
        again may only add its stop."""
        if stop_after is None:
            stop_after = read_stop_after(self.settings.stop_file)
        try:
            request = self.control.checkpoint if self.control is not None else None
        except ValueError:  # an unreadable control file: read again at the next boundary
            request = None
        if request is not None and request.after_step not in save_at:
            save_at.add(request.after_step)
            if request.after_step < step:
                self.results["checkpoint_error"] = (
                    f"the request to checkpoint after step {request.after_step} reached this worker only "
                    f"before step {step}"
                )
            elif self.writer is None:
                self.results["checkpoint_error"] = (
                    f"a checkpoint after step {request.after_step} was requested, "
                    "but this worker has no checkpoint directory"
                )
        if request is not None and request.stop:
            stop_after = request.after_step if stop_after is None else min(stop_after, request.after_step)
        return stop_after

    def _end_with_checkpoint(self, exc: PlanNotApplicable) -> None:
        """After a plan the engine cannot apply: when no rank of the current layout is gone, every
        worker holds its share of the committed state and they all refuse the same plan, so they
        save it together (collective per stage, as at any step); otherwise the job's latest
        durable checkpoint is where it resumes. Either way, say where and how."""
        from executor.checkpoint import CheckpointError, latest_checkpoint  # noqa: PLC0415
        from executor.trainer import checkpoint_payload  # noqa: PLC0415

        root = self.settings.checkpoint_dir
        if root is not None and self.writer is not None and not exc.lost:
            payload = checkpoint_payload(self.trainer)
            if payload is not None:
                self.writer.submit(payload)
            self._finish_checkpoints()
        try:
            where = str(latest_checkpoint(root)) if root is not None else None
        except CheckpointError:
            where = None
        self.results["resume_from"] = where
        said = (
            f"its state is in {where}: resume with `elaswave run --resume {root} ...` on the nodes there are now"
            if where
            else "no checkpoint of this job exists (no checkpoint directory, or none written yet)"
        )
        print(f"worker {self.args.worker_id}: {exc}; {said}", file=sys.stderr, flush=True)

    def _checkpoint_due(self, step: int, stop_after: int | None, save_at: set[int]) -> bool:
        """Every worker reaches the same verdict: the settings are the job's, and a stop or an
        operator's request is announced at least one boundary ahead (module docstring)."""
        if self.writer is None:
            return False
        from executor.checkpoint import scheduled  # noqa: PLC0415

        return (
            scheduled(step, self.settings.steps, self.settings.checkpoint_every)
            or step == stop_after
            or step in save_at
        )

    def _gather_checkpoint(self, step: int, stop_after: int | None, save_at: set[int]) -> None:
        from executor.trainer import checkpoint_payload  # noqa: PLC0415

        if self._checkpoint_due(step, stop_after, save_at):
            t0 = time.perf_counter()
            self._payload = checkpoint_payload(self.trainer)
            self.results["checkpoints"].append({"step": step, "gather_s": time.perf_counter() - t0})

    def _write_checkpoint(self) -> None:
        if self._payload is not None and self.writer is not None:
            self.writer.submit(self._payload)
        self._payload = None

    def _finish_checkpoints(self) -> None:
        """Wait for the checkpoints in flight: as long as a big model's write may take when the job
        ends well; one worker timeout when it does not (a stage that died will never mark its
        share, and an incomplete checkpoint stays a temporary directory, never the latest)."""
        if self.writer is None:
            return
        try:
            self.writer.wait(timeout_s=600.0 if self.exit_code == 0 else self.args.timeout_s)
        except TimeoutError as exc:
            self.results["checkpoint_error"] = str(exc)
        if self.writer.errors:
            self.results["checkpoint_error"] = "; ".join(
                f"{type(e).__name__}: {e}" for e in self.writer.errors
            )
        self.results["checkpoints_written"] = [str(p) for p in self.writer.written]

    def _new_checkpoint(self) -> str:
        """The newest checkpoint this worker committed since its previous step report ("" for
        none): the Core reports it as written (`checkpoint_written`, the job's latest)."""
        written = self.writer.written if self.writer is not None else []
        if len(written) <= self._checkpoints_reported:
            return ""
        self._checkpoints_reported = len(written)
        return str(written[-1])

    def _committed(self, step: int, result: Any, seconds: float) -> None:
        if result is None:
            raise RuntimeError(f"step {step} committed on rank {self.args.rank} without having run")
        self.results["samples"][step] = sorted(result.sample_ids)  # global ids the trainer actually fed
        self.results["stage_of_step"][step] = self.trainer.stage  # a restore may change the stage count
        self.results["committed_unix"][step] = time.time()  # recovery time is measured up to this
        self.results["compute_s"][step] = self._compute_s
        if step % STORE_LIST_EVERY == 0:
            self._refresh_stores()  # a standby replaced since the last plan is known before it is needed
        if result is not None and result.loss is not None:
            self.results["losses"][step] = result.loss
        if self.metrics is not None:
            self.metrics.send(
                step=step,
                step_time_s=seconds,
                compute_time_s=self._compute_s,
                checkpoint=self._new_checkpoint(),
                loss=None if result is None else result.loss,
                samples=0 if result is None else result.samples_processed,
                stage=self.trainer.stage,
                dp_rank=self.trainer.dp_index,
            )
        if self.settings.on_step is not None:
            self.settings.on_step(step, result.loss)
        every = self.settings.log_every
        if every and (step + 1) % every == 0 and result.loss is not None and self.trainer.dp_index == 0:
            rate = self.trainer.layout.global_batch / seconds if seconds > 0 else float("inf")
            print(f"step {step:>6}  loss {result.loss:.6f}  {rate:,.0f} samples/s (this step)", flush=True)


def _store_list(stores: str) -> list[str]:
    """The job's stores, `host:port,host:port`, in the order every worker tries them."""
    return [a.strip() for a in stores.split(",") if a.strip()]


def run_worker(spec: Any, settings: WorkerSettings) -> tuple[int, dict[str, Any]]:
    """Train this rank to the end (or until it leaves); (exit code, results). Writes the results
    to the place's results file when one is set, and tells the agent when the work is complete."""
    worker = CoreDrivenWorker(spec, settings)
    results = worker.run()
    out = settings.place.results_file
    if out is not None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, sort_keys=True))
        tmp.replace(out)
    if worker.exit_code == 0 and (
        results["committed_steps"] == settings.steps or "stopped_after_step" in results
    ):
        from wire.local_protocol import mark_finished  # noqa: PLC0415

        # The whole job is trained, or stopped where the launcher or an operator asked: the agent
        # reports a finished worker, not a departure for the Core to plan around.
        written = results.get("checkpoints_written") or []
        mark_finished(checkpoint=written[-1] if written else "")
    sys.stdout.flush()
    return worker.exit_code, results
