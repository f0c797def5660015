"""Multi-process engine vs the single-process reference on the same batches (CPU / gloo).

Tolerances: losses agree to rtol 1e-6; parameters to rtol 1e-5 + atol 1e-5 and Adam moments to
rtol 1e-4 + atol 1e-7. The only differences are fp32 summation order (micro-batch size, DP
reduction); Adam divides each element's gradient by its own RMS, so a round-off in an element whose
gradient is ~1e-9 can move that element by a visible fraction of one step (lr = 3e-3), hence the
absolute parameter tolerance of 1e-5 (0.3 % of a single step).
"""

from __future__ import annotations

import pytest
import torch

from executor.launch import JobSpec, job_losses, merged_state, run_job
from executor.reference import run_reference
from tests.executor.engine_cases import gpt_spec, layout, states_equal

STEPS = 10


def _assert_matches_reference(results: dict, cfg, global_batch: int, slots: int, steps: int) -> None:
    ref = run_reference(cfg, global_batch, slots, steps)
    losses = job_losses(results)
    assert len(losses) == steps
    assert losses == pytest.approx(ref.losses, rel=1e-6)
    assert ref.losses[-1] < ref.losses[0]  # it actually trains
    state = merged_state(results)
    assert state["step_count"] == steps
    for name, unit in ref.state["units"].items():
        got = state["units"][name]
        torch.testing.assert_close(got["param"], unit["param"], rtol=1e-5, atol=1e-5, msg=name)
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[k], unit[k], rtol=1e-4, atol=1e-7, msg=f"{name}.{k}")


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_pp2_dp2_matches_reference_and_zero_layouts_agree_bit_for_bit() -> None:
    cfg = gpt_spec()
    runs = {}
    for zero in ("interleaved", "contiguous"):
        lay = layout(
            [(0, 3), (3, 6)], [(0, 1), (2, 3)], global_batch=8, num_micro_batches=4, zero_layout=zero
        )
        runs[zero] = run_job(JobSpec(cfg, lay, STEPS))
        _assert_matches_reference(runs[zero], cfg, 8, 4, STEPS)
    # Both layouts reduce every element in DP-rank order and apply the same AdamW: same bits.
    assert job_losses(runs["interleaved"]) == job_losses(runs["contiguous"])
    assert states_equal(merged_state(runs["interleaved"]), merged_state(runs["contiguous"]))
    samples = {r: res.samples_processed for r, res in runs["interleaved"].items()}
    assert all(s == [4] * STEPS for s in samples.values())


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "ranks, weights",
    [
        ([(0, 1), (2,)], [(2, 1), (1,)]),  # fan-in: two senders per receiver, uneven 2:1 split
        ([(0,), (1, 2)], [(1,), (1, 3)]),  # fan-out
    ],
)
def test_uneven_stages_match_reference(ranks: list[tuple[int, ...]], weights: list[tuple[int, ...]]) -> None:
    cfg = gpt_spec()
    lay = layout([(0, 2), (2, 6)], ranks, global_batch=7, num_micro_batches=3, weights=weights)
    results = run_job(JobSpec(cfg, lay, STEPS))
    _assert_matches_reference(results, cfg, 7, 3, STEPS)
    for r, res in results.items():
        expected = sum(len(lay.samples_of(r, m)) for m in range(3))
        assert res.samples_processed == [expected] * STEPS
    assert sum(results[r].samples_processed[0] for r in lay.stages[1].ranks) == 7


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_rollback_and_replay_is_exact() -> None:
    cfg = gpt_spec(dropout=0.1)
    lay = layout([(0, 3), (3, 6)], [(0, 1), (2, 3)])
    plain = run_job(JobSpec(cfg, lay, 6))
    replayed = run_job(JobSpec(cfg, lay, 6, replay_steps=(2, 5)))
    assert job_losses(plain) == job_losses(replayed)
    assert states_equal(merged_state(plain), merged_state(replayed))
    last = [res for res in replayed.values() if res.stage == 1]
    assert all(res.replayed_losses == {2: res.losses[2], 5: res.losses[5]} for res in last)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_dropout_rng_is_placement_invariant_only_in_that_mode() -> None:
    cfg, steps = gpt_spec(dropout=0.1), 5
    losses = {}
    for mode in ("placement_invariant", "per_rank"):
        for dp in (1, 2):
            ranks = [tuple(range(dp)), tuple(range(dp, 2 * dp))]
            lay = layout([(0, 3), (3, 6)], ranks, rng_mode=mode)
            losses[mode, dp] = job_losses(run_job(JobSpec(cfg, lay, steps)))
    inv1, inv2 = losses["placement_invariant", 1], losses["placement_invariant", 2]
    assert inv1 == pytest.approx(inv2, rel=1e-6)
    assert inv1 == pytest.approx(run_reference(cfg, 8, 4, steps).losses, rel=1e-6)
    per1, per2 = losses["per_rank", 1], losses["per_rank", 2]
    deviation = max(abs(a - b) / a for a, b in zip(per1, per2, strict=True))
    assert deviation > 1e-4, deviation  # different masks: far beyond round-off


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_dynamic_communicator_drives_the_same_engine_bit_for_bit() -> None:
    """The fault-tolerant executor.comm.Communicator (pipeline pairs served by per-link groups)
    in place of StaticComm: same losses and state, including a blocking layer migration."""
    cfg = gpt_spec(dropout=0.1)
    ranks = [(0, 1), (2, 3)]
    start = layout([(0, 3), (3, 6)], ranks, global_batch=6)
    relayouts = ((2, layout([(0, 2), (2, 6)], ranks, global_batch=6)),)  # block 1 -> stage 1
    static = run_job(JobSpec(cfg, start, 4, relayouts=relayouts))
    dynamic = run_job(JobSpec(cfg, start, 4, relayouts=relayouts, comm_kind="dynamic"))
    assert job_losses(static) == job_losses(dynamic)
    assert states_equal(merged_state(static), merged_state(dynamic))
