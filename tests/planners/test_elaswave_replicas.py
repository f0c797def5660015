"""The DP shape step (planners.elaswave_replicas): after a loss the policy re-slots, regroups the
stages or drops a replica where the cost model predicts a faster step than thinning every stage,
the global batch kept; a join brings the fault-free shape back (planners.elaswave_policy_join)."""

from __future__ import annotations

from planners.dataflow import micro_batch_sizes, resize_after_loss
from planners.elaswave_model import uniform_model
from planners.elaswave_policy import ElasWaveInput, ElasWaveSettings, plan_elaswave
from planners.elaswave_policy_join import Joins, Spare
from planners.elaswave_reasons import Outcome, Step
from planners.elaswave_replicas import drop_replica, restage, shape_replicas
from planners.layout import make_uniform_layout

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
