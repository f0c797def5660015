"""ZeRO ownership layouts and migration volume (ElasWave §6.3, Fig. 10)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners import Layout, StageLayout, make_uniform_layout, validate
from planners.dataflow import resize_after_join, resize_after_loss
from planners.partition import apply_boundaries
from planners.zero import (
    contiguous_ownership,
    interleaved_ownership,
    layer_move_cost,
    layout_ownership,
    migration_cost,
    migration_cost_from_transfers,
    ownership_problems,
    shard_transfers,
    shard_transfers_by_intervals,
)
from tests.planners.strategies import layouts


@settings(max_examples=80)
@given(layouts())
def test_ownership_is_complete_for_both_layouts(layout: Layout) -> None:
    for kind in ("interleaved", "contiguous"):
        lay = replace(layout, zero_layout=kind)
        assert ownership_problems(lay) == ()
        owned = layout_ownership(lay)
        for layer in range(lay.num_layers):
            stage = lay.stages[lay.stage_of_layer(layer)]
            elements = [e for iv in owned.get(layer, ()) for e in range(iv.start, iv.stop)]
            assert elements == list(range(lay.layer_numel[layer]))  # each element once, in order
            assert {iv.rank for iv in owned.get(layer, ())} <= set(stage.ranks)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=6), st.integers(1, 6))
def test_interleaved_rank_j_owns_shard_j_of_every_layer(numel: list[int], dp: int) -> None:
    ranks = tuple(range(10, 10 + dp))
    owned = interleaved_ownership(range(len(numel)), numel, ranks)
    for layer, n in enumerate(numel):
        sizes = {iv.rank: iv.size for iv in owned if iv.layer == layer}
        assert sum(sizes.values()) == n and (not sizes or max(sizes.values()) - min(sizes.values()) <= 1)
        starts = [iv.start for iv in owned if iv.layer == layer]
        ranks_in_order = [iv.rank for iv in owned if iv.layer == layer]
        assert ranks_in_order == sorted(ranks_in_order) and starts == sorted(starts)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=6), st.integers(1, 6))
def test_contiguous_rank_owns_one_block_of_the_flat_buffer(numel: list[int], dp: int) -> None:
    ranks = tuple(range(dp))
    offsets = [sum(numel[:i]) for i in range(len(numel))]
    flat: dict[int, list[int]] = {}
    for iv in contiguous_ownership(range(len(numel)), numel, ranks):
        flat.setdefault(iv.rank, []).extend(range(offsets[iv.layer] + iv.start, offsets[iv.layer] + iv.stop))
    total = sum(numel)
    for elems in flat.values():
        assert elems == list(range(elems[0], elems[0] + len(elems)))  # contiguous
        assert abs(len(elems) - total / dp) < 1
    assert sorted(e for es in flat.values() for e in es) == list(range(total))


@pytest.mark.parametrize("dp", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("layers_per_stage", [1, 2])
def test_interleaved_layer_move_sends_exactly_the_layer(dp: int, layers_per_stage: int) -> None:
    n = 1000 * dp + 7
    cost = layer_move_cost("interleaved", layers_per_stage * dp, dp, n)
    assert cost.total_elements == cost.cross_stage_elements == n and cost.intra_stage_elements == 0
    assert cost.per_stage_elements == (n, n)


@pytest.mark.parametrize("dp", [2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("multiple", [1, 2, 4])
def test_contiguous_layer_move_matches_paper_formula(dp: int, multiple: int) -> None:
    """Fig. 10a: |O_i| across stages plus (D-1)/2 |O_i| reshuffled inside each stage, so each
    stage moves (D+1)/2 |O_i| — exactly when D divides |O_i| and a stage has >= D layers."""
    n = 1000 * dp
    cost = layer_move_cost("contiguous", multiple * dp, dp, n)
    assert cost.cross_stage_elements == n
    assert cost.per_stage_elements == ((dp + 1) * n // 2,) * 2
    assert cost.total_elements == dp * n  # both stages reshard concurrently
    odd = layer_move_cost("contiguous", multiple * dp, dp, 997)  # rounding: a few elements per cut
    assert all(abs(x - (dp + 1) / 2 * 997) <= 2 * dp for x in odd.per_stage_elements)


def test_interleaved_move_between_stages_of_different_dp_is_still_one_copy() -> None:
    old = make_uniform_layout(4, 2, 3, 6, 1, layer_numel=(30, 31, 32, 33))
    old = replace(old, stages=(old.stages[0], replace(old.stages[1], ranks=(3, 4))))
    new = apply_boundaries(old, (1,))  # layer 1 moves from stage 0 (D=3) to stage 1 (D=2)
    cost = migration_cost(old, new)
    assert cost.total_elements == cost.cross_stage_elements == 31
    moved = shard_transfers(old, new)
    assert {t.layer for t in moved} == {1}
    contiguous = migration_cost(
        replace(old, zero_layout="contiguous"), replace(new, zero_layout="contiguous")
    )
    assert contiguous.total_elements > cost.total_elements


def test_transfers_require_same_model() -> None:
    a = make_uniform_layout(2, 1, 2, 2, 1, layer_numel=(4, 4))
    with pytest.raises(ValueError, match="disagree on layer_numel"):
        shard_transfers(a, replace(a, layer_numel=(4, 5)))


def _reblock(layout: Layout, stages: tuple[StageLayout, ...], cuts: list[int]) -> tuple[StageLayout, ...]:
    """`stages` (their ranks and weights) over new contiguous layer blocks ending at `cuts`."""
    edges = [0, *cuts, layout.num_layers]
    return tuple(
        replace(s, stage=p, layer_start=edges[p], layer_stop=edges[p + 1]) for p, s in enumerate(stages)
    )


@st.composite
def relayouts(draw: st.DrawFn) -> tuple[Layout, Layout]:
    """(old, new) layouts of one model: new = old after losses, joins, moved boundaries, a dropped
    or added stage, a reordered DP group, a switch of ZeRO layout, or an unrelated rank set."""
    old = draw(layouts(max_layers=8, max_stages=4, max_dp=4))
    new = old
    kind = draw(st.sampled_from(["lose", "join", "boundaries", "restage", "permute", "unrelated"]))
    if kind == "lose":
        lost = [r for s in old.stages for r in s.ranks[1:] if draw(st.booleans())]
        new = resize_after_loss(old, lost).layout
    elif kind == "join":
        fresh = iter(range(max(old.ranks()) + 1, max(old.ranks()) + 20))
        new = resize_after_join(
            old, {s.stage: [next(fresh) for _ in range(draw(st.integers(0, 3)))] for s in old.stages}
        ).layout
    elif kind == "permute":
        stages = tuple(
            replace(s, ranks=tuple(draw(st.permutations(s.ranks))), sample_weights=()) for s in old.stages
        )
        new = replace(old, stages=stages)
    if kind in ("lose", "join", "boundaries", "permute"):
        stages = new.stages
    elif kind == "restage":  # one stage fewer (its ranks leave) or one more (fresh ranks)
        if old.num_stages > 1 and draw(st.booleans()):
            gone = draw(st.integers(0, old.num_stages - 1))
            stages = tuple(s for s in old.stages if s.stage != gone)
        else:
            stages = (
                *old.stages,
                StageLayout(old.num_stages, 0, 0, (max(old.ranks()) + 1, max(old.ranks()) + 2)),
            )
    else:
        other = draw(layouts(max_layers=old.num_layers, max_stages=4, max_dp=4))
        stages = other.stages
    stages = stages[: old.num_layers]
    if kind != "permute" and len(stages) > 0:
        cuts = (
            sorted(
                draw(
                    st.sets(
                        st.integers(1, old.num_layers - 1), min_size=len(stages) - 1, max_size=len(stages) - 1
                    )
                )
            )
            if len(stages) > 1
            else []
        )
        stages = _reblock(old, stages, cuts)
    zero = draw(st.sampled_from([old.zero_layout, "interleaved", "contiguous"]))
    new = replace(old, stages=stages, zero_layout=zero, stage_mem_cap_bytes=None)
    return old, new


@settings(max_examples=150, deadline=None)
@given(relayouts())
def test_closed_form_migration_cost_equals_the_enumerated_transfers(case: tuple[Layout, Layout]) -> None:
    """`migration_cost` (closed form, no interval list) == `migration_cost_from_transfers` (every
    `shard_transfers` interval counted) in total, across/inside stages and per stage."""
    old, new = case
    assert validate(old).ok and validate(new).ok, validate(new).problems
    fast, slow = migration_cost(old, new), migration_cost_from_transfers(old, new)
    assert (
        fast.total_elements,
        fast.cross_stage_elements,
        fast.intra_stage_elements,
        fast.per_stage_elements,
    ) == (slow.total_elements, slow.cross_stage_elements, slow.intra_stage_elements, slow.per_stage_elements)
    transfers = shard_transfers(old, new)
    assert transfers == shard_transfers_by_intervals(old, new)  # per-layer merge == every interval listed
    assert fast.total_elements == sum(t.size for t in transfers)
    assert fast.reason and slow.reason
    if old == new:
        assert fast.total_elements == 0


@pytest.mark.parametrize("kind", ["interleaved", "contiguous"])
@pytest.mark.parametrize("dp", [2, 3, 5])
def test_closed_form_matches_transfers_on_the_paper_layer_move(kind: str, dp: int) -> None:
    old = make_uniform_layout(8, 2, dp, dp, 1, layer_numel=(1000 * dp + 3,) * 8, zero_layout=kind)  # type: ignore[arg-type]
    new = apply_boundaries(old, (3,))
    assert migration_cost(old, new) == replace(
        migration_cost_from_transfers(old, new), reason=migration_cost(old, new).reason
    )
