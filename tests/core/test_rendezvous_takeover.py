"""The rendezvous of `elaswave run --core` survives a Core takeover in the middle of it (issue 24,
item 2): the nodes that joined keep their places, and an answer lost with the old leader comes
from the new one. Real Cores on one real etcd (tests/core/test_takeover_decisions.py's cluster);
the answers are compared with those of the same joins on one Core without a takeover.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest

from core_service.core import Core
from tests.conftest import _wipe_etcd
from tests.core.test_takeover_decisions import SCHEDULER, cluster
from tests.test_launcher_multinode import join_body

pytestmark = [pytest.mark.etcd, pytest.mark.multiproc]
# What differs from one run to the next whatever happens: the job's new token and the ports.
PER_RUN = ("token", "grpc_port", "store_port", "standby_store_port")


async def post(core: Core, node: str, poll_s: float) -> httpx.Response:
    body = join_body(node, poll_s=poll_s, timeout_s=60.0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{core.http_port}", timeout=60) as client:
        return await client.post(
            "/api/v1/rendezvous/j", json=body, headers={"Authorization": f"Bearer {SCHEDULER}"}
        )


def place(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return {k: v for k, v in response.json().items() if k not in PER_RUN}


async def joins(etcd_url: str, scenario: str) -> dict[str, dict[str, Any]]:
    """Node a joins first, then node b. `scenario`: "none" (one Core throughout), "gathering"
    (the leader stops after a joined; b reaches the new leader first), "formed" (the leader
    stops after forming the job, before a heard of it)."""
    async with AsyncExitStack() as stack:
        cores = await cluster(stack, etcd_url, 1 if scenario == "none" else 2)
        first = await post(cores.leader, "a", poll_s=0.5)
        assert first.status_code == 202 and first.json()["joined"] == ["a"], first.text
        if scenario == "gathering":
            await cores.take_over()
            b = await post(cores.leader, "b", poll_s=30)  # before a polls again
            a = await post(cores.leader, "a", poll_s=30)
        else:
            b = await post(cores.leader, "b", poll_s=30)
            if scenario == "formed":
                await cores.take_over()
            a = await post(cores.leader, "a", poll_s=30)
        assert a.json()["token"] == b.json()["token"]
        job = cores.leader.table.get("j")
        assert job.check_token(a.json()["token"])  # the token the new leader knows
        return {"a": place(a), "b": place(b)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", ["gathering", "formed"])
def test_a_takeover_during_the_rendezvous_gives_every_node_its_place(
    etcd_registry_url: str, scenario: str
) -> None:
    reference = asyncio.run(joins(etcd_registry_url, "none"))
    assert (reference["a"]["node_index"], reference["b"]["node_index"]) == (0, 1)
    _wipe_etcd(etcd_registry_url)
    assert asyncio.run(joins(etcd_registry_url, scenario)) == reference
