"""Re-layout through one path, `FabricParticipant.on_plan` (ElasWave §4.2, §5.2, §6.2).

* A loss whose plan also rebalances the pipeline: PP=2 x DP=3, worker 4 (stage 1) is killed with
  SIGKILL mid-step; the plan drops it *and* moves block 2 (unit 3) from the damaged stage 1 to
  stage 0.
  The survivors live-remap the committed shards onto the new ranks with the old boundaries, then
  migrate the block, then re-seed the snapshot ring. Right after recovery the gathered parameters
  and Adam moments equal the fault-free run's at the last committed step bitwise; the remaining
  losses follow the fault-free ones (mean relative deviation <= 1e-4); the same samples are fed;
  the snapshots verify after recovery and equal the live shards bitwise at the end.
* A pipeline-only plan (no rank lost, block 1 = unit 2 moves to stage 1) applied at a step boundary
  through the same protocol path, with blocking and with non-blocking migration (shadow layer and
  gradient payback inside the next step, Fig. 9): no group is rebuilt, and losses and final
  state are bit-identical to the run without the move.

Job driver and assertions come from test_failstop.py. Units: 0 embed, 1-4 block_0..block_3, 5 head;
the base layout holds units [0, 3) on stage 0 and [3, 6) on stage 1.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from executor.fabric.relayout import RelayoutError, plan_relayout
from planners.dataflow import resize_after_loss
from planners.layout import Layout, RngMode, make_uniform_layout
from tests.executor.test_failstop import (
    FAIL_STEP,
    STEPS,
    Scenario,
    _clean,
    _last_stage_losses,
    _mean_rel_dev,
    _merged,
    _run,
    assert_exact_edit,
    assert_recovered_bitwise,
    assert_same_samples,
    assert_snapshots_equal_live,
    assert_states_bitwise,
    base_layout,
)

RNG: RngMode = "placement_invariant"
RELAYOUT_AT = 3


def with_bounds(layout: Layout, bounds: list[tuple[int, int]]) -> Layout:
    return replace(
        layout,
        stages=tuple(
            replace(s, layer_start=lo, layer_stop=hi)
            for s, (lo, hi) in zip(layout.stages, bounds, strict=True)
        ),
    )


def loss_and_rebalance(victim: int) -> Layout:
    """The victim leaves stage 1 and block 2 (unit 3) moves out of stage 1 into stage 0 (§4.2)."""
    return with_bounds(resize_after_loss(base_layout(RNG), {victim}).layout, [(0, 4), (4, 6)])


def test_plan_is_diffed_into_remap_then_migration() -> None:
    old = base_layout(RNG)
    steps = plan_relayout(old, loss_and_rebalance(4))
    assert steps.lost == {4} and steps.moves == ((3, 1, 0),)
    assert steps.remap_to is not None
    assert [s.ranks for s in steps.remap_to.stages] == [(0, 1, 2), (3, 5)]
    assert [(s.layer_start, s.layer_stop) for s in steps.remap_to.stages] == [(0, 3), (3, 6)]
    pipeline_only = plan_relayout(old, with_bounds(old, [(0, 2), (2, 6)]))
    assert pipeline_only.remap_to is None and pipeline_only.moves == ((2, 0, 1),) and not pipeline_only.lost
    loss_only = plan_relayout(old, resize_after_loss(old, {1}).layout)
    assert loss_only.moves == () and loss_only.remap_to is not None
    assert plan_relayout(old, old).is_empty


def test_plans_outside_remap_and_migration() -> None:
    old = base_layout(RNG)
    # a rank added (a joining worker takes rank 4 back): one rebuild, the joiner reads everything
    joined = plan_relayout(resize_after_loss(old, {4}).layout, old)
    assert joined.rebuild and not joined.lost and joined.remap_to is None and not joined.moves
    # a whole stage dropped: one rebuild from live shards and backups, no remap or migration
    whole = plan_relayout(old, replace(old, stages=(replace(old.stages[0], layer_stop=6),)))
    assert whole.rebuild and whole.lost == {3, 4, 5} and whole.remap_to is None and not whole.moves
    with pytest.raises(RelayoutError, match="unsupported .*: changing the global batch"):
        plan_relayout(old, replace(old, global_batch=6))
    three = make_uniform_layout(6, 3, 1, global_batch=6, num_micro_batches=2, layer_numel=(8,) * 6)
    three = with_bounds(three, [(0, 3), (3, 4), (4, 6)])
    assert plan_relayout(three, with_bounds(three, [(0, 1), (1, 2), (2, 6)])).rebuild  # block 2: 0 -> 2
    assert plan_relayout(three, with_bounds(three, [(0, 2), (2, 3), (3, 6)])).moves == ((2, 0, 1), (3, 1, 2))


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_kill9_with_layer_rebalance_recovers_bitwise() -> None:
    sc = Scenario(RNG, kill_at_op=8, victim=4, new_layout=loss_and_rebalance(4))
    clean, faulty = _clean(RNG), _run(sc)
    ref_losses, got_losses = _last_stage_losses(clean), _last_stage_losses(faulty)
    assert sorted(got_losses) == list(range(STEPS))
    assert all(got_losses[s] == ref_losses[s] for s in range(FAIL_STEP))
    deviation = _mean_rel_dev(got_losses, ref_losses, range(FAIL_STEP, STEPS))
    print(f"\nloss + block 2 (unit 3) moved to stage 0: mean relative loss deviation {deviation:.3e}")
    assert deviation <= 1e-4
    assert_recovered_bitwise(clean, faulty)
    assert_same_samples(clean, faulty, FAIL_STEP)
    plan = sc.plan()
    assert plan is not None
    assert_exact_edit(faulty, plan)
    for w, r in faulty.items():
        (report,) = r["migrations"]  # the block moved once, in the recovery
        assert report["moved_layers"] == ((3, 1, 0),), w
        assert r["stage_after"] == r["stage"]  # ranks keep their stage, the block changed stage
    # stage 0 now holds embed and blocks 0-2 (DP 3), stage 1 holds block 3 and the head (DP 2)
    assert {u for r in faulty.values() if r["stage"] == 0 for u in r["recovered_state"]["units"]} == {
        "embed",
        "block_0",
        "block_1",
        "block_2",
    }
    assert_snapshots_equal_live(faulty)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("migration", ["blocking", "nonblocking"])
def test_pipeline_only_plan_through_protocol_is_bit_identical(migration: str) -> None:
    """Blocking: the boundary migrates before step RELAYOUT_AT. Non-blocking (Fig. 9): the plan
    only posts the transfers and arms the shadow layer; step RELAYOUT_AT carries the move, and
    the ring is re-seeded inside the step after it. Either way the losses and the final state are
    bit-identical to the run without the move, and the snapshots end equal to the live shards."""
    old = base_layout(RNG)
    sc = Scenario(
        RNG, relayout_at=RELAYOUT_AT, new_layout=with_bounds(old, [(0, 2), (2, 6)]), migration=migration
    )
    clean, moved = _clean(RNG), _run(sc)
    assert _last_stage_losses(moved) == _last_stage_losses(clean)
    assert_states_bitwise(_merged(clean, "final_state"), _merged(moved, "final_state"))
    plan = sc.plan()
    assert plan is not None
    assert not any(assert_exact_edit(moved, plan).values())  # a clean boundary: nothing half-matched
    for w, r in moved.items():
        assert r["edits"][0]["rebuilt"] == () and r["edits"][0]["at_step"] == RELAYOUT_AT, w
        (report,) = r["migrations"]
        assert report["moved_layers"] == ((2, 0, 1),) and report["mode"] == migration, (w, report)
        if migration == "nonblocking":  # stage 0 ran block 1 as a shadow, stage 1 folded its payback
            assert (report["shadow_slots_run"], report["payback_slots"]) == (
                (1, 0) if r["stage"] == 0 else (0, 1)
            ), w
        assert r["samples"] == clean[w]["samples"]
    assert_snapshots_equal_live(moved)


def test_nonblocking_plan_path_falls_back_where_it_cannot_apply() -> None:
    """The plan path migrates non-blocking only where Fig. 9's exactness holds; a loss plan that
    also moves a block leaves stages of different DP sizes, so it migrates blocking."""
    from executor.fabric.trainer_state import FabricParticipant

    class Gloo:
        backend = "gloo"

    part = FabricParticipant.__new__(FabricParticipant)
    part.comm, part.migration, part.shadow_slots = Gloo(), "nonblocking", 1  # type: ignore[assignment]
    old = base_layout(RNG)
    assert part._nonblocking_applies(old, plan_relayout(old, with_bounds(old, [(0, 2), (2, 6)])).moves)
    rebalance = plan_relayout(old, loss_and_rebalance(4))
    assert not part._nonblocking_applies(rebalance.remap_to, rebalance.moves)
    part.migration = "blocking"
    assert not part._nonblocking_applies(old, ((2, 0, 1),))
    with pytest.raises(ValueError, match="migration must be one of"):
        FabricParticipant(None, None, migration="async")  # type: ignore[arg-type]


def test_step_carrying_a_nonblocking_migration_refuses_rollback() -> None:
    """Its moved blocks have no committed copy in the new layout: a rollback says so instead of
    restoring a state without them."""
    from executor.fabric.trainer_state import FabricParticipant, MigrationInFlight

    class Comm:
        worker = 0

    class InFlight:
        moves = ((1, 0, 1),)

    part = FabricParticipant.__new__(FabricParticipant)
    part.comm, part._inflight = Comm(), InFlight()  # type: ignore[assignment]
    with pytest.raises(MigrationInFlight, match=r"non-blocking migration of \(\(1, 0, 1\),\) failed"):
        part.on_rollback()
