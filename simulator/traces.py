"""Device-availability events: Bamboo spot traces and a seeded Poisson failure generator.

Bamboo format (Thorpe et al., NSDI'23, `project_pactum` traces): one event per line,
`milliseconds,add|remove,nodeName`; the nodes added at time 0 form the initial cluster. Blank
lines and lines starting with `#` are ignored. The Poisson generator fails each device at a
constant hourly rate and, optionally, brings it back after an exponential repair time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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
