"""What a job's members and event log say about its progress: the workers that finished, the
ranks leaving the layout, the spares ready to join, and the executors' acknowledgements of an
epoch (read again by a new leader, `ScheduleEngine.restore`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from core_service.jobs import Job
from core_service.model import Ack, AckPhase, Event, MemberRecord, PlanFailure, WorkerState

log = logging.getLogger("elaswave.core.engine")

# Workers whose rank leaves the layout at the next plan (the states LayoutPolicy re-plans for).
LEAVING_STATES = frozenset({WorkerState.LOST, WorkerState.LEFT, WorkerState.PREEMPTING, WorkerState.DRAINING})
# Executor acknowledgements as recorded in the event log ("plan_<phase>", see ExecutorService).
ACK_EVENT_KINDS = frozenset({"plan_received", "plan_paused", "plan_applied", "plan_resumed", "plan_failed"})


def finished_workers(job: Job) -> list[MemberRecord]:
    """The workers of the job's layout that finished its work when every worker of the layout has
    ended (their agents said Leave(finished) after a clean exit), else []. Spares are no workers
    of the layout; without a layout every non-spare member counts. A worker LOST once another had
    finished (`Job.work_done`: after the last step committed everywhere) ended too, as did one
    that left then: the job completes without them rather than wait for a plan nobody needs."""
    parsed = job.parsed_layout()
    finished: list[MemberRecord] = []
    ended: set[int] = set()
    ended_after_the_work = job.work_done
    for member in job.members.values():
        if member.state is WorkerState.SPARE or (parsed is not None and member.rank not in parsed.ranks):
            continue
        if member.state is WorkerState.LEFT and member.finished:
            finished.append(member)
        elif not (ended_after_the_work and member.state.is_gone):
            return []
        ended.add(member.rank)
    if not finished or (parsed is not None and ended != parsed.ranks):
        return []  # a rank of the layout has no ended worker (it never registered)
    return finished


def leaving_ranks(job: Job) -> list[tuple[MemberRecord, int]]:
    """Members in a leaving state whose rank is still in the job's current layout."""
    try:
        parsed = job.parsed_layout()
    except (ValueError, KeyError, TypeError) as exc:
        log.error("job=%s has a layout that cannot be read (%s); nothing re-planned", job.name, exc)
        return []
    if parsed is None:
        return []
    members = sorted(job.members.values(), key=lambda m: m.worker_id)
    return [(m, m.rank) for m in members if m.state in LEAVING_STATES and m.rank in parsed.ranks]


def ready_spares(job: Job) -> list[MemberRecord]:
    """Spares whose worker subscribed to plans (SPARE) and that no plan has taken in yet."""
    members = sorted(job.members.values(), key=lambda m: m.worker_id)
    return [m for m in members if m.state is WorkerState.SPARE and m.rank < 0]


def apply_unfinished(job: Job, epoch: int) -> bool:
    """Was the previous leader still applying `epoch`? Publishing always records `plan_published`
    then `phase_applying`, and a finished apply a later phase event; writes are ordered, so a
    stored plan whose events are missing (the leader died in between) was still being applied."""
    events = list(job.events)
    published = [e.seq for e in events if e.kind == "plan_published" and e.data.get("epoch") == epoch]
    if not published:
        pruned = bool(events) and events[0].seq > 1
        return not pruned  # pruned: the plan is older than the whole kept event log
    later = [e.kind for e in events if e.kind.startswith("phase_") and e.seq > published[-1]]
    return not later or later[-1] == "phase_applying"


def acks_from_events(events: Iterable[Event], epoch: int) -> dict[str, Ack]:
    """Each worker's last acknowledged phase of `epoch`, as `ScheduleEngine.acknowledge` recorded it."""
    acks: dict[str, Ack] = {}
    for event in events:
        if event.kind in ACK_EVENT_KINDS and event.worker_id and event.data.get("epoch") == epoch:
            phase = AckPhase(event.kind.removeprefix("plan_").upper())
            if phase == AckPhase.FAILED:
                failure = PlanFailure(event.data.get("failure", PlanFailure.UNSPECIFIED.value))
                acks[event.worker_id] = Ack(phase, failure, str(event.data.get("reason", event.detail)))
            else:
                acks[event.worker_id] = Ack(phase)
    return acks
