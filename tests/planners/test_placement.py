"""Initial placement (`planners.placement`): balanced stages, ranks spread over nodes, clear refusals."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners.placement import PlacementError, UnitCost, plan_placement
from planners.validation import validate


def units(costs: list[float], sizes: list[int] | None = None) -> list[UnitCost]:
    sizes = sizes or [10] * len(costs)
    return [UnitCost(f"u{i}", n, 4 * n, c) for i, (c, n) in enumerate(zip(costs, sizes, strict=True))]


def test_partition_minimises_the_slowest_stage() -> None:
    # A heavy block in the middle: the best 2-way split isolates the cheap tail, not the midpoint.
    p = plan_placement(
        units([1, 1, 6, 1, 1]), global_batch=8, micro_batches=2, nnodes=1, nproc_per_node=2, pp=2
    )
    blocks = [(s.layer_start, s.layer_stop) for s in p.layout.stages]
    worst = max(p.stage_step_s)
    best = (
        min(max(sum([1, 1, 6, 1, 1][:k]), sum([1, 1, 6, 1, 1][k:])) for k in range(1, 5)) * 8
    )  # DP 1: 8 samples
    assert worst == pytest.approx(best)
    assert blocks in ([(0, 3), (3, 5)], [(0, 2), (2, 5)])
    assert validate(p.layout).ok


def test_ties_in_time_go_to_balanced_parameter_bytes() -> None:
    # Every unit costs the same time; sizes differ, so the byte-balanced split is the only tie-break.
    u = units([1, 1, 1, 1], sizes=[100, 1, 1, 100])
    p = plan_placement(u, global_batch=4, micro_batches=1, nnodes=1, nproc_per_node=2, pp=2)
    assert [(s.layer_start, s.layer_stop) for s in p.layout.stages] == [(0, 2), (2, 4)]
    assert p.stage_param_bytes == (404, 404)
    # Nearly equal times (measurement noise) count as a tie too, within the tolerance.
    # Splitting after unit 1 is 0.4% faster (1.01 vs 1.014 per sample); after unit 0 balances bytes better.
    u = units([1, 0.01, 1.004], sizes=[300, 1, 1])
    kw = {"global_batch": 4, "micro_batches": 1, "nnodes": 1, "nproc_per_node": 2, "pp": 2}
    p = plan_placement(u, **kw, time_tolerance=0.01)
    assert [(s.layer_start, s.layer_stop) for s in p.layout.stages] == [(0, 1), (1, 3)]
    p = plan_placement(u, **kw, time_tolerance=0.0)
    assert [(s.layer_start, s.layer_stop) for s in p.layout.stages] == [(0, 2), (2, 3)]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 9), min_size=1, max_size=7),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 3),
)
def test_partition_is_optimal_against_brute_force(costs: list[int], pp: int, nnodes: int, nproc: int) -> None:
    world = nnodes * nproc
    if pp > len(costs) or pp > world:
        with pytest.raises(PlacementError):
            plan_placement(
                units([float(c) for c in costs]),
                global_batch=12,
                micro_batches=2,
                nnodes=nnodes,
                nproc_per_node=nproc,
                pp=pp,
            )
        return
    p = plan_placement(
        units([float(c) for c in costs]),
        global_batch=12,
        micro_batches=2,
        nnodes=nnodes,
        nproc_per_node=nproc,
        pp=pp,
        time_tolerance=0.0,
    )
    dp = [s.dp_size for s in p.layout.stages]
    assert sum(dp) == world and max(dp) - min(dp) <= 1
    best = min(
        max(
            sum(costs[a:b]) * 12 / dp[i]
            for i, (a, b) in enumerate(zip((0, *cuts), (*cuts, len(costs)), strict=True))
        )
        for cuts in itertools.combinations(range(1, len(costs)), pp - 1)
    )
    assert max(p.stage_step_s) == pytest.approx(best)
    assert validate(p.layout, exhaustive=True).ok
    assert sorted(p.layout.ranks()) == list(range(world))
    # Every stage spans as many nodes as it can.
    for s in p.layout.stages:
        assert len(p.stage_nodes(s.stage)) == min(s.dp_size, nnodes)


def test_stage_ranks_are_spread_so_one_node_loss_never_empties_a_stage() -> None:
    p = plan_placement(units([1] * 6), global_batch=8, micro_batches=2, nnodes=2, nproc_per_node=2, pp=2)
    assert p.rank_node == (0, 0, 1, 1)  # torchrun numbering: node n runs n*K .. n*K+K-1
    assert [s.ranks for s in p.layout.stages] == [(0, 2), (1, 3)]
    assert p.exposed_stages == () and p.warnings == ()
    for node in range(2):
        lost = set(p.ranks_on_node(node))
        assert all(set(s.ranks) - lost for s in p.layout.stages)
    p = plan_placement(units([1] * 8), global_batch=16, micro_batches=2, nnodes=4, nproc_per_node=3, pp=4)
    assert all(len(p.stage_nodes(s)) == 3 for s in range(4))

    assert p.layout.dp_sizes == (3, 3, 3, 3)


def test_uneven_dp_gives_the_first_stages_a_rank_more_and_balances_work_for_it() -> None:
    p = plan_placement(units([1] * 5), global_batch=12, micro_batches=2, nnodes=1, nproc_per_node=3, pp=2)
    assert p.layout.dp_sizes == (2, 1)
    # Stage 0 has twice the ranks, so it takes more units: 3 x 6 samples = 18 vs 2 x 12 = 24 is the best.
    assert [(s.layer_start, s.layer_stop) for s in p.layout.stages] == [(0, 3), (3, 5)]
    assert "do not split evenly" in p.reason


def test_warnings_name_the_stages_a_node_loss_would_empty() -> None:
    p = plan_placement(units([1] * 4), global_batch=8, micro_batches=2, nnodes=1, nproc_per_node=4, pp=2)
    assert p.exposed_stages == (0, 1)
    assert any("one node" in w and "every stage" in w for w in p.warnings)
    p = plan_placement(units([1] * 4), global_batch=8, micro_batches=2, nnodes=3, nproc_per_node=1, pp=3)
    assert p.exposed_stages == (0, 1, 2)
    assert "stage 1 (ranks [1], all on node 1)" in p.warnings[0]
    p = plan_placement(units([1] * 4), global_batch=4, micro_batches=4, nnodes=2, nproc_per_node=2, pp=1)
    assert any("no samples" in w for w in p.warnings)  # 4 ranks, 1 sample per micro-batch


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pp": 5}, "--pp 5 needs at least 5 units"),
        ({"pp": 3, "nproc_per_node": 2}, "--pp 3 needs at least 3 workers"),
        ({"pp": 0}, "--pp must be >= 1"),
        ({"nnodes": 0}, "--nnodes and --nproc-per-node must be >= 1"),
        ({"micro_batches": 9}, "micro_batches <= global_batch"),
        ({"time_tolerance": -1.0}, "time_tolerance"),
    ],
)
def test_bad_input_is_refused_with_what_to_change(kwargs: dict, message: str) -> None:
    args = {"global_batch": 8, "micro_batches": 2, "nnodes": 1, "nproc_per_node": 4, "pp": 2} | kwargs
    with pytest.raises(PlacementError, match=message.replace("(", r"\(").replace("+", r"\+")):
        plan_placement(units([1] * 4), **args)


def test_bad_units_are_refused() -> None:
    with pytest.raises(PlacementError, match="no units"):
        plan_placement([], global_batch=8, micro_batches=2, nnodes=1, nproc_per_node=1)
    with pytest.raises(PlacementError, match="bad measured time"):
        plan_placement(
            [UnitCost("x", 1, 4, float("nan"))], global_batch=8, micro_batches=2, nnodes=1, nproc_per_node=1
        )
    with pytest.raises(PlacementError, match="negative size"):
        plan_placement(
            [UnitCost("x", -1, 4, 1.0)], global_batch=8, micro_batches=2, nnodes=1, nproc_per_node=1
        )


def test_layout_uses_every_unit_as_a_layer() -> None:
    u = [
        UnitCost("embed", 1000, 4000, 0.1),
        UnitCost("block", 50, 200, 1.0),
        UnitCost("head", 1000, 4000, 0.2),
    ]
    p = plan_placement(u, global_batch=6, micro_batches=3, nnodes=1, nproc_per_node=2, pp=1)
    layout = p.layout
    assert layout.num_layers == 3 and layout.layer_numel == (1000, 50, 1000)
    assert layout.zero_layout == "interleaved" and layout.rng_mode == "placement_invariant"
    assert layout.frequencies_mhz == () and layout.stages[0].ranks == (0, 1)
    assert "embed..head" in p.reason


# ------------------------------------------------------------------------------ memory cap


def _mem_units() -> list[UnitCost]:
    # 6 equal units of 1 MiB of parameters, 1 MiB of activations per sample, 1 ms per sample each
    return [UnitCost(f"u{i}", 1 << 18, 1 << 20, 1e-3, 1 << 20) for i in range(6)]


def test_memory_cap_shapes_the_split_and_is_reported() -> None:
    free = plan_placement(_mem_units(), global_batch=32, micro_batches=2, nnodes=1, nproc_per_node=2, pp=2)
    assert [s.num_layers for s in free.layout.stages] == [3, 3]
    # Stage 0 keeps 2 micro-batches in flight (1F1B), stage 1 one: capping at what 3 units need on
    # stage 1 but not on stage 0 forces the boundary toward stage 0.
    cap = max(free.stage_mem_bytes) - 1
    capped = plan_placement(
        _mem_units(), global_batch=32, micro_batches=2, nnodes=1, nproc_per_node=2, pp=2, mem_cap_bytes=cap
    )
    assert all(m <= cap for m in capped.stage_mem_bytes)
    assert [s.num_layers for s in capped.layout.stages] != [3, 3]


def test_a_job_that_cannot_fit_the_memory_cap_is_refused_with_what_to_change() -> None:
    with pytest.raises(
        PlacementError,
        match=r"no split of the 6 units over 2 stage\(s\) fits .* GiB per worker: "
        r"the best split needs .* Use more stages",
    ):
        plan_placement(
            _mem_units(),
            global_batch=32,
            micro_batches=2,
            nnodes=1,
            nproc_per_node=2,
            pp=2,
            mem_cap_bytes=1 << 20,
        )
    with pytest.raises(PlacementError, match="positive number of bytes"):
        plan_placement(
            _mem_units(), global_batch=32, micro_batches=2, nnodes=1, nproc_per_node=2, pp=2, mem_cap_bytes=0
        )


@pytest.mark.parametrize(("nnodes", "nproc", "pp"), [(2, 4, 2), (2, 4, 1), (4, 2, 2), (3, 4, 2), (2, 8, 4)])
def test_a_node_loss_leaves_a_copy_of_every_lost_shard(nnodes: int, nproc: int, pp: int) -> None:
    """DP neighbours sit on different nodes, so each lost rank's ring snapshot (on its DP
    predecessor) survives the loss of its node: the recovery stays in place."""
    from planners.applicability import judge, lost_without_copy
    from planners.dataflow import resize_after_loss

    p = plan_placement(
        units([1] * 8), global_batch=32, micro_batches=2, nnodes=nnodes, nproc_per_node=nproc, pp=pp
    )
    for node in range(nnodes):
        lost = frozenset(p.ranks_on_node(node))
        assert lost_without_copy(p.layout, lost) == (), (node, [s.ranks for s in p.layout.stages])
        new = resize_after_loss(p.layout, set(lost)).layout
        assert judge(p.layout, new).in_place
