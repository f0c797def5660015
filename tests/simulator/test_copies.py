"""What the simulator credits `elaswave` with is what the executor applies: in place only while
one of the k copies the executor keeps (`planners.backup.backup_holder_sets`) survives, k from
the job's first layout on (the prior of `planners.redundancy`), and a RESTORE paid in full even
when the next change comes before it is done; and what the copies cost is what the executor pays:
the gradient exchange of every copy beyond the first on every step, the re-seed of the copies a
plan moved, and the whole state of a rank whose node was swapped for a spare."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planners.applicability import lost_without_copy
from planners.backup import backup_holder_sets, shard_elements
from planners.layout import Layout
from simulator.cluster import ClusterChange, cluster_timeline
from simulator.copies import in_place
from simulator.costs import RecoveryCosts
from simulator.elaswave_sim import migration_bytes
from simulator.engine import run_policy
from simulator.jobs import JOBS
from simulator.layouts import (
    busiest_state_bytes,
    extra_copy_traffic_s,
    layout_candidate,
    rank_state_bytes,
    reseed_bytes,
)
from simulator.policies import make_policy
from simulator.traces import TraceEvent

SPEC = JOBS["llama2-34b"]  # 12 nodes of 2 ranks (TP 4 on 8 devices), PP 8 x DP 3


def first_layout() -> Layout:
    policy = make_policy("elaswave", SPEC, RecoveryCosts())
    layout = policy.step(ClusterChange(0.0, frozenset()), float("inf")).layout
    assert layout is not None
    return layout


def test_the_first_layout_keeps_the_prior_copies() -> None:
    policy = make_policy("elaswave", SPEC, RecoveryCosts())
    tr = policy.step(ClusterChange(0.0, frozenset()), float("inf"))
    assert tr.layout is not None and tr.layout.backup_copies == 2
    assert tr.candidate.reason == "healthy layout; backup copies 1->2", tr.candidate.reason


def test_in_place_only_while_a_copy_the_executor_keeps_survives() -> None:
    layout = first_layout()
    sets = backup_holder_sets(layout)
    rank = 5
    first, second = sets[rank][:2]
    one = replace(layout, backup_copies=1)
    for lost in ({rank, first}, {rank, first, second}):
        lost_set = frozenset(lost)
        for lay in (one, layout):
            assert in_place(lay, lay, lost_set) == (not lost_without_copy(lay, lost_set))
    assert not in_place(one, one, frozenset({rank, first}))  # its only copy went with it
    assert in_place(layout, layout, frozenset({rank, first}))  # the second copy survives
    assert not in_place(layout, layout, frozenset({rank, first, second}))


@pytest.mark.parametrize("join_start_s", [0.0, 30.0])
def test_a_restore_the_next_change_interrupts_is_still_paid_in_full(join_start_s: float) -> None:
    layout = first_layout()
    rank = 5
    nodes = dict(layout.rank_nodes)
    burst = sorted({nodes[r] for r in (rank, *backup_holder_sets(layout)[rank])})
    assert len(burst) == 3  # the shard and its two copies on three nodes
    events = [TraceEvent(0, "add", f"n{i:02d}") for i in range(SPEC.num_nodes)]
    events += [TraceEvent(1000, "remove", f"n{n:02d}") for n in burst]
    events += [TraceEvent(1100, "add", f"fresh{i}") for i in range(3)]  # before the restore ends
    costs = RecoveryCosts(join_start_s=join_start_s)  # the joiner starting: the restore goes on
    run = run_policy("elaswave", SPEC, cluster_timeline(events, SPEC).changes, 6000.0, costs)
    assert run.restores == 1
    stalled = [s for s in run.segments if s.kind == "recovery" and s.start_s < 4000]
    restore = costs.restore_s(busiest_state_bytes(SPEC, layout))
    assert stalled[0].start_s == 1000 and stalled[0].end_s == 1100  # cut short by the join ...
    assert any(name == "unfinished restore" for name, _ in stalled[-1].costs)  # ... paid after it
    assert sum(s.duration_s for s in stalled) >= restore
    # Nothing trains until it is done (also not while the joining node starts).
    assert not [s for s in run.segments if s.throughput > 0 and 1000 <= s.start_s < stalled[-1].end_s]


def test_every_copy_beyond_the_first_costs_its_gradient_exchange_every_step() -> None:
    layout = first_layout()  # k = 2
    prof = SPEC.profile()
    extra = extra_copy_traffic_s(SPEC, layout)
    # One more gradient shard (bf16, as the step model's all-reduce) out of the busiest rank.
    shard = max(shard_elements(layout).values()) * 2
    assert extra == pytest.approx(shard / prof.allreduce_bytes_per_s)
    assert extra_copy_traffic_s(SPEC, replace(layout, backup_copies=1)) == 0.0
    assert extra_copy_traffic_s(SPEC, replace(layout, backup_copies=3)) > extra
    policy = make_policy("elaswave", SPEC, RecoveryCosts())
    tr = policy.step(ClusterChange(0.0, frozenset()), float("inf"))
    bare = layout_candidate(SPEC, layout, "elaswave", tr.candidate.reason)
    assert tr.candidate.step_time_s == pytest.approx(bare.step_time_s + extra)


def test_a_plan_pays_the_re_seed_of_the_copies_it_moved_and_a_swapped_rank_its_whole_state() -> None:
    layout = first_layout()
    per_row = 12  # parameters and both Adam moments, fp32
    assert reseed_bytes(layout, layout) == 0.0  # nothing moved
    everything = reseed_bytes(None, layout)  # after a RESTORE: every copy
    assert everything > 0 and everything >= per_row * max(shard_elements(layout).values())
    assert 0 < reseed_bytes(layout, layout, frozenset({5})) <= everything  # rank 5's node swapped
    # Same rank ids (device positions), but the swapped rank holds nothing: it receives it all.
    assert migration_bytes(SPEC, layout, layout) == 0.0
    assert migration_bytes(SPEC, layout, layout, frozenset({5})) == pytest.approx(
        rank_state_bytes(SPEC, layout, 5)
    )
    # A swap (node 2's ranks lost, a spare in the slot at once): the recovery says both.
    events = [TraceEvent(0, "add", f"n{i:02d}") for i in range(SPEC.num_nodes)] + [
        TraceEvent(0, "add", "spare")
    ]
    events += [TraceEvent(1000, "remove", "n02")]
    run = run_policy("elaswave", SPEC, cluster_timeline(events, SPEC).changes, 3000.0, RecoveryCosts())
    (recovery,) = [s for s in run.segments if s.kind == "recovery"]
    items = dict(recovery.costs)
    assert recovery.mode == "in place" and items["backup re-seed"] > 0 and items["state transfer"] > 0
