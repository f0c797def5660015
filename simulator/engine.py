"""Discrete-event replay of a cluster timeline for one policy.

At every change (`simulator.cluster`) the policy builds its plan (`simulator.policies`). A change
that costs something stops progress for its itemised cost (detection, planning, communicator,
state transfer, replay, restore); during a healing join the others run without the joining
ranks, then the new plan runs. A new change during a recovery starts a new recovery from that
instant (what was being applied is lost), except the rest of a RESTORE: the checkpoint reload
and the redone steps are work the job must still do before it trains on, whatever the next plan
(it is added to the next recovery as "unfinished restore"). A policy with no feasible plan
stalls until the cluster changes again.

Linear scaling efficiency is time-weighted over the horizon: LSE(t) = throughput(t) /
(healthy throughput x live job devices(t) / job devices), with recoveries and stalls at zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from planners.chameleon.candidates import torchft
from planners.chameleon.state import ClusterState
from planners.layout import Layout
from simulator.cluster import ClusterChange
from simulator.costs import RecoveryCosts
from simulator.jobs import JobSpec
from simulator.policies import make_policy
from simulator.sim_policy import Transition


@dataclass(frozen=True)
class Segment:
    start_s: float
    end_s: float
    throughput: float
    alive_devices: int
    kind: str  # "run", "recovery", "healing", "stalled"
    reason: str
    mode: str = ""  # how the plan was reached: "in place", "restore", "restart"
    costs: tuple[tuple[str, float], ...] = ()
    layout: Layout | None = None  # the ElasWave policies' planned layout
    previous_layout: Layout | None = None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class PolicyRun:
    policy: str
    segments: tuple[Segment, ...]
    fault_free_throughput: float
    num_devices: int
    horizon_s: float
    plan_changes: int = 0
    restores: int = 0

    @property
    def time_averaged_throughput(self) -> float:
        return sum(s.throughput * s.duration_s for s in self.segments) / self.horizon_s

    @property
    def time_weighted_lse(self) -> float:
        """Time-weighted LSE; recoveries and stalls count as zero, intervals with no live device
        are left out (no linear-scaling reference)."""
        weighted = covered = 0.0
        for s in self.segments:
            if s.alive_devices == 0:
                continue
            covered += s.duration_s
            weighted += s.duration_s * lse(
                s.throughput, self.fault_free_throughput, s.alive_devices, self.num_devices
            )
        return weighted / covered if covered else 0.0

    @property
    def min_running_lse(self) -> float | None:
        """Worst LSE of the steady segments (recoveries and stalls excluded)."""
        values = [
            lse(s.throughput, self.fault_free_throughput, s.alive_devices, self.num_devices)
            for s in self.segments
            if s.kind == "run" and s.alive_devices and s.duration_s > 0
        ]
        return min(values) if values else None

    def seconds(self, kind: str) -> float:
        return sum(s.duration_s for s in self.segments if s.kind == kind)

    def cost_totals(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for s in self.segments:
            if s.kind == "recovery":
                for name, value in s.costs:
                    totals[name] = totals.get(name, 0.0) + value
        return totals


def lse(throughput: float, fault_free: float, alive: int, total: int) -> float:
    return throughput / (fault_free * alive / total) if alive and fault_free else 0.0


def fault_free_throughput(spec: JobSpec) -> float:
    return torchft(ClusterState(spec.shape, spec.profile())).throughput


def run_policy(
    policy: str,
    spec: JobSpec,
    changes: Sequence[ClusterChange],
    horizon_s: float,
    costs: RecoveryCosts | None = None,
    on_event: Callable[[], None] | None = None,
) -> PolicyRun:
    """Replay `changes` (the first at t=0 is the starting cluster) under one policy."""
    rate = max(len(changes) - 1, 1) / horizon_s  # observed cluster changes per second
    costs = costs or RecoveryCosts()
    sim = make_policy(policy, spec, costs, rate)
    total = spec.shape.num_devices
    segments: list[Segment] = []
    points = [c for c in changes if c.time_s < horizon_s]
    throughput, step_s, plan_changes, restores = 0.0, float("inf"), 0, 0
    unfinished = 0.0  # seconds of a RESTORE a change cut short
    for i, change in enumerate(points):
        end = points[i + 1].time_s if i + 1 < len(points) else horizon_s
        alive = total - len([d for d in change.dead_devices if d < total])
        t = change.time_s
        if i > 0 and costs.join_start_s > 0 and change.kind == "join":
            # The joining node starts (process, registration) while the plan in force runs on.
            ready = min(t + costs.join_start_s, end)
            if unfinished > 0:  # ... or the RESTORE a change interrupted goes on meanwhile
                done = min(ready - t, unfinished)
                segments.append(Segment(t, t + done, 0.0, alive, "recovery", "unfinished restore", "restore"))
                t, unfinished = t + done, unfinished - done
            kind = "run" if throughput > 0 else "stalled"
            if ready > t:
                segments.append(Segment(t, ready, throughput, alive, kind, "joining node starting"))
            t = ready
        tr = sim.step(change, step_s)
        if i > 0 and tr.mode:
            plan_changes += 1
            restores += tr.mode == "restore"
        if unfinished > 0:
            tr = _with_unfinished_restore(tr, unfinished)
        recover_end = min(t + tr.stall_s, end)
        unfinished = t + tr.stall_s - end if tr.mode == "restore" and t + tr.stall_s > end else 0.0
        if recover_end > t:
            said = _said(tr.costs)
            segments.append(
                Segment(
                    t,
                    recover_end,
                    0.0,
                    alive,
                    "recovery",
                    said,
                    tr.mode,
                    tr.costs,
                    tr.layout,
                    tr.previous_layout,
                )
            )
            t = recover_end
        heal_end = min(t + tr.heal_s, end)
        if heal_end > t:
            segments.append(
                Segment(
                    t, heal_end, tr.heal_throughput, alive, "healing", "joining replica heals from a peer"
                )
            )
            t = heal_end
        cand = tr.candidate
        throughput = cand.throughput
        step_s = cand.step_time_s
        if t < end:
            segments.append(
                Segment(t, end, throughput, alive, "run" if cand.feasible else "stalled", cand.reason)
            )
        if on_event:
            on_event()
    return PolicyRun(
        policy, tuple(segments), fault_free_throughput(spec), total, horizon_s, plan_changes, restores
    )


def _with_unfinished_restore(tr: Transition, seconds: float) -> Transition:
    """`tr` after the rest of a RESTORE the change interrupted (it still has to be done)."""
    costs = (*tr.costs, ("unfinished restore", seconds))
    return replace(tr, stall_s=tr.stall_s + seconds, costs=costs, mode="restore")


def _said(costs: tuple[tuple[str, float], ...]) -> str:
    return "; ".join(f"{name} {value:.3g} s" for name, value in costs)
