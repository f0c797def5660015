"""Every baseline plans from its previous plan (issue 25 item 4): the state a new plan moves is
priced from what the ranks hold under the plan in force, Chameleon searches DP degrees around
the running one, and ReCycle keeps the replicas its restart dropped out until they are whole."""

from __future__ import annotations

from planners.chameleon.reparallel import oobleck, reparallelise
from simulator.cluster import ClusterChange
from simulator.costs import RecoveryCosts
from simulator.jobs import JOBS, ranks_of_devices
from simulator.policies import RecyclePolicy, make_policy
from simulator.sim_policy import dp_degree, held_layers

SPEC = JOBS["llama2-7b"]


def dead_nodes(*nodes: int) -> frozenset[int]:
    return ranks_of_devices(SPEC, {d for n in nodes for d in range(8 * n, 8 * n + 8)})


def test_a_plan_reached_again_from_itself_moves_nothing() -> None:
    policy = make_policy("chameleon", SPEC, RecoveryCosts())
    for build in (reparallelise, oobleck):
        first = build(policy.state(dead_nodes(11)))
        assert first.feasible and first.bytes_moved > 0  # from the configured layout
        again = build(policy.state(dead_nodes(11), held_layers(first)))
        assert again.feasible and again.bytes_moved == 0.0, again.reason


def test_chameleon_searches_around_the_dp_degree_in_force() -> None:
    state = make_policy("chameleon", SPEC, RecoveryCosts()).state(dead_nodes(3, 7, 11))
    near_configured = reparallelise(state, dp_range=0)
    near_previous = reparallelise(state, dp_range=0, current_dp=6)
    assert dp_degree(near_configured) == SPEC.shape.dp and dp_degree(near_previous) == 6


def test_recycle_keeps_the_replicas_its_restart_dropped_until_they_are_whole() -> None:
    policy = make_policy("recycle", JOBS["llama2-34b"], RecoveryCosts())
    assert isinstance(policy, RecyclePolicy)
    spec = JOBS["llama2-34b"]
    policy.step(ClusterChange(0.0, frozenset()), float("inf"))
    three = frozenset(range(spec.shape.num_devices - 24, spec.shape.num_devices))
    t = policy.step(ClusterChange(600.0, three, lost_slots=(9, 10, 11)), 1.0)
    assert "out of memory" in t.candidate.reason and policy.excluded  # ElasWave §7.2's case
    two = frozenset(range(spec.shape.num_devices - 16, spec.shape.num_devices))
    t2 = policy.step(ClusterChange(700.0, two, joined_slots=(9,)), 1.0)
    assert policy.excluded, "a replica with a dead rank stays out"
    assert t2.candidate.throughput == t.candidate.throughput
    policy.step(ClusterChange(800.0, frozenset(), joined_slots=(10, 11)), 1.0)
    assert not policy.excluded
