"""Plans outside remap-then-migrate, applied in place from memory by one rebuild
(`executor.fabric.rebuild`): a whole stage lost, and blocks moved by more than one stage.

A whole stage lost, recovered in place from memory (no step lost, no checkpoint read).

PP=3 x DP=(3, 1, 2) on gloo: stage 1 is worker 3 alone, so its shard's backup lives in stage 2
(`planners.backup`: a DP = 1 stage is backed up by its next neighbour). Worker 3 is killed with
SIGKILL mid-step; the plan drops stage 1 and gives its blocks to stages 0 and 2 (three stages
become two). The survivors rebuild every unit from live shards and the backup in one exchange
(`executor.fabric.rebuild`) and replay the step. Compared with a fault-free run of the same seed:
right after recovery the gathered parameters and Adam moments equal the fault-free state at the
last committed step bitwise; every later step feeds its global batch once per stage; the losses
follow the fault-free ones; at the end every backup equals its owner's live shard bitwise.

Blocks moved by more than one stage: PP=4 x DP=(2, 1, 1, 2), a pipeline-only plan moves units
1-2 to stage 0 and unit 3 to stage 1, so stage 3's ranks send unit 3 two stages up over a pair
group made for the transfer (`planners.applicability.far_pairs`). The state right after equals
the fault-free run's bitwise, the losses follow it, and every backup equals its live shard.

Stages regrouped at an unchanged count (`planners.elaswave_replicas.restage`): PP=3 x DP=(3, 1, 2),
worker 4 (stage 2) is killed and the plan regroups the five survivors into stages of DP (2, 2, 1):
worker 2 moves from stage 0 to stage 1, a live rank in another stage, which the remap (it keeps
every rank in its stage) cannot serve; the rebuild does, and the state, losses and backups equal
the fault-free run's.

Job driver and assertions come from test_failstop.py (units: 0 embed, 1-4 block_0..block_3,
5 head).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from executor.fabric.relayout import plan_relayout
from planners.applicability import far_pairs, judge
from planners.backup import backup_holders
from planners.dataflow import resize_after_loss
from planners.elaswave_replicas import restage
from planners.layout import Layout, StageLayout, make_uniform_layout
from tests.executor.engine_cases import NUM_UNITS
from tests.executor.test_failstop import (
    BATCH,
    CFG,
    FAIL_STEP,
    STEPS,
    Scenario,
    _clean,
    _last_stage_losses,
    _mean_rel_dev,
    _merged,
    _run,
    assert_snapshots_equal_live,
    assert_states_bitwise,
)

VICTIM = 3


def three_stages() -> Layout:
    base = make_uniform_layout(
        NUM_UNITS, 3, 1, global_batch=BATCH, num_micro_batches=2, layer_numel=CFG.unit_numels()
    )
    return base.replace(
        stages=(StageLayout(0, 0, 2, (0, 1, 2)), StageLayout(1, 2, 4, (3,)), StageLayout(2, 4, 6, (4, 5)))
    )


def stage_one_lost() -> Layout:
    """Stage 1's blocks split between its neighbours: units [0, 3) on stage 0, [3, 6) on stage 1."""
    return three_stages().replace(stages=(StageLayout(0, 0, 3, (0, 1, 2)), StageLayout(1, 3, 6, (4, 5))))


def test_the_plan_is_in_place_and_reads_the_backup_in_the_next_stage() -> None:
    old, new = three_stages(), stage_one_lost()
    assert backup_holders(old)[VICTIM] == 4  # DP = 1: backed up by the next stage
    verdict = judge(old, new)
    assert verdict.in_place and verdict.lost == {VICTIM}, verdict.reason
    assert plan_relayout(old, new).rebuild


def _stage_batches(results: dict[int, dict[str, Any]], step: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in results.values():
        out.setdefault(r["stage_after"], []).extend(r["samples"][step])
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_whole_stage_lost_is_rebuilt_from_memory_bitwise() -> None:
    layout = three_stages()
    sc = Scenario(kill_at_op=3, victim=VICTIM, new_layout=stage_one_lost(), layout=layout)
    clean, faulty = _clean("placement_invariant", layout=layout), _run(sc)
    assert sorted(faulty) == [0, 1, 2, 4, 5]
    # the committed state came back whole, from live shards and the backup: nothing replayed
    ref_state = _merged(clean, "committed_state")
    assert ref_state["step_count"] == FAIL_STEP
    assert_states_bitwise(ref_state, _merged(faulty, "recovered_state"))
    assert {r["stage_after"] for r in faulty.values()} == {0, 1}
    ref_losses, got_losses = _last_stage_losses(clean), _last_stage_losses(faulty)
    assert sorted(got_losses) == list(range(STEPS))
    assert all(got_losses[s] == ref_losses[s] for s in range(FAIL_STEP))
    assert _mean_rel_dev(got_losses, ref_losses, range(FAIL_STEP, STEPS)) <= 1e-4
    for step in range(FAIL_STEP, STEPS):
        assert _stage_batches(faulty, step) == {
            s: list(range(step * BATCH, (step + 1) * BATCH)) for s in (0, 1)
        }
    assert_snapshots_equal_live(faulty)


def four_stages() -> Layout:
    return three_stages().replace(
        stages=(
            StageLayout(0, 0, 1, (0, 1)),
            StageLayout(1, 1, 2, (2,)),
            StageLayout(2, 2, 3, (3,)),
            StageLayout(3, 3, 6, (4, 5)),
        )
    )


def far_moves() -> Layout:
    bounds = [(0, 3), (3, 4), (4, 5), (5, 6)]
    old = four_stages()
    return old.replace(
        stages=tuple(
            replace(s, layer_start=a, layer_stop=b) for s, (a, b) in zip(old.stages, bounds, strict=True)
        )
    )


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_blocks_moved_two_stages_travel_over_pair_groups_bitwise() -> None:
    old, new = four_stages(), far_moves()
    assert far_pairs(old, new, frozenset()) == ((3, 0), (3, 1), (4, 2), (5, 2))
    assert plan_relayout(old, new).rebuild
    sc = Scenario(relayout_at=FAIL_STEP, new_layout=new, layout=old)
    clean, moved = _clean("placement_invariant", layout=old), _run(sc)
    ref_state = _merged(clean, "committed_state")
    assert_states_bitwise(ref_state, _merged(moved, "recovered_state"))
    ref_losses, got_losses = _last_stage_losses(clean), _last_stage_losses(moved)
    assert all(got_losses[s] == ref_losses[s] for s in range(FAIL_STEP))
    assert _mean_rel_dev(got_losses, ref_losses, range(FAIL_STEP, STEPS)) <= 1e-4
    for w, r in moved.items():
        (edit,) = r["edits"]
        pairs = {f"xfer/{a}-{b}" for a, b in ((0, 3), (1, 3), (2, 4), (2, 5)) if w in (a, b)}
        assert pairs <= set(edit["rebuilt"]), (w, edit)
    assert_snapshots_equal_live(moved)


REGROUP_VICTIM = 4


def regrouped() -> Layout:
    """The survivors of losing worker 4, regrouped by the DP shape step into three stages."""
    out = restage(resize_after_loss(three_stages(), [REGROUP_VICTIM]).layout, 3)
    assert out is not None
    return out


def test_a_live_rank_changing_stage_at_the_same_count_is_a_rebuild() -> None:
    old, new = three_stages(), regrouped()
    assert [s.ranks for s in new.stages] == [(0, 1), (2, 3), (5,)]  # worker 2: stage 0 -> 1
    assert judge(old, new).in_place
    assert plan_relayout(old, new).rebuild
    # Without a loss too (a plan that only regroups the live ranks).
    same = old.replace(stages=(StageLayout(0, 0, 2, (0, 1)), StageLayout(1, 2, 4, (2, 3)), old.stages[2]))
    assert plan_relayout(old, same).rebuild


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_stages_regrouped_at_the_same_count_are_rebuilt_bitwise() -> None:
    layout = three_stages()
    sc = Scenario(kill_at_op=3, victim=REGROUP_VICTIM, new_layout=regrouped(), layout=layout)
    clean, faulty = _clean("placement_invariant", layout=layout), _run(sc)
    assert sorted(faulty) == [0, 1, 2, 3, 5]
    assert {w: r["stage_after"] for w, r in faulty.items()} == {0: 0, 1: 0, 2: 1, 3: 1, 5: 2}
    assert_states_bitwise(_merged(clean, "committed_state"), _merged(faulty, "recovered_state"))
    ref_losses, got_losses = _last_stage_losses(clean), _last_stage_losses(faulty)
    assert sorted(got_losses) == list(range(STEPS))
    assert all(got_losses[s] == ref_losses[s] for s in range(FAIL_STEP))
    assert _mean_rel_dev(got_losses, ref_losses, range(FAIL_STEP, STEPS)) <= 1e-4
    for step in range(FAIL_STEP, STEPS):
        assert _stage_batches(faulty, step) == {
            s: list(range(step * BATCH, (step + 1) * BATCH)) for s in (0, 1, 2)
        }
    assert_snapshots_equal_live(faulty)
