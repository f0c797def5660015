"""A worker lost after the job's last step committed (stepped one tick at a time).

A worker finishes only once the job's last step has committed, and a step commits on every rank
of the layout: a loss after that takes nothing from the job. Whether the loss reaches the Core
after another worker's finish or before it (then a plan is already under way, which no worker
will ever apply), the job ends COMPLETED with the checkpoint its workers reported, on the layout
it committed, instead of waiting in APPLYING for acks that never come.
"""

from __future__ import annotations

import pytest

from core_service.elaswave_policy import ElasWavePolicy
from core_service.model import JobPhase, WorkerState
from tests.core.test_engine import Harness, run
from tests.core.test_growth import FAULT_FREE, make_job, ticks

CHECKPOINT = "/ckpt/g/step-99"


async def _running_job(h: Harness):  # noqa: ANN202 - core_service.jobs.Job
    job = make_job(h)
    await h.join_layout("g", FAULT_FREE)
    await ticks(h, job, JobPhase.RUNNING, 1.0)
    return job


async def _finish(h: Harness, worker: str, now: float) -> None:
    session = h.membership.sessions[("g", worker)]
    await h.membership.leave(session, "done", now, finished=True, checkpoint=CHECKPOINT)


def _completed_without(job, lost: str) -> None:  # noqa: ANN001 - core_service.jobs.Job
    assert job.phase is JobPhase.COMPLETED and job.final_checkpoint == CHECKPOINT
    done = next(e for e in job.events if e.kind == "job_completed")
    assert done.data == {"final_checkpoint": CHECKPOINT, "workers": 3, "ended_unfinished": [lost]}
    assert job.members[lost].state is WorkerState.LOST
    assert job.layout_json == FAULT_FREE.to_json()  # the layout it committed, every rank of it


@pytest.mark.timeout(30)
def test_a_worker_lost_after_another_finished_is_no_change_and_the_job_completes() -> None:
    h = Harness(None, ElasWavePolicy(), default_job=False)

    async def scenario() -> None:
        job = await _running_job(h)
        await _finish(h, "g-w0", 2.0)
        assert await h.engine.tick(job, 2.0) == JobPhase.RUNNING  # the others still end
        h.membership.mark_lost(job, "g-w3", "worker process killed by signal 9", "process_exit", 2.1)
        assert not job.pending_changes
        assert await h.engine.tick(job, 2.2) == JobPhase.RUNNING and job.plan_epoch == 0
        for worker in ("g-w1", "g-w2"):
            await _finish(h, worker, 3.0)
        assert await h.engine.tick(job, 3.0) == JobPhase.COMPLETED
        _completed_without(job, "g-w3")
        assert job.plan_epoch == 0 and "plan_published" not in [e.kind for e in job.events]

    run(scenario())


@pytest.mark.timeout(30)
def test_a_plan_for_a_loss_that_came_after_the_last_commit_is_dropped_when_a_worker_finishes() -> None:
    h = Harness(None, ElasWavePolicy(), default_job=False)

    async def scenario() -> None:
        job = await _running_job(h)
        # The loss reaches the Core before any worker's finish: it plans, as for any loss.
        h.membership.mark_lost(job, "g-w3", "worker process killed by signal 9", "process_exit", 2.0)
        await ticks(h, job, JobPhase.APPLYING, 2.0)
        assert job.plan_epoch == 1 and job.layout_json != FAULT_FREE.to_json()
        await _finish(h, "g-w0", 2.5)
        assert await h.engine.tick(job, 2.5) == JobPhase.RUNNING  # the plan dropped, not applied
        dropped = next(e for e in job.events if e.kind == "plan_dropped")
        assert dropped.data["plan_epoch"] == 1
        assert job.layout_json == FAULT_FREE.to_json() and not job.pending_changes
        for worker in ("g-w1", "g-w2"):
            await _finish(h, worker, 3.0)
        assert await h.engine.tick(job, 3.0) == JobPhase.COMPLETED
        _completed_without(job, "g-w3")
        assert await h.engine.tick(job, 60.0) == JobPhase.COMPLETED  # no apply timeout, no retry

    run(scenario())


@pytest.mark.timeout(30)
def test_a_worker_lost_before_any_finished_still_blocks_completion_and_is_planned_for() -> None:
    h = Harness(None, ElasWavePolicy(), default_job=False)

    async def scenario() -> None:
        job = await _running_job(h)
        h.membership.mark_lost(job, "g-w3", "worker process killed by signal 9", "process_exit", 2.0)
        assert [e.kind for e in job.pending_changes] == ["worker_lost"]
        await ticks(h, job, JobPhase.APPLYING, 2.0)
        assert job.plan_epoch == 1  # a loss mid-job is recovered, as ever

    run(scenario())
