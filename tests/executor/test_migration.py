"""Pipeline-only changes (blocks move between stages, no rank lost) are bit-identical (FlexTrain,
ElasWave §6.2-6.3): same losses (exact float equality) and same final parameters and moments.

Units of the test model: 0 embed, 1-4 block_0..block_3, 5 head; the start layout holds units
[0, 3) on stage 0 and [3, 6) on stage 1."""

from __future__ import annotations

import pytest

from executor.launch import JobSpec, job_losses, merged_state, run_job
from executor.migration import moved_layers
from executor.nonblocking_migration import check_nonblocking
from planners.layout import Layout, StageLayout, ZeroLayoutKind
from planners.zero import migration_cost
from tests.executor.engine_cases import (
    block_unit,
    gpt_block_numel,
    gpt_spec,
    layout,
    max_state_diff,
    states_equal,
)

STEPS = 8
RANKS = [(0, 1), (2, 3)]
START = [(0, 3), (3, 6)]
BLOCK1_TO_STAGE1 = [(0, 2), (2, 6)]
BLOCKS12_TO_STAGE0 = [(0, 4), (4, 6)]


def _relayouts(zero: ZeroLayoutKind) -> tuple[tuple[int, Layout], ...]:
    # Step 3: block 1 moves to stage 1; step 6: blocks 1 and 2 move to stage 0.
    return (
        (3, layout(BLOCK1_TO_STAGE1, RANKS, zero_layout=zero)),
        (6, layout(BLOCKS12_TO_STAGE0, RANKS, zero_layout=zero)),
    )


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_moving_layers_between_stages_is_bit_identical() -> None:
    cfg = gpt_spec(dropout=0.1)
    base = run_job(JobSpec(cfg, layout(START, RANKS), STEPS))
    base_losses, base_state = job_losses(base), merged_state(base)
    for zero in ("interleaved", "contiguous"):
        moved = run_job(
            JobSpec(cfg, layout(START, RANKS, zero_layout=zero), STEPS, relayouts=_relayouts(zero))
        )
        assert job_losses(moved) == base_losses, zero
        state = merged_state(moved)
        assert states_equal(state, base_state), max_state_diff(state, base_state)
        assert {res.stage for res in moved.values()} == {0, 1}
        assert len(moved[0].migrations) == 2


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_migration_moves_exactly_the_planned_shards() -> None:
    cfg = gpt_spec()
    results = {}
    for zero in ("interleaved", "contiguous"):
        start = layout(START, RANKS, zero_layout=zero)
        target = layout(BLOCK1_TO_STAGE1, RANKS, zero_layout=zero)
        results[zero] = run_job(JobSpec(cfg, start, 2, relayouts=((1, target),)))
        reports = [results[zero][r].migrations[0] for r in range(4)]
        assert all(rep["moved_layers"] == ((block_unit(1), 0, 1),) for rep in reports)
        # Moments of every re-owned interval (the planner's overlap matrix) + the moved block's parameters.
        numel, planned = start.layer_numel[block_unit(1)], migration_cost(start, target)
        assert sum(rep["elements_sent"] for rep in reports) == 2 * planned.total_elements + numel
        assert sum(rep["elements_sent"] for rep in reports) == sum(
            rep["elements_received"] for rep in reports
        )
        if zero == "interleaved":
            # D disjoint rank-to-rank sends: rank j of stage 0 -> rank j of stage 1, nothing else.
            assert [rep["transfers"] for rep in reports] == [1, 1, 1, 1]
            assert planned.total_elements == numel
        else:
            assert planned.intra_stage_elements > 0
            assert sum(rep["transfers"] for rep in reports) > 4
    assert job_losses(results["interleaved"]) == job_losses(results["contiguous"])


def test_only_pipeline_only_changes_are_accepted() -> None:
    start = layout(START, RANKS)
    assert moved_layers(start, layout([(0, 4), (4, 6)], RANKS)) == ((block_unit(2), 1, 0),)
    with pytest.raises(ValueError, match="keeps every stage's ranks"):
        moved_layers(start, layout(START, [(0,), (1, 2, 3)]))
    with pytest.raises(ValueError, match="also changes"):
        moved_layers(start, layout(BLOCK1_TO_STAGE1, RANKS, global_batch=16))

    def five_layers(bounds: list[tuple[int, int]]) -> Layout:
        stages = tuple(StageLayout(p, lo, hi, (p,)) for p, (lo, hi) in enumerate(bounds))
        return Layout(5, 4, 2, stages, (10,) * 5)

    with pytest.raises(ValueError, match="one stage at a time"):  # layer 2 would skip stage 1
        moved_layers(five_layers([(0, 1), (1, 2), (2, 5)]), five_layers([(0, 3), (3, 4), (4, 5)]))


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch, k", [(8, 2), (6, 3)])  # B=6, M=4: some ranks have empty slots
def test_nonblocking_migration_with_shadow_and_payback_is_bit_identical(batch: int, k: int) -> None:
    cfg = gpt_spec(dropout=0.1)
    start = layout(START, RANKS, global_batch=batch)
    base = run_job(JobSpec(cfg, start, 8))
    relayouts = (
        (3, layout(BLOCK1_TO_STAGE1, RANKS, global_batch=batch)),
        (6, layout(BLOCKS12_TO_STAGE0, RANKS, global_batch=batch)),
    )
    moved = run_job(JobSpec(cfg, start, 8, relayouts=relayouts, migration="nonblocking", shadow_slots=k))
    assert job_losses(moved) == job_losses(base)
    assert states_equal(merged_state(moved), merged_state(base)), max_state_diff(
        merged_state(moved), merged_state(base)
    )
    for rank, res in moved.items():
        first, second = res.migrations
        assert first["mode"] == second["mode"] == "nonblocking"
        own = [len(start.samples_of(rank, m)) > 0 for m in range(4)]
        source, target = (first, second) if rank in (0, 1) else (second, first)
        # The source ran the shadow for its non-empty slots < k; the target folded its slots >= k.
        assert source["shadow_slots_run"] == sum(own[:k])
        assert target["payback_slots"] == sum(own[k:])
        # Per moved block: full parameters + this rank's half of the moments + the payback gradient.
        numel = gpt_block_numel()
        for rep, side in ((source, "elements_sent"), (target, "elements_received")):
            assert rep[side] == len(rep["moved_layers"]) * (numel + 2 * (numel // 2) + numel)


def test_nonblocking_migration_preconditions() -> None:
    moves = ((block_unit(1), 0, 1),)
    check_nonblocking(layout(START, RANKS), moves, 4)
    with pytest.raises(ValueError, match="interleaved"):
        check_nonblocking(layout(START, RANKS, zero_layout="contiguous"), moves, 1)
    with pytest.raises(ValueError, match="split samples differently"):
        check_nonblocking(layout(START, [(0, 1), (2,)]), moves, 1)
    with pytest.raises(ValueError, match="shadow_slots"):
        check_nonblocking(layout(START, RANKS), moves, 5)
