"""What survives a leader change, and what the leader loop survives.

In-process Cores (real Core objects, servers and elections; several Cores share one registry) for
the leader loop's failure handling and the durability of API answers; real Core processes on a
real etcd, SIGKILLed, for the state a standby serves after a crash.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from core_service.agent_session import Registration
from core_service.config import CoreSettings, load_settings
from core_service.core import Core
from core_service.job_snapshot import Policy
from core_service.jobs import Job
from core_service.model import JobPhase
from core_service.registry import MemoryRegistry, PlanStore, Registry
from planners.layout import Layout, Plan, make_uniform_layout
from tests.core.procs import CoreProcess, create_job, new_token, wait_until
from tests.core.test_engine import FailingFor
from tests.core.test_plan_flow import RawAgent
from tests.etcd_server import EtcdServer
from wire.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    executor_pb2,
    executor_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

SCHEDULER_TOKEN = "scheduler-token-0123456789"
ADMIN = {"Authorization": f"Bearer {SCHEDULER_TOKEN}"}
LAYOUT = make_uniform_layout(num_layers=4, num_stages=2, dp=2, global_batch=8, num_micro_batches=2)


# ---- in-process Cores ----------------------------------------------------------------------------
def settings(core_id: str) -> CoreSettings:
    # No heartbeat loss during these tests: members registered in-process send no heartbeats.
    return load_settings(
        dev_mode=True,
        core_id=core_id,
        grpc_port=0,
        http_port=0,
        registry_url="memory://",
        scheduler_token=SCHEDULER_TOKEN,
        heartbeat_timeout_s=600.0,
        lease_ttl_s=600.0,
    )


@asynccontextmanager
async def running(
    core_id: str, registry: Registry | None = None, policy: Policy | None = None, **knobs: float
) -> AsyncIterator[Core]:
    core = Core(settings(core_id), policy=policy, registry=registry)
    for name, value in knobs.items():
        setattr(core, name, value)
    await core.start()
    try:
        yield core
    finally:
        await core.stop()


async def eventually(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)
    return value


async def create_job_rest(core: Core, name: str, layout: Layout | None = None) -> httpx.Response:
    body: dict[str, Any] = {"name": name}
    if layout is not None:
        body["layout"] = json.loads(layout.to_json())
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{core.http_port}", timeout=10) as client:
        return await client.post("/api/v1/jobs", json=body, headers=ADMIN)


async def join_all(core: Core, job: str, layout: Layout) -> None:
    for rank in layout.ranks():
        stage = layout.stage_of_rank(rank)
        reg = Registration(
            job=job,
            worker_id=f"w{rank}",
            host="h",
            pid=100 + rank,
            devices=[],
            stage=stage,
            dp_rank=layout.stages[stage].dp_index(rank),
            rank=rank,
            holds_own_lease=False,
        )
        await core.membership.register(reg, time.time())


def stored_layout(registry: Registry, job: str, epoch: int) -> Layout:
    body = PlanStore(registry, "/elaswave").get(job, epoch)
    assert body is not None, f"job {job} has no stored plan {epoch}"
    return Plan.from_json(body).new


def kinds(job: Job) -> list[str]:
    return [e.kind for e in job.events]


@pytest.mark.timeout(60)
def test_leader_loop_keeps_ticking_other_jobs_while_one_jobs_planner_raises() -> None:
    async def scenario() -> None:
        async with running("a", policy=FailingFor({"bad"})) as core:
            assert await core.wait_leader(10)
            for name in ("bad", "good"):
                assert (await create_job_rest(core, name, LAYOUT)).status_code == 201
                await join_all(core, name, LAYOUT)
            bad, good = core.table.get("bad"), core.table.get("good")
            await eventually(
                lambda: good.phase == JobPhase.RUNNING and "decision_none" in kinds(good),
                10,
                "good to plan its joins",
            )
            for rank in (3, 1):  # two losses, planned one after the other while "bad" keeps failing
                for job in (bad, good):
                    core.membership.mark_lost(job, f"w{rank}", "killed", "process_exit", time.time())
                epoch = good.plan_epoch + 1

                def published(e: int = epoch) -> bool:
                    return good.plan_epoch == e

                await eventually(published, 10, f"good to publish epoch {epoch}")
            await eventually(lambda: kinds(bad).count("planner_failed") >= 3, 10, "bad to be retried")
            assert core.is_leader and all(not t.done() for t in core._leader_tasks)
            assert bad.phase == JobPhase.PLANNING and bad.plan_epoch == 0
            assert {e.worker_id for e in bad.pending_changes if e.kind == "worker_lost"} == {"w1", "w3"}
            assert sorted(stored_layout(core.registry, "good", 2).ranks()) == [0, 2]

    # Bounded inside the loop: a stall fails with the await it stalled on (a CI run once hit the
    # 60 s test timeout here with nothing but idle threads in the dump).
    asyncio.run(asyncio.wait_for(scenario(), 45))


@pytest.mark.timeout(60)
def test_plans_that_cannot_be_stored_make_the_leader_step_down_and_the_standby_replans() -> None:
    registry = MemoryRegistry()

    async def scenario() -> None:
        async with (
            running("a", registry, max_consecutive_failures=5, step_down_hold_off_s=60.0) as a,
            running("b", registry) as b,
        ):
            assert await a.wait_leader(10) and not b.is_leader
            assert (await create_job_rest(a, "train", LAYOUT)).status_code == 201
            await join_all(a, "train", LAYOUT)
            job = a.table.get("train")
            await eventually(lambda: "decision_none" in kinds(job), 10, "the joins to be planned")
            # Another publisher (a Core that still believes it leads) stores epoch 1: every plan of
            # "a" is now fenced off (StaleEpoch), tick after tick.
            split_brain = Plan(
                epoch=1,
                old=LAYOUT,
                new=LAYOUT,
                reasons=("split brain",),
                predicted_step_time_s=0.0,
                job="train",
                policy="other",
                created_unix=time.time(),
            )
            PlanStore(registry, "/elaswave").publish(
                "train", split_brain.to_json().encode(), expected_epoch=0
            )
            a.membership.mark_lost(job, "w3", "killed", "process_exit", time.time())

            await eventually(lambda: b.is_leader, 15, "the standby to take over")
            assert not a.is_leader and not a.persister.enabled and not a._leader_tasks
            leader_is_b = f"not leader; leader is 127.0.0.1:{b.grpc_port}"
            await eventually(lambda: a.not_leader_message() == leader_is_b, 5, "a to know who leads")
            # The standby planned the loss that "a" never could, from the newest stored plan.
            restored = b.table.get("train")
            await eventually(lambda: restored.plan_epoch == 2, 10, "the new leader to publish epoch 2")
            replans = [e for e in restored.events if e.kind == "replan_after_takeover"]
            assert [e.worker_id for e in replans] == ["w3"]
            assert sorted(stored_layout(registry, "train", 2).ranks()) == [0, 1, 2]
            assert restored.layout_json is not None
            assert Layout.from_json(restored.layout_json) == stored_layout(registry, "train", 2)
            await asyncio.sleep(0.5)
            assert not a.is_leader  # holding off: no flapping back

    asyncio.run(scenario())
    registry.close()


@pytest.mark.timeout(60)
def test_mutating_calls_answer_unavailable_when_their_writes_cannot_be_stored() -> None:
    registry = MemoryRegistry()

    async def scenario() -> None:
        async with running("a", registry, durable_wait_s=0.5, stop_flush_s=0.5) as core:
            assert await core.wait_leader(10)
            assert (await create_job_rest(core, "train")).status_code == 201
            assert registry.get("/elaswave/jobs/train/spec") is not None  # stored before the 201
            await join_all(core, "train", LAYOUT)
            registry.close()  # the backend is gone: every write now fails and is retried

            started = time.monotonic()
            late = await create_job_rest(core, "late")
            assert late.status_code == 503, late.text
            assert "not stored" in late.json()["detail"] and "closed" in late.json()["detail"]
            assert time.monotonic() - started < 5.0  # bounded by durable_wait_s, not hung
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{core.http_port}", timeout=10) as client:
                preempt = await client.post(
                    "/api/v1/jobs/train/preempt",
                    headers=ADMIN,
                    json={"worker_ids": ["w1"], "deadline_unix": time.time() + 60},
                )
            assert preempt.status_code == 503 and "not stored" in preempt.json()["detail"]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{core.grpc_port}") as channel:
                stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.SignalPreemption(
                        scheduler_pb2.SignalPreemptionRequest(
                            job="train", worker_ids=["w2"], deadline_unix=time.time() + 60
                        ),
                        metadata=[("authorization", f"Bearer {SCHEDULER_TOKEN}")],
                        timeout=10,
                    )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "not stored" in err.value.details()

    asyncio.run(scenario())


# ---- real processes on a real etcd ---------------------------------------------------------------
@pytest.fixture
def pair(tmp_path: Path, etcd_registry_url: str) -> Iterator[dict[str, Any]]:
    token = new_token()
    leader = CoreProcess(tmp_path, "core-a", etcd_registry_url, token)
    leader.wait_leader()
    standby = CoreProcess(tmp_path, "core-b", etcd_registry_url, token)
    state: dict[str, Any] = {
        "token": token,
        "tmp": tmp_path,
        "etcd": etcd_registry_url,
        "cores": [leader, standby],
        "agents": [],
    }
    yield state
    for agent in state["agents"]:
        agent.close()
    for core in state["cores"]:
        core.stop()


def events(core: CoreProcess, job: str) -> list[dict[str, Any]]:
    return core.http.get(f"/api/v1/jobs/{job}/events", params={"limit": 10_000}).json()["events"]


@pytest.mark.etcd
@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_standby_serves_the_published_layout_and_epoch_after_the_leader_is_killed(pair: dict) -> None:
    leader, standby = pair["cores"]
    job_token = create_job(leader, pair["token"], "train", layout=json.loads(LAYOUT.to_json()))
    agents = {}
    for rank in LAYOUT.ranks():
        stage = LAYOUT.stage_of_rank(rank)
        dp = LAYOUT.stages[stage].dp_index(rank)
        agents[rank] = RawAgent(leader.grpc_address, job_token, f"w{rank}", rank, stage, dp)
        pair["agents"].append(agents[rank])
        agents[rank].step(0, stage, dp)
    wait_until(lambda: leader.job("train")["members_by_state"] == {"RUNNING": 4}, 15, "four running workers")
    wait_until(lambda: leader.job("train")["phase"] == "RUNNING", 10, "the engine to settle")

    agents[3].vanish()
    wait_until(lambda: leader.job("train")["plan_epoch"] == 1, 10, "the leader to publish epoch 1")
    published = leader.job("train")["layout"]
    assert sorted(Layout.from_json(json.dumps(published)).ranks()) == [0, 1, 2]
    leader.kill()
    standby.wait_leader(timeout_s=15)

    after = standby.job("train")
    assert after["plan_epoch"] == 1
    assert after["layout"] == published != json.loads(LAYOUT.to_json())
    assert after["phase"] == "APPLYING"  # the apply the dead leader was watching goes on
    with grpc.insecure_channel(standby.grpc_address) as channel:
        auth = [("authorization", f"Bearer {job_token}")]
        executor = executor_pb2_grpc.ExecutorServiceStub(channel)
        plans = executor.SubscribePlans(
            executor_pb2.SubscribePlansRequest(job="train", worker_id="w0"), metadata=auth, timeout=10
        )
        plan = next(plans).plan
        plans.cancel()
        assert plan.epoch == 1 and json.loads(plan.layout_json) == published
        # The survivors resume epoch 1 through the new leader, which completes the apply.
        for rank in (0, 1, 2):
            executor.AckPlanPhase(
                executor_pb2.AckPlanPhaseRequest(
                    job="train",
                    worker_id=f"w{rank}",
                    epoch=1,
                    phase=executor_pb2.PLAN_PHASE_RESUMED,
                    phase_time_s=0.01,
                ),
                # Each worker's own credential: the new leader knows it from the registry.
                metadata=agents[rank].auth,
                timeout=5,
            )
    wait_until(lambda: standby.job("train")["phase"] == "RUNNING", 10, "the apply to complete")
    assert standby.job("train")["plan_epoch"] == 1


@pytest.mark.etcd
@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_acknowledged_changes_survive_a_leader_killed_right_after_answering(
    pair: dict, etcd_server: EtcdServer
) -> None:
    core_a, core_b = pair["cores"]
    job_token = create_job(core_a, pair["token"], "train")
    for rank in (0, 1):
        pair["agents"].append(RawAgent(core_a.grpc_address, job_token, f"w{rank}", rank, 0, rank))
    wait_until(lambda: len(core_a.job("train")["members"]) == 2, 10, "two registered workers")
    answer = core_a.http.post(
        "/api/v1/jobs/train/preempt",
        headers={"Authorization": f"Bearer {pair['token']}"},
        json={"worker_ids": ["w1"], "deadline_unix": time.time() + 600, "reason": "spot"},
    )
    assert answer.status_code == 202, answer.text
    core_a.kill()  # at once: whatever was acknowledged must already be in etcd
    core_b.wait_leader(timeout_s=15)
    assert core_b.states("train")["w1"] == "PREEMPTING"
    preempted = [e for e in events(core_b, "train") if e["seq"] == answer.json()["event_seq"]]
    assert [(e["kind"], e["worker_id"]) for e in preempted] == [("worker_preempting", "w1")]

    # While etcd does not answer, a job creation cannot be stored, so it is not acknowledged; the
    # leader then dies before etcd comes back: the client must not hold a 201 for a lost job.
    core_c = CoreProcess(pair["tmp"], "core-c", pair["etcd"], pair["token"])
    pair["cores"].append(core_c)
    result: dict[str, Any] = {}

    def create_late() -> None:
        try:
            result["status"] = create_job_status(core_b, pair["token"], "late")
        except httpx.HTTPError as exc:
            result["error"] = exc

    etcd_server.pause()
    try:
        sender = threading.Thread(target=create_late)
        sender.start()
        sender.join(timeout=1.0)
        assert sender.is_alive(), f"answered {result} while etcd was paused"
        core_b.kill()
    finally:
        etcd_server.resume()
    sender.join(timeout=10)
    assert "error" in result and "status" not in result
    core_c.wait_leader(timeout_s=15)
    # Unacknowledged is not the same as not applied: a write already in the paused etcd's socket
    # passes its leader fence (the dead leader's lease outlives it by up to the TTL) and lands on
    # resume. Either outcome is consistent; what must never happen is a 201 for a lost job.
    late = core_c.http.get("/api/v1/jobs/late")
    assert late.status_code in (200, 404), late.text
    if late.status_code == 200:
        assert late.json()["name"] == "late"
    assert core_c.states("train")["w1"] == "PREEMPTING"


def create_job_status(core: CoreProcess, token: str, name: str) -> int:
    response = core.http.post(
        "/api/v1/jobs", json={"name": name}, headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    return response.status_code


@pytest.mark.timeout(60)
def test_a_core_that_stops_does_not_record_the_streams_it_closes_as_losses() -> None:
    # Stopping (or stepping down) closes every agent stream from this side; stored as "stream
    # closed without leave", those closes would make the next leader plan healthy workers out.
    async def scenario() -> None:
        registry = MemoryRegistry()
        release = asyncio.Event()

        async def reports(worker: int) -> AsyncIterator[agent_pb2.ConnectRequest]:
            yield agent_pb2.ConnectRequest(
                register=agent_pb2.Register(
                    job="train",
                    worker_id=f"w{worker}",
                    host="h",
                    pid=100 + worker,
                    rank=worker,
                    heartbeat_interval_ms=200,
                )
            )
            await release.wait()

        async with running("a", registry=registry) as core:
            await eventually(lambda: core.is_leader, 10, "core a to lead")
            created = await create_job_rest(core, "train")
            assert created.status_code == 201, created.text
            token = created.json()["token"]
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{core.grpc_port}")
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            calls = [
                stub.Connect(reports(w), metadata=[("authorization", f"Bearer {token}")]) for w in (0, 1)
            ]
            for call in calls:
                assert (await call.read()).WhichOneof("body") == "ack"
            await eventually(lambda: len(core.table.get("train").members) == 2, 5, "two members")
            await core.persister.wait_durable(5.0)
        release.set()
        await channel.close()
        stored_events = [
            json.loads(v)["kind"] for _k, v in registry.get_prefix("/elaswave/jobs/train/events/")
        ]
        stored_states = {
            json.loads(v)["worker_id"]: json.loads(v)["state"]
            for _k, v in registry.get_prefix("/elaswave/jobs/train/members/")
        }
        assert "worker_lost" not in stored_events, stored_events
        assert stored_states == {"w0": "JOINING", "w1": "JOINING"}, stored_states
        registry.close()

    asyncio.run(scenario())
