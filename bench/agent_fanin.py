"""Benchmark: N simulated agents streaming reports at 1 Hz into one Core (not a test).

Starts a real Core (`elaswave core`, in-memory registry) in its own process, then one load
process opens N real AgentService streams (spread over a few channels), registers every agent,
and sends one report per agent per second (heartbeats, every 5th a step report) with random
phases. After a warm-up it measures, over a window:
  - sustained reports/s the Core handled (from its /metrics counter), against the reports/s the
    load process managed to send (1 per agent per second offered), and the CPU each process used;
  - detection latency: K agents vanish (stream cancelled, no Leave) at known instants, spread
    over the window; the time until each shows up LOST in the Core's event feed (polled every
    20 ms through the REST API from a thread of its own, so the figure includes up to 20 ms of
    polling but not the load generator's own event-loop delays).

When the two processes together need more CPU than the machine has, not every agent may register
within `--register-timeout`; the row then says how many did and measures with those.

    python -m bench.agent_fanin --agents 1000 10000 --window 20 --kills 50
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import itertools
import json
import multiprocessing
import os
import platform
import queue
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil

from agent.node_link import ChannelEnded, NodeChannel, NodeLink
from wire.v1 import agent_pb2, agent_pb2_grpc

STREAMS_PER_CHANNEL = 200


def start_core(tmp: Path, token: str) -> tuple[subprocess.Popen, dict]:
    ready = tmp / "core.json"
    env = dict(os.environ, ELASWAVE_SCHEDULER_TOKEN=token, ELASWAVE_EVENTS_KEPT="100000")
    cmd = [
        sys.executable,
        "-m",
        "elaswave.cli",
        "core",
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        "--ready-file",
        str(ready),
        "--heartbeat-timeout",
        "5",
        "--lease-ttl",
        "5",
        "--log-level",
        "WARNING",
    ]
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 30
    while not ready.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("core did not start")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


def reports_total(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    return sum(
        float(m.group(1)) for m in re.finditer(r"^elaswave_agent_reports_total\{[^}]*\} (\S+)$", text, re.M)
    )


def bench_register(job: str, worker_id: str) -> agent_pb2.Register:
    """A simulated agent's registration: one worker, heartbeats at 1 Hz."""
    return agent_pb2.Register(
        job=job, worker_id=worker_id, host="bench", pid=1, stage=0, dp_rank=0, heartbeat_interval_ms=1000
    )


class SimAgent:
    def __init__(self, stub: agent_pb2_grpc.AgentServiceStub, job: str, token: str, worker_id: str) -> None:
        self.stub, self.job, self.token, self.worker_id = stub, job, token, worker_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.call: Any = None
        self.registered = asyncio.Event()
        self.sent = 0  # reports handed to the stream (after the register message)

    async def requests(self):  # noqa: ANN201 - async generator of ConnectRequest
        reg = bench_register(self.job, self.worker_id)
        yield agent_pb2.ConnectRequest(register=reg)
        while True:
            item = await self.queue.get()
            if item is None:
                return
            self.sent += 1
            yield item

    async def run(self, stop: asyncio.Event) -> None:
        call = self.stub.Connect(self.requests(), metadata=[("authorization", f"Bearer {self.token}")])
        self.call = call
        async for _ in call:
            self.registered.set()
        # The stream ends when cancelled (a vanishing agent) or at shutdown.

    def write(self, msg: agent_pb2.ConnectRequest) -> None:
        self.queue.put_nowait(msg)

    def kill(self) -> None:
        """The agent vanishes: its stream is cancelled, no Leave."""
        assert self.call is not None
        self.call.cancel()

    def finish(self) -> None:
        self.queue.put_nowait(None)

    async def report_loop(self, stop: asyncio.Event) -> None:
        await report_loop(self, stop)


async def report_loop(agent: SimAgent | MuxAgent, stop: asyncio.Event) -> None:
    """One report a second from a random phase on: heartbeats, every 5th a step report."""
    await agent.registered.wait()
    await asyncio.sleep(random.random())
    seq = 0
    while not stop.is_set():
        seq += 1
        if seq % 5 == 0:
            msg = agent_pb2.ConnectRequest(
                step=agent_pb2.StepMetrics(
                    step=seq, step_time_s=1.0, compute_time_s=0.9, loss=1.0, samples=8, stage=0, dp_rank=0
                )
            )
        else:
            msg = agent_pb2.ConnectRequest(heartbeat=agent_pb2.Heartbeat(seq=seq, sent_unix=time.time()))
        agent.write(msg)
        await asyncio.sleep(1.0)


class MuxAgent:
    """An agent behind a node multiplexer: one channel of a NodeLink (agent/node_link.py), what
    the multiplexer forwards for an agent on its node. Vanishing ends the channel without a
    Leave, which is what the multiplexer sends when the agent's local stream breaks."""

    def __init__(self, link: NodeLink, job: str, token: str, worker_id: str) -> None:
        self.link, self.job, self.token, self.worker_id = link, job, token, worker_id
        self.channel: NodeChannel | None = None
        self.registered = asyncio.Event()
        self.sent = 0

    async def run(self, stop: asyncio.Event) -> None:
        reg = bench_register(self.job, self.worker_id)
        self.channel = self.link.open(reg, self.token)
        with contextlib.suppress(ChannelEnded):
            while True:
                response = await self.channel.read()
                if response.WhichOneof("body") == "ack":
                    self.registered.set()

    def write(self, msg: agent_pb2.ConnectRequest) -> None:
        assert self.channel is not None
        self.sent += 1
        self.channel.write(msg)

    def kill(self) -> None:
        assert self.channel is not None
        self.channel.end()

    def finish(self) -> None:
        pass

    async def report_loop(self, stop: asyncio.Event) -> None:
        await report_loop(self, stop)


def watch_events(
    http_port: int, since: int, victims: list[str], duration_s: float, results: Any, ready: Any
) -> None:
    """Polls the event feed every 20 ms for `duration_s` or until every victim was lost; puts
    ({worker: monotonic time seen}, {worker: the Core's time_unix of the loss}) on `results`."""
    seen_at: dict[str, float] = {}
    marked_unix: dict[str, float] = {}  # the Core's clock when it marked the worker lost
    reasons: dict[str, str] = {}
    with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=10) as client:
        client.get("/healthz")
        ready.set()
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline and not set(victims) <= seen_at.keys():
            events = client.get("/api/v1/jobs/bench/events", params={"since": since, "limit": 10000}).json()
            now = time.monotonic()
            for event in events["events"]:
                since = max(since, event["seq"])
                if event["kind"] == "worker_lost":
                    seen_at.setdefault(event["worker_id"], now)
                    marked_unix.setdefault(event["worker_id"], event["time_unix"])
                    reasons.setdefault(event["worker_id"], event["detail"])
            time.sleep(0.02)
    results.put((seen_at, marked_unix, reasons))


async def load(
    grpc_port: int,
    http_port: int,
    job_token: str,
    n: int,
    window_s: float,
    kills: int,
    warmup_s: float,
    register_timeout_s: float,
    per_node: int = 1,
    linger_s: float = 0.01,
) -> dict:
    # A local subchannel pool gives each channel its own TCP connection (by default channels to
    # one target share one), as separate agent processes would have.
    target, options = f"127.0.0.1:{grpc_port}", [("grpc.use_local_subchannel_pool", 1)]
    agents: list[SimAgent] | list[MuxAgent]
    links: list[NodeLink] = []
    if per_node > 1:
        # One connection and one ConnectNode stream per simulated node, as node multiplexers have.
        channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(-(-n // per_node))]
        links = [NodeLink(c, linger_s=linger_s) for c in channels]
        agents = [MuxAgent(links[i // per_node], "bench", job_token, f"a{i}") for i in range(n)]
    else:
        channels = [
            grpc.aio.insecure_channel(target, options=options)
            for _ in range(max(1, n // STREAMS_PER_CHANNEL))
        ]
        agents = [
            SimAgent(
                agent_pb2_grpc.AgentServiceStub(channels[i % len(channels)]), "bench", job_token, f"a{i}"
            )
            for i in range(n)
        ]
    stop = asyncio.Event()
    tasks = [asyncio.ensure_future(a.run(stop)) for a in agents]
    tasks += [asyncio.ensure_future(a.report_loop(stop)) for a in agents]
    t0 = time.monotonic()
    # Measure with the agents that registered if not all of them do (a saturated machine).
    while sum(a.registered.is_set() for a in agents) < n and time.monotonic() - t0 < register_timeout_s:
        await asyncio.sleep(0.1)
    register_s = time.monotonic() - t0
    registered = [a for a in agents if a.registered.is_set()]
    if len(registered) < kills:
        raise RuntimeError(f"only {len(registered)} of {n} agents registered within {register_timeout_s}s")
    # The load process's own full collections over 10,000 agents' objects stalled its loop for
    # a few hundred ms: those would be counted as the Core's detection time.
    gc.freeze()
    await asyncio.sleep(warmup_s)
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=10)
    since = (await http.get("/api/v1/jobs/bench")).json()["last_event_seq"]
    before = await asyncio.to_thread(reports_total, httpx.Client(base_url=f"http://127.0.0.1:{http_port}"))
    # The watcher polls the event feed from a process of its own: the load process, busy with
    # 10,000 agents, must not delay the observation of a detection (from a thread of this
    # process, GIL hand-offs added about 100 ms to every detection at 10,000 agents).
    victims = random.Random(7).sample(registered, kills)
    ctx = multiprocessing.get_context("spawn")
    results, ready = ctx.Queue(), ctx.Event()
    watcher = ctx.Process(
        target=watch_events,
        args=(http_port, since, [v.worker_id for v in victims], window_s + 5, results, ready),
        daemon=True,
    )
    watcher.start()
    await asyncio.to_thread(ready.wait, 60)
    start = time.monotonic()
    sent_before = sum(a.sent for a in agents)
    killed_at: dict[str, float] = {}
    killed_unix: dict[str, float] = {}

    async def killer() -> None:
        for i, victim in enumerate(victims):
            await asyncio.sleep(max(0.0, start + (i + 0.5) * window_s / max(1, kills) - time.monotonic()))
            killed_at[victim.worker_id] = time.monotonic()
            killed_unix[victim.worker_id] = time.time()
            victim.kill()

    await asyncio.gather(killer(), asyncio.sleep(window_s))
    seen_at, marked_unix, reasons = await asyncio.to_thread(results.get, True, 30)
    watcher.join(5)
    elapsed = time.monotonic() - start
    after = await asyncio.to_thread(reports_total, httpx.Client(base_url=f"http://127.0.0.1:{http_port}"))
    sent = sum(a.sent for a in agents) - sent_before
    stop.set()
    for a in agents:
        a.finish()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for link in links:
        await link.close()
    for c in channels:
        await c.close()
    await http.aclose()
    # A victim already LOST before its kill (its heartbeats or lease lapsed on a starved machine)
    # is no detection: it counts among the false losses, not as a negative latency.
    early = {w for w in killed_unix if w in marked_unix and marked_unix[w] < killed_unix[w]}
    latencies = sorted(seen_at[w] - killed_at[w] for w in killed_at if w in seen_at and w not in early)
    # Kill to the Core's mark (one machine, one clock): the detection without the feed's polling.
    marked = sorted(
        (marked_unix[w] - killed_unix[w]) * 1000 for w in killed_unix if w in marked_unix and w not in early
    )

    def p(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")

    return {
        "agents": n,
        "registered": len(registered),
        "register_s": register_s,
        "sent_per_s": sent / elapsed,
        "handled_per_s": (after - before) / elapsed,
        "kills": kills,
        "detected": len(latencies),
        "p50_ms": p(0.5) * 1000,
        "p99_ms": p(0.99) * 1000,
        "max_ms": (latencies[-1] * 1000 if latencies else float("nan")),
        "mean_ms": statistics.fmean(latencies) * 1000 if latencies else float("nan"),
        "latencies_ms": [round(x * 1000) for x in latencies],
        # Kill to the Core's mark (same machine, same clock): without the feed's polling delay.
        "marked_p99_ms": marked[min(len(marked) - 1, int(0.99 * len(marked)))] if marked else float("nan"),
        "marked_ms": [round(m) for m in marked],
        # Workers declared lost that were never killed: false detections (should be none).
        "false_lost": sorted(early | {w for w in marked_unix if w not in killed_unix}),
        "false_reasons": collections.Counter(
            reasons[w] for w in early | {w for w in marked_unix if w not in killed_unix}
        ),
    }


def run_one(
    n: int,
    window_s: float,
    kills: int,
    warmup_s: float,
    register_timeout_s: float,
    per_node: int = 1,
    linger_s: float = 0.01,
) -> dict:
    token = "bench-" + os.urandom(12).hex()
    with tempfile.TemporaryDirectory() as tmp:
        proc, info = start_core(Path(tmp), token)
        try:
            http = httpx.Client(base_url=f"http://127.0.0.1:{info['http_port']}", timeout=10)
            while http.get("/healthz").json()["role"] != "leader":
                time.sleep(0.05)
            job_token = http.post(
                "/api/v1/jobs", json={"name": "bench"}, headers={"Authorization": f"Bearer {token}"}
            ).json()["token"]
            core, me = psutil.Process(proc.pid), psutil.Process()
            core_before, me_before = core.cpu_times(), me.cpu_times()
            started = time.monotonic()
            result = asyncio.run(
                load(
                    info["grpc_port"],
                    info["http_port"],
                    job_token,
                    n,
                    window_s,
                    kills,
                    warmup_s,
                    register_timeout_s,
                    per_node,
                    linger_s,
                )
            )
            core_after, me_after = core.cpu_times(), me.cpu_times()
            result["core_cpu_s"] = (core_after.user + core_after.system) - (
                core_before.user + core_before.system
            )
            result["load_cpu_s"] = (me_after.user + me_after.system) - (me_before.user + me_before.system)
            result["wall_s"] = time.monotonic() - started
            return result
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a Core still draining thousands of streams
                proc.kill()
                proc.wait(timeout=30)


def _row_child(results: Any, args: tuple[Any, ...]) -> None:
    results.put(run_one(*args))


def run_isolated(*args: Any) -> dict:
    """`run_one` in a fresh process: a row's thousands of gRPC streams leave threads and sockets
    behind in the process that ran them (still tearing down when the next row starts), which
    would starve the next row's Core into false losses."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_row_child, args=(results, args))
    child.start()
    try:
        while True:
            with contextlib.suppress(queue.Empty):
                return results.get(timeout=1.0)
            if not child.is_alive():
                raise RuntimeError(f"the row's process exited ({child.exitcode}) without a result")
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
            child.join(10)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--window", type=float, default=20.0, help="measurement window, seconds")
    parser.add_argument(
        "--warmup", type=float, default=5.0, help="seconds after registration before measuring"
    )
    parser.add_argument("--kills", type=int, default=50, help="agents that vanish during the window")
    parser.add_argument(
        "--register-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for every agent to register; then measure with those that did",
    )
    parser.add_argument(
        "--per-node",
        type=int,
        nargs="+",
        default=[1, 100],
        help="agents per stream: 1 = each agent its own Connect stream; K > 1 = K agents behind each "
        "node multiplexer's ConnectNode stream (agent/node_link.py); each value is a row per agent count",
    )
    parser.add_argument(
        "--linger", type=float, default=0.01, help="multiplexer: seconds a frame waits for others (batching)"
    )
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()}, {psutil.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, Python {platform.python_version()}; "
        "Core and load generator share the machine; load average before the run "
        f"{os.getloadavg()[0]:.1f} (other processes compete for the same cores)"
    )
    print(
        "| agents | per stream | registered | register (s) | sent reports/s | handled reports/s | Core CPU (cores) | "
        "load CPU (cores) | kills detected | p50 detect (ms) | p99 detect (ms) | max (ms) | p99 marked (ms) | false losses | "
        "machine load avg |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, per_node in itertools.product(args.agents, args.per_node):
        r = run_isolated(
            n, args.window, args.kills, args.warmup, args.register_timeout, per_node, args.linger
        )
        print(
            f"| {r['agents']} | {per_node} | {r['registered']} | {r['register_s']:.1f} | {r['sent_per_s']:.0f} | "
            f"{r['handled_per_s']:.0f} | {r['core_cpu_s'] / r['wall_s']:.2f} | {r['load_cpu_s'] / r['wall_s']:.2f} | "
            f"{r['detected']}/{r['kills']} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['max_ms']:.0f} | "
            f"{r['marked_p99_ms']:.0f} | {len(r['false_lost'])} | "
            f"{os.getloadavg()[0]:.1f} |",
            flush=True,
        )
        if r["false_lost"]:
            print(
                f"  false losses of the {n} x {per_node} row, by reason: {dict(r['false_reasons'])}",
                file=sys.stderr,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
