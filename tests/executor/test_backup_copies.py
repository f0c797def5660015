"""Two copies of every shard backup (`Layout.backup_copies` = 2, issue 25): a rank and the holder
of its first backup killed in the same step, recovered in place from the second copy.

PP=2 x DP=3 on gloo, every rank a node of its own. With one copy, rank 0's shard lives only on
rank 2 (its DP predecessor, ElasWave §5.1), so losing both is a RESTORE. With two, rank 0's
second copy is on rank 1 (`planners.backup`), which also keeps rank 2's first copy. Workers 0
and 2 SIGKILL themselves on entering the gradient reduce-scatter of step FAIL_STEP; the
survivors roll back, remap the lost shards from rank 1's copies (no checkpoint read) and replay.
Compared with the fault-free run of the same seed and layout: the recovered state equals the
committed fault-free state bitwise, every step feeds its global batch once per stage, the losses
follow the fault-free ones, and at the end every backup (both copies of every shard, on the
holders the new layout names) equals its owner's live shard bitwise. Memory: the host bytes each
worker's backups take, before and after, are what `planners.backup.backup_cost` counts for it
(both copies of every shard).

Job driver and assertions come from test_failstop.py (units: 0 embed, 1-4 block_0..block_3,
5 head).
"""

from __future__ import annotations

from typing import Any

import pytest

from planners.applicability import judge
from planners.backup import backup_cost, backup_holder_sets, backup_holders, protected_by
from planners.dataflow import resize_after_loss
from planners.layout import Layout
from tests.executor.test_failstop import (
    FAIL_STEP,
    STEPS,
    Scenario,
    _clean,
    _last_stage_losses,
    _mean_rel_dev,
    _merged,
    _run,
    assert_same_samples,
    assert_states_bitwise,
    base_layout,
)

VICTIM, FIRST_HOLDER, SECOND_HOLDER = 0, 2, 1
REDUCE_SCATTER_OP = 5  # KillingCommunicator's op numbering


def two_copies() -> Layout:
    return base_layout("placement_invariant").replace(backup_copies=2)


def test_one_copy_would_restore_and_two_apply_in_place() -> None:
    lost = {VICTIM, FIRST_HOLDER}
    one = base_layout("placement_invariant")
    assert backup_holders(one)[VICTIM] == FIRST_HOLDER
    refused = judge(one, resize_after_loss(one, lost).layout)
    assert not refused.in_place and refused.without_copy == (VICTIM,)
    two = two_copies()
    assert backup_holder_sets(two)[VICTIM] == (FIRST_HOLDER, SECOND_HOLDER)
    verdict = judge(two, resize_after_loss(two, lost).layout)
    assert verdict.in_place and verdict.lost == lost, verdict.reason


def assert_every_copy_equals_live(results: dict[int, dict[str, Any]]) -> None:
    """Each worker keeps exactly the copies the final layout's holder sets give it, and each
    equals its owner's live shard bitwise; the periodic checksums found nothing."""
    (final,) = {Layout.from_json(r["layout_after"]) for r in results.values()}
    sets = backup_holder_sets(final)
    assert all(len(hs) == 2 for hs in sets.values()), sets
    for w, r in results.items():
        assert sorted(r["snapshot"]) == list(protected_by(sets, w)), (w, sets)
        for owner, snap in r["snapshot"].items():
            live = results[owner]["live_shard"]
            assert sorted(snap) == sorted(live), (w, owner)
            for unit, (lo, hi, rows) in live.items():
                assert (lo, hi) == snap[unit][:2], (w, owner, unit)
                assert rows.tobytes() == snap[unit][2].tobytes(), (w, owner, unit)
        assert r["checksum_mismatches"] == 0


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_rank_and_first_holder_lost_together_recover_from_the_second_copy() -> None:
    layout = two_copies()
    sc = Scenario(kill_at_op=REDUCE_SCATTER_OP, victim=VICTIM, also_killed=(FIRST_HOLDER,), layout=layout)
    clean, faulty = _clean("placement_invariant", layout=layout), _run(sc)
    assert sorted(faulty) == [1, 3, 4, 5]
    assert all(r["restored_from"] == [] for r in faulty.values())  # in place: no checkpoint read
    ref_state = _merged(clean, "committed_state")
    assert ref_state["step_count"] == FAIL_STEP
    assert_states_bitwise(ref_state, _merged(faulty, "recovered_state"))
    assert_same_samples(clean, faulty, FAIL_STEP)
    ref_losses, got_losses = _last_stage_losses(clean), _last_stage_losses(faulty)
    assert sorted(got_losses) == list(range(STEPS))
    assert all(got_losses[s] == ref_losses[s] for s in range(FAIL_STEP))
    assert _mean_rel_dev(got_losses, ref_losses, range(FAIL_STEP, STEPS)) <= 1e-4
    assert_every_copy_equals_live(faulty)
    # memory: what every worker's backups take is what the planners count (both copies)
    before = backup_cost(layout).per_rank_bytes
    assert {w: r["initial_backup_bytes"] for w, r in clean.items()} == before
    single = backup_cost(base_layout("placement_invariant")).per_rank_bytes
    assert sum(before.values()) == 2 * sum(single.values()) > 0
    (final,) = {Layout.from_json(r["layout_after"]) for r in faulty.values()}
    after = backup_cost(final).per_rank_bytes
    assert {w: r["backup_bytes"] for w, r in faulty.items()} == after
