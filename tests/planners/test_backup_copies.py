"""k copies of every ZeRO shard backup (`Layout.backup_copies`, planners.backup): the first copy is
§5.1's single copy unchanged, further copies go to failure domains of their own, a job with
fewer domains (or ranks) than asked falls back and says so, the Core declares RESTORE only when
a shard lost every copy, and every copy is counted in the memory checks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners.applicability import judge, lost_without_copy, unit_sources
from planners.backup import (
    BACKUP_ROWS,
    FLOAT_BYTES,
    backup_cost,
    backup_holder_sets,
    backup_holders,
    backup_placement,
    extra_copy_bytes,
    first_surviving,
    recovery_sources,
    shard_elements,
    snapshot_rank_bytes,
)
from planners.dataflow import resize_after_loss
from planners.layout import Layout, StageLayout, make_uniform_layout
from planners.placement import PlacementError, UnitCost, plan_placement
from planners.validation import validate


def uniform(pp: int, dp: int, layers: int = 8, k: int = 1) -> Layout:
    return make_uniform_layout(layers, pp, dp, 16, 2, (100,) * layers).replace(backup_copies=k)


def on_nodes(layout: Layout, nodes: list[tuple[int, ...]]) -> Layout:
    return layout.replace(rank_nodes=tuple((r, n) for n, ranks in enumerate(nodes) for r in ranks))


def node_of(layout: Layout, rank: int) -> int:
    return dict(layout.rank_nodes).get(rank, -1 - rank)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.integers(0, 3), st.integers(2, 4))
def test_one_copy_is_the_single_copy_rule_and_the_first_of_k(pp: int, dp: int, nodes: int, k: int) -> None:
    """k = 1 places exactly what the single-copy rule does; with k > 1 the first copy is that
    same one, and every holder is another rank, distinct from the shard's other holders."""
    layout = uniform(pp, dp)
    if nodes:
        layout = layout.replace(rank_nodes=tuple((r, r % nodes) for r in layout.ranks()))
    single = backup_holders(layout)
    assert backup_holder_sets(layout) == {r: (h,) for r, h in single.items()}
    assert "copies" not in backup_cost(layout).reason
    many = backup_holder_sets(layout.replace(backup_copies=k))
    assert {r: hs[0] for r, hs in many.items()} == single
    for rank, holders in many.items():
        assert rank not in holders and len(set(holders)) == len(holders) <= k


def test_further_copies_go_to_nodes_of_their_own() -> None:
    """Three nodes, stage DP order interleaved over them: with k = 2 the two copies of every
    shard sit on the two nodes that do not run it, so any two nodes lost leave a copy."""
    layout = on_nodes(uniform(2, 3, k=2), [(0, 3), (1, 4), (2, 5)])
    sets = backup_holder_sets(layout)
    assert sets == {0: (2, 1), 1: (0, 2), 2: (1, 0), 3: (5, 4), 4: (3, 5), 5: (4, 3)}
    for rank, holders in sets.items():
        assert len({node_of(layout, r) for r in (rank, *holders)}) == 3
    assert backup_placement(layout).notes == ()


def test_a_two_rank_stage_takes_its_second_copy_from_the_neighbouring_stage() -> None:
    layout = uniform(2, 2, k=2)  # every rank a node of its own; the ring has one other rank
    sets = backup_holder_sets(layout)
    assert sets == {0: (1, 2), 1: (0, 3), 2: (3, 0), 3: (2, 1)}  # spread over the neighbour's ranks


def test_more_copies_than_failure_domains_fall_back_and_say_why() -> None:
    two_nodes = on_nodes(uniform(2, 2, k=3), [(0, 2), (1, 3)])
    placed = backup_placement(two_nodes)
    for rank, holders in placed.holders.items():
        assert len(holders) == 3  # three distinct ranks, but only one other node exists
        assert node_of(two_nodes, holders[0]) != node_of(two_nodes, rank)
    assert any("share a node" in n and "spans 2 nodes" in n for n in placed.notes), placed.notes
    assert "share a node" in backup_cost(two_nodes).reason
    tiny = uniform(1, 2, k=3)  # two ranks: one other rank to keep a copy
    short = backup_placement(tiny)
    assert short.holders == {0: (1,), 1: (0,)}
    assert any("fewer than backup_copies=3" in n for n in short.notes), short.notes


def test_restore_only_when_a_shard_lost_every_copy() -> None:
    one, two = uniform(2, 3), uniform(2, 3, k=2)
    lost = frozenset({0, backup_holders(one)[0]})  # a rank and its first holder, one step
    assert (
        lost_without_copy(one, lost) == (0,) and not judge(one, resize_after_loss(one, lost).layout).in_place
    )
    verdict = judge(two, resize_after_loss(two, lost).layout)
    assert verdict.in_place and verdict.without_copy == (), verdict.reason
    assert recovery_sources(two, lost) == {0: 1, 2: 1}  # rank 0 from its second copy
    assert first_surviving(backup_holder_sets(two), 0, lost) == 1
    assert 1 in unit_sources(two, lost, 0)
    everything = frozenset({0, 1, 2})
    refused = judge(two, two.replace(stages=(StageLayout(0, 0, 8, (3, 4, 5)),)))
    assert not refused.in_place and set(refused.without_copy) == everything
    assert "every one of its 2 backup copies" in refused.reason


def test_the_cost_counts_every_copy() -> None:
    layout = uniform(3, 2, k=2)
    elements = shard_elements(layout)
    per_row = BACKUP_ROWS * FLOAT_BYTES
    held = backup_cost(layout).per_rank_bytes
    assert sum(held.values()) == 2 * per_row * sum(elements.values())
    single = backup_cost(layout.replace(backup_copies=1)).per_rank_bytes
    extra = extra_copy_bytes(layout)
    assert {r: single[r] + extra.get(r, 0) for r in layout.ranks()} == held
    assert "2 copies of every shard, all counted" in backup_cost(layout).reason


def test_the_gradient_exchange_counts_each_copy_on_another_node() -> None:
    """Every holder receives its owner's gradient shard every step (executor.fabric.snapshot):
    from copy index 1 on only the copies beyond the first; same-node copies stay in host memory."""
    layout = on_nodes(uniform(2, 3, k=2), [(0, 3), (1, 4), (2, 5)])
    elements = shard_elements(layout)
    sets = backup_holder_sets(layout)
    extra = snapshot_rank_bytes(layout, from_copy=1, grad_bytes=2)
    for rank in sets:
        assert extra[rank][0] == 2 * elements[rank]  # one further copy, on a node of its own
    assert sum(i for _, i in extra.values()) == sum(o for o, _ in extra.values())
    every = snapshot_rank_bytes(layout)  # both copies, fp32
    assert all(every[r][0] == 2 * 4 * elements[r] for r in layout.ranks())
    assert snapshot_rank_bytes(layout.replace(backup_copies=1), from_copy=1) == {}
    one_node = on_nodes(uniform(2, 3, k=2), [(0, 1, 2, 3, 4, 5)])
    assert snapshot_rank_bytes(one_node) == {}


class _Flat:
    def stage_memory_bytes(self, layout: Layout, stage: int) -> float:
        return 1000.0


def test_validation_counts_the_extra_copies_against_the_cap() -> None:
    base = uniform(2, 2).replace(stage_mem_cap_bytes=(1500.0, 1500.0))
    assert validate(base, _Flat()).ok  # one copy: the model's own estimate
    two = base.replace(backup_copies=2)
    extra = max(extra_copy_bytes(two).values())
    assert extra > 500
    report = validate(two, _Flat())
    assert not report.ok and "extra shard backup copies" in report.reason, report.reason
    assert validate(two.replace(stage_mem_cap_bytes=(1000.0 + extra,) * 2), _Flat()).ok


def test_placement_counts_every_copy_against_the_cap() -> None:
    units = [UnitCost(f"u{i}", numel=10_000, param_bytes=40_000, seconds_per_sample=0.01) for i in range(4)]
    kw = {"global_batch": 8, "micro_batches": 2, "nnodes": 2, "nproc_per_node": 2, "pp": 2}
    one = plan_placement(units, **kw)
    two = plan_placement(units, backup_copies=2, **kw)
    assert two.layout.backup_copies == 2
    assert one.backup is not None and two.backup is not None
    assert sum(two.backup.per_rank_bytes.values()) == 2 * sum(one.backup.per_rank_bytes.values())
    assert max(two.stage_mem_bytes) > max(one.stage_mem_bytes)
    with pytest.raises(PlacementError, match="with the shard backups it keeps"):
        plan_placement(units, backup_copies=2, mem_cap_bytes=max(one.stage_mem_bytes), **kw)
    with pytest.raises(PlacementError, match="backup_copies must be >= 1"):
        plan_placement(units, backup_copies=0, **kw)
