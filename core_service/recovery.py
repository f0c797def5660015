"""The Core's rules for restartable recovery (docs/architecture.md ("The Core's decisions")).

Pure decisions the schedule engine (`core_service/engine.py`) acts on:

- which mode a plan gets: IN_PLACE when the executors can reach the new layout from the committed
  one (`planners.applicability.judge`, the rule the executor applies too, with the copies the
  workers report still being re-seeded: `core_service.backup_windows`), else RESTORE (reload
  the latest durable checkpoint in place). A RESTORE stays sticky until a step commits on it:
  workers that started restoring have dropped their in-memory state, so all of them must restore.
  An executor that refuses a plan as not applicable forces the next plan to RESTORE as well;
- how a collective failure that changed no membership is answered: a replay on the same layout
  while the named peer still looks alive (a transient network error must not cost a rank), at
  most `COLLECTIVE_RETRIES` times without a commit, then the peer is lost;
- how far retries go without a commit: `MAX_IN_PLACE_RETRIES` retry plans in place, then
  RESTORE; `MAX_RESTORE_FAILURES` failed RESTORE plans, then the engine refuses and stops.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from core_service.backup_windows import unprotected_pairs
from core_service.jobs import Job
from core_service.model import Event, MemberRecord, RetryRequest
from core_service.registry import PlanStore
from planners.applicability import judge
from planners.layout import Layout, PlanMode

MAX_IN_PLACE_RETRIES = 3
MAX_RESTORE_FAILURES = 3
# Replays on the same layout one named peer (or "no peer", rank -1) gets before the next report
# marks it lost (or, without a peer, the engine refuses): a peer that keeps failing collectives
# is faulty even while its agent heartbeats.
COLLECTIVE_RETRIES = 2
# A report from a worker that has not acknowledged the newest plan is taken as older than that
# plan for this long after it was published: executors report after ~1 s without a plan, and
# acknowledge a plan within milliseconds of receiving it.
ANSWER_WINDOW_S = 5.0
RESTORE = "restore in place from the latest durable checkpoint"
NO_PEER = -1
# Event kinds the engine records for these decisions (besides plan_published / decision_refuse).
COMMITTED_EVENT = "layout_committed"
COLLECTIVE_EVENT = "collective_failure"


def restore_outstanding(job: Job) -> bool:
    """A RESTORE plan was published and no step has committed on it (or on a later plan) yet."""
    plan = job.last_plan
    return plan is not None and plan.mode == PlanMode.RESTORE and job.committed_epoch < job.plan_epoch


def choose_mode(
    job: Job,
    committed: Layout | None,
    new: Layout,
    request: RetryRequest | None,
    standby: frozenset[int] = frozenset(),
) -> tuple[PlanMode, tuple[str, ...]]:
    """The mode of a plan `committed -> new`, and one reason per rule that asks for RESTORE.
    `standby`: ranks `new` drops while their workers run (`Plan.standby`): not lost."""
    why = []
    if committed is not None:
        # copies still being re-seeded after the committed plan protect nothing yet
        verdict = judge(committed, new, standby, unprotected_pairs(job))
        if not verdict.in_place:
            why.append(verdict.reason)
    if restore_outstanding(job):
        why.append(
            f"the RESTORE plan of epoch {job.plan_epoch} has not committed a step yet, and workers "
            "that started restoring have no in-memory state left"
        )
    if request is not None:
        for worker, ack in sorted(request.not_applicable().items()):
            why.append(f"{worker} cannot apply epoch {request.epoch} in place: {ack.reason}")
    mode = PlanMode.RESTORE if why else PlanMode.IN_PLACE
    return mode, tuple(f"{RESTORE}: {w}" for w in why)


def committed_epoch_in(events: Iterable[Event]) -> int:
    """The newest epoch the event log says a step committed on (0: none). Executors acknowledge
    RESUMED only after a commit, and a commit is atomic across the layout's workers, so one
    RESUMED proves the epoch committed."""
    epochs = [
        e.data.get("epoch", 0)
        for e in events
        if e.kind in ("plan_resumed", COMMITTED_EVENT) and isinstance(e.data.get("epoch"), int)
    ]
    return max(epochs, default=0)


def stored_plans(
    store: PlanStore, job: Job
) -> tuple[int, tuple[int, bytes] | None, tuple[int, bytes | None] | None]:
    """What a new leader restores `job` from (`ScheduleEngine.restore`): its current epoch, its
    newest stored plan, and the plan of the newest epoch its event log shows a commit for (None
    without one; its body None when pruned). The committed epoch is the newer of the event log's
    and the job's recovery record's (`core_service.recovery_record`): the record outlives the
    bounded event log. Blocking registry reads: run it in a thread."""
    epoch, latest = store.current_epoch(job.name), store.latest(job.name)
    committed = max(committed_epoch_in(job.events), job.committed_epoch)
    if committed == 0:
        return epoch, latest, None
    if latest is not None and latest[0] == committed:
        return epoch, latest, latest
    return epoch, latest, (committed, store.get(job.name, committed))


@dataclass(frozen=True)
class CollectiveFailure:
    """A survivor's report that a collective failed (executor.proto `ReportPeerFailureRequest`)."""

    reporter: str
    peer_rank: int  # NO_PEER when no peer could be named
    step: int
    operation: str
    error: str

    def describe(self) -> str:
        return (
            f"collective {self.operation or 'operation'} failed on {self.reporter} at step {self.step}: "
            f"{self.error or 'peer unreachable'}"
        )


class PeerAction(StrEnum):
    RETRY = "retry"  # a replay on the same layout is requested (or already on its way)
    ANSWERED = "answered"  # a newer plan the reporter has not acknowledged yet answers it
    MARK_LOST = "mark_lost"  # the peer looks dead, or keeps failing after its replays
    REFUSED = "refused"  # no peer named and the replays did not help: the engine gave up
    GONE = "gone"  # the peer is already lost or left (its agent said so first)
    NOT_IN_LAYOUT = "not_in_layout"  # the plan in force removed it: its closed links are expected


@dataclass(frozen=True)
class PeerOutcome:
    action: PeerAction
    peer: MemberRecord | None
    reason: str


def judge_collective_failure(
    job: Job, failure: CollectiveFailure, heartbeat_timeout_s: float, now: float
) -> PeerOutcome:
    """What a collective-failure report calls for; changes nothing. The reported peer must exist
    (the caller checks) unless `peer_rank` is NO_PEER."""
    peer = None
    if failure.peer_rank != NO_PEER:
        members = [m for m in job.members.values() if m.rank == failure.peer_rank]
        peer = next((m for m in members if not m.state.is_gone), members[0] if members else None)
        if peer is None or peer.state.is_gone:
            return PeerOutcome(PeerAction.GONE, peer, "already gone")
        if not job.in_layout(peer):
            return PeerOutcome(PeerAction.NOT_IN_LAYOUT, peer, "not in the layout in force")
        silent = now - peer.last_heartbeat_unix
        if silent > heartbeat_timeout_s / 2:  # the threshold at which membership nudges an agent
            return PeerOutcome(
                PeerAction.MARK_LOST, peer, f"{failure.describe()}; its agent is silent for {silent:.2f}s"
            )
    recovery = job.recovery
    done = recovery.collective_retries.get(failure.peer_rank, 0)
    if (
        peer is not None
        and done >= COLLECTIVE_RETRIES
        and (recovery.request is not None or not answered(job, failure.reporter, now))
    ):
        return PeerOutcome(
            PeerAction.MARK_LOST,
            peer,
            f"{failure.describe()}; still failing after {done} replays on the same layout",
        )
    if recovery.request is not None:
        return PeerOutcome(PeerAction.RETRY, peer, "a plan is already on its way")
    if answered(job, failure.reporter, now):
        return PeerOutcome(PeerAction.ANSWERED, peer, f"epoch {job.plan_epoch} answers it")
    if done >= COLLECTIVE_RETRIES:
        return PeerOutcome(
            PeerAction.REFUSED,
            None,
            f"{failure.describe()}; no peer could be named and {done} replays on the same layout "
            "did not help: nothing is marked lost and no further plan is published (check the "
            "network and the workers' logs, then restart the job from its latest checkpoint)",
        )
    operation = failure.operation or "a collective"
    return PeerOutcome(
        PeerAction.RETRY,
        peer,
        f"collective failure in {operation} at step {failure.step}: replay on the same layout "
        f"(retry {done + 1} of {COLLECTIVE_RETRIES})",
    )


def answered(job: Job, reporter: str, now: float) -> bool:
    """The newest plan post-dates the reporter's failure: a worker acknowledges a plan as soon as
    it receives it, so a reporter that has acknowledged nothing of a plan this term published
    moments ago had not seen it when its collective failed, and that plan aborts and replays its
    step. After `ANSWER_WINDOW_S` a report counts again (its acknowledgement may have been lost)."""
    plan = job.last_plan
    if plan is None or job.plan_epoch not in job.acks or now - plan.created_unix > ANSWER_WINDOW_S:
        return False  # no plan, none this term has watched, or long enough ago to have been received
    return reporter not in job.acks[job.plan_epoch]
