"""Discrete-event replay of device losses and arrivals for every recovery policy.

Events (trace or Poisson) are turned into the set of dead ranks over time. At each change every
policy builds its plan for the new state (`planners.chameleon`); if the plan differs from the
running one the job makes no progress for the policy's MTTR, then runs at the plan's steady
throughput until the next change. A new event during a recovery restarts the recovery if it
changes the plan, else the recovery in progress simply continues. A policy with no feasible plan
stalls (throughput 0) until the cluster changes again; ReCycle then falls back to a TorchFT-style
restart without the damaged replicas (`simulated_candidate`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from planners.chameleon.policy import POLICIES, chameleon_step
from planners.chameleon.state import Candidate, ClusterState, MttrModel
from simulator.jobs import JobSpec, ranks_of_devices
from simulator.traces import TraceEvent

SIM_POLICIES: tuple[str, ...] = (
    "elaswave",
    "elaswave-migrate",
    "elaswave-resize",
    "recycle",
    "torchft",
    "oobleck",
    "chameleon",
)


@dataclass(frozen=True)
class Segment:
    start_s: float
    end_s: float
    throughput: float
    alive_devices: int
    lse: float | None
    downtime_s: float
    reason: str


@dataclass(frozen=True)
class PolicyRun:
    policy: str
    segments: tuple[Segment, ...]
    fault_free_throughput: float
    horizon_s: float
    plan_changes: int = 0

    @property
    def time_averaged_throughput(self) -> float:
        return sum(s.throughput * (s.end_s - s.start_s) for s in self.segments) / self.horizon_s

    @property
    def downtime_s(self) -> float:
        """Seconds without progress: recoveries plus stalls (no feasible plan)."""
        return sum(s.end_s - s.start_s for s in self.segments if s.throughput == 0.0)

    @property
    def recovery_s(self) -> float:
        return sum(s.end_s - s.start_s for s in self.segments if s.downtime_s > 0)

    @property
    def lse_after_changes(self) -> tuple[float, ...]:
        return tuple(s.lse for s in self.segments if s.lse is not None)


def dead_device_timeline(events: Sequence[TraceEvent], spec: JobSpec) -> list[tuple[float, frozenset[int]]]:
    """(time, dead devices) at every change. Node events fill the job's node slots (spares queue
    until a slot is free); `dev<i>` events kill or revive device i directly."""
    per_node, n_slots = spec.devices_per_node, spec.num_nodes
    slot_of: dict[str, int] = {}
    spares: list[str] = []
    node_events = any(_device_index(e.target) is None for e in events)
    dead_slots = set(range(n_slots)) if node_events else set()
    dead_devs: set[int] = set()
    out: list[tuple[float, frozenset[int]]] = []

    def devices() -> frozenset[int]:
        nodes = {d for s in dead_slots for d in range(s * per_node, (s + 1) * per_node)}
        return frozenset(nodes | dead_devs)

    out.append((0.0, devices()))
    for ev in sorted(events):
        dev = _device_index(ev.target)
        if dev is not None:
            (dead_devs.add if ev.kind == "remove" else dead_devs.discard)(dev)
        elif ev.kind == "add":
            if dead_slots:
                slot = min(dead_slots)
                dead_slots.discard(slot)
                slot_of[ev.target] = slot
            else:
                spares.append(ev.target)
        elif ev.target in slot_of:
            slot = slot_of.pop(ev.target)
            if spares:
                slot_of[spares.pop(0)] = slot
            else:
                dead_slots.add(slot)
        elif ev.target in spares:
            spares.remove(ev.target)
        state = devices()
        if out and out[-1][0] == ev.time_s:
            out[-1] = (ev.time_s, state)
        elif not out or out[-1][1] != state:
            out.append((ev.time_s, state))
    return out


def _device_index(target: str) -> int | None:
    return int(target[3:]) if target.startswith("dev") and target[3:].isdigit() else None


def base_mttr(policy: str, mttr: MttrModel) -> float:
    """Minimum downtime of any plan change, per policy (see MttrModel)."""
    return {
        "torchft": mttr.torchft_restart_s,
        "recycle": mttr.recycle_s,
        "oobleck": mttr.oobleck_restart_s,
        "reparallelise": mttr.reparallel_restart_s,
    }.get(policy, mttr.elaswave_base_s)


def run_policy(
    policy: str,
    spec: JobSpec,
    timeline: Sequence[tuple[float, frozenset[int]]],
    horizon_s: float,
    expected_gap_s: float,
    mttr: MttrModel | None = None,
    on_event: Callable[[], None] | None = None,
) -> PolicyRun:
    """Replay `timeline` (time, dead devices) under one policy."""
    mttr = mttr or MttrModel()
    rerouting_allowed = True  # Chameleon: rerouting only from the configured layout
    shape, prof = spec.shape, spec.profile()
    fault_free = POLICIES["torchft"](ClusterState(shape, prof, mttr=mttr)).throughput
    cache: dict[frozenset[int], Candidate] = {}
    segments: list[Segment] = []
    running: tuple | None = None
    busy_until = 0.0  # end of the recovery in progress
    changes = 0
    points = [(t, d) for t, d in timeline if t < horizon_s]
    for i, (t, dead) in enumerate(points):
        end = points[i + 1][0] if i + 1 < len(points) else horizon_s
        ranks = ranks_of_devices(spec, set(dead))
        state = ClusterState(
            shape, prof, failed=ranks, expected_time_to_next_event_s=expected_gap_s, mttr=mttr
        )
        if policy == "chameleon":
            cand, rerouting_allowed = chameleon_step(state, rerouting_allowed)
        else:
            cand = cache.get(ranks) or cache.setdefault(ranks, simulated_candidate(policy, state))
        signature = _signature(cand)
        if signature != running:
            if running is not None:
                busy_until = t + max(cand.transition_s, base_mttr(_mttr_kind(policy, cand), mttr))
                changes += 1
            running = signature
        alive = shape.num_devices - len(dead)
        thr = cand.throughput
        lse = thr / (fault_free * alive / shape.num_devices) if alive and cand.feasible else None
        resume = min(max(busy_until, t), end)
        if resume > t:
            segments.append(Segment(t, resume, 0.0, alive, None, resume - t, "recovering"))
        if resume < end:
            segments.append(Segment(resume, end, thr, alive, lse, 0.0, cand.reason))
        if on_event:
            on_event()
    return PolicyRun(policy, tuple(segments), fault_free, horizon_s, changes)


def _mttr_kind(policy: str, cand: Candidate) -> str:
    """Chameleon pays ReCycle's recovery when it reroutes, re-parallelisation's otherwise."""
    if policy != "chameleon":
        return policy
    return "recycle" if cand.reason.startswith("rerouting") else "reparallelise"


def simulated_candidate(policy: str, state: ClusterState) -> Candidate:
    """The policy's plan; when ReCycle's rerouting cannot run (the rerouted activations exceed
    memory, or a stage lost every live peer) it restarts without the damaged replicas, as TorchFT
    does, if any replica is whole; otherwise the job stalls."""
    cand = POLICIES[policy](state)
    if policy == "recycle" and not cand.feasible:
        fallback = POLICIES["torchft"](state)
        if fallback.feasible:
            return replace(
                fallback,
                policy="recycle",
                reason=f"{cand.reason}; restarted without damaged replicas: {fallback.reason}",
            )
    return cand


def _signature(cand: Candidate) -> tuple:
    if not cand.feasible:
        return ("infeasible",)
    return tuple(
        (p.num_slots, tuple((s.layer_start, s.layer_stop, s.ranks, s.freq_mhz) for s in p.stages))
        for p in cand.pipelines
    )
