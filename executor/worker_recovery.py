"""How a Core-driven worker follows plans (the recovery half of `executor.worker.CoreDrivenWorker`).

After a step that did not commit, the worker waits for the Core's plan and applies it from its
last committed state (docs/architecture.md ("Recovery")): an attempt that is interrupted (a peer
failed during the recovery, a newer plan arrived, the store went away) is acknowledged FAILED
and the next plan starts from the same point; a plan the engine cannot apply in place is
acknowledged FAILED as not applicable and the Core re-plans in RESTORE mode, whose checkpoint the
workers agree on here. Before each attempt the worker makes sure its store answers, moving to
the next standby address when it does not. A step that failed with nobody the Core saw leave is
reported to the Core, which replays it on the same layout.

Blocking behaviour: `_recover` blocks at most the worker timeout for each plan it waits for (then
raises PlanTimeout); each apply is bounded by the communicator timeout per wait and gives up as
soon as a newer plan is known.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

# A step that failed with no plan this long afterwards is reported to the Core (peer -1).
NO_PLAN_REPORT_S = 0.25
STORE_CONNECT_S = 2.0  # how long a standby store address may take to answer
# With every known store gone, how long to wait for a replacement the Core lists (a new standby
# imports torch: 10-15 s on a loaded 2-core machine), asking every STORE_POLL_S.
STORE_WAIT_S, STORE_POLL_S = 60.0, 1.0
RESTORE_COMMIT_WAIT_S = 2.0  # a checkpoint in flight may still commit this long before a restore


class PlanNotApplicable(RuntimeError):
    """The Core's plan asks for a change the engine cannot apply in place (RelayoutError)."""

    def __init__(self, epoch: int, reason: str, lost: frozenset[int]) -> None:
        super().__init__(f"plan {epoch} cannot be applied in place: {reason}")
        self.epoch, self.reason, self.lost = epoch, reason, lost


class PlanFollowing:
    """Mixed into CoreDrivenWorker, whose constructor sets every attribute annotated here."""

    args: Any  # wire.worker_env.WorkerPlace
    settings: Any  # executor.worker.WorkerSettings
    comm: Any  # executor.comm.Communicator
    proto: Any  # executor.step_protocol.StepProtocol
    participant: Any  # executor.fabric.trainer_state.FabricParticipant
    plans: Any  # executor.plan_client.PlanClient
    writer: Any  # executor.checkpoint.CheckpointWriter | None
    results: dict[str, Any]
    store_addresses: list[str]
    _store_index: int
    _applying: int | None
    resumed_from: Path | None  # the checkpoint this job started from (None: from scratch)
    _fault_fired: bool

    def _superseded(self) -> str | None:
        """The communicator's interrupt: a plan newer than the one this worker trains on or is
        applying makes every wait give up at once (a recovery never waits on a superseded plan)."""
        current = self.proto.plan_epoch if self._applying is None else self._applying
        newest = self.plans.newest_epoch()
        return f"plan epoch {newest} is published (this worker is at {current})" if newest > current else None

    def _restore_source(self, plan: Any) -> Path | None:
        """The checkpoint every worker of a RESTORE plan reloads: the first worker to ask names the
        job's latest complete one (after settling its own writes in flight) and the rest take
        that name from the store, so all of them load the same step. With nothing written yet
        (or no checkpoint directory) it is the checkpoint the job resumed from, and None, the
        job's initial state, for a job that started from scratch."""
        from executor.checkpoint import CheckpointError, latest_checkpoint  # noqa: PLC0415

        root = self.settings.checkpoint_dir
        choice = "initial"
        if self.resumed_from is not None:  # this job's first state: never the initial one
            choice = str(self.resumed_from)
        if root is not None:
            # A checkpoint whose other shares are still being written gets a moment to commit; one
            # waiting for a lost stage's share never will (it stays incomplete, never the latest).
            # A RESTORE's lost ranks are dead, not departing: a share their stage has not written
            # yet will never come, so that checkpoint is given up at once (after one more look).
            if self.writer is not None:
                self.writer.give_up_waiting(0.0, self._stages_without_writer(plan))
                self.writer.give_up_waiting(RESTORE_COMMIT_WAIT_S)
                with contextlib.suppress(TimeoutError):
                    self.writer.wait(timeout_s=self.args.timeout_s)
            with contextlib.suppress(CheckpointError):
                choice = str(latest_checkpoint(root))
        key = f"{self.comm.namespace}/e{plan.epoch}/restore-from"
        agreed = self.comm.store.compare_set(key, "", choice).decode()
        return None if agreed == "initial" else Path(agreed)

    def _ensure_store(self) -> None:
        """Before applying a plan: if the store is gone, move to the next address of the list that
        answers (every worker tries them in the same order, so they meet on the same one).
        Raises StoreLost (the apply is interrupted, retried with the next plan) if none does."""
        from torch.distributed import DistNetworkError  # noqa: PLC0415

        from executor.comm import StoreLost  # noqa: PLC0415
        from executor.store_server import connect_live  # noqa: PLC0415

        try:
            self.comm.store.check([f"{self.comm.namespace}/alive"])
            self._refresh_stores()
            return
        except DistNetworkError:
            pass
        n = len(self.store_addresses)
        for offset in range(1, n):
            index = (self._store_index + offset) % n
            try:
                store = connect_live(self.store_addresses[index], STORE_CONNECT_S)
            except (ConnectionError, DistNetworkError, RuntimeError):
                continue
            self._move_store(index, store)
            return
        if self._store_from_the_core():
            return
        raise StoreLost(f"no store answers at {self.store_addresses}")

    def _move_store(self, index: int, store: Any) -> None:
        self._store_index = index
        self.comm.replace_store(store)
        self.results.setdefault("store_moves", []).append(self.store_addresses[index])
        print(
            f"worker {self.args.worker_id}: the store is gone; now on {self.store_addresses[index]}",
            flush=True,
        )
        self._refresh_stores()

    def _store_from_the_core(self) -> bool:
        """Every store this worker knows is gone, e.g. the standby died before its replacement's
        address reached this worker through a store. The launchers report each replacement to the
        Core (`elaswave run --core`): wait, at most STORE_WAIT_S, for a store the Core lists and
        this worker does not know yet, and move there (every worker gets the same list, in the
        same order, so they meet on the same store). False when the Core lists none (a job whose
        launcher reports no stores) or none answers in time."""
        from executor.store_server import connect_first_answering  # noqa: PLC0415

        deadline = time.monotonic() + STORE_WAIT_S
        while time.monotonic() < deadline and self._superseded() is None:
            listed = self.plans.job_stores()
            if listed == []:
                return False
            fresh = [a for a in listed or () if a not in self.store_addresses]
            if fresh:
                try:
                    index, store = connect_first_answering(fresh, timeout_s=STORE_CONNECT_S * len(fresh))
                except TimeoutError:
                    pass
                else:
                    self.store_addresses.extend(fresh)
                    self._move_store(len(self.store_addresses) - len(fresh) + index, store)
                    return True
            time.sleep(STORE_POLL_S)
        return False

    def _refresh_stores(self) -> None:
        """Take the job's current store list from the store (`executor.store_server.STORES_KEY`:
        a replacement standby writes it into the stores still alive), keeping this worker on the
        store it uses now. Called before every plan and every few commits; a store without the key
        (an older launcher) leaves the list as it is. Never blocks: check before get."""
        from torch.distributed import DistError  # noqa: PLC0415

        from executor.store_server import STORES_KEY  # noqa: PLC0415

        try:
            if not self.comm.store.check([STORES_KEY]):
                return
            listed = [a for a in self.comm.store.get(STORES_KEY).decode().split(",") if a]
        except DistError:  # the store went meanwhile: the next plan moves this worker
            return
        current = self.store_addresses[self._store_index]
        if current not in listed:
            listed.insert(0, current)
        if listed != self.store_addresses:
            self.store_addresses, self._store_index = listed, listed.index(current)

    def _maybe_inject_fault(self, step: int) -> None:
        """WorkerPlace.collective_fault_at: the first attempt at that step fails here like a
        collective whose peers are all alive (chaos tests and drills; never set by the launcher)."""
        if self.args.collective_fault_at == step and not self._fault_fired:
            from executor.comm import PeerFailure  # noqa: PLC0415

            self._fault_fired = True
            raise PeerFailure("injected", f"fault injected at step {step} on rank {self.args.rank}")

    def _wait_plan(self, step: int, newer_than: int) -> Any:
        """Wait for a plan newer than `newer_than`. A step that failed with no plan after
        NO_PLAN_REPORT_S (nobody the agents saw die, no link peer named) is reported to the Core
        as a collective failure without a peer, which replays the step on the same layout."""
        from executor.plan_client import PlanTimeout  # noqa: PLC0415

        quick = 0.0 if self._failed_on_the_store_alone(step) else min(NO_PLAN_REPORT_S, self.args.timeout_s)
        try:
            return self.plans.wait_plan(newer_than, timeout_s=quick)
        except PlanTimeout:
            if self.proto.failure is not None or self.results["failures"]:
                self.plans.report_peer_failure(
                    -1, step, "step", f"no plan {quick:g} s after step {step} failed"
                )
        return self.plans.wait_plan(newer_than, timeout_s=max(0.0, self.args.timeout_s - quick))

    def _failed_on_the_store_alone(self, step: int) -> bool:
        """Whether every failure recorded at `step` was the store's. No agent reports a store's
        loss (the store is no worker), so no plan can come before a worker reports it: waiting
        NO_PLAN_REPORT_S for one only delays the recovery. A store lost with workers (its node
        gone) also fails collectives on other groups: then the agents' reports are awaited."""
        failures = [f for f in self.results["failures"] if f["step"] == step]
        return bool(failures) and all(f["group"] == "store" for f in failures)

    def _recover(self, step: int) -> int | None:
        """Wait for the Core's plan and apply it from the last committed state; the step to run
        next (`step`, or the next step of a restored checkpoint), or None if this worker is not in
        the new layout. An attempt that is interrupted (a peer failed during the recovery, a
        newer plan arrived) is acknowledged FAILED and the next plan is applied from the same
        committed state; one this worker cannot apply in place is acknowledged FAILED as not
        applicable, and the Core re-plans (in RESTORE mode). Raises PlanTimeout when no plan
        comes within the worker timeout, PlanNotApplicable when even a RESTORE plan is refused."""
        from executor.comm import StoreLost  # noqa: PLC0415
        from executor.step_protocol import PlanInterrupted  # noqa: PLC0415
        from planners.layout import PlanMode  # noqa: PLC0415

        tried = self.proto.plan_epoch
        while True:
            t0 = time.perf_counter()
            published = self._wait_plan(step, tried)
            tried = published.epoch
            waited = time.perf_counter() - t0
            self.plans.ack(published.epoch, "RECEIVED", waited)
            # Its DP replica dropped while it is alive (`Plan.standby`): it hands its state over
            # with the plan's rebuild first, then leaves like a planned departure (a later plan
            # re-creates the replica from spares, `Plan.joiners`).
            standby = self.args.rank in published.standby and not self.proto.joining
            if self.args.rank not in published.new.ranks() and not standby:
                # A planned departure, not a failed apply: a FAILED ack would make the Core re-plan.
                self.plans.ack(published.epoch, "PAUSED", 0.0)
                self.results["left_at_step"] = step
                print(
                    f"worker {self.args.worker_id}: plan {published.epoch} has no rank {self.args.rank}; leaving at "
                    f"the boundary of step {step} ({'; '.join(published.reasons)})",
                    flush=True,
                )
                return None
            self.plans.ack(published.epoch, "PAUSED", 0.0)
            # Applied from this worker's committed layout (the Core's `old` is its own view of it);
            # a joiner has none: the plan's `old` is the job's, which it is not part of yet.
            old = published.old if self.proto.joining else self.participant.committed_layout
            plan = replace(published, old=old)
            t1 = time.perf_counter()
            self._applying = plan.epoch
            try:
                self._ensure_store()
                report = self.proto.apply_plan(plan)
            except ValueError as exc:  # RelayoutError: refused before any group was edited
                self._failed(plan.epoch, step, exc, "NOT_APPLICABLE", time.perf_counter() - t1)
                if plan.mode is PlanMode.RESTORE:
                    lost = frozenset(self.participant.committed_layout.ranks()) - frozenset(plan.new.ranks())
                    raise PlanNotApplicable(plan.epoch, str(exc), lost) from exc
                continue
            except (PlanInterrupted, StoreLost) as exc:
                self._failed(plan.epoch, step, exc, "INTERRUPTED", time.perf_counter() - t1)
                print(f"worker {self.args.worker_id}: {exc}; waiting for a newer plan", flush=True)
                continue
            finally:
                self._applying = None
            applied = time.perf_counter() - t1
            # With the copies the plan re-seeds in the background (planners.reprotect): the Core
            # plans a loss inside that window as the RESTORE it is.
            self.plans.ack(plan.epoch, "APPLIED", applied, window=self.participant.window)
            if standby:
                self.results["left_at_step"], self.results["handed_over_epoch"] = step, plan.epoch
                print(
                    f"worker {self.args.worker_id}: plan {plan.epoch} drops rank {self.args.rank} "
                    f"while alive; its state handed over, leaving at the boundary of step {step}",
                    flush=True,
                )
                return None
            if self.writer is not None and plan.old is not None:
                self._give_up_on_gone_writers(plan)
            return self._applied(plan, step, waited, applied, report)

    def _give_up_on_gone_writers(self, plan: Any) -> None:
        """A checkpoint in flight waits for every old stage's share, written by the stage's first
        rank. A writer the new layout lacks (and does not hold as a standby) was lost or is
        leaving: its share comes within RESTORE_COMMIT_WAIT_S (already on disk, or flushed as it
        departs) or never. Otherwise every writer is alive, and the worker timeout is a bound."""
        assert self.writer is not None
        if self._stages_without_writer(plan):
            self.writer.give_up_waiting(RESTORE_COMMIT_WAIT_S)
        elif set(plan.new.ranks()) != set(plan.old.ranks()):
            self.writer.give_up_waiting(self.args.timeout_s)

    @staticmethod
    def _stages_without_writer(plan: Any) -> set[int]:
        """Stages of the old layout whose writer (the stage's first rank) the new layout lacks
        and does not hold as a standby: lost or leaving."""
        if plan.old is None:
            return set()
        staying = set(plan.new.ranks()) | set(plan.standby)
        return {i for i, stage in enumerate(plan.old.stages) if stage.ranks and stage.ranks[0] not in staying}

    def _failed(self, epoch: int, step: int, exc: BaseException, failure: str, seconds: float) -> None:
        """Acknowledge plan `epoch` FAILED (`failure`: NOT_APPLICABLE or INTERRUPTED) and keep it."""
        self.plans.ack(epoch, "FAILED", seconds, reason=str(exc)[:1000], failure=failure)
        self.results["interrupted"].append(
            {"epoch": epoch, "step": step, "failure": failure, "error": str(exc)[:300]}
        )

    def _applied(self, plan: Any, step: int, waited: float, applied: float, report: Any) -> int:
        from planners.layout import PlanMode  # noqa: PLC0415

        resume_at = self.proto.committed_step + 1
        window = self.participant.window
        record: dict[str, Any] = {
            "step": step,
            "epoch": plan.epoch,
            "mode": plan.mode.value,
            "plan_wait_s": waited,
            "apply_s": applied,
            "communicator_s": report.seconds,
            "rebuilt": list(report.rebuilt),
            "reused": list(report.reused),
            "reasons": list(plan.reasons),
            "resume_at": resume_at,
            "applied_unix": time.time(),
            "state_bytes_received": self.participant.rebuilt_bytes,
            "reprotect_window": None if window is None else window.as_dict(),
            # the apply after the edit, itemised (FabricParticipant.apply_phases)
            "apply_phases": {k: round(v, 6) for k, v in self.participant.apply_phases.items()},
        }
        restored = ""
        if plan.mode is PlanMode.RESTORE:
            _epoch, where, _next = self.participant.restored_from[-1]
            record.update(restored_from=where, steps_lost=step - resume_at)
            self.results["restores"].append(record)
            restored = (
                f"; restored {where or 'the initial state'} in place, replaying from step "
                f"{resume_at} ({step - resume_at} steps lost)"
            )
        self.results["recoveries"].append(record)
        print(
            f"worker {self.args.worker_id}: plan {plan.epoch} applied before step {step} "
            f"(waited {waited * 1e3:.0f} ms, applied in {applied * 1e3:.0f} ms; rebuilt {list(report.rebuilt)}, "
            f"reused {len(report.reused)} groups){restored}",
            flush=True,
        )
        return resume_at
