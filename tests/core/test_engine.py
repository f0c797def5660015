"""The schedule engine stepped one tick at a time (RUNNING -> PLANNING -> APPLYING -> RUNNING)."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from core_service.config import JobSpec, load_settings
from core_service.engine import ScheduleEngine
from core_service.jobs import JobTable
from core_service.membership import Membership, Registration
from core_service.metrics import CoreMetrics
from core_service.model import JobPhase, WorkerState
from core_service.persist import Persister
from core_service.policies import LayoutPolicy
from core_service.registry import MemoryRegistry, PlanStore
from planners.layout import Layout, make_uniform_layout


class Harness:
    def __init__(self, layout: Layout | None) -> None:
        self.registry = MemoryRegistry()
        self.settings = load_settings(dev_mode=True)
        self.metrics = CoreMetrics(CollectorRegistry())
        self.persister = Persister(self.registry)
        self.table = JobTable(self.settings, self.registry, self.persister)
        self.membership = Membership(self.table, self.registry, self.metrics)
        self.plans = PlanStore(self.registry, self.settings.key_prefix)
        self.engine = ScheduleEngine(self.table, self.metrics, LayoutPolicy(), self.publish, apply_timeout_s=5.0)
        spec = JobSpec(name="j", token=SecretStr("t" * 16))
        self.job = self.table.create_job(spec, layout.to_json() if layout else None, now=0.0)

    def publish(self, job: str, body: bytes, expected: int) -> int:
        return self.plans.publish(job, body, expected_epoch=expected)

    async def join(self, worker: str, rank: int, stage: int, dp_rank: int) -> None:
        reg = Registration("j", worker, "host", 100 + rank, [], stage, dp_rank, rank, holds_own_lease=False)
        await self.membership.register(reg, now=0.0)
        self.table.set_state(self.job, self.job.members[worker], WorkerState.RUNNING, "stepping",
                             now=0.0, kind="worker_running")

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
        assert h.engine.tick(h.job, 1.0) == JobPhase.PLANNING
        assert h.engine.tick(h.job, 1.1) == JobPhase.RUNNING
        assert h.job.plan_epoch == 0 and "decision_none" in h.kinds()

        lost_rank = layout.stages[1].ranks[0]
        h.membership.mark_lost(h.job, f"w{lost_rank}", "worker process killed by signal 9", "process_exit", 2.0)
        assert h.engine.tick(h.job, 2.0) == JobPhase.PLANNING
        assert h.engine.tick(h.job, 2.1) == JobPhase.APPLYING
        assert h.job.plan_epoch == 1
        epoch, body = h.plans.latest("j")
        new_layout = Layout.from_json(json.loads(body)["layout_json"])
        assert lost_rank not in new_layout.ranks()
        assert new_layout.stages[0] == layout.stages[0]  # the untouched stage is unchanged

        # Still applying until every live worker has resumed.
        live = [w for w in h.job.members if h.job.members[w].state != WorkerState.LOST]
        for worker in live[:-1]:
            h.job.acks.setdefault(1, {})[worker] = "RESUMED"
        assert h.engine.tick(h.job, 2.2) == JobPhase.APPLYING
        h.job.acks[1][live[-1]] = "RESUMED"
        assert h.engine.tick(h.job, 2.3) == JobPhase.RUNNING
        assert h.kinds()[-3:] == ["plan_published", "phase_applying", "phase_running"]

    run(scenario())


@pytest.mark.timeout(30)
def test_new_loss_while_applying_replans_from_the_cumulative_state() -> None:
    layout = make_uniform_layout(num_layers=4, num_stages=2, dp=3, global_batch=12, num_micro_batches=2)
    h = Harness(layout)

    async def scenario() -> None:
        for rank in layout.ranks():
            stage = layout.stage_of_rank(rank)
            await h.join(f"w{rank}", rank, stage, layout.stages[stage].dp_index(rank))
        h.engine.tick(h.job, 1.0)
        h.engine.tick(h.job, 1.0)
        first, second = layout.stages[0].ranks[0], layout.stages[1].ranks[2]
        h.membership.mark_lost(h.job, f"w{first}", "gone", "process_exit", 2.0)
        h.engine.tick(h.job, 2.0)
        assert h.engine.tick(h.job, 2.0) == JobPhase.APPLYING
        h.membership.mark_lost(h.job, f"w{second}", "gone too", "stream_closed", 2.5)
        assert h.engine.tick(h.job, 2.5) == JobPhase.PLANNING
        assert h.engine.tick(h.job, 2.6) == JobPhase.APPLYING
        assert h.job.plan_epoch == 2
        final = Layout.from_json(json.loads(h.plans.latest("j")[1])["layout_json"])
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
        h.engine.tick(h.job, 1.0)
        h.engine.tick(h.job, 1.0)
        h.membership.mark_lost(h.job, f"w{layout.stages[1].ranks[0]}", "gone", "process_exit", 2.0)
        h.engine.tick(h.job, 2.0)
        assert h.engine.tick(h.job, 2.0) == JobPhase.APPLYING
        merged = Layout.from_json(json.loads(h.plans.latest("j")[1])["layout_json"])
        assert merged.num_stages == 1 and merged.stages[0].ranks == layout.stages[0].ranks
        assert (merged.stages[0].layer_start, merged.stages[0].layer_stop) == (0, 2)
        h.membership.mark_lost(h.job, f"w{layout.stages[0].ranks[0]}", "gone", "process_exit", 3.0)
        h.engine.tick(h.job, 3.0)
        assert h.engine.tick(h.job, 3.0) == JobPhase.RUNNING
        refusal = [e for e in h.job.events if e.kind == "decision_refuse"]
        assert refusal and "every stage would lose all of its ranks" in refusal[-1].detail
        assert h.job.plan_epoch == 1  # nothing more was published

    run(scenario())


@pytest.mark.timeout(30)
def test_job_without_layout_records_changes_and_never_publishes() -> None:
    h = Harness(None)

    async def scenario() -> None:
        await h.join("a", -1, -1, -1)
        h.membership.mark_lost(h.job, "a", "gone", "process_exit", 1.0)
        for t in range(5):
            h.engine.tick(h.job, 1.0 + t)
        assert h.job.phase == JobPhase.RUNNING and h.job.plan_epoch == 0
        assert h.plans.latest("j") is None

    run(scenario())
