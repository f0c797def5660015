"""ZeRO ownership layouts and migration volume (ElasWave §6.3, Fig. 10)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners import Layout, make_uniform_layout
from planners.partition import apply_boundaries
from planners.zero import (
    contiguous_ownership,
    interleaved_ownership,
    layer_move_cost,
    layout_ownership,
    migration_cost,
    ownership_problems,
    shard_transfers,
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
    contiguous = migration_cost(replace(old, zero_layout="contiguous"), replace(new, zero_layout="contiguous"))
    assert contiguous.total_elements > cost.total_elements


def test_transfers_require_same_model() -> None:
    a = make_uniform_layout(2, 1, 2, 2, 1, layer_numel=(4, 4))
    with pytest.raises(ValueError, match="disagree on layer_numel"):
        shard_transfers(a, replace(a, layer_numel=(4, 5)))
