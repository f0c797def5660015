"""Leases across leadership changes, on in-process Cores.

A leader whose lease lapsed refuses requests, and its leader loop stops acting, even before it
learns that it lost the lease. And a liveness lease that a previous leader held for an agent
expiring is no loss: only a lease the leading Core holds (or the agent's own) speaks for a worker.

The election's keepalive thread can sit in a registry call for the call's deadline (etcd: 5 s),
longer than the leader TTL, so the Core's `is_leader` flag can lag the lease. Here that call is
held for as long as the test wants: an in-process Core on a registry whose `refresh_lease`
blocks on demand, so the window is entered and left deterministically.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import grpc
import httpx
import pytest

from core_service.agent_session import Registration
from core_service.config import CoreSettings, load_settings
from core_service.core import Core
from core_service.persist import NotDurable
from core_service.registry import (
    Fence,
    FenceLost,
    MemoryRegistry,
    PlanStore,
    Registry,
    TxnResult,
    TxnWrite,
    WatchHandle,
    holder_of,
)
from core_service.registry.base import KVEvent
from wire.v1 import scheduler_pb2, scheduler_pb2_grpc

SCHEDULER_TOKEN = "scheduler-token-0123456789"
ADMIN = {"Authorization": f"Bearer {SCHEDULER_TOKEN}"}
# Long enough that the keepalive (every TTL/3) keeps the lease through the set-up on a loaded CI
# machine: at 1 s, a keepalive thread starved for 0.7 s while the first request was served lost
# the lease before the test reached its window. The window itself waits out the TTL, whatever it is.
LEADER_TTL_S = 3.0
HEARTBEAT_TIMEOUT_S = 0.5
SILENT_WORKER = Registration(
    job="train", worker_id="w0", host="h", pid=1, devices=[], stage=0, dp_rank=0, rank=0, holds_own_lease=True
)


class StallingRegistry(Registry):
    """A MemoryRegistry whose `refresh_lease` blocks while `stalled` is set, like an etcd call
    waiting for its deadline, and whose transactions (every fenced write) block while
    `writes_held` is set, like writes in flight through a partition. Not a MemoryRegistry itself,
    so the Core keeps its short leader TTL."""

    def __init__(self) -> None:
        self.inner = MemoryRegistry()
        self.stalled = threading.Event()
        self.released = threading.Event()
        self.stalled_calls = 0
        self.writes_held = threading.Event()
        self.writes_released = threading.Event()
        self.held_writes = 0

    def refresh_lease(self, lease_id: int) -> None:
        if self.stalled.is_set():
            self.stalled_calls += 1
            self.released.wait(30)
        self.inner.refresh_lease(lease_id)

    def grant_lease(self, ttl_s: float) -> int:
        return self.inner.grant_lease(ttl_s)

    def revoke_lease(self, lease_id: int) -> None:
        self.inner.revoke_lease(lease_id)

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        self._hold_write()
        return self.inner.put(key, value, lease)

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def get_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        return self.inner.get_prefix(prefix)

    def delete(self, key: str) -> bool:
        self._hold_write()
        return self.inner.delete(key)

    def delete_prefix(self, prefix: str) -> int:
        return self.inner.delete_prefix(prefix)

    def create(self, key: str, value: bytes, lease: int | None = None) -> bool:
        return self.inner.create(key, value, lease)

    def compare_and_swap(
        self,
        key: str,
        expected: bytes | None,
        value: bytes,
        lease: int | None = None,
        also: Sequence[tuple[str, bytes]] = (),
        fence: Fence | None = None,
    ) -> bool:
        return self.inner.compare_and_swap(key, expected, value, lease, also, fence)

    def transact(self, compares: Sequence[tuple[str, bytes | None]], writes: Sequence[TxnWrite]) -> TxnResult:
        self._hold_write()
        return self.inner.transact(compares, writes)

    def _hold_write(self) -> None:
        if self.writes_held.is_set():
            self.held_writes += 1
            self.writes_released.wait(30)

    def watch_prefix(self, prefix: str, callback: Callable[[KVEvent], None]) -> WatchHandle:
        return self.inner.watch_prefix(prefix, callback)

    def close(self) -> None:
        self.inner.close()


async def eventually(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


async def scheduler_call(core: Core) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{core.grpc_port}") as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        try:
            await stub.GetJobState(
                scheduler_pb2.GetJobStateRequest(job="train"),
                metadata=[("authorization", f"Bearer {SCHEDULER_TOKEN}")],
                timeout=5,
            )
        except grpc.aio.AioRpcError as err:
            return err.code()
        return grpc.StatusCode.OK


@pytest.mark.timeout(60)
def test_leader_with_a_lapsed_lease_refuses_requests_before_its_keepalive_reports_back() -> None:
    registry = StallingRegistry()
    settings = load_settings(
        dev_mode=True,
        core_id="a",
        grpc_port=0,
        http_port=0,
        registry_url="memory://",
        scheduler_token=SCHEDULER_TOKEN,
        leader_ttl_s=LEADER_TTL_S,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
    )

    async def scenario() -> None:
        core = Core(settings, registry=registry)
        await core.start()
        try:
            assert await core.wait_leader(10)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{core.http_port}", timeout=5) as http:
                created = await http.post("/api/v1/jobs", json={"name": "train"}, headers=ADMIN)
                assert created.status_code == 201, created.text
                assert await scheduler_call(core) == grpc.StatusCode.OK

                # The keepalive's next refresh hangs; the lease runs out behind it.
                registry.stalled.set()
                await eventually(lambda: registry.stalled_calls > 0, 5, "the keepalive to stall")
                # The last refresh that went through was sent before the stalled one, so the lease
                # is past its TTL by the time this sleep ends.
                await asyncio.sleep(LEADER_TTL_S + 0.1)
                assert core.is_leader  # the window: nobody has told the Core yet
                assert not core.leads
                assert await scheduler_call(core) == grpc.StatusCode.UNAVAILABLE
                refused = await http.post("/api/v1/jobs", json={"name": "other"}, headers=ADMIN)
                assert refused.status_code == 503 and refused.json()["detail"].startswith("not leader")
                assert (await http.get("/api/v1/jobs/train")).status_code == 503
                assert (await http.get("/healthz")).json()["role"] == "standby"
                assert "other" not in core.table.jobs
                # Nor does its leader loop act: a worker silent past the heartbeat timeout is left
                # to the successor (registered in-process, as no agent can connect now).
                await core.membership.register(SILENT_WORKER, time.time())
                await asyncio.sleep(HEARTBEAT_TIMEOUT_S + 0.3)
                assert core.table.get("train").members["w0"].state.value == "JOINING"

                # The stalled refresh returns and finds its lease gone: the Core steps down for good.
                registry.released.set()
                await eventually(lambda: not core.is_leader or core.leads, 5, "the keepalive to report back")
        finally:
            registry.released.set()
            await core.stop()
            registry.close()

    asyncio.run(scenario())


def quiet_settings(core_id: str) -> CoreSettings:
    # Heartbeats and Core-held leases outlast the test: only the deletions it makes count.
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


@pytest.mark.timeout(60)
def test_a_core_held_lease_lapsing_is_no_news_about_the_worker() -> None:
    registry = MemoryRegistry()
    worker = replace(SILENT_WORKER, holds_own_lease=False)
    alive_key = "/elaswave/jobs/train/alive/w0"

    async def scenario() -> None:
        old = Core(quiet_settings("old"), registry=registry)
        await old.start()
        assert await old.wait_leader(10)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{old.http_port}", timeout=5) as http:
            assert (await http.post("/api/v1/jobs", json={"name": "train"}, headers=ADMIN)).status_code == 201
        first = await old.membership.register(worker, time.time())
        old_lease, credential = first.lease_id, first.worker_token
        assert old_lease is not None and registry.get(alive_key) is not None
        await old.stop()  # its lease for w0 lives on, as a crashed leader's would until its TTL

        new = Core(quiet_settings("new"), registry=registry)
        await new.start()
        try:
            assert await new.wait_leader(10)
            job = new.table.get("train")
            # The old leader's lease ends before w0 reconnects: no news about w0.
            registry.revoke_lease(old_lease)
            await asyncio.sleep(0.3)
            assert job.members["w0"].state.value == "JOINING"
            # w0 reconnects (with its own credential: it is a live member, and nobody else may
            # register as it). The lease this Core now holds for it ends while its stream is
            # open: only this Core could have let it lapse, so it is granted again, no loss.
            session = await new.membership.register(worker, time.time(), credential)
            new_lease = session.lease_id
            assert new_lease is not None and new_lease != old_lease
            registry.revoke_lease(new_lease)
            await eventually(
                lambda: session.lease_id not in (None, new_lease) and registry.get(alive_key) is not None,
                5,
                "a new lease for w0",
            )
            assert job.members["w0"].state.value == "JOINING"
            assert new.metrics.lease_regrants._value.get() == 1
        finally:
            await new.stop()
            registry.close()

    asyncio.run(scenario())


# ---- fenced writes: a deposed leader's writes never land -------------------------------------------
LEADER_KEY = "/elaswave/core/leader"


# The fenced-write scenario only needs its leader's lease to run out once the test stalls the
# keepalive (the successor then waits it out). 1 s lapsed by itself on a loaded CI machine, where
# this in-process Core shares its loop with the test: the first request after it led got a 503.
FENCED_LEADER_TTL_S = 3.0


def fenced_settings(core_id: str) -> CoreSettings:
    # Heartbeats and Core-held leases outlast the test.
    return load_settings(
        dev_mode=True,
        core_id=core_id,
        grpc_port=0,
        http_port=0,
        registry_url="memory://",
        scheduler_token=SCHEDULER_TOKEN,
        leader_ttl_s=FENCED_LEADER_TTL_S,
        heartbeat_timeout_s=600.0,
        lease_ttl_s=600.0,
    )


def stored_event_kinds(registry: Registry, job: str) -> list[str]:
    return [json.loads(raw)["kind"] for _, raw in registry.get_prefix(f"/elaswave/jobs/{job}/events/")]


@pytest.mark.timeout(60)
def test_writes_a_deposed_leader_had_in_flight_never_land_and_it_steps_down() -> None:
    registry = StallingRegistry()
    job_dir = "/elaswave/jobs/train/"

    async def scenario() -> None:
        a = Core(fenced_settings("a"), registry=registry)
        b: Core | None = None
        await a.start()
        try:
            assert await a.wait_leader(10)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{a.http_port}", timeout=5) as http:
                assert (
                    await http.post("/api/v1/jobs", json={"name": "train"}, headers=ADMIN)
                ).status_code == 201
            await a.membership.register(SILENT_WORKER, time.time())
            await a.persister.flush()
            job = a.table.get("train")

            # A partition: a's keepalive hangs (so a is never told it lost) and its writes stay in flight.
            registry.stalled.set()
            registry.writes_held.set()
            await eventually(lambda: registry.stalled_calls > 0, 5, "the keepalive to stall")
            a.table.record(
                job, "split_brain_probe", detail="queued by a leader about to be deposed", now=time.time()
            )
            a.membership.mark_lost(job, "w0", "killed", "process_exit", time.time())
            await eventually(lambda: registry.held_writes > 0, 5, "a's first write to be in flight")
            acknowledged = asyncio.ensure_future(a.persister.wait_durable(30))

            # a's lease runs out behind the stalled refresh; b takes the leader key and writes its records.
            b = Core(fenced_settings("b"), registry=registry.inner)
            await b.start()
            assert await b.wait_leader(10)
            await b.persister.flush()
            successor_view = registry.inner.get_prefix(job_dir)
            assert a.is_leader, "nothing has told a yet: only the fence stands between it and b's records"

            registry.writes_released.set()  # a's writes reach the registry, late
            await eventually(lambda: not a.is_leader, 10, "a to step down")
            assert not registry.released.is_set(), "a's keepalive is still stuck: the fence deposed it"
            with pytest.raises(NotDurable, match="leadership lost.*refused"):
                await acknowledged
            assert not a.persister.enabled and a.persister.backlog == 0
            a.table.record(job, "after_step_down", now=time.time())  # a standby writes nothing
            await asyncio.sleep(0.3)
            assert registry.inner.get_prefix(job_dir) == successor_view
            assert "split_brain_probe" not in stored_event_kinds(registry.inner, "train")
            assert b.is_leader and b.table.get("train").members["w0"].state.value == "JOINING"
            assert holder_of(registry.inner.get(LEADER_KEY) or b"") == b.identity
        finally:
            registry.released.set()
            registry.writes_released.set()
            if b is not None:
                await b.stop()
            await a.stop()
            registry.close()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_leader_whose_key_was_deleted_stores_nothing_more_and_starts_a_new_term() -> None:
    # An in-memory registry: the Core's leader lease is an hour long, so only the fence can notice.
    registry = MemoryRegistry()

    async def scenario() -> None:
        core = Core(quiet_settings("a"), registry=registry)
        await core.start()
        try:
            assert await core.wait_leader(10)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{core.http_port}", timeout=5) as http:
                assert (
                    await http.post("/api/v1/jobs", json={"name": "train"}, headers=ADMIN)
                ).status_code == 201
            assert core.persister.terms_started == 1

            registry.delete(LEADER_KEY)  # the leader key is gone while this Core goes on writing
            core.table.record(core.table.get("train"), "written_without_the_key", now=time.time())
            # The write is refused, the term ends; nobody leads, so this Core wins a fresh term.
            await eventually(lambda: core.persister.terms_started == 2 and core.is_leader, 10, "a new term")
            await eventually(
                lambda: "core_leader" in stored_event_kinds(registry, "train"),
                5,
                "the new term to record its start",
            )
            assert stored_event_kinds(registry, "train") == ["job_created", "core_leader"]
            assert "written_without_the_key" not in [e.kind for e in core.table.get("train").events]
            assert holder_of(registry.get(LEADER_KEY) or b"") == core.identity  # same Core, a new term
        finally:
            await core.stop()
            registry.close()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_plans_and_liveness_keys_are_fenced_too_and_a_refusal_ends_the_term() -> None:
    registry = MemoryRegistry()
    worker = replace(SILENT_WORKER, holds_own_lease=False)  # the Core writes its liveness key

    async def scenario() -> None:
        core = Core(quiet_settings("a"), registry=registry)
        await core.start()
        try:
            assert await core.wait_leader(10)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{core.http_port}", timeout=5) as http:
                assert (
                    await http.post("/api/v1/jobs", json={"name": "train"}, headers=ADMIN)
                ).status_code == 201

            registry.delete(LEADER_KEY)
            with pytest.raises(FenceLost):
                await core._publish_plan("train", b'{"plan": "from a deposed leader"}', 0)
            await eventually(
                lambda: core.persister.terms_started == 2 and core.is_leader, 10, "a second term"
            )
            assert PlanStore(registry, "/elaswave").current_epoch("train") == 0

            registry.delete(LEADER_KEY)
            with pytest.raises(FenceLost):
                await core.membership.register(worker, time.time())
            await eventually(lambda: core.persister.terms_started == 3 and core.is_leader, 10, "a third term")
            assert registry.get("/elaswave/jobs/train/alive/w0") is None
            assert registry.get("/elaswave/jobs/train/members/w0") is None
        finally:
            await core.stop()
            registry.close()

    asyncio.run(scenario())
