"""Restartable recovery in the schedule engine, stepped one tick at a time (docs/architecture.md
("The Core's decisions"); core_service/recovery.py): committed layouts, plan modes, retry plans,
their bounds, and collective failures without a membership change."""

from __future__ import annotations

import pytest

from core_service.executor_service import report_collective_failure
from core_service.job_snapshot import snapshot_of
from core_service.jobs import Job
from core_service.model import Ack, AckPhase, JobPhase, PlanFailure, WorkerState
from core_service.policies import resize_for_going
from core_service.recovery import (
    COLLECTIVE_RETRIES,
    MAX_IN_PLACE_RETRIES,
    MAX_RESTORE_FAILURES,
    RESTORE,
    CollectiveFailure,
    committed_epoch_in,
)
from planners.layout import Layout, Plan, PlanMode, make_uniform_layout
from tests.core.test_engine import Harness, run

# Two stages of three ranks: 0 1 2 | 3 4 5. A rank's ring snapshot is kept by its DP predecessor.
LAYOUT = make_uniform_layout(num_layers=4, num_stages=2, dp=3, global_batch=12, num_micro_batches=2)
# Two stages of two ranks: 0 1 | 2 3.
SMALL = make_uniform_layout(num_layers=4, num_stages=2, dp=2, global_batch=8, num_micro_batches=2)


def stored(h: Harness, epoch: int) -> Plan:
    body = h.plans.get("j", epoch)
    assert body is not None, f"no plan {epoch}"
    return Plan.from_json(body)


def resized(layout: Layout, going: list[int]) -> tuple[Layout, tuple[str, ...]]:
    """What the resize-only policy plans for `going` (the Harness's policy)."""
    result = resize_for_going(layout, going)
    assert result.layout is not None
    return result.layout, result.reasons


def expected(
    epoch: int, old: Layout, new: Layout, reasons: tuple[str, ...], mode: PlanMode, now: float
) -> Plan:
    return Plan(
        epoch=epoch,
        old=old,
        new=new,
        reasons=reasons,
        predicted_step_time_s=0.0,
        job="j",
        policy="elaswave-resize",
        mode=mode,
        created_unix=now,
    )


def last_event(job: Job, kind: str) -> dict:
    event = [e for e in job.events if e.kind == kind][-1]
    return {"detail": event.detail, **event.data}


def beat(h: Harness, now: float) -> None:
    """Every live agent heartbeats (what membership records on each Heartbeat)."""
    for member in h.job.live_members():
        member.last_heartbeat_unix = now


async def started(layout: Layout) -> Harness:
    """A running job whose joins are planned (nothing to do), at epoch 0."""
    h = Harness(layout)
    await h.join_layout("j", layout)
    assert await h.engine.tick(h.job, 1.0) == JobPhase.PLANNING
    assert await h.engine.tick(h.job, 1.0) == JobPhase.RUNNING
    return h


async def lose(h: Harness, ranks: list[int], now: float) -> None:
    for rank in ranks:
        h.membership.mark_lost(h.job, f"j-w{rank}", "worker process killed by signal 9", "process_exit", now)
    assert await h.engine.tick(h.job, now) == JobPhase.PLANNING


def ack(h: Harness, worker: str, epoch: int, phase: AckPhase, now: float) -> None:
    h.engine.acknowledge(h.job, worker, epoch, Ack(phase), 0.01, now)


def fail(h: Harness, worker: str, epoch: int, kind: PlanFailure, reason: str, now: float) -> None:
    h.engine.acknowledge(h.job, worker, epoch, Ack(AckPhase.FAILED, kind, reason), 0.01, now)


@pytest.mark.timeout(30)
def test_two_losses_in_one_tick_are_planned_together_in_place() -> None:
    async def scenario() -> None:
        h = await started(LAYOUT)
        await lose(h, [0, 4], 2.0)  # different stages; their ring holders 2 and 3 survive
        assert await h.engine.tick(h.job, 2.1) == JobPhase.APPLYING
        new, reasons = resized(LAYOUT, [0, 4])
        assert stored(h, 1) == expected(1, LAYOUT, new, reasons, PlanMode.IN_PLACE, 2.1)
        assert (h.job.plan_epoch, h.job.committed_epoch) == (1, 0)
        assert h.job.committed_layout_json == LAYOUT.to_json() and h.job.layout_json == new.to_json()
        assert last_event(h.job, "plan_published")["mode"] == "in_place"

    run(scenario())


@pytest.mark.timeout(30)
def test_an_interrupted_apply_without_a_new_change_is_retried_under_a_new_epoch() -> None:
    async def scenario() -> None:
        h = await started(LAYOUT)
        await lose(h, [4], 2.0)
        await h.engine.tick(h.job, 2.0)
        new, _ = resized(LAYOUT, [4])
        ack(h, "j-w0", 1, AckPhase.RECEIVED, 2.1)
        fail(h, "j-w3", 1, PlanFailure.INTERRUPTED, "peer 5 did not answer the remap", 2.2)
        assert await h.engine.tick(h.job, 2.2) == JobPhase.PLANNING
        assert await h.engine.tick(h.job, 2.3) == JobPhase.APPLYING
        reason = (
            "retry of epoch 1 after its apply failed on ['j-w3'] "
            "(interrupted: peer 5 did not answer the remap)"
        )
        assert stored(h, 2) == expected(2, LAYOUT, new, (reason,), PlanMode.IN_PLACE, 2.3)
        event = last_event(h.job, "plan_published")
        assert (event["epoch"], event["retry_of"], event["mode"]) == (2, 1, "in_place")
        assert event["failed_workers"] == ["j-w3"] and event["failures"] == {"j-w3": "interrupted"}
        assert (h.job.plan_epoch, h.job.committed_epoch, h.job.recovery.in_place_retries) == (2, 0, 1)
        assert h.job.recovery.request is None and h.job.layout_json == new.to_json()

    run(scenario())


@pytest.mark.timeout(30)
def test_a_plan_an_executor_cannot_apply_in_place_is_followed_by_a_restore() -> None:
    async def scenario() -> None:
        h = await started(LAYOUT)
        await lose(h, [4], 2.0)
        await h.engine.tick(h.job, 2.0)
        new, _ = resized(LAYOUT, [4])
        fail(h, "j-w3", 1, PlanFailure.NOT_APPLICABLE, "snapshot checksum mismatch", 2.2)
        await h.engine.tick(h.job, 2.2)
        assert await h.engine.tick(h.job, 2.3) == JobPhase.APPLYING
        reasons = (
            "retry of epoch 1 after its apply failed on ['j-w3'] (not_applicable: snapshot checksum mismatch)",
            f"{RESTORE}: j-w3 cannot apply epoch 1 in place: snapshot checksum mismatch",
        )
        assert stored(h, 2) == expected(2, LAYOUT, new, reasons, PlanMode.RESTORE, 2.3)
        assert last_event(h.job, "plan_published")["failures"] == {"j-w3": "not_applicable"}
        assert (h.job.plan_epoch, h.job.last_plan, h.job.recovery.in_place_retries) == (2, stored(h, 2), 0)

    run(scenario())


@pytest.mark.timeout(30)
def test_a_whole_stage_lost_gives_a_restore_plan_from_the_committed_layout() -> None:
    async def scenario() -> None:
        h = await started(SMALL)
        await lose(h, [0], 2.0)  # rank 1 keeps rank 0's snapshot: in place
        await h.engine.tick(h.job, 2.0)
        first, _ = resized(SMALL, [0])
        assert stored(h, 1).mode == PlanMode.IN_PLACE
        ack(h, "j-w1", 1, AckPhase.RESUMED, 2.5)
        assert (h.job.committed_epoch, h.job.committed_layout_json) == (1, first.to_json())
        await lose(h, [2, 3], 3.0)  # all of stage 1: its snapshots went with it
        assert await h.engine.tick(h.job, 3.1) == JobPhase.APPLYING
        merged, reasons = resized(first, [2, 3])
        assert merged.num_stages == 1 and merged.ranks() == (1,)
        why = (
            f"{RESTORE}: the optimizer state of lost ranks [2, 3] (stages [1]) has no surviving "
            "copy: its ring snapshot was on a rank lost with it"
        )
        assert stored(h, 2) == expected(2, first, merged, (*reasons, why), PlanMode.RESTORE, 3.1)
        assert h.job.layout_json == merged.to_json() and h.job.committed_layout_json == first.to_json()
        # The restored worker's first commit says what the restore cost; the event keeps it.
        h.engine.acknowledge(h.job, "j-w1", 2, Ack(AckPhase.RESUMED, steps_replayed=3), 0.01, 3.5)
        resumed = last_event(h.job, "plan_resumed")
        assert resumed["steps_lost"] == 3 and "3 committed steps replayed" in resumed["detail"]
        assert (h.job.committed_epoch, h.job.committed_layout_json) == (2, merged.to_json())
        with pytest.raises(ValueError, match="steps_replayed"):
            Ack(AckPhase.APPLIED, steps_replayed=1)

    run(scenario())


@pytest.mark.timeout(30)
def test_the_committed_layout_advances_on_the_first_resumed_ack() -> None:
    async def scenario() -> None:
        h = await started(LAYOUT)
        await lose(h, [4], 2.0)
        await h.engine.tick(h.job, 2.0)
        new, _ = resized(LAYOUT, [4])
        for worker in ("j-w0", "j-w1"):
            for phase in (AckPhase.RECEIVED, AckPhase.PAUSED, AckPhase.APPLIED):
                ack(h, worker, 1, phase, 2.1)
        assert (h.job.committed_epoch, h.job.committed_layout_json) == (0, LAYOUT.to_json())
        ack(h, "j-w0", 1, AckPhase.RESUMED, 2.2)
        assert (h.job.committed_epoch, h.job.committed_layout_json) == (1, new.to_json())
        assert last_event(h.job, "layout_committed")["epoch"] == 1
        assert await h.engine.tick(h.job, 2.3) == JobPhase.APPLYING  # the others have not resumed
        assert committed_epoch_in(h.job.events) == 1  # what a new leader would restore from
        # The next plan starts from the committed layout.
        await lose(h, [0], 3.0)
        await h.engine.tick(h.job, 3.0)
        assert stored(h, 2).old == new and stored(h, 2).mode == PlanMode.IN_PLACE

    run(scenario())


@pytest.mark.timeout(30)
def test_restore_stays_sticky_until_a_step_commits_on_it() -> None:
    async def scenario() -> None:
        h = await started(LAYOUT)
        await lose(h, [4], 2.0)
        await h.engine.tick(h.job, 2.0)
        fail(h, "j-w3", 1, PlanFailure.NOT_APPLICABLE, "no snapshot", 2.1)
        await h.engine.tick(h.job, 2.1)
        await h.engine.tick(h.job, 2.1)
        assert stored(h, 2).mode == PlanMode.RESTORE
        # Rank 0 alone would be in place from the committed layout, but workers are restoring.
        await lose(h, [0], 2.5)
        assert await h.engine.tick(h.job, 2.6) == JobPhase.APPLYING
        new, reasons = resized(resized(LAYOUT, [4])[0], [0])
        why = (
            f"{RESTORE}: the RESTORE plan of epoch 2 has not committed a step yet, and workers that "
            "started restoring have no in-memory state left"
        )
        assert stored(h, 3) == expected(3, LAYOUT, new, (*reasons, why), PlanMode.RESTORE, 2.6)
        ack(h, "j-w1", 3, AckPhase.RESUMED, 3.0)
        await lose(h, [1], 3.5)
        await h.engine.tick(h.job, 3.6)
        latest = stored(h, 4)
        assert (latest.old, latest.mode) == (new, PlanMode.IN_PLACE)
        assert (h.job.committed_epoch, h.job.plan_epoch) == (3, 4)

    run(scenario())


@pytest.mark.timeout(30)
def test_retries_without_progress_turn_to_restore_and_then_to_a_refusal() -> None:
    async def scenario() -> None:
        h = await started(LAYOUT)
        await lose(h, [4], 2.0)
        await h.engine.tick(h.job, 2.0)
        new, _ = resized(LAYOUT, [4])
        now = 2.0
        modes = []
        for epoch in range(1, 1 + MAX_IN_PLACE_RETRIES + MAX_RESTORE_FAILURES):
            now += 0.1
            fail(h, "j-w0", epoch, PlanFailure.INTERRUPTED, f"peer died during epoch {epoch}", now)
            assert await h.engine.tick(h.job, now) == JobPhase.PLANNING
            assert await h.engine.tick(h.job, now) == JobPhase.APPLYING
            assert h.job.plan_epoch == epoch + 1 and stored(h, epoch + 1).new == new
            modes.append(stored(h, epoch + 1).mode)
        assert modes == [PlanMode.IN_PLACE] * 3 + [PlanMode.RESTORE] * 3
        assert stored(h, 5).reasons[-1] == (
            f"{RESTORE}: the in-place recovery was retried 3 times without a committed step"
        )
        assert (h.job.recovery.in_place_retries, h.job.recovery.restore_failures) == (3, 2)
        fail(h, "j-w0", 7, PlanFailure.INTERRUPTED, "peer died again", 3.0)
        await h.engine.tick(h.job, 3.0)
        assert await h.engine.tick(h.job, 3.0) == JobPhase.RUNNING
        refusal = last_event(h.job, "decision_refuse")
        assert refusal["detail"].startswith(
            "restoring from the latest durable checkpoint failed 3 times without a committed step"
        )
        assert (refusal["mode"], refusal["failed_workers"], refusal["epoch"]) == ("restore", ["j-w0"], 7)
        # Stopped: another failure of the same epoch plans nothing.
        fail(h, "j-w1", 7, PlanFailure.INTERRUPTED, "peer died again", 3.1)
        for t in (3.1, 3.2):
            assert await h.engine.tick(h.job, t) == JobPhase.RUNNING
        assert (h.job.plan_epoch, h.job.recovery.gave_up_at, h.job.recovery.request) == (7, 7, None)
        latest = h.plans.latest("j")
        assert latest is not None and latest[0] == 7

    run(scenario())


def collective(reporter: str, peer_rank: int) -> CollectiveFailure:
    return CollectiveFailure(reporter, peer_rank, 7, "all_reduce(stage 1 dp group)", "Connection reset")


@pytest.mark.timeout(30)
def test_a_collective_failure_on_a_live_peer_is_replayed_then_the_peer_is_lost() -> None:
    async def scenario() -> None:
        h = await started(LAYOUT)
        now = 2.0
        for retry in range(1, COLLECTIVE_RETRIES + 1):
            beat(h, now)
            assert report_collective_failure(h.engine, h.membership, h.job, collective("j-w3", 4), now) == (
                False,
                "j-w4",
            )
            # The same failure from another survivor before the plan: one replay for both.
            report_collective_failure(h.engine, h.membership, h.job, collective("j-w5", 4), now)
            assert await h.engine.tick(h.job, now) == JobPhase.PLANNING
            assert await h.engine.tick(h.job, now) == JobPhase.APPLYING
            epoch = retry
            reason = (
                f"retry of epoch {epoch - 1} after collective failure in all_reduce(stage 1 dp group) at "
                f"step 7: replay on the same layout (retry {retry} of {COLLECTIVE_RETRIES})"
            )
            assert stored(h, epoch) == expected(epoch, LAYOUT, LAYOUT, (reason,), PlanMode.IN_PLACE, now)
            # A late report of the same failure, from a worker that has not received the plan yet.
            report_collective_failure(h.engine, h.membership, h.job, collective("j-w0", 4), now + 0.1)
            assert h.job.recovery.request is None
            for worker in ("j-w3", "j-w5"):
                ack(h, worker, epoch, AckPhase.RECEIVED, now + 0.2)
            now += 1.0
        assert h.job.recovery.collective_retries == {4: COLLECTIVE_RETRIES}
        assert [e.data["peer_rank"] for e in h.job.events if e.kind == "collective_failure"] == [4, 4]
        beat(h, now)
        marked = report_collective_failure(h.engine, h.membership, h.job, collective("j-w3", 4), now)
        assert marked == (True, "j-w4") and h.job.members["j-w4"].state == WorkerState.LOST
        assert "still failing after 2 replays" in h.job.members["j-w4"].lost_reason
        assert await h.engine.tick(h.job, now) == JobPhase.PLANNING  # a change while applying
        await h.engine.tick(h.job, now)
        new, reasons = resized(LAYOUT, [4])
        assert stored(h, 3) == expected(3, LAYOUT, new, reasons, PlanMode.IN_PLACE, now)

    run(scenario())


@pytest.mark.timeout(30)
def test_a_collective_failure_on_a_silent_peer_marks_it_lost_at_once() -> None:
    async def scenario() -> None:
        h = await started(LAYOUT)
        beat(h, 1.0)
        h.job.members["j-w4"].last_heartbeat_unix = 0.5  # 1.5 s silent: over half the 2 s timeout
        marked = report_collective_failure(h.engine, h.membership, h.job, collective("j-w3", 4), 2.0)
        assert marked == (True, "j-w4") and h.job.members["j-w4"].state == WorkerState.LOST
        assert h.job.recovery.request is None and h.job.recovery.collective_retries == {}
        # Reported again once gone: the dead-peer path, nothing more happens.
        assert report_collective_failure(h.engine, h.membership, h.job, collective("j-w5", 4), 2.0) == (
            False,
            "j-w4",
        )
        await h.engine.tick(h.job, 2.0)
        await h.engine.tick(h.job, 2.0)
        assert [e.worker_id for e in h.job.events if e.kind == "worker_lost"] == ["j-w4"]
        assert stored(h, 1).new == resized(LAYOUT, [4])[0] and h.job.plan_epoch == 1

    run(scenario())


@pytest.mark.timeout(30)
def test_a_collective_failure_without_a_named_peer_is_replayed_then_refused() -> None:
    async def scenario() -> None:
        h = await started(LAYOUT)
        now = 2.0
        for epoch in range(1, COLLECTIVE_RETRIES + 1):
            beat(h, now)
            assert report_collective_failure(h.engine, h.membership, h.job, collective("j-w0", -1), now) == (
                False,
                "",
            )
            await h.engine.tick(h.job, now)
            assert await h.engine.tick(h.job, now) == JobPhase.APPLYING
            plan = stored(h, epoch)
            assert (plan.old, plan.new, plan.mode) == (LAYOUT, LAYOUT, PlanMode.IN_PLACE)
            assert plan.reasons[0].endswith(f"(retry {epoch} of {COLLECTIVE_RETRIES})")
            ack(h, "j-w0", epoch, AckPhase.RECEIVED, now)
            now += 1.0
        for reporter in ("j-w0", "j-w1"):  # every survivor reports: one refusal
            outcome = report_collective_failure(h.engine, h.membership, h.job, collective(reporter, -1), now)
            assert outcome == (False, "")
        refusals = [e for e in h.job.events if e.kind == "decision_refuse"]
        assert len(refusals) == 1 and "no peer could be named and 2 replays" in refusals[0].detail
        assert refusals[0].data["peer_rank"] == -1
        await h.engine.tick(h.job, now)
        assert h.job.plan_epoch == COLLECTIVE_RETRIES and h.job.recovery.request is None
        assert all(m.state == WorkerState.RUNNING for m in h.job.members.values())
        assert snapshot_of(h.job).gone == ()

    run(scenario())
