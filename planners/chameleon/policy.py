"""Policy choice by Chameleon's eq. (8): throughput x effective-time ratio.

`score = B / t_step * t_next / (t_transition + t_next)` (Chameleon §III). The time between
two events is fixed by the environment, so with `E` the expected time from now to the next event
the new state runs for `t_next = max(E - t_transition, 0)` and the ratio is `t_next / E`: a
policy that moves many bytes wins only when the next event is far enough away.

Candidates: ElasWave (resize + migrate + DVFS), re-parallelisation to a new DP x PP (Chameleon's
dynamic parallelism), micro-batch rerouting (ReCycle), dropping replicas (TorchFT); the
simulator also scores the ElasWave ablations and Oobleck templates through the same table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from planners.chameleon.candidates import recycle, rerouting_estimate, torchft
from planners.chameleon.elastic import elaswave
from planners.chameleon.reparallel import oobleck, reparallelise
from planners.chameleon.state import Candidate, ClusterState

PolicyBuilder = Callable[[ClusterState], Candidate]

POLICIES: dict[str, PolicyBuilder] = {
    "elaswave": elaswave,
    "elaswave-migrate": lambda s: elaswave(s, migrate=True, dvfs=False),
    "elaswave-resize": lambda s: elaswave(s, migrate=False, dvfs=False),
    "reparallelise": reparallelise,
    "recycle": recycle,
    "torchft": torchft,
    "oobleck": oobleck,
}
DEFAULT_CHOICES: tuple[str, ...] = ("elaswave", "reparallelise", "recycle", "torchft")


@dataclass(frozen=True)
class Scored:
    candidate: Candidate
    score: float
    effective_ratio: float


@dataclass(frozen=True)
class PolicyDecision:
    """The chosen candidate and every alternative's eq. (8) score, best first."""

    chosen: Candidate
    scored: tuple[Scored, ...]
    reason: str


def eq8_score(candidate: Candidate, horizon_s: float) -> Scored:
    """Eq. (8) for one candidate over a horizon of `horizon_s` seconds to the next event."""
    if horizon_s <= 0:
        raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
    ratio = max(horizon_s - candidate.transition_s, 0.0) / horizon_s
    return Scored(candidate, candidate.throughput * ratio, ratio)


def choose_policy(state: ClusterState, policies: Sequence[str] = DEFAULT_CHOICES) -> PolicyDecision:
    """Build each policy's candidate for `state` and keep the highest eq. (8) score."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ValueError(f"unknown policies {unknown}; choose from {sorted(POLICIES)}")
    return decide([POLICIES[p](state) for p in policies], state.expected_time_to_next_event_s)


def decide(candidates: Sequence[Candidate], horizon_s: float) -> PolicyDecision:
    """Rank already-built candidates by eq. (8); ties go to the earlier candidate."""
    scored = sorted((eq8_score(c, horizon_s) for c in candidates), key=lambda s: -s.score)
    best = scored[0]
    if not best.candidate.feasible or best.score <= 0:
        reasons = "; ".join(f"{s.candidate.policy}: {s.candidate.reason}" for s in scored)
        return PolicyDecision(best.candidate, tuple(scored), f"no policy can run the job: {reasons}")
    runner_up = next((s for s in scored[1:] if s.candidate.feasible), None)
    margin = (
        f", {best.score / runner_up.score:.3f}x {runner_up.candidate.policy}"
        if runner_up and runner_up.score > 0
        else ""
    )
    return PolicyDecision(
        best.candidate,
        tuple(scored),
        f"eq. 8: {best.candidate.policy} scores {best.score:.4g} samples/s "
        f"(throughput {best.candidate.throughput:.4g} x effective ratio "
        f"{best.effective_ratio:.4f} over {horizon_s:.0f} s){margin}",
    )


def chameleon_step(
    state: ClusterState, rerouting_allowed: bool, current_dp: int | None = None
) -> tuple[Candidate, bool]:
    """Chameleon's own choice (§III-IV): eq. (8) between rerouting, scored with its eq. (13)
    estimate, and dynamic parallelism. Rerouting needs the configured symmetric layout, so it is
    offered only until the first re-parallelisation (and again once the job is whole).
    `current_dp`: the DP degree of the plan in force (the search starts from it).
    Returns the plan to run and whether rerouting stays available."""
    rep = reparallelise(state, current_dp=current_dp)
    options = [rep]
    rec = recycle(state) if rerouting_allowed else None
    estimate = None
    if rec is not None and rec.feasible:
        estimate = replace(rec, step_time_s=rerouting_estimate(state).step_time_s)
        options.insert(0, estimate)
    chosen = decide(options, state.expected_time_to_next_event_s).chosen
    if rec is not None and chosen is estimate:
        return replace(rec, policy="chameleon", reason="rerouting: " + rec.reason), True
    return replace(rep, policy="chameleon", reason="dynamic parallelism: " + rep.reason), not state.failed
