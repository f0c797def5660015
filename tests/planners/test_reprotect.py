"""Which backup copies a plan re-seeds, and the window in which they protect nothing
(`planners.reprotect`, issue 23 item 2), with the applicability rule that uses it."""

from __future__ import annotations

import pytest

from executor.zero import unit_ownership
from planners.applicability import judge, lost_without_copy
from planners.backup import backup_holder_sets
from planners.dataflow import resize_after_loss
from planners.layout import Layout, make_uniform_layout
from planners.reprotect import ReprotectWindow, backup_pairs, reseed_pairs, shard_intervals

NAMES = [f"u{i}" for i in range(6)]
NUMEL = (100, 37, 64, 1, 250, 9)


def pp2_dp3(**kw: object) -> Layout:
    """Stage 0: layers 0-2 on ranks 0-2; stage 1: layers 3-5 on ranks 3-5."""
    return make_uniform_layout(6, 2, 3, global_batch=12, num_micro_batches=2, layer_numel=NUMEL).replace(**kw)


STAGE_PER_NODE = ((0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 1))


def test_backup_pairs_are_every_copy_of_every_shard() -> None:
    layout = pp2_dp3(backup_copies=2)
    sets = backup_holder_sets(layout)
    assert backup_pairs(layout) == {(o, h) for o, hs in sets.items() for h in hs}
    assert len(backup_pairs(layout)) == 12


@pytest.mark.parametrize("zero_layout", ["interleaved", "contiguous"])
def test_shard_intervals_are_the_engines(zero_layout: str) -> None:
    """The same (start, stop) per unit as the engine's optimizer (`executor.zero.unit_ownership`),
    empty intervals included, for a layout of uneven stages."""
    layout = pp2_dp3(zero_layout=zero_layout)
    layout = resize_after_loss(layout, {4}).layout
    got = shard_intervals(layout)
    for stage in layout.stages:
        owned = unit_ownership(layout, stage, NAMES)
        for j, rank in enumerate(stage.ranks):
            assert got[rank] == tuple((layer, *owned[NAMES[layer]][j]) for layer in stage.layers)
    assert any(lo == hi for ivs in got.values() for _, lo, hi in ivs)  # layer 3 has 1 element


def test_a_loss_reseeds_only_the_copies_of_the_stage_it_changed() -> None:
    """Every rank a node of its own: the ring of §5.1 in each stage. Losing rank 4 changes stage
    1's shards (DP 3 -> 2) and its ring (3 <- 5, 5 <- 3); stage 0's copies stay where they are."""
    old = pp2_dp3()
    new = resize_after_loss(old, {4}).layout
    assert backup_holder_sets(old) == {0: (2,), 1: (0,), 2: (1,), 3: (5,), 4: (3,), 5: (4,)}
    assert reseed_pairs(old, new) == {(3, 5), (5, 3)}
    assert reseed_pairs(old, old) == frozenset()  # a replay on the same layout moves nothing
    assert reseed_pairs(None, new) == backup_pairs(new)  # after a RESTORE, every copy


def test_copies_still_being_seeded_are_seeded_again() -> None:
    """A plan made inside a window re-seeds the window's copies even where the new layout keeps
    them: they never arrived."""
    old = pp2_dp3()
    new = resize_after_loss(old, {4}).layout
    assert reseed_pairs(old, new, unprotected={(1, 0)}) == {(3, 5), (5, 3), (1, 0)}
    assert reseed_pairs(old, new, unprotected={(4, 3)}) == {(3, 5), (5, 3)}  # gone with the layout


def test_a_stage_per_node_moves_the_cross_stage_copies() -> None:
    """A stage per node: every copy lives in the other stage (`planners.backup` rule 2), spread
    by DP index; losing rank 0 respreads the copies both stages keep in stage 0."""
    old = pp2_dp3(rank_nodes=STAGE_PER_NODE)
    new = resize_after_loss(old, {0}).layout
    assert backup_holder_sets(old) == {0: (3,), 1: (4,), 2: (5,), 3: (0,), 4: (1,), 5: (2,)}
    assert backup_holder_sets(new) == {1: (3,), 2: (4,), 3: (1,), 4: (2,), 5: (1,)}
    assert reseed_pairs(old, new) == {(1, 3), (2, 4), (3, 1), (4, 2), (5, 1)}


def test_a_loss_inside_the_window_is_a_restore() -> None:
    """Right after the plan for losing rank 0, rank 1 (whose copy moves from 4 to 3) and rank 4
    (the old holder of 1's copy) are lost together. Once the copies are re-seeded that is in
    place (3 keeps 1's copy, 2 keeps 4's); inside the window it is a RESTORE, and says why."""
    l0 = pp2_dp3(rank_nodes=STAGE_PER_NODE)
    l1 = resize_after_loss(l0, {0}).layout
    l2 = resize_after_loss(l1, {1, 4}).layout
    window = reseed_pairs(l0, l1)
    assert judge(l1, l2).in_place
    verdict = judge(l1, l2, unprotected=window)
    assert not verdict.in_place and verdict.without_copy == (1, 4)
    assert "re-protection window" in verdict.reason and "[1, 4]" in verdict.reason
    # a copy outside the window still counts: losing 5 alone reads its copy on 1
    assert judge(l1, resize_after_loss(l1, {5}).layout, unprotected=window - {(5, 1)}).in_place


def test_only_the_first_surviving_copy_counts() -> None:
    """With two copies, recovery reads the first one still alive: a loss whose first surviving
    copy is being re-seeded is refused even where a later copy is up to date (conservative)."""
    layout = pp2_dp3(backup_copies=2)
    assert backup_holder_sets(layout)[0] == (2, 1)
    assert lost_without_copy(layout, frozenset({0}), {(0, 2)}) == (0,)
    assert lost_without_copy(layout, frozenset({0}), {(0, 1)}) == ()
    assert lost_without_copy(layout, frozenset({0, 2}), {(0, 2)}) == ()  # reads the copy on 1


def test_window_steps_and_validation() -> None:
    window = ReprotectWindow(3, ((1, 3), (2, 4)), from_step=5, until_step=6)
    assert window.owners == (1, 2)
    assert window.open_at(4) and window.open_at(5) and not window.open_at(6)
    assert not ReprotectWindow(3, ((1, 3),), 5, 6, closed_step=6).open_at(5)
    assert not ReprotectWindow(3, ((1, 3),), 5, 6, superseded_by=4).open_at(5)
    assert ReprotectWindow.from_dict(window.as_dict()) == window
    with pytest.raises(ValueError, match="from step 5 to step 4"):
        ReprotectWindow(3, ((1, 3),), 5, 4)
    with pytest.raises(ValueError, match="two ranks"):
        ReprotectWindow(3, ((1, 1),), 5, 6)
