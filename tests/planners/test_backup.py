"""Where shard backups go (planners.backup) and what the Core may then publish in place
(planners.applicability): one node's loss never takes a shard and its copy, a whole stage lost
keeps its state in a neighbouring stage, and state never has to travel between stages that share
no group."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners.applicability import far_pairs, judge, lost_without_copy
from planners.backup import BACKUP_ROWS, FLOAT_BYTES, backup_cost, backup_holders, shard_elements
from planners.layout import Layout, StageLayout, make_uniform_layout
from planners.placement import PlacementError, UnitCost, plan_placement


def uniform(pp: int, dp: int, layers: int = 8) -> Layout:
    return make_uniform_layout(layers, pp, dp, 16, 2, (100,) * layers)


def with_nodes(layout: Layout, nodes: list[tuple[int, ...]]) -> Layout:
    return layout.replace(rank_nodes=tuple((r, n) for n, ranks in enumerate(nodes) for r in ranks))


def test_ring_predecessor_on_another_node_keeps_the_copy() -> None:
    layout = uniform(2, 3)  # stage 0: 0 1 2, stage 1: 3 4 5; every rank a node of its own
    assert backup_holders(layout) == {0: 2, 1: 0, 2: 1, 3: 5, 4: 3, 5: 4}


def test_a_stage_on_one_node_is_backed_up_in_its_neighbour_on_another_node() -> None:
    layout = with_nodes(uniform(2, 2), [(0, 1), (2, 3)])  # torchrun's numbering: a stage per node
    holders = backup_holders(layout)
    assert holders == {0: 2, 1: 3, 2: 0, 3: 1}  # next stage for stage 0, previous for the last
    assert lost_without_copy(layout, frozenset({2, 3})) == ()  # node 1 lost: every copy on node 0


def test_a_dp1_stage_is_backed_up_by_the_next_stage_and_the_last_by_the_previous() -> None:
    holders = backup_holders(uniform(3, 1))
    assert holders == {0: 1, 1: 2, 2: 1}
    assert backup_holders(uniform(1, 1)) == {}  # one rank: nowhere to keep a copy


def test_same_node_copies_only_when_nothing_else_exists() -> None:
    one_node = with_nodes(uniform(2, 2), [(0, 1, 2, 3)])
    assert backup_holders(one_node) == {0: 1, 1: 0, 2: 3, 3: 2}  # a process loss is still covered


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(2, 4), st.integers(1, 4))
def test_one_node_loss_leaves_a_copy_of_every_shard(pp: int, nnodes: int, per_node: int) -> None:
    """The launcher's placement over any number of nodes, and torchrun's node-major numbering
    of the same ranks (a stage may then sit on one node): losing any one node leaves a copy."""
    units = [UnitCost(f"u{i}", numel=100, param_bytes=400, seconds_per_sample=0.01) for i in range(8)]
    if nnodes * per_node < pp:
        return
    placement = plan_placement(
        units, global_batch=64, micro_batches=2, nnodes=nnodes, nproc_per_node=per_node, pp=pp
    )
    node_major = placement.layout.replace(
        rank_nodes=tuple((r, r // per_node) for r in range(nnodes * per_node))
    )
    for layout in (placement.layout, node_major):
        for node in range(nnodes):
            ranks = frozenset(r for r, n in layout.rank_nodes if n == node)
            assert lost_without_copy(layout, ranks) == (), (pp, nnodes, per_node, node)


def test_whole_stage_loss_is_in_place_and_stage_with_its_backups_is_not() -> None:
    old = with_nodes(uniform(2, 2), [(0, 1), (2, 3)])
    fewer = old.replace(stages=(StageLayout(0, 0, 8, (0, 1)),))
    verdict = judge(old, fewer)
    assert verdict.in_place and verdict.lost == {2, 3}, verdict.reason
    ring_only = uniform(2, 2)  # no node information: the copies of stage 1 are inside stage 1
    refused = judge(ring_only, fewer)
    assert not refused.in_place and refused.without_copy == (2, 3)
    assert "no surviving copy" in refused.reason


def test_state_between_stages_that_are_not_adjacent_gets_a_pair_group() -> None:
    old = uniform(4, 1)  # 0 | 1 | 2 | 3, two layers each
    # rank 3 moves to stage 0, but blocks 6-7 it holds are needed by stage 2, two stages away
    far = old.replace(
        stages=(StageLayout(0, 0, 2, (3,)), StageLayout(1, 2, 4, (1,)), StageLayout(2, 4, 8, (2,)))
    )
    verdict = judge(old, far)
    assert verdict.in_place and verdict.lost == {0}, verdict.reason
    assert far_pairs(old, far, verdict.lost) == ((3, 2),)
    near = old.replace(
        stages=(StageLayout(0, 0, 4, (0,)), StageLayout(1, 4, 6, (2,)), StageLayout(2, 6, 8, (3,)))
    )
    assert judge(old, near).in_place  # stage 1 lost: its blocks go to stage 0 from stage 2's copy
    assert far_pairs(old, near, frozenset({1})) == ()


def test_the_cost_is_three_rows_of_every_shard_kept() -> None:
    layout = uniform(3, 1)
    cost = backup_cost(layout)
    elements = shard_elements(layout)
    per_row = BACKUP_ROWS * FLOAT_BYTES
    assert cost.per_rank_bytes == {0: 0, 1: per_row * (elements[0] + elements[2]), 2: per_row * elements[1]}
    assert cost.stage_max_bytes(layout, 1) == cost.max_bytes
    assert "3 of 3 shards are backed up in a neighbouring stage" in cost.reason


def test_placement_tells_the_layout_where_ranks_run_and_reports_the_cost() -> None:
    units = [UnitCost(f"u{i}", numel=1000, param_bytes=4000, seconds_per_sample=0.01) for i in range(4)]
    placement = plan_placement(units, global_batch=8, micro_batches=2, nnodes=2, nproc_per_node=1, pp=2)
    assert dict(placement.layout.rank_nodes) == {0: 0, 1: 1}
    assert placement.backup is not None and placement.backup.max_bytes > 0
    assert "shard backups take" in placement.reason


def test_the_placement_memory_check_counts_the_backups_a_rank_keeps() -> None:
    """PP=2 over 3 ranks: stage 1 is one rank whose whole shard is backed up on stage 0's rank 0,
    which then needs more than the estimate's copy of its own share."""
    units = [UnitCost(f"u{i}", numel=10_000, param_bytes=40_000, seconds_per_sample=0.01) for i in range(4)]
    free = plan_placement(units, global_batch=8, micro_batches=2, nnodes=1, nproc_per_node=3, pp=2)
    assert free.layout.dp_sizes == (2, 1) and backup_holders(free.layout)[2] == 0
    own_share = 3 * free.stage_param_bytes[0] / 2
    assert free.backup is not None and free.backup.per_rank_bytes[0] > own_share
    with pytest.raises(PlacementError, match="with the shard backups it keeps"):
        plan_placement(
            units,
            global_batch=8,
            micro_batches=2,
            nnodes=1,
            nproc_per_node=3,
            pp=2,
            mem_cap_bytes=free.stage_mem_bytes[0] - 1,
        )
