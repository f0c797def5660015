"""Every simulated policy: its plan after each cluster change and what reaching it costs.

- `elaswave`, `elaswave-migrate`, `elaswave-resize`: this project's Core and executor
  (`simulator.elaswave_sim`): the Core's own planner, credited in place only where the executor's
  applicability rule allows, RESTORE otherwise.
- `elaswave-theoretical`: the ElasWave paper's system (`planners.chameleon.elastic`): any plan in
  place, joins in place through the dynamic communicator's scale-up (ElasWave §5, Fig. 8) with
  the joining ranks' state sent by their peers. Labelled: the executor here cannot apply all of
  these plans.
- `torchft`: whole replicas only. `RecoveryCosts.torchft_model = "docs"` (default): survivors
  continue after a quorum change, a joining replica heals from a live peer while the others train
  (torchft's documentation); "paper": a ~20 s full restart on every change (ElasWave §7.6).
- `recycle`: rerouting with its deferred-W memory (`simulator.baselines`), restart without damaged
  replicas when rerouting cannot run.
- `chameleon`, `oobleck`: dynamic parallelism (Chameleon §III-IV) and Oobleck's templates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from planners.chameleon.candidates import torchft
from planners.chameleon.elastic import elaswave as elaswave_candidate
from planners.chameleon.policy import chameleon_step
from planners.chameleon.reparallel import oobleck
from planners.chameleon.state import Candidate, ClusterState
from planners.elaswave_policy import ElasWaveSettings
from simulator.baselines import recycle_or_restart
from simulator.cluster import ClusterChange
from simulator.costs import RecoveryCosts
from simulator.elaswave_sim import ElasWavePolicy
from simulator.jobs import LINK_BYTES_PER_S, JobSpec
from simulator.layouts import rank_state_bytes
from simulator.sim_policy import (
    Pricer,
    SimPolicy,
    Transition,
    dp_degree,
    healthy_layout,
    held_layers,
    itemised,
    ranks_of,
    signature,
)


@dataclass
class CandidatePolicy(SimPolicy):
    """A baseline planned from the dead ranks and its previous plan (what every rank holds under
    it: the state a new plan moves is priced from there, not from the configured layout);
    `price` says what reaching a new plan costs."""

    build: Callable[[JobSpec, ClusterState], tuple[Candidate, str]] = lambda spec, s: (torchft(s), "")
    price: Pricer = lambda p, cand, how, lost, arrived, step_s: Transition(cand)
    plan_ranks: set = field(default_factory=set)
    previous: Candidate | None = None  # the plan in force

    def plan(self, dead: frozenset[int]) -> tuple[Candidate, str]:
        key = (dead, held_layers(self.previous))
        if key not in self.cache:
            self.cache[key] = self.build(self.spec, self.state(dead, key[1]))
        return self.cache[key]

    def step(self, change: ClusterChange, step_before_s: float) -> Transition:
        dead, lost, arrived = self.ranks(change)
        cand, how = self.plan(dead)
        if not self.running:  # the starting cluster: nothing to recover from
            self.running, self.plan_ranks, self.previous = signature(cand), ranks_of(cand), cand
            return Transition(cand)
        before, after = self.running, signature(cand)
        self.running = after
        if cand.feasible:
            self.previous = cand
        lost_running = lost & self.plan_ranks  # ranks the running plan used
        self.plan_ranks = ranks_of(cand)
        joining = arrived & self.plan_ranks  # arrived ranks the new plan uses
        if before == after and not lost_running and not joining:
            return Transition(cand)
        t = self.price(self, cand, how, bool(lost_running), frozenset(joining), step_before_s)
        if t.heal_s > 0:  # the others train without the joining ranks meanwhile
            t = replace(t, heal_throughput=self.plan(dead | frozenset(joining))[0].throughput)
        return t


@dataclass
class ChameleonPolicy(CandidatePolicy):
    """Chameleon's own choice (eq. 8 between rerouting and dynamic parallelism); rerouting needs
    the configured symmetric layout, so it is offered only until the first re-parallelisation."""

    rerouting_allowed: bool = True

    def plan(self, dead: frozenset[int]) -> tuple[Candidate, str]:
        state = self.state(dead, held_layers(self.previous))
        cand, self.rerouting_allowed = chameleon_step(state, self.rerouting_allowed, dp_degree(self.previous))
        return cand, "rerouting" if cand.reason.startswith("rerouting") else "reparallelise"


@dataclass
class RecyclePolicy(CandidatePolicy):
    """ReCycle planned from its previous plan: it reroutes around the dead ranks of the replicas
    it runs; when rerouting cannot run it restarts without the damaged replicas, and those stay
    out (its configured layout is now the smaller one) until each is whole again."""

    excluded: frozenset[int] = frozenset()  # replicas the last restart dropped

    def plan(self, dead: frozenset[int]) -> tuple[Candidate, str]:
        pp = self.spec.shape.pp
        whole_again = {d for d in self.excluded if not any(r // pp == d for r in dead)}
        self.excluded = self.excluded - whole_again
        out = frozenset(r for d in self.excluded for r in range(d * pp, (d + 1) * pp))
        key = (dead | out, "recycle")
        if key not in self.cache:
            self.cache[key] = _build_recycle(self.spec, self.state(dead | out))
        cand, how = self.cache[key]
        if how == "restart":
            self.excluded |= {r // pp for r in dead}
        return cand, how


def price_torchft(
    p: SimPolicy, cand: Candidate, how: str, lost: bool, arrived: frozenset[int], step_s: float
) -> Transition:
    c = p.costs
    if c.torchft_model == "paper":
        items = [("restart", c.torchft_restart_s)] + ([("replay", p.replay_s(step_s))] if lost else [])
        return itemised(cand, "restart", items)
    items = [("communicator", c.partial_communicator_s)]  # survivors change quorum (torchft docs)
    if lost:  # ... and go on without the lost replica after replaying the step in flight
        items = [("detection", c.detection_s), *items, ("replay", p.replay_s(step_s))]
    # A joining replica heals from a live peer while the others train (torchft docs).
    heal = c.transfer_s(
        max((rank_state_bytes(p.spec, healthy_layout(p.spec), r) for r in arrived), default=0.0)
    )
    return itemised(cand, "in place", items, heal_s=heal)


def price_recycle(
    p: SimPolicy, cand: Candidate, how: str, lost: bool, arrived: frozenset[int], step_s: float
) -> Transition:
    c = p.costs
    items = [("detection", c.detection_s)] if lost else []
    if how == "restart":
        items += [("communicator", c.full_communicator_s)]
    else:
        items += [("communicator", c.partial_communicator_s)]
    if arrived:
        state = max(rank_state_bytes(p.spec, healthy_layout(p.spec), r) for r in arrived)
        items.append(("state transfer", c.transfer_s(state)))
    if lost:
        items.append(("replay", p.replay_s(step_s)))
    return itemised(cand, "restart" if how == "restart" else "in place", items)


def price_replan(restart: Callable[[RecoveryCosts], float], label: str) -> Pricer:
    """Chameleon / Oobleck: a restart into the new plan plus its transfer (cand.transition_s)."""

    def price(
        p: SimPolicy, cand: Candidate, how: str, lost: bool, arrived: frozenset[int], step_s: float
    ) -> Transition:
        c = p.costs
        items = [("detection", c.detection_s)] if lost else []
        comm = c.partial_communicator_s if how == "rerouting" else restart(c)
        moved = cand.transition_s * LINK_BYTES_PER_S  # the plan's transfer from the configured layout
        joining = max((rank_state_bytes(p.spec, healthy_layout(p.spec), r) for r in arrived), default=0.0)
        items += [(label, comm), ("state transfer", c.transfer_s(max(moved, joining)))]
        if lost:
            items.append(("replay", p.replay_s(step_s)))
        return itemised(cand, "restart", items)

    return price


def price_theoretical(
    p: SimPolicy, cand: Candidate, how: str, lost: bool, arrived: frozenset[int], step_s: float
) -> Transition:
    c = p.costs
    items = [("detection", c.detection_s)] if lost else []
    items += [("planning", c.elaswave_planning_s), ("communicator", c.elaswave_communicator_s)]
    moved = cand.transition_s * LINK_BYTES_PER_S  # migration into the busiest rank
    if arrived:
        moved += max(rank_state_bytes(p.spec, healthy_layout(p.spec), r) for r in arrived)
    items.append(("state transfer", c.transfer_s(moved)))
    if lost:
        items.append(("replay", p.replay_s(step_s)))
    return itemised(cand, "in place", items)


def _build_recycle(spec: JobSpec, state: ClusterState) -> tuple[Candidate, str]:
    cand, restarted = recycle_or_restart(spec, state)
    return cand, "restart" if restarted else "reroute"


def _build_theoretical(spec: JobSpec, state: ClusterState) -> tuple[Candidate, str]:
    return replace(elaswave_candidate(state), policy="elaswave-theoretical"), ""


SIM_POLICIES: tuple[str, ...] = (
    "elaswave",
    "elaswave-migrate",
    "elaswave-resize",
    "elaswave-theoretical",
    "recycle",
    "torchft",
    "oobleck",
    "chameleon",
)
BASELINES: tuple[str, ...] = ("recycle", "torchft", "oobleck", "chameleon")


def make_policy(
    name: str, spec: JobSpec, costs: RecoveryCosts, event_rate_per_s: float = 1 / 3600
) -> SimPolicy:
    """The policy `name`; `event_rate_per_s`: how often the cluster changes (for join decisions)."""
    ablations = {
        "elaswave": ElasWaveSettings(),
        "elaswave-migrate": ElasWaveSettings(dvfs=False),
        "elaswave-resize": ElasWaveSettings(migrate=False, dvfs=False),
    }
    if name in ablations:
        return ElasWavePolicy(name, spec, costs, settings=ablations[name], event_rate_per_s=event_rate_per_s)
    if name == "elaswave-theoretical":
        return CandidatePolicy(name, spec, costs, build=_build_theoretical, price=price_theoretical)
    if name == "recycle":
        return RecyclePolicy(name, spec, costs, price=price_recycle)
    if name == "torchft":
        return CandidatePolicy(name, spec, costs, build=lambda sp, s: (torchft(s), ""), price=price_torchft)
    if name == "oobleck":
        restart = price_replan(lambda c: c.full_communicator_s, "restart")
        return CandidatePolicy(name, spec, costs, build=lambda sp, s: (oobleck(s), ""), price=restart)
    if name == "chameleon":
        return ChameleonPolicy(
            name, spec, costs, price=price_replan(lambda c: c.chameleon_restart_s, "restart")
        )
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(SIM_POLICIES)}")
