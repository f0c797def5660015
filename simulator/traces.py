"""Device-availability events: Bamboo spot traces and a seeded Poisson failure generator.

Bamboo format (Thorpe et al., NSDI'23, `project_pactum` traces): one event per line,
`milliseconds,add|remove,nodeName`; the nodes added at time 0 form the initial cluster. Blank
lines and lines starting with `#` are ignored. The Poisson generator fails each device at a
constant hourly rate and, optionally, brings it back after an exponential repair time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True, order=True)
class TraceEvent:
    time_s: float
    kind: str  # "add" | "remove"
    target: str  # node name (traces) or "dev<i>" (Poisson generator)


def parse_bamboo(lines: Iterable[str], source: str = "trace") -> list[TraceEvent]:
    """Parse Bamboo lines; raises ValueError naming the line that is wrong."""
    events = []
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            raise ValueError(f"{source}:{number}: expected 'milliseconds,add|remove,nodeName', got {line!r}")
        ms, kind, node = parts
        try:
            t = float(ms) / 1000.0
        except ValueError:
            raise ValueError(f"{source}:{number}: milliseconds {ms!r} is not a number") from None
        if t < 0 or kind not in ("add", "remove") or not node:
            raise ValueError(
                f"{source}:{number}: need ms >= 0, kind add|remove and a node name, got {line!r}"
            )
        events.append(TraceEvent(t, kind, node))
    return sorted(events, key=lambda e: e.time_s)


def load_bamboo(path: str | Path) -> list[TraceEvent]:
    p = Path(path)
    with p.open() as f:
        return parse_bamboo(f, str(p))


def write_bamboo(events: Sequence[TraceEvent], path: str | Path) -> None:
    lines = [f"{round(e.time_s * 1000)},{e.kind},{e.target}" for e in sorted(events)]
    Path(path).write_text("\n".join(lines) + "\n")


def poisson_device_failures(
    num_devices: int, rate_per_device_hour: float, hours: float, seed: int, repair_hours: float | None = 1.0
) -> list[TraceEvent]:
    """Each device fails after Exp(rate) hours; with `repair_hours`, returns after Exp(1/repair)."""
    if num_devices < 1 or rate_per_device_hour < 0 or hours <= 0:
        raise ValueError("need num_devices >= 1, rate_per_device_hour >= 0 and hours > 0")
    rng = np.random.default_rng(seed)
    events: list[TraceEvent] = []
    horizon = hours * 3600.0
    for dev in range(num_devices):
        t = 0.0
        while rate_per_device_hour > 0:
            t += rng.exponential(3600.0 / rate_per_device_hour)
            if t >= horizon:
                break
            events.append(TraceEvent(t, "remove", f"dev{dev}"))
            if repair_hours is None:
                break
            t += rng.exponential(3600.0 * repair_hours)
            if t >= horizon:
                break
            events.append(TraceEvent(t, "add", f"dev{dev}"))
    return sorted(events)


def spot_trace(
    num_nodes: int,
    hours: float,
    seed: int,
    preempt_per_node_hour: float = 0.15,
    mean_outage_hours: float = 0.75,
    prefix: str = "node",
) -> list[TraceEvent]:
    """A synthetic Bamboo-format spot trace: all nodes at t=0, preemptions at a per-node hourly
    rate, each node replaced after an exponential outage (new name, as spot replacements are)."""
    rng = np.random.default_rng(seed)
    events = [TraceEvent(0.0, "add", f"{prefix}{i}") for i in range(num_nodes)]
    horizon, fresh = hours * 3600.0, num_nodes
    for i in range(num_nodes):
        name, t = f"{prefix}{i}", 0.0
        while True:
            t += rng.exponential(3600.0 / preempt_per_node_hour)
            if t >= horizon:
                break
            events.append(TraceEvent(t, "remove", name))
            t += rng.exponential(3600.0 * mean_outage_hours)
            if t >= horizon:
                break
            name, fresh = f"{prefix}{fresh}", fresh + 1
            events.append(TraceEvent(t, "add", name))
    return sorted(events)


def spot_cluster_trace(
    seed: int,
    hours: float = 11.0,
    nodes: int = 16,
    bursts_per_hour: float = 0.8,
    mean_burst: float = 2.0,
    mean_replace_hours: float = 0.5,
    prefix: str = "node",
) -> list[TraceEvent]:
    """A Bamboo-format spot trace with the statistics spot measurements report, seeded.

    Bamboo (Thorpe et al., NSDI'23, §2) measured EC2 spot clusters for training and found that
    preemptions come in bursts (several instances reclaimed at once, as a zone's capacity is
    taken back), that the autoscaler's replacements arrive after a delay, and that the cluster
    size therefore wanders below its target for long stretches; the public traces of that study
    (Bamboo's format, up to 32 nodes over about 11 hours) are what `elaswave simulate --trace`
    replays. This generator has those three properties: bursts are a Poisson process
    (`bursts_per_hour`), each reclaiming a geometric number of nodes (mean `mean_burst`, drawn
    from the nodes up at that moment), and every reclaimed node is replaced by a fresh one (a new
    name, as spot replacements are) after an exponential delay (mean `mean_replace_hours`). The
    defaults are our choice, not a fit: 16 nodes (a 12-node Table-2 job with 4 spares), 11 hours,
    ~1.6 preemptions per hour, half an hour to a replacement.
    """
    if nodes < 1 or hours <= 0 or bursts_per_hour < 0 or mean_burst < 1 or mean_replace_hours <= 0:
        raise ValueError(
            "need nodes >= 1, hours > 0, bursts_per_hour >= 0, mean_burst >= 1, mean_replace_hours > 0"
        )

    def reclaim(rng: np.random.Generator, up: int) -> list[tuple[int, float]]:
        size = min(up, int(rng.geometric(1.0 / mean_burst)))
        return [(int(i), 0.0) for i in sorted(rng.choice(up, size=size, replace=False), reverse=True)]

    return _burst_trace(seed, hours, nodes, bursts_per_hour, mean_replace_hours, prefix, reclaim)


def bursty_cluster_trace(
    seed: int,
    hours: float = 11.0,
    nodes: int = 16,
    bursts_per_hour: float = 0.4,
    burst_nodes: tuple[int, int] = (2, 4),
    burst_window_s: float = 60.0,
    mean_replace_hours: float = 0.5,
    prefix: str = "node",
) -> list[TraceEvent]:
    """A Bamboo-format trace of correlated preemptions, seeded (issue 25's bursty traces).

    Bursts are a Poisson process (`bursts_per_hour`); each takes a uniform number of nodes in
    `burst_nodes` (inclusive) among those up, each at its own instant within `burst_window_s` of
    the burst's start (a zone's capacity reclaimed over a minute, not in one instant), and every
    reclaimed node is replaced by a fresh one after an exponential delay (`mean_replace_hours`).
    """
    low, high = burst_nodes
    if nodes < 1 or hours <= 0 or bursts_per_hour < 0 or not 1 <= low <= high or burst_window_s < 0:
        raise ValueError("need nodes >= 1, hours > 0, bursts_per_hour >= 0, 1 <= burst_nodes[0] <= [1]")
    if mean_replace_hours <= 0:
        raise ValueError("mean_replace_hours must be > 0")

    def reclaim(rng: np.random.Generator, up: int) -> list[tuple[int, float]]:
        size = min(up, int(rng.integers(low, high + 1)))
        offsets = sorted(rng.uniform(0.0, burst_window_s, size=size))
        chosen = sorted(rng.choice(up, size=size, replace=False), reverse=True)
        return [(int(i), float(dt)) for i, dt in zip(chosen, offsets, strict=True)]

    return _burst_trace(seed, hours, nodes, bursts_per_hour, mean_replace_hours, prefix, reclaim)


def _burst_trace(
    seed: int,
    hours: float,
    nodes: int,
    bursts_per_hour: float,
    mean_replace_hours: float,
    prefix: str,
    reclaim: Callable[[np.random.Generator, int], list[tuple[int, float]]],
) -> list[TraceEvent]:
    """The shared process of both generators: Poisson bursts, each reclaiming the nodes `reclaim`
    picks (indices into the nodes up, descending, each with its offset from the burst's start),
    every reclaimed node replaced by a fresh one after an exponential delay."""
    rng = np.random.default_rng(seed)
    horizon = hours * 3600.0
    up = [f"{prefix}{i}" for i in range(nodes)]
    events = [TraceEvent(0.0, "add", name) for name in up]
    pending: list[float] = []  # arrival times of replacements
    fresh, t = nodes, 0.0
    while bursts_per_hour > 0:
        t += rng.exponential(3600.0 / bursts_per_hour)
        if t >= horizon:
            break
        for arrival in sorted(a for a in pending if a <= t):
            pending.remove(arrival)
            up.append(f"{prefix}{fresh}")
            events.append(TraceEvent(arrival, "add", up[-1]))
            fresh += 1
        for i, dt in reclaim(rng, len(up)):
            events.append(TraceEvent(t + dt, "remove", up.pop(i)))
            pending.append(t + dt + rng.exponential(3600.0 * mean_replace_hours))
    for arrival in sorted(a for a in pending if a < horizon):
        events.append(TraceEvent(arrival, "add", f"{prefix}{fresh}"))
        fresh += 1
    events.append(TraceEvent(horizon, "add", f"{prefix}{fresh}"))  # marks the trace's end
    return sorted(events)
