"""Each decision a leader makes survives a takeover in the middle of it (issue 24, item 2).

Real Cores (servers, elections, persisters) in this process, each with its own connection to one
real etcd. The leader is stopped in the middle of a decision; the next Core takes over from what
etcd holds and finishes it. Every scenario runs twice, without and with the takeover(s), and the
outcome (the stored plans, their modes and retry counts, the decision that ends it) must be the
same: a new leader that forgot the decision would end elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest

from core_service.agent_session import Registration
from core_service.config import load_settings
from core_service.core import Core
from core_service.jobs import Job
from core_service.model import Ack, AckPhase, JobPhase, PlanFailure, StepReport
from core_service.recovery import MAX_IN_PLACE_RETRIES, MAX_RESTORE_FAILURES
from planners.layout import Layout, Plan, make_uniform_layout
from tests.conftest import _wipe_etcd
from tests.core.test_growth import FAULT_FREE

pytestmark = [pytest.mark.etcd, pytest.mark.multiproc]
SCHEDULER = "scheduler-token-0123456789"
LAYOUT = make_uniform_layout(num_layers=4, num_stages=2, dp=2, global_batch=8, num_micro_batches=2)


def core_settings(core_id: str, etcd_url: str, **knobs: Any) -> Any:
    # No heartbeat loss: the members registered in-process send no heartbeats. A long leader
    # TTL (and so loop-stall bound): these tests stop the leader on purpose, and it resigns at
    # once; with the 2 s default, a CI machine that starved a leader's keepalive thread or its
    # loop (these tests read etcd on it) for 2 s deposed it mid-scenario ("0 leaders").
    return load_settings(
        dev_mode=True,
        core_id=core_id,
        grpc_port=0,
        http_port=0,
        registry_url=etcd_url,
        scheduler_token=SCHEDULER,
        heartbeat_timeout_s=600.0,
        lease_ttl_s=600.0,
        leader_ttl_s=20.0,
        **knobs,
    )


async def eventually(predicate: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        await asyncio.sleep(0.02)
    return value


class Cluster:
    """Cores on one etcd, started at once; `take_over` stops the leader and waits for the next."""

    def __init__(self, cores: list[Core]) -> None:
        self.cores = cores
        self.stopped: list[Core] = []

    @property
    def leader(self) -> Core:
        leaders = [c for c in self.cores if c.is_leader and c not in self.stopped]
        assert len(leaders) == 1, f"{len(leaders)} leaders"
        return leaders[0]

    async def take_over(self) -> Core:
        old = self.leader
        await old.stop()  # stops leading in the middle of the decision; etcd keeps what it stored
        self.stopped.append(old)
        live = [c for c in self.cores if c not in self.stopped]
        await eventually(lambda: any(c.is_leader for c in live), 20, "a standby to take over")
        return self.leader

    def job(self, name: str) -> Job:
        return self.leader.table.get(name)


async def cluster(stack: AsyncExitStack, etcd_url: str, n: int, **knobs: Any) -> Cluster:
    cores = []
    for i in range(n):
        core = Core(core_settings(f"core-{i}", etcd_url, **knobs))
        await core.start()
        stack.push_async_callback(core.stop)
        if i == 0:
            assert await core.wait_leader(15)
        cores.append(core)
    return Cluster(cores)


async def create(core: Core, name: str, layout: Layout, **body: Any) -> None:
    request = {"name": name, "layout": json.loads(layout.to_json()), **body}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{core.http_port}", timeout=10) as client:
        answer = await client.post(
            "/api/v1/jobs", json=request, headers={"Authorization": f"Bearer {SCHEDULER}"}
        )
    assert answer.status_code == 201, answer.text


async def register(core: Core, job: str, worker: str, rank: int, layout: Layout | None) -> None:
    stage = layout.stage_of_rank(rank) if layout is not None and rank >= 0 else -1
    dp = layout.stages[stage].dp_index(rank) if stage >= 0 and layout is not None else -1
    reg = Registration(job, worker, "h", 100, [], stage, dp, rank, holds_own_lease=False)
    session = await core.membership.register(reg, time.time())
    if rank >= 0:  # a worker of the layout steps once: RUNNING, as it is when a plan comes
        core.membership.step(session, StepReport(0, 0.1, 0.1, None, 8, stage, dp, time.time()))


def stored_plans(core: Core, job: str) -> list[Plan]:
    plans = []
    for epoch in range(1, core.plans.current_epoch(job) + 1):
        raw = core.plans.get(job, epoch)
        assert raw is not None, f"plan {epoch} of {job} is missing"
        plans.append(Plan.from_json(raw))
    return plans


def published(job: Job) -> list[tuple[int, str, int, int]]:
    """(epoch, mode, in-place retries, restore failures) of every plan the job's log shows."""
    return [
        (e.data["epoch"], e.data["mode"], e.data["in_place_retries"], e.data["restore_failures"])
        for e in job.events
        if e.kind == "plan_published"
    ]


# ---- recovery counters and RESTORE stickiness ----------------------------------------------------
async def failing_applies(etcd_url: str, takeovers: frozenset[int]) -> dict[str, Any]:
    """A loss's plan whose apply fails on w0 again and again: in-place retries up to their bound,
    then RESTORE (sticky), restore failures up to theirs, then the engine refuses. The leader is
    stopped once each epoch in `takeovers` is published, before its failure is reported."""
    async with AsyncExitStack() as stack:
        cores = await cluster(stack, etcd_url, 1 + len(takeovers))
        await create(cores.leader, "train", LAYOUT)
        for rank in LAYOUT.ranks():
            await register(cores.leader, "train", f"w{rank}", rank, LAYOUT)
        job = cores.job("train")
        await eventually(lambda: "decision_none" in [e.kind for e in job.events], 15, "the joins planned")
        cores.leader.membership.mark_lost(job, "w3", "killed", "process_exit", time.time())
        epoch = 1
        while True:
            await eventually(
                lambda e=epoch: (
                    cores.job("train").plan_epoch == e and cores.job("train").phase == JobPhase.APPLYING
                ),
                15,
                f"epoch {epoch} to be applied",
            )
            if epoch in takeovers:
                await cores.leader.persister.wait_durable(10)
                await cores.take_over()
                await eventually(
                    lambda: cores.job("train").phase == JobPhase.APPLYING,
                    15,
                    "the new leader to watch the apply",
                )
            job, leader = cores.job("train"), cores.leader
            failed = Ack(AckPhase.FAILED, PlanFailure.INTERRUPTED, "a peer hung up")
            leader.engine.acknowledge(job, "w0", epoch, failed, 0.1, time.time())
            await eventually(
                lambda e=epoch: (
                    cores.job("train").plan_epoch > e
                    or "decision_refuse" in [x.kind for x in cores.job("train").events]
                ),
                15,
                f"the answer to the failure of epoch {epoch}",
            )
            if cores.job("train").plan_epoch == epoch:
                break
            epoch += 1
        await leader.persister.wait_durable(10)
        job = cores.job("train")
        refusals = [e.detail for e in job.events if e.kind == "decision_refuse"]
        return {
            "plans": [
                (p.epoch, p.mode.value, p.new.to_json(), p.reasons) for p in stored_plans(leader, "train")
            ],
            "published": published(job),
            "refusal": refusals[-1],
            "counters": (
                job.recovery.in_place_retries,
                job.recovery.restore_failures,
                job.recovery.gave_up_at,
            ),
            "record": leader.registry.get("/elaswave/jobs/train/recovery"),
        }


@pytest.mark.timeout(180)
def test_retry_bounds_and_restore_stickiness_continue_across_takeovers(etcd_registry_url: str) -> None:
    reference = asyncio.run(failing_applies(etcd_registry_url, frozenset()))
    modes = [mode for _, mode, _, _ in reference["published"]]
    restores = MAX_RESTORE_FAILURES  # RESTORE plans before the refusal: the first, then one per failure
    assert modes == ["in_place"] * (1 + MAX_IN_PLACE_RETRIES) + ["restore"] * restores, modes
    assert "failed 3 times" in reference["refusal"]

    _wipe_etcd(etcd_registry_url)  # the same etcd, emptied for the second run
    # Stopped once during the in-place retries (epoch 3) and once on a sticky RESTORE (epoch 6).
    taken_over = asyncio.run(failing_applies(etcd_registry_url, frozenset({3, 6})))
    assert taken_over["published"] == reference["published"]
    assert taken_over["plans"] == reference["plans"]
    assert taken_over["refusal"] == reference["refusal"]
    assert taken_over["counters"] == reference["counters"]
    assert taken_over["record"] == reference["record"]


# ---- a ready spare -------------------------------------------------------------------------------
async def spare_ready_while_applying(etcd_url: str, takeover: bool) -> tuple[Plan, str]:
    """A loss's plan is being applied when a spare becomes ready: it is taken in once the apply
    finished. With `takeover`, the leader is stopped in between (the change was in its memory)."""
    async with AsyncExitStack() as stack:
        cores = await cluster(stack, etcd_url, 2 if takeover else 1)
        await create(cores.leader, "g", FAULT_FREE, expected_workers=4, spare_workers=1, max_workers=4)
        for rank in FAULT_FREE.ranks():
            await register(cores.leader, "g", f"w{rank}", rank, FAULT_FREE)
        job = cores.job("g")
        await eventually(lambda: "decision_none" in [e.kind for e in job.events], 15, "the joins planned")
        cores.leader.membership.mark_lost(job, "w3", "killed", "process_exit", time.time())
        await eventually(lambda: job.plan_epoch == 1 and job.phase == JobPhase.APPLYING, 15, "epoch 1")
        await register(cores.leader, "g", "s0", -1, None)
        assert cores.leader.membership.mark_spare_ready(job, "s0", time.time())
        await cores.leader.persister.wait_durable(10)
        assert job.phase == JobPhase.APPLYING and job.plan_epoch == 1  # deferred until applied
        if takeover:
            await cores.take_over()
            await eventually(lambda: cores.job("g").phase == JobPhase.APPLYING, 15, "the apply watched again")
        job, leader = cores.job("g"), cores.leader
        for worker in ("w0", "w1", "w2"):
            leader.engine.acknowledge(job, worker, 1, Ack(AckPhase.RESUMED), 0.1, time.time())
        await eventually(lambda: job.plan_epoch == 2, 15, "the plan that takes the spare in")
        plan = stored_plans(leader, "g")[1]
        return plan, job.member("s0").state.value


@pytest.mark.timeout(120)
def test_a_spare_ready_before_a_takeover_is_taken_in_by_the_new_leader(etcd_registry_url: str) -> None:
    reference, state = asyncio.run(spare_ready_while_applying(etcd_registry_url, takeover=False))
    assert reference.joiners and reference.joiners[0][1] == "s0" and state == "JOINING"

    _wipe_etcd(etcd_registry_url)  # the same etcd, emptied for the second run
    plan, state = asyncio.run(spare_ready_while_applying(etcd_registry_url, takeover=True))
    assert (plan.joiners, plan.new, plan.old, plan.mode) == (
        reference.joiners,
        reference.new,
        reference.old,
        reference.mode,
    )
    assert state == "JOINING"


# ---- the end of a RESTORE's stickiness, once its commit left the event log -----------------------
async def restore_committed_then_log_rolls_over(etcd_url: str, takeover: bool) -> Plan:
    """A RESTORE plan commits a step (its stickiness ends); then the job writes more events than
    its log keeps (periodic checkpoints), so the commit event is pruned; then a worker is lost.
    With `takeover`, the leader is stopped before that loss."""
    async with AsyncExitStack() as stack:
        cores = await cluster(stack, etcd_url, 2 if takeover else 1, events_kept=100)
        await create(cores.leader, "train", LAYOUT)
        for rank in LAYOUT.ranks():
            await register(cores.leader, "train", f"w{rank}", rank, LAYOUT)
        job, leader = cores.job("train"), cores.leader
        await eventually(lambda: "decision_none" in [e.kind for e in job.events], 15, "the joins planned")
        leader.membership.mark_lost(job, "w3", "killed", "process_exit", time.time())
        await eventually(lambda: job.plan_epoch == 1 and job.phase == JobPhase.APPLYING, 15, "epoch 1")
        refused = Ack(AckPhase.FAILED, PlanFailure.NOT_APPLICABLE, "cannot reach it in place")
        leader.engine.acknowledge(job, "w0", 1, refused, 0.1, time.time())
        await eventually(lambda: job.plan_epoch == 2 and job.phase == JobPhase.APPLYING, 15, "the RESTORE")
        assert job.last_plan is not None and job.last_plan.mode.value == "restore"
        for worker in ("w0", "w1", "w2"):
            leader.engine.acknowledge(job, worker, 2, Ack(AckPhase.RESUMED), 0.1, time.time())
        await eventually(lambda: job.phase == JobPhase.RUNNING and job.committed_epoch == 2, 15, "the commit")
        for step in range(120):  # a checkpoint per step: the log keeps the newest 100 events
            leader.membership.checkpoint_written(job, "w0", f"/ckpt/step-{step:04d}", time.time())
        assert all(e.kind != "layout_committed" for e in job.events)
        await leader.persister.wait_durable(10)
        if takeover:
            await cores.take_over()
        job, leader = cores.job("train"), cores.leader
        leader.membership.mark_lost(job, "w2", "killed", "process_exit", time.time())
        await eventually(lambda: job.plan_epoch == 3, 15, "the plan of the second loss")
        return stored_plans(leader, "train")[2]


@pytest.mark.timeout(120)
def test_a_restore_that_committed_stays_committed_after_its_events_are_pruned_and_a_takeover(
    etcd_registry_url: str,
) -> None:
    reference = asyncio.run(restore_committed_then_log_rolls_over(etcd_registry_url, takeover=False))
    assert reference.mode.value == "in_place"  # planned from the RESTORE's committed layout
    _wipe_etcd(etcd_registry_url)  # the same etcd, emptied for the second run
    plan = asyncio.run(restore_committed_then_log_rolls_over(etcd_registry_url, takeover=True))
    assert (plan.mode, plan.old, plan.new, plan.reasons) == (
        reference.mode,
        reference.old,
        reference.new,
        reference.reasons,
    )
