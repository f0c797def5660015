"""What every simulated policy shares: the transition a change leads to, the stateful base class,
the price of a change as itemised costs, and the job's healthy layout."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from planners.chameleon.state import Candidate, ClusterState, MttrModel
from planners.layout import Layout
from simulator.cluster import ClusterChange
from simulator.costs import RecoveryCosts
from simulator.jobs import JobSpec, ranks_of_devices
from simulator.layouts import initial_layout

# Transfer-only MTTRs: the candidates' transition_s is then the state moved, priced by RecoveryCosts.
TRANSFER_ONLY = MttrModel(0.0, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Transition:
    """The plan running after a change and what reaching it cost."""

    candidate: Candidate
    stall_s: float = 0.0  # no progress
    heal_s: float = 0.0  # then `heal_throughput`, before the new plan's (TorchFT healing)
    heal_throughput: float = 0.0
    mode: str = ""  # "in place", "restore", "restart", "" (nothing to do)
    costs: tuple[tuple[str, float], ...] = ()
    layout: Layout | None = None
    previous_layout: Layout | None = None


@dataclass
class SimPolicy(ABC):
    """Base: a stateful policy the engine steps through the changes of one run; each policy
    (`simulator.policies`, `simulator.elaswave_sim`) says what a change leads to (`step`)."""

    name: str
    spec: JobSpec
    costs: RecoveryCosts
    running: tuple = ()
    cache: dict = field(default_factory=dict)

    def ranks(self, change: ClusterChange) -> tuple[frozenset[int], frozenset[int], frozenset[int]]:
        """(dead ranks, ranks lost at this change, ranks whose node was swapped or joined)."""
        dead = ranks_of_devices(self.spec, set(change.dead_devices))
        lost = ranks_of_devices(self.spec, set(change.devices("lost")))
        swapped = ranks_of_devices(self.spec, set(change.devices("swapped")))
        joined = ranks_of_devices(self.spec, set(change.devices("joined")))
        return dead, lost | swapped, (swapped | joined) - dead

    def state(self, dead: frozenset[int], held: tuple[tuple[int, int, int], ...] = ()) -> ClusterState:
        """The cluster with `dead` ranks; `held`: what every rank holds under the plan in force."""
        return ClusterState(
            self.spec.shape, self.spec.profile(), failed=dead, mttr=TRANSFER_ONLY, held_layers=held
        )

    def replay_s(self, step_s: float) -> float:
        return self.costs.replay_fraction * step_s if step_s != float("inf") else 0.0

    @abstractmethod
    def step(self, change: ClusterChange, step_before_s: float) -> Transition:
        """The plan running after `change` and what reaching it cost."""


# What reaching `candidate` costs: (policy, candidate, how it was planned, ranks of the running
# plan were lost, ranks joining the new plan, the step time before the change) -> Transition.
Pricer = Callable[[SimPolicy, Candidate, str, bool, frozenset[int], float], Transition]


def signature(cand: Candidate) -> tuple:
    if not cand.feasible:
        return ("infeasible", cand.reason)
    return tuple(
        (p.num_slots, tuple((s.layer_start, s.layer_stop, s.ranks, s.freq_mhz) for s in p.stages))
        for p in cand.pipelines
    )


def held_layers(cand: Candidate | None) -> tuple[tuple[int, int, int], ...]:
    """(rank, layer_start, layer_stop) of every rank of `cand`: what a policy that plans from its
    previous plan moves state from (`ClusterState.held_layers`)."""
    if cand is None or not cand.feasible:
        return ()
    return tuple(
        sorted((r, s.layer_start, s.layer_stop) for p in cand.pipelines for s in p.stages for r in s.ranks)
    )


def dp_degree(cand: Candidate | None) -> int | None:
    """Replicas of `cand`: its pipelines, or the ranks of its one pipeline's first stage."""
    if cand is None or not cand.feasible or not cand.pipelines:
        return None
    return len(cand.pipelines) if len(cand.pipelines) > 1 else len(cand.pipelines[0].stages[0].ranks)


def ranks_of(cand: Candidate) -> set[int]:
    return {r for p in cand.pipelines for s in p.stages for r in s.ranks}


def itemised(cand: Candidate, mode: str, items: list[tuple[str, float]], heal_s: float = 0.0) -> Transition:
    items = [(k, v) for k, v in items if v > 0]
    return Transition(cand, sum(v for _, v in items), heal_s=heal_s, mode=mode, costs=tuple(items))


@lru_cache(maxsize=16)
def healthy_layout(spec: JobSpec) -> Layout:
    """The job's healthy layout, built once per job."""
    return initial_layout(spec)
