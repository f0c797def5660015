"""What the deployments probe, on live Cores bound to port 0: /healthz is liveness on every Core,
/readyz and the gRPC health service's overall status follow leadership (the standby is not ready
and NOT_SERVING until it takes over), and promtool accepts the Core's /metrics."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core_service.config import CoreSettings, load_settings
from core_service.core import Core
from core_service.registry import MemoryRegistry

pytestmark = pytest.mark.multiproc

TOKEN = "probe-test-token-0123456789"
DOCKER = Path(__file__).resolve().parents[2] / "docker"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def settings(core_id: str) -> CoreSettings:
    return load_settings(
        core_id=core_id, grpc_port=0, http_port=0, registry_url="memory://", scheduler_token=TOKEN
    )


async def probes(core: Core) -> tuple[int, int, str, int]:
    """(/healthz status, /readyz status, /readyz role, gRPC overall health status)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{core.http_port}", timeout=5) as http:
        live, ready = await http.get("/healthz"), await http.get("/readyz")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{core.grpc_port}") as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return live.status_code, ready.status_code, ready.json()["role"], health.status


async def script(name: str, args: list[str], core: Core) -> tuple[int, str]:
    """Runs docker/NAME against `core`'s ports (without blocking the loop the Cores run on);
    returns (exit status, stdout)."""
    env = {**os.environ, "ELASWAVE_HTTP_PORT": str(core.http_port), "ELASWAVE_GRPC_PORT": str(core.grpc_port)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(DOCKER / name),
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode().strip()


async def eventually_probes(core: Core, expected: tuple[int, int, str, int], timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (seen := await probes(core)) != expected:
        assert asyncio.get_running_loop().time() < deadline, f"probes {seen}, expected {expected}"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(60)
def test_readiness_and_grpc_health_follow_leadership_and_liveness_does_not() -> None:
    registry = MemoryRegistry()

    async def scenario() -> None:
        leader = Core(settings("a"), registry=registry)
        await leader.start()
        assert await leader.wait_leader(10)
        standby = Core(settings("b"), registry=registry)
        await standby.start()
        try:
            await eventually_probes(leader, (200, 200, "leader", SERVING), 5)
            assert await probes(standby) == (200, 503, "standby", NOT_SERVING)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{standby.http_port}", timeout=5) as http:
                detail = (await http.get("/readyz")).json()["detail"]
            assert detail == leader.not_leader_message("http")  # REST clients get the leader's REST URL
            # The images' HEALTHCHECK: both Cores are alive (a standby too); the workers' helper
            # finds the leader's own address through either Core.
            assert await script("healthcheck.py", ["core"], leader) == (0, "")
            assert await script("healthcheck.py", ["core"], standby) == (0, "")
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{leader.http_port}", timeout=5) as http:
                host = (await http.get("/healthz")).json()["leader"].rpartition(":")[0]  # what it advertises
            assert host and host != "unknown"
            found = await script("find-leader.py", [f"127.0.0.1:{leader.http_port}", "5"], leader)
            assert found == (0, f"{host}:{leader.http_port}")
            await leader.stop()  # resigns: the standby takes over
            await eventually_probes(standby, (200, 200, "leader", SERVING), 10)
            code, _ = await script("healthcheck.py", ["core"], leader)
            assert code == 1  # nothing answers on the stopped Core's ports
        finally:
            await standby.stop()
            registry.close()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_promtool_accepts_the_cores_metrics() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: run `make system-deps` (Debian package prometheus)"
    registry = MemoryRegistry()

    async def scrape() -> str:
        core = Core(settings("m"), registry=registry)
        await core.start()
        try:
            assert await core.wait_leader(10)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{core.http_port}", timeout=5) as http:
                headers = {"Authorization": f"Bearer {TOKEN}"}
                assert (
                    await http.post("/api/v1/jobs", json={"name": "probe"}, headers=headers)
                ).status_code == 201
                await http.get("/api/v1/jobs/nope")  # a refusal, so the rejection counters have samples
                await asyncio.sleep(1.2)  # one sample of the job gauges and of the member gauges
                return (await http.get("/metrics")).text
        finally:
            await core.stop()
            registry.close()

    exposition = asyncio.run(scrape())
    assert "elaswave_core_is_leader 1.0" in exposition
    assert 'elaswave_job_live_workers{job="probe"} 0.0' in exposition
    result = subprocess.run(
        [promtool, "check", "metrics"], input=exposition, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stdout + result.stderr
