"""The schedule engine stepped one tick at a time (RUNNING -> PLANNING -> APPLYING -> RUNNING)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from core_service.agent_session import Registration
from core_service.config import JobSpec, load_settings
from core_service.engine import ScheduleEngine
from core_service.job_snapshot import Decision, JobSnapshot, Policy
from core_service.jobs import JobTable
from core_service.membership import Membership
from core_service.metrics import CoreMetrics
from core_service.model import Ack, AckPhase, JobPhase, StepReport, WorkerState
from core_service.persist import Persister
from core_service.policies import LayoutPolicy
from core_service.recovery import stored_plans
from core_service.registry import MemoryRegistry, PlanStore, RegistryError
from planners.layout import Layout, Plan, make_uniform_layout

RESUMED = Ack(AckPhase.RESUMED)


class Harness:
    def __init__(
        self,
        layout: Layout | None,
        policy: Policy | None = None,
        registry: MemoryRegistry | None = None,
        default_job: bool = True,
    ) -> None:
        self.registry = registry or MemoryRegistry()
        self.settings = load_settings(dev_mode=True)
        self.metrics = CoreMetrics(CollectorRegistry())
        self.persister = Persister(self.registry)
        self.table = JobTable(self.settings, self.registry, self.persister)
        self.membership = Membership(self.table, self.registry, self.metrics)
        self.plans = PlanStore(self.registry, self.settings.key_prefix)
        self.engine = ScheduleEngine(
            self.table, self.metrics, policy or LayoutPolicy(), self.publish, apply_timeout_s=5.0
        )
        if default_job:
            self.job = self.add_job("j", layout)

    def add_job(self, name: str, layout: Layout | None):  # noqa: ANN201 - returns core_service.jobs.Job
        spec = JobSpec(name=name, token=SecretStr("t" * 16))
        return self.table.create_job(spec, layout.to_json() if layout else None, now=0.0)

    async def publish(self, job: str, body: bytes, expected: int) -> int:
        return self.plans.publish(job, body, expected_epoch=expected)

    async def join(self, worker: str, rank: int, stage: int, dp_rank: int, job: str = "j") -> None:
        reg = Registration(job, worker, "host", 100 + rank, [], stage, dp_rank, rank, holds_own_lease=False)
        await self.membership.register(reg, now=0.0)
        record = self.table.get(job)
        self.table.set_state(
            record, record.members[worker], WorkerState.RUNNING, "stepping", now=0.0, kind="worker_running"
        )

    async def join_layout(self, job: str, layout: Layout) -> None:
        for rank in layout.ranks():
            stage = layout.stage_of_rank(rank)
            await self.join(f"{job}-w{rank}", rank, stage, layout.stages[stage].dp_index(rank), job=job)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.job.events]


def run(coro):  # noqa: ANN001, ANN201 - tiny helper for async set-up
    return asyncio.new_event_loop().run_until_complete(coro)


@pytest.mark.timeout(30)
def test_loss_is_planned_published_applied_and_resumed_tick_by_tick() -> None:
    layout = make_uniform_layout(num_layers=4, num_stages=2, dp=2, global_batch=8, num_micro_batches=2)
    h = Harness(layout)

    async def scenario() -> None:
        for rank in layout.ranks():
            stage = layout.stage_of_rank(rank)
            await h.join(f"w{rank}", rank, stage, layout.stages[stage].dp_index(rank))
        # Joins are changes: the engine plans once for all of them and finds nothing to do.
        assert await h.engine.tick(h.job, 1.0) == JobPhase.PLANNING
        assert await h.engine.tick(h.job, 1.1) == JobPhase.RUNNING
        assert h.job.plan_epoch == 0 and "decision_none" in h.kinds()

        lost_rank = layout.stages[1].ranks[0]
        h.membership.mark_lost(
            h.job, f"w{lost_rank}", "worker process killed by signal 9", "process_exit", 2.0
        )
        assert await h.engine.tick(h.job, 2.0) == JobPhase.PLANNING
        assert await h.engine.tick(h.job, 2.1) == JobPhase.APPLYING
        assert h.job.plan_epoch == 1
        new_layout = layout_of_epoch(h, "j", 1)
        assert lost_rank not in new_layout.ranks()
        assert new_layout.stages[0] == layout.stages[0]  # the untouched stage is unchanged

        # Still applying until every live worker has resumed.
        live = [w for w in h.job.members if h.job.members[w].state != WorkerState.LOST]
        for worker in live[:-1]:
            h.job.acks.setdefault(1, {})[worker] = RESUMED
        assert await h.engine.tick(h.job, 2.2) == JobPhase.APPLYING
        h.job.acks[1][live[-1]] = RESUMED
        assert await h.engine.tick(h.job, 2.3) == JobPhase.RUNNING
        assert h.kinds()[-4:] == ["plan_published", "phase_applying", "layout_committed", "phase_running"]

    run(scenario())


@pytest.mark.timeout(30)
def test_new_loss_while_applying_replans_from_the_cumulative_state() -> None:
    layout = make_uniform_layout(num_layers=4, num_stages=2, dp=3, global_batch=12, num_micro_batches=2)
    h = Harness(layout)

    async def scenario() -> None:
        for rank in layout.ranks():
            stage = layout.stage_of_rank(rank)
            await h.join(f"w{rank}", rank, stage, layout.stages[stage].dp_index(rank))
        await h.engine.tick(h.job, 1.0)
        await h.engine.tick(h.job, 1.0)
        first, second = layout.stages[0].ranks[0], layout.stages[1].ranks[2]
        h.membership.mark_lost(h.job, f"w{first}", "gone", "process_exit", 2.0)
        await h.engine.tick(h.job, 2.0)
        assert await h.engine.tick(h.job, 2.0) == JobPhase.APPLYING
        h.membership.mark_lost(h.job, f"w{second}", "gone too", "stream_closed", 2.5)
        assert await h.engine.tick(h.job, 2.5) == JobPhase.PLANNING
        assert await h.engine.tick(h.job, 2.6) == JobPhase.APPLYING
        assert h.job.plan_epoch == 2
        final = layout_of_epoch(h, "j", 2)
        assert first not in final.ranks() and second not in final.ranks()
        assert sorted(final.ranks()) == sorted(set(layout.ranks()) - {first, second})

    run(scenario())


@pytest.mark.timeout(30)
def test_emptied_stage_hands_its_layers_on_and_losing_everything_is_refused() -> None:
    layout = make_uniform_layout(num_layers=2, num_stages=2, dp=1, global_batch=4, num_micro_batches=2)
    h = Harness(layout)

    async def scenario() -> None:
        for rank in layout.ranks():
            await h.join(f"w{rank}", rank, layout.stage_of_rank(rank), 0)
        await h.engine.tick(h.job, 1.0)
        await h.engine.tick(h.job, 1.0)
        h.membership.mark_lost(h.job, f"w{layout.stages[1].ranks[0]}", "gone", "process_exit", 2.0)
        await h.engine.tick(h.job, 2.0)
        assert await h.engine.tick(h.job, 2.0) == JobPhase.APPLYING
        merged = layout_of_epoch(h, "j", 1)
        assert merged.num_stages == 1 and merged.stages[0].ranks == layout.stages[0].ranks
        assert (merged.stages[0].layer_start, merged.stages[0].layer_stop) == (0, 2)
        h.membership.mark_lost(h.job, f"w{layout.stages[0].ranks[0]}", "gone", "process_exit", 3.0)
        await h.engine.tick(h.job, 3.0)
        # Nobody is left and no plan is possible: the job ends FAILED (terminal), not RUNNING.
        assert await h.engine.tick(h.job, 3.0) == JobPhase.FAILED
        refusal = [e for e in h.job.events if e.kind == "decision_refuse"]
        assert refusal and "every stage would lose all of its ranks" in refusal[-1].detail
        assert "every stage would lose all of its ranks" in h.job.end_reason
        assert h.job.plan_epoch == 1  # nothing more was published
        assert await h.engine.tick(h.job, 4.0) == JobPhase.FAILED

    run(scenario())


@pytest.mark.timeout(30)
def test_job_without_layout_records_changes_and_never_publishes() -> None:
    h = Harness(None)

    async def scenario() -> None:
        await h.join("a", -1, -1, -1)
        h.membership.mark_lost(h.job, "a", "gone", "process_exit", 1.0)
        for t in range(5):
            await h.engine.tick(h.job, 1.0 + t)
        assert h.job.phase == JobPhase.RUNNING and h.job.plan_epoch == 0
        assert h.plans.latest("j") is None

    run(scenario())


class FailingFor:
    """LayoutPolicy, except that deciding for the jobs in `broken` raises (a planner bug)."""

    name = "elaswave-resize"

    def __init__(self, broken: set[str]) -> None:
        self.broken = broken
        self.inner = LayoutPolicy()

    def decide(self, snapshot: JobSnapshot) -> Decision:
        if snapshot.job in self.broken:
            raise ZeroDivisionError(f"planner bug for {snapshot.job}")
        return self.inner.decide(snapshot)


def plan_of_epoch(h: Harness, job: str, epoch: int) -> Plan:
    body = h.plans.get(job, epoch)
    assert body is not None, f"no plan {epoch} for {job}"
    return Plan.from_json(body)


def layout_of_epoch(h: Harness, job: str, epoch: int) -> Layout:
    return plan_of_epoch(h, job, epoch).new


@pytest.mark.timeout(30)
def test_a_failing_policy_stays_with_its_job_keeps_the_change_and_backs_off() -> None:
    layout = make_uniform_layout(num_layers=4, num_stages=2, dp=2, global_batch=8, num_micro_batches=2)
    policy = FailingFor({"bad"})
    h = Harness(None, policy=policy, default_job=False)

    async def scenario() -> None:
        bad, good = h.add_job("bad", layout), h.add_job("good", layout)
        for name in ("bad", "good"):
            await h.join_layout(name, layout)
        assert await h.engine.tick_all(1.0) == []  # both plan the joins: PLANNING
        assert await h.engine.tick_all(1.0) == []  # the broken planner is not a Core failure
        assert bad.phase == JobPhase.PLANNING and good.phase == JobPhase.RUNNING
        assert [e.kind for e in bad.events][-1] == "planner_failed"
        assert "ZeroDivisionError" in bad.events[-1].detail and bad.events[-1].data["retry_in_s"] == 0.5
        assert len(bad.pending_changes) == 4  # the four joins are still to plan for

        lost = layout.stages[1].ranks[0]
        for job in (bad, good):
            h.membership.mark_lost(job, f"{job.name}-w{lost}", "killed", "process_exit", 2.0)
        await h.engine.tick_all(2.0)  # good: RUNNING -> PLANNING; bad: retried at 1.5 s, fails again
        assert await h.engine.tick_all(2.1) == []
        assert good.phase == JobPhase.APPLYING and good.plan_epoch == 1
        failures = [e.data["failures"] for e in bad.events if e.kind == "planner_failed"]
        assert failures == [1, 2]  # 0.5 s then 1 s apart: no retry at 2.1 s
        assert bad.plan_epoch == 0 and len(bad.pending_changes) == 5

        policy.broken.clear()
        await h.engine.tick_all(2.5)
        assert bad.phase == JobPhase.PLANNING  # still backing off until 3.0 s
        assert await h.engine.tick_all(3.0) == [] and bad.phase == JobPhase.APPLYING
        assert bad.plan_epoch == 1 and not bad.pending_changes
        assert layout_of_epoch(h, "bad", 1) == layout_of_epoch(h, "good", 1)
        assert lost not in layout_of_epoch(h, "bad", 1).ranks()

    run(scenario())


@pytest.mark.timeout(30)
def test_a_plan_that_cannot_be_stored_is_reported_and_planned_again() -> None:
    layout = make_uniform_layout(num_layers=4, num_stages=2, dp=2, global_batch=8, num_micro_batches=2)
    h = Harness(None, default_job=False)

    async def scenario() -> None:
        job = h.add_job("j", layout)
        await h.join_layout("j", layout)
        await h.engine.tick_all(1.0)
        await h.engine.tick_all(1.0)
        h.membership.mark_lost(job, "j-w3", "killed", "process_exit", 2.0)
        # A real registry failure: the epoch counter holds something that is not an epoch.
        h.registry.put(h.plans.epoch_key("j"), b"garbage")
        await h.engine.tick_all(2.0)
        failures = await h.engine.tick_all(2.1)
        assert [f.job for f in failures] == ["j"] and isinstance(failures[0].error, RegistryError)
        assert "not a decimal epoch" in str(failures[0].error)
        assert job.phase == JobPhase.PLANNING and [e.kind for e in job.pending_changes] == ["worker_lost"]
        h.registry.delete(h.plans.epoch_key("j"))
        assert await h.engine.tick_all(2.2) == []
        assert job.phase == JobPhase.APPLYING and job.plan_epoch == 1
        assert sorted(layout_of_epoch(h, "j", 1).ranks()) == [0, 1, 2]

    run(scenario())


@pytest.mark.timeout(30)
def test_restore_takes_the_newest_plan_replans_unplanned_losses_and_resumes_the_apply() -> None:
    layout = make_uniform_layout(num_layers=4, num_stages=2, dp=3, global_batch=12, num_micro_batches=2)
    old = Harness(None, default_job=False)

    async def scenario() -> None:
        old.persister.start()
        job = old.add_job("j", layout)
        await old.join_layout("j", layout)
        await old.engine.tick_all(1.0)
        await old.engine.tick_all(1.0)
        first, second = layout.stages[0].ranks[0], layout.stages[1].ranks[2]
        old.membership.mark_lost(job, f"j-w{first}", "killed", "process_exit", 2.0)
        await old.engine.tick_all(2.0)
        await old.engine.tick_all(2.0)
        assert job.phase == JobPhase.APPLYING and job.plan_epoch == 1
        # One executor resumed epoch 1 (recorded as ExecutorService records acks), then a second
        # worker was lost and stored, and the leader died before its next tick.
        old.table.record(job, "plan_resumed", worker_id="j-w1", now=2.1, data={"epoch": 1})
        old.membership.mark_lost(job, f"j-w{second}", "killed", "process_exit", 2.2)
        await old.persister.wait_durable(5.0)

        new = Harness(None, registry=old.registry, default_job=False)
        new.persister.start()
        new.table.jobs = new.table.read_registry(3.0)
        restored = new.table.get("j")
        assert restored.layout_json == layout.to_json()  # the spec keeps the creation layout
        epoch, latest, committed = stored_plans(new.plans, restored)
        assert committed == (1, old.plans.get("j", 1))  # j-w1 resumed epoch 1
        new.engine.restore(restored, epoch, latest, 3.0, committed)

        assert restored.plan_epoch == 1 and restored.committed_epoch == 1
        assert restored.committed_layout_json == layout_of_epoch(old, "j", 1).to_json()
        assert restored.last_plan == plan_of_epoch(old, "j", 1)
        assert restored.layout_json == layout_of_epoch(old, "j", 1).to_json()
        assert [(e.kind, e.worker_id) for e in restored.pending_changes] == [
            ("replan_after_takeover", f"j-w{second}")
        ]
        assert restored.phase == JobPhase.APPLYING and restored.acks == {1: {"j-w1": RESUMED}}
        assert await new.engine.tick(restored, 3.1) == JobPhase.PLANNING  # a change while applying
        assert await new.engine.tick(restored, 3.2) == JobPhase.APPLYING
        final = layout_of_epoch(new, "j", 2)
        assert sorted(final.ranks()) == sorted(set(layout.ranks()) - {first, second})
        assert plan_of_epoch(new, "j", 2).old == layout_of_epoch(old, "j", 1)
        await new.persister.stop(5.0)
        await old.persister.stop(5.0)

    run(scenario())


async def _stored_joining_with_a_step(layout: Layout) -> tuple[MemoryRegistry, str]:
    """The old leader's term: w0 registered, its first step stored, its move to RUNNING not."""
    old = Harness(layout, default_job=False)
    old.persister.start()
    job = old.add_job("j", layout)
    session = await old.membership.register(W0, now=0.0)
    member = job.members["w0"]
    member.last_step = StepReport(0, 0.1, 0.1, 2.0, 2, 0, 0, 1.0)
    old.table.save_member(job, member)  # the first of the step's two writes
    await old.persister.wait_durable(5.0)
    await old.persister.stop()
    return old.registry, session.worker_token


W0 = Registration("j", "w0", "host", 100, [], 0, 0, 0, holds_own_lease=False)


@pytest.mark.timeout(30)
def test_a_member_stored_joining_with_a_step_runs_at_its_next_step_after_a_takeover() -> None:
    """The leader stores a member's first step, then its move to RUNNING; killed between the two
    writes (a CI run caught it), the next leader loads a member that says JOINING and has
    stepped. Its next step report must make it RUNNING (it stayed JOINING for good)."""
    layout = make_uniform_layout(num_layers=4, num_stages=1, dp=1, global_batch=2, num_micro_batches=1)
    registry, worker_token = run(_stored_joining_with_a_step(layout))
    new = Harness(layout, registry=registry, default_job=False)
    new.table.load_from_registry(now=2.0)
    job = new.table.get("j")
    assert job.members["w0"].state is WorkerState.JOINING and job.members["w0"].last_step is not None
    # The agent reconnects to the new leader with its credential.
    session = run(new.membership.register(W0, now=2.0, presented=worker_token))
    new.membership.step(session, StepReport(1, 0.1, 0.1, 1.9, 2, 0, 0, 3.0))
    assert job.members["w0"].state is WorkerState.RUNNING
    assert [e.detail for e in job.events if e.kind == "worker_running"] == ["step 1 reported"]
