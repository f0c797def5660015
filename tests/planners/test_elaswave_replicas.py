"""The DP shape step (planners.elaswave_replicas): after a loss the policy re-slots, regroups the
stages or drops a replica where the cost model predicts a faster step than thinning every stage,
the global batch kept; a join brings the fault-free shape back (planners.elaswave_policy_join)."""

from __future__ import annotations

import pytest

from planners.chameleon.state import JobProfile
from planners.dataflow import micro_batch_sizes, resize_after_loss
from planners.elaswave_model import RankReport, job_model, uniform_model
from planners.elaswave_policy import ElasWaveInput, ElasWaveSettings, plan_elaswave
from planners.elaswave_policy_join import Joins, Spare
from planners.elaswave_reasons import Outcome, Step
from planners.elaswave_replicas import TRUSTED_SHARE, drop_replica, restage, shape_replicas
from planners.layout import Layout, make_uniform_layout

LAYOUT = make_uniform_layout(num_layers=12, num_stages=3, dp=4, global_batch=48, num_micro_batches=4)


def test_a_loss_is_answered_by_the_fastest_shape_with_the_global_batch_kept() -> None:
    model = uniform_model(LAYOUT, [], "test")
    thinned = resize_after_loss(LAYOUT, [5]).layout  # stage 1: 12 samples per slot over 3 ranks
    shaped, reasons = shape_replicas(thinned, {}, model, 0.02, (3, 3))
    assert reasons[0].step is Step.REPLICA and reasons[0].outcome is Outcome.CHANGED
    assert shaped.global_batch == LAYOUT.global_batch and sorted(shaped.ranks()) == sorted(thinned.ranks())
    assert max(micro_batch_sizes(shaped)) <= 3  # no rank takes more than before the loss
    plan = plan_elaswave(ElasWaveInput(LAYOUT, (5,), model))
    kept = plan_elaswave(ElasWaveInput(LAYOUT, (5,), model), ElasWaveSettings(replicas=False))
    assert plan.predicted_step_time_s < kept.predicted_step_time_s * 0.98
    assert any(r.step is Step.REPLICA for r in plan.reasons) and plan.layout is not None


def test_drop_replica_cuts_every_stage_to_the_smallest_and_restage_equalises() -> None:
    thinned = resize_after_loss(LAYOUT, [5, 6]).layout  # DP sizes 4, 2, 4
    dropped = drop_replica(thinned)
    assert dropped is not None and dropped[0].dp_sizes == (2, 2, 2) and dropped[1] == (2, 3, 10, 11)
    regrouped = restage(thinned, 2)
    assert regrouped is not None and regrouped.dp_sizes == (5, 5) and regrouped.num_layers == 12
    assert drop_replica(LAYOUT) is None and restage(LAYOUT, 3) is None


def test_a_join_restores_the_fault_free_shape_after_a_reshape() -> None:
    model = uniform_model(LAYOUT, [], "test")
    lost = plan_elaswave(ElasWaveInput(LAYOUT, (5,), model))
    assert lost.layout is not None and lost.layout.dp_sizes != LAYOUT.dp_sizes  # reshaped
    joins = Joins((Spare("s0"),), LAYOUT, next_rank=12, max_ranks=12)
    back = plan_elaswave(ElasWaveInput(lost.layout, (), model, joins=joins))
    assert back.layout is not None and back.joiners == ((12, "s0"),)
    assert back.layout.dp_sizes == LAYOUT.dp_sizes and back.layout.num_micro_batches == 4
    assert back.layout.stages[1].ranks == (4, 12, 6, 7)  # the newcomer in the lost rank's place
    assert any(r.step is Step.REPLICA and "fault-free shape" in r.text for r in back.reasons)


# ---- what a model does not explain of the measured step (PP=2 x DP=4 on 2 CPU cores) ---------------
KILL_24 = make_uniform_layout(num_layers=6, num_stages=2, dp=4, global_batch=16, num_micro_batches=2)
# A profile of compute alone, as a describe run registers: 1 ms forward, 2 ms backward per sample.
COMPUTE_ONLY = JobProfile(
    layer_fwd_s=(1e-3,) * 6,
    layer_bwd_s=(2e-3,) * 6,
    layer_param_bytes=(20_000.0,) * 6,
    layer_act_bytes=(100.0,) * 6,
    mem_cap_bytes=1e9,
)


def reports(layout: Layout, compute_s: float, wall_s: float) -> tuple[RankReport, ...]:
    return tuple(RankReport(r, compute_s, False, wall_s) for r in layout.ranks())


def test_the_uniform_model_charges_the_wall_step_beyond_compute_per_mini_step() -> None:
    # bench.mttr's one kill: the ranks computed 0.034 s of a 0.2275 s step.
    model = job_model(KILL_24, None, "test", reports(KILL_24, 0.034, 0.2275))
    slots = KILL_24.num_micro_batches + KILL_24.num_stages - 1
    assert model.cost.ministep_overhead_s == pytest.approx((0.2275 - 0.034) / slots)
    assert model.cost.step_time(KILL_24) == pytest.approx(0.2275)  # predicted at its wall step
    assert model.explained_share == pytest.approx(0.034 / 0.2275)
    assert "predicts 15% of the median wall step 0.2275 s, the rest charged as 0.0645 s" in model.reason
    # Without wall times, or a wall step no longer than predicted, nothing is charged.
    assert job_model(KILL_24, None, "test", reports(KILL_24, 0.034, 0.0)).cost.ministep_overhead_s == 0.0
    fast = job_model(KILL_24, None, "test", reports(KILL_24, 0.034, 0.02))
    assert fast.cost.ministep_overhead_s == 0.0 and fast.explained_share == 1.0


def test_without_a_priced_exchange_a_loss_keeps_the_stage_count() -> None:
    # Uncharged, the model regrouped this loss into 4 stages of 8 slots, then into PP=1 x DP=7; the
    # job stepped 2.5x and 1.8x slower. Charged, and with the stage count kept, it thins stage 1.
    model = job_model(KILL_24, None, "test", reports(KILL_24, 0.034, 0.2275))
    plan = plan_elaswave(ElasWaveInput(KILL_24, (5,), model))
    assert plan.layout is not None and plan.layout.num_stages == 2 and plan.layout.num_micro_batches == 2
    assert plan.layout.dp_sizes == (4, 3)
    kept = [r.text for r in plan.reasons if r.step is Step.REPLICA]
    assert kept and kept[0].startswith("DP shape kept"), kept
    assert 0.2275 < plan.predicted_step_time_s < 0.2275 * 1.1


def test_a_profile_that_explains_little_of_the_step_keeps_the_stage_count() -> None:
    # Unmeasured (the simulator's case) the profile is trusted: it regroups the loss into 4
    # stages of 8 slots, as the uncharged uniform model did.
    trusted = plan_elaswave(ElasWaveInput(KILL_24, (5,), job_model(KILL_24, COMPUTE_ONLY, "", ())))
    assert trusted.layout is not None and trusted.layout.dp_sizes == (2, 2, 2, 1)
    # Measured at its own prediction it is trusted still; at 0.2275 s it explains a quarter of
    # the step: two stages stay.
    predicted = job_model(KILL_24, COMPUTE_ONLY, "", ()).cost.step_time(KILL_24)
    agreed = job_model(KILL_24, COMPUTE_ONLY, "", reports(KILL_24, predicted, predicted))
    assert agreed.explained_share == 1.0 and agreed.cost.ministep_overhead_s == 0.0
    assert plan_elaswave(ElasWaveInput(KILL_24, (5,), agreed)).layout == trusted.layout
    measured = job_model(KILL_24, COMPUTE_ONLY, "", reports(KILL_24, predicted, 0.2275))
    assert measured.explained_share is not None and measured.explained_share < TRUSTED_SHARE
    plan = plan_elaswave(ElasWaveInput(KILL_24, (5,), measured))
    assert plan.layout is not None and plan.layout.dp_sizes == (4, 3), plan.reasons


def test_without_a_priced_exchange_another_stage_count_is_taken_when_nothing_else_fits_memory() -> None:
    # Uniform memory per block: 1 element x (2 + 2 + 12 / DP) bytes. One stage of 4 blocks at
    # DP=4 holds 28 bytes <= 30; at DP=3 32 > 30 and no single-stage shape fits. Two stages (DP 2
    # and 1, three blocks and one: 30 and 16 bytes) do.
    layout = make_uniform_layout(
        num_layers=4, num_stages=1, dp=4, global_batch=8, num_micro_batches=2, stage_mem_cap_bytes=(30.0,)
    )
    model = job_model(layout, None, "test", reports(layout, 0.03, 0.1))
    plan = plan_elaswave(ElasWaveInput(layout, (3,), model))
    assert plan.layout is not None and plan.layout.num_stages == 2, plan.reasons
    assert any(r.step is Step.REPLICA and "2 stages" in r.text for r in plan.reasons), plan.reasons
