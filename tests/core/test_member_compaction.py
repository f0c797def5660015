"""Compaction of gone members in a real in-process Core (core_service.member_bounds): the oldest
beyond the bound go, from the job and the registry; a member the layout references, or whose
agent stream is still open, stays; a newer holder of a rank takes the protection over."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from pydantic import SecretStr

from core_service.agent_session import AgentSession, Registration
from core_service.config import JobSpec, load_settings
from core_service.core import Core
from core_service.grpc_util import RpcError
from planners.layout import make_uniform_layout

LAYOUT = make_uniform_layout(num_layers=4, num_stages=1, dp=2, global_batch=4, num_micro_batches=1)
KEPT = 3


def registration(worker: str, rank: int) -> Registration:
    return Registration("train", worker, "h", 1, [], 0 if rank >= 0 else -1, max(rank, -1), rank, False)


async def scenario() -> None:
    settings = load_settings(
        dev_mode=True,
        core_id="compact",
        grpc_port=0,
        http_port=0,
        registry_url="memory://",
        scheduler_token="scheduler-token-0123456789",
        heartbeat_timeout_s=600.0,
        lease_ttl_s=600.0,
        gone_members_kept=KEPT,
        registrations_per_s=1.0,
        registration_burst=20,
    )
    core = Core(settings)
    await core.start()
    try:
        assert await core.wait_leader(10)
        job = core.table.create_job(
            JobSpec(name="train", token=SecretStr("job-token-0123456789")), LAYOUT.to_json(), now=time.time()
        )
        members = core.membership
        sessions: dict[str, AgentSession] = {}

        async def join(worker: str, rank: int) -> None:
            sessions[worker] = await members.register(registration(worker, rank), time.time())

        async def vanish(worker: str) -> None:
            await members.close_session(sessions[worker], time.time(), clean=False)

        await join("r0", 0)
        await join("r1", 1)
        await vanish("r0")  # LOST; rank 0 is in the layout
        await join("exited", -1)
        members.mark_lost(job, "exited", "worker process exited", "process_exit", time.time())  # stream open
        for i in range(8):
            await join(f"s{i}", -1)
            await vanish(f"s{i}")
        assert len(job.gone) == 10
        members.compact(job)  # (the leader's tick may have done it already: the same result)
        kept = set(job.members)
        # r1 live; r0 referenced by the layout; "exited" has its stream: those two count towards
        # the 3 gone members kept, so of the spares only the newest stays.
        assert kept == {"r1", "r0", "exited", "s7"}, kept
        assert core.metrics.members_compacted._value.get() == 7
        await core.wait_durable()
        stored = {
            key.rsplit("/", 1)[1] for key, _ in core.registry.get_prefix("/elaswave/jobs/train/members/")
        }
        assert stored == kept
        # The history stays in the event log.
        assert [e.worker_id for e in job.events if e.kind == "worker_lost"][:2] == ["r0", "exited"]

        # A newer holder of rank 0 goes too: it is the one the layout references now.
        await join("r0-again", 0)
        await vanish("r0-again")
        await vanish("exited")
        members.compact(job)
        assert "r0" not in job.members and "r0-again" in job.members
        gone = sorted(m.worker_id for m in job.members.values() if m.state.is_gone)
        assert gone == ["exited", "r0-again", "s7"], gone

        # The registration rate: 20 at once, then refused with when to retry.
        accepted = refused = 0
        for i in range(20):
            try:
                await join(f"burst{i}", -1)
                accepted += 1
            except RpcError as err:
                assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "over its rate limit (1/s, burst 20" in err.message and "retry in" in err.message
                refused += 1
        # 12 registrations above took their tokens from the burst of 20 (and ~1/s came back).
        assert 6 <= accepted <= 10 and refused == 20 - accepted, (accepted, refused)
        assert core.metrics.registrations_refused._value.get() == refused
        # A live member's reconnect with its own credential is never rate-limited.
        again = await members.register(registration("r1", 1), time.time(), sessions["r1"].worker_token)
        assert again.worker_id == "r1"
        json.dumps([m.public() for m in job.members.values()])  # the view still serialises
    finally:
        await core.stop()


@pytest.mark.timeout(60)
def test_compaction_keeps_the_referenced_and_the_connected_and_the_rate_limit_refuses() -> None:
    asyncio.run(scenario())
