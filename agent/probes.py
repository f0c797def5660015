"""Health probes of host, worker process and interconnect, and the memory report (psutil).

Each probe returns a ``HealthProbe`` whose ``detail`` says what was seen, for people reading the
dashboard; none raises: a failing probe is a result, not an error.
"""

from __future__ import annotations

import asyncio
import time

import psutil

from agent.config import Address
from agent.devices import DeviceSet
from agent.worker import Worker
from wire.v1 import agent_pb2

# Host is under memory pressure (unhealthy) when less than this fraction of memory is available.
MIN_AVAILABLE_MEMORY_FRACTION = 0.05
_GIB = 2**30


def prime_cpu_percent() -> None:
    """psutil's first non-blocking cpu_percent is meaningless; take it at startup."""
    psutil.cpu_percent(interval=None)


def host_probe() -> agent_pb2.HealthProbe:
    started = time.perf_counter()
    memory = psutil.virtual_memory()
    cpu = psutil.cpu_percent(interval=None)
    load1 = psutil.getloadavg()[0]
    available_fraction = memory.available / memory.total
    healthy = available_fraction >= MIN_AVAILABLE_MEMORY_FRACTION
    detail = (
        f"cpu {cpu:.1f}% load1 {load1:.2f} memory used {(memory.total - memory.available) / _GIB:.2f}/"
        f"{memory.total / _GIB:.2f} GiB, {available_fraction:.0%} available"
    )
    if not healthy:
        detail += f" (memory pressure: below {MIN_AVAILABLE_MEMORY_FRACTION:.0%} available)"
    return agent_pb2.HealthProbe(
        kind=agent_pb2.PROBE_KIND_HOST,
        healthy=healthy,
        detail=detail,
        latency_ms=(time.perf_counter() - started) * 1000,
    )


def process_probe(worker: Worker | None) -> agent_pb2.HealthProbe:
    started = time.perf_counter()
    if worker is None:
        healthy, detail = False, "worker not launched"
    else:
        healthy = worker.is_alive()
        detail = f"pid {worker.pid} {'alive' if healthy else 'gone'}"
        if healthy:
            detail += f", rss {worker.rss_bytes() / _GIB:.3f} GiB"
    return agent_pb2.HealthProbe(
        kind=agent_pb2.PROBE_KIND_PROCESS,
        healthy=healthy,
        detail=detail,
        latency_ms=(time.perf_counter() - started) * 1000,
    )


def memory_usage(
    worker: Worker | None, devices: DeviceSet
) -> tuple[agent_pb2.MemoryUsage, agent_pb2.HealthProbe]:
    """The MemoryUsage report and the DEVICE probe taken with it (one device read serves both)."""
    memory = psutil.virtual_memory()
    rss = worker.rss_bytes() if worker is not None else 0
    reading = devices.read(rss)
    usage = agent_pb2.MemoryUsage(
        host_used_bytes=memory.total - memory.available,
        host_total_bytes=memory.total,
        worker_rss_bytes=rss,
        device_used_bytes=reading.used_bytes,
        device_total_bytes=reading.total_bytes,
        cpu_percent=psutil.cpu_percent(interval=None),
    )
    return usage, reading.probe


async def interconnect_probe(peer: Address, timeout_s: float) -> agent_pb2.HealthProbe:
    """TCP connect latency to one peer; unhealthy when it refuses or does not answer in time."""
    started = time.perf_counter()
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(peer.host, peer.port), timeout_s)
    except TimeoutError:
        healthy, detail = False, f"peer {peer}: no answer within {timeout_s * 1000:.0f} ms"
    except OSError as exc:
        healthy, detail = False, f"peer {peer}: {exc.strerror or exc}"
    else:
        writer.close()
        healthy, detail = True, f"peer {peer}: connected"
    latency_ms = (time.perf_counter() - started) * 1000
    return agent_pb2.HealthProbe(
        kind=agent_pb2.PROBE_KIND_INTERCONNECT,
        healthy=healthy,
        detail=f"{detail} in {latency_ms:.2f} ms",
        latency_ms=latency_ms,
    )
