"""The ElasWave policy (resize + Algorithm 1 re-partition + DVFS, ElasWave §4.1-4.3) driving the
schedule engine one tick at a time, and its resize-only baseline selected by configuration."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core_service.config import ConfigError, FailSlowSettings, load_settings
from core_service.elaswave_policy import ElasWavePolicy, make_policy
from core_service.job_snapshot import JobSnapshot, WorkerView
from core_service.model import Ack, AckPhase, JobPhase, StepReport
from core_service.policies import LayoutPolicy
from planners.applicability import judge
from planners.dataflow import resize_after_loss
from planners.elaswave_replicas import restage
from planners.layout import Layout, Plan, PlanMode, StageLayout, make_uniform_layout
from planners.validation import validate
from tests.core.test_engine import Harness, run


def published(h: Harness) -> tuple[int, Plan, Layout]:
    latest = h.plans.latest("j")
    assert latest is not None, "no plan published"
    epoch, body = latest
    plan = Plan.from_json(body)
    return epoch, plan, plan.new


async def settle(h: Harness, now: float) -> None:
    """The joins are one change: planned once, nothing to do."""
    assert await h.engine.tick(h.job, now) == JobPhase.PLANNING
    assert await h.engine.tick(h.job, now + 0.1) == JobPhase.RUNNING
    assert h.job.plan_epoch == 0


async def apply_all(h: Harness, epoch: int, now: float) -> None:
    for worker, member in h.job.members.items():
        if not member.state.is_gone:
            h.job.acks.setdefault(epoch, {})[worker] = Ack(AckPhase.RESUMED)
    assert await h.engine.tick(h.job, now) == JobPhase.RUNNING


def moves(old: Layout, new: Layout) -> list[tuple[int, int, int]]:
    return [
        (b, old.stage_of_layer(b), new.stage_of_layer(b))
        for b in range(old.num_layers)
        if old.stage_of_layer(b) != new.stage_of_layer(b)
    ]


@pytest.mark.timeout(60)
def test_loss_in_one_stage_moves_a_block_to_the_adjacent_stage() -> None:
    from executor.fabric.relayout import plan_relayout  # noqa: PLC0415 - torch only for this check

    layout = make_uniform_layout(num_layers=4, num_stages=2, dp=3, global_batch=12, num_micro_batches=2)
    h = Harness(layout, ElasWavePolicy())

    async def scenario() -> None:
        await h.join_layout("j", layout)
        await settle(h, 1.0)
        h.membership.mark_lost(h.job, "j-w4", "worker process killed by signal 9", "process_exit", 2.0)
        assert await h.engine.tick(h.job, 2.0) == JobPhase.PLANNING
        assert await h.engine.tick(h.job, 2.1) == JobPhase.APPLYING
        epoch, plan, new = published(h)
        assert epoch == 1 and plan.policy == "elaswave"
        assert validate(new, exhaustive=True).ok
        # Stage 1 lost a rank (micro-batch 2 -> 3); block 2 moves to stage 0, one stage only.
        assert new.stages[1].ranks == (3, 5) and new.stages[0].ranks == (0, 1, 2)
        assert moves(layout, new) == [(2, 1, 0)]
        relayout = plan_relayout(layout, new)  # the executor accepts it in place
        assert relayout.moves == ((2, 1, 0),) and relayout.lost == {4}
        assert any("unit 2 stage 1->0" in r for r in plan.reasons), plan.reasons
        assert any(r.startswith("predicted step time") for r in plan.reasons)
        assert plan.predicted_step_time_s > 0
        await apply_all(h, 1, 2.2)

    run(scenario())


def _three_stages() -> Layout:
    # Stages 0 and 1 run one rank each after the loss (6 samples per slot), stage 2 six ranks (1
    # each): Algorithm 1 wants stage 2 to take block 2 from stage 0, two stages away.
    stages = (
        StageLayout(0, 0, 3, (0, 1)),
        StageLayout(1, 3, 6, (2,)),
        StageLayout(2, 6, 9, tuple(range(3, 9))),
    )
    return Layout(num_layers=9, global_batch=12, num_micro_batches=2, stages=stages, layer_numel=(1,) * 9)


@pytest.mark.timeout(60)
def test_best_partition_moving_a_block_two_stages_is_published_in_place() -> None:
    """No partition as good as Algorithm 1's moves every block at most one stage; the executor
    applies the two-stage move by one rebuild (executor/fabric/rebuild.py), so the Core adopts it
    and publishes it in place."""
    layout = _three_stages()
    assert validate(layout).ok
    # Algorithm 1's own move is the subject: the DP shape step (which would regroup the four
    # ranks into two stages here, planners.elaswave_replicas) is off.
    h = Harness(layout, ElasWavePolicy(replicas=False))

    async def scenario() -> None:
        await h.join_layout("j", layout)
        await settle(h, 1.0)
        h.membership.mark_lost(h.job, "j-w1", "worker process killed by signal 9", "process_exit", 2.0)
        assert await h.engine.tick(h.job, 2.0) == JobPhase.PLANNING
        assert await h.engine.tick(h.job, 2.1) == JobPhase.APPLYING
        _, plan, new = published(h)
        assert validate(new, exhaustive=True).ok
        assert new.boundaries == (1, 2) and new.stages[0].ranks == (0,)
        assert plan.mode is PlanMode.IN_PLACE and judge(layout, new).in_place
        moved = [r for r in plan.reasons if r.startswith("re-partition (Algorithm 1")]
        assert len(moved) == 1 and "unit 2 stage 0->2" in moved[0], plan.reasons

    run(scenario())


def _report(h: Harness, worker: str, step: int, seconds: float) -> None:
    member = h.job.members[worker]
    session = h.membership.sessions[("j", worker)]
    h.membership.step(
        session, StepReport(step, seconds, seconds, None, 2, member.stage, member.dp_rank, float(step))
    )


@pytest.mark.timeout(60)
def test_slow_worker_is_up_clocked_and_given_its_clock_back_when_it_recovers() -> None:
    layout = make_uniform_layout(num_layers=4, num_stages=2, dp=3, global_batch=12, num_micro_batches=2)
    h = Harness(layout, ElasWavePolicy())
    # A 12% straggler; the default ratio (1.5) would flag only stragglers DVFS cannot make up for.
    h.job.failslow.settings = FailSlowSettings(ratio=1.05, trigger_steps=3, clear_steps=3)

    def step_all(step: int, slow_s: float) -> None:
        for worker in sorted(h.job.members):
            _report(h, worker, step, slow_s if worker == "j-w4" else 1.0)

    async def scenario() -> None:
        await h.join_layout("j", layout)
        await settle(h, 1.0)
        for step in range(3):  # flagged only after trigger_steps consecutive slow steps
            assert not h.job.pending_changes
            step_all(step, 1.12)
        assert [e.kind for e in h.job.pending_changes] == ["worker_slow"]
        assert await h.engine.tick(h.job, 5.0) == JobPhase.PLANNING
        assert await h.engine.tick(h.job, 5.1) == JobPhase.APPLYING
        epoch, plan, new = published(h)
        assert epoch == 1 and validate(new).ok
        assert new.frequencies_mhz == ((4, 1568),)  # 1,400 MHz x 1.12, below the 1,650 MHz maximum
        assert new.stages == layout.stages  # a sub-layer gap: no block moves, no rank leaves
        assert any("DVFS" in r and "rank 4 at 1568 MHz" in r for r in plan.reasons), plan.reasons
        assert any("fail-slow" in r for r in plan.reasons)
        await apply_all(h, 1, 5.2)
        # Compensated: normal step times, but the worker is cleared only after clear_steps of them.
        for step in range(3, 5):
            step_all(step, 1.0)
            assert not h.job.pending_changes and await h.engine.tick(h.job, 6.0 + step) == JobPhase.RUNNING
        step_all(5, 1.0)
        assert [e.kind for e in h.job.pending_changes] == ["worker_recovered"]
        assert await h.engine.tick(h.job, 9.0) == JobPhase.PLANNING
        assert await h.engine.tick(h.job, 9.1) == JobPhase.APPLYING
        epoch, plan, new = published(h)
        assert epoch == 2 and new.frequencies_mhz == ((4, 1400),)  # pinned at nominal: SetFrequency is sent
        assert any("back to the nominal 1400 MHz" in r for r in plan.reasons), plan.reasons

    run(scenario())


def _snapshot(layout: Layout, lost: int, model: dict[str, Any] | None) -> JobSnapshot:
    live = tuple(
        WorkerView(f"w{r}", "h", layout.stage_of_rank(r), 0, r, "RUNNING")
        for r in layout.ranks()
        if r != lost
    )
    gone = (WorkerView(f"w{lost}", "h", layout.stage_of_rank(lost), 0, lost, "LOST"),)
    return JobSnapshot(
        "j",
        0,
        layout,
        live,
        gone,
        (f"worker_lost:w{lost}",),
        None if model is None else json.dumps(model),
    )


def test_registered_model_is_the_cost_model_when_the_job_has_one() -> None:
    layout = make_uniform_layout(num_layers=4, num_stages=2, dp=3, global_batch=12, num_micro_batches=2)
    # Block 2 is cheap: after rank 4 goes, stage 1 (blocks 2-3 at micro-batch 3) is still faster
    # than stage 0, so nothing should move; the uniform model would move block 2.
    model = {
        "job": {"pp": 2, "dp": 3, "micro_batch": 2, "global_batch": 12},
        "profile": {
            "layer_fwd_s": [1.0, 1.0, 0.1, 1.0],
            "layer_bwd_s": [2.0, 2.0, 0.2, 2.0],
            "layer_param_bytes": [1.0] * 4,
            "layer_act_bytes": [0.0] * 4,
            "mem_cap_bytes": 1e12,
        },
    }
    with_model = ElasWavePolicy().decide(_snapshot(layout, 4, model))
    assert with_model.action == "publish" and "registered profile" in with_model.reasons[0]
    assert with_model.layout is not None and with_model.layout.boundaries == (2,)
    assert any(r.startswith("no unit moves") for r in with_model.reasons), with_model.reasons
    uniform = ElasWavePolicy().decide(_snapshot(layout, 4, None))
    assert "uniform blocks" in uniform.reasons[0]
    assert uniform.layout is not None and uniform.layout.boundaries == (3,)


def test_policy_is_selected_by_configuration() -> None:
    assert load_settings(dev_mode=True).policy == "elaswave"
    assert isinstance(make_policy(load_settings(dev_mode=True).policy), ElasWavePolicy)
    baseline = make_policy(load_settings(dev_mode=True, policy="elaswave-resize").policy)
    assert isinstance(baseline, LayoutPolicy) and baseline.name == "elaswave-resize"
    with pytest.raises(ConfigError, match="policy 'resize' is unknown: choose 'elaswave'.*'elaswave-resize'"):
        load_settings(dev_mode=True, policy="resize")


def test_memory_caps_keep_a_block_where_it_is() -> None:
    # Uniform model memory per block on a DP=3 stage: 1 element x (2 + 2 + 12/3) bytes = 8 bytes;
    # stage 0 may hold two blocks (16 <= 20) but not the third the re-partition would give it.
    capped = make_uniform_layout(
        num_layers=4,
        num_stages=2,
        dp=3,
        global_batch=12,
        num_micro_batches=2,
        stage_mem_cap_bytes=(20.0, 1e9),
    )
    # Algorithm 1's memory constraint alone: the DP shape step off.
    decision = ElasWavePolicy(replicas=False).decide(_snapshot(capped, 4, None))
    assert decision.action == "publish"
    new = decision.layout
    assert new is not None
    assert new.boundaries == (2,) and new.stages[1].ranks == (3, 5)
    assert any(r.startswith("no unit moves") for r in decision.reasons), decision.reasons
    # With it: regrouping the five ranks into 3 stages keeps every cap (a stage's cap is its
    # ranks' tightest), but the uniform model prices no DP exchange, so the stage count stays.
    shaped = ElasWavePolicy().decide(_snapshot(capped, 4, None)).layout
    assert shaped is not None and shaped.num_stages == 2
    regrouped = restage(resize_after_loss(capped, [4]).layout, 3)
    assert regrouped is not None and regrouped.stage_mem_cap_bytes == (20.0, 20.0, 1e9)


@pytest.mark.timeout(60)
def test_a_unit_moved_for_a_straggler_does_not_move_back_in_its_cool_down() -> None:
    """A 3x straggler's plan moves a unit off its stage (optional: only a slow rank); when it
    recovers within the cool-down, the unit stays put and only its up-clock is given back: no
    ping-pong (issue 27)."""
    layout = make_uniform_layout(num_layers=8, num_stages=2, dp=2, global_batch=8, num_micro_batches=2)
    h = Harness(layout, ElasWavePolicy())
    h.job.failslow.settings = FailSlowSettings(ratio=1.5, trigger_steps=2, clear_steps=2)

    def step_all(step: int, slow_s: float) -> None:
        for worker in sorted(h.job.members):
            _report(h, worker, step, slow_s if worker == "j-w0" else 1.0)

    async def scenario() -> None:
        await h.join_layout("j", layout)
        await settle(h, 1.0)
        for step in range(3):  # its first step has no peer report yet to be judged against
            step_all(step, 3.0)
        assert [e.kind for e in h.job.pending_changes] == ["worker_slow"]
        assert await h.engine.tick(h.job, 5.0) == JobPhase.PLANNING
        assert await h.engine.tick(h.job, 5.1) == JobPhase.APPLYING
        _, first, new = published(h)
        moved = moves(layout, new)
        assert moved and all(src == 0 for _, src, _ in moved), first.reasons  # off the straggler's stage
        assert set(h.job.unit_moved_at) == {b for b, _, _ in moved}
        await apply_all(h, 1, 5.2)
        for step in range(3, 5):  # recovered (its reported time back at the peers')
            step_all(step, 1.0)
        assert [e.kind for e in h.job.pending_changes] == ["worker_recovered"]
        assert await h.engine.tick(h.job, 9.0) == JobPhase.PLANNING
        phase = await h.engine.tick(h.job, 9.1)
        if phase == JobPhase.APPLYING:  # the up-clock given back, the units kept where they are
            epoch, plan, back = published(h)
            assert epoch == 2 and back.boundaries == new.boundaries, plan.reasons
            assert any("cool-down" in r for r in plan.reasons), plan.reasons
        else:
            assert phase == JobPhase.RUNNING and h.job.plan_epoch == 1
            decision = [e for e in h.job.events if e.kind.startswith("decision_")][-1]
            assert "cool-down" in decision.detail, decision.detail

    run(scenario())


@pytest.mark.timeout(60)
def test_the_wall_step_the_workers_report_prices_a_loss() -> None:
    """The workers report their wall step and their own compute (0.2275 s and 0.034 s, as bench.mttr's
    one kill at PP=2 x DP=4 measured on 2 CPU cores); the policy charges the difference per
    mini-step, keeps the stage count, and predicts about the step the job then ran."""
    layout = make_uniform_layout(num_layers=6, num_stages=2, dp=4, global_batch=16, num_micro_batches=2)
    h = Harness(layout, ElasWavePolicy())

    async def scenario() -> None:
        await h.join_layout("j", layout)
        await settle(h, 1.0)
        for worker, member in sorted(h.job.members.items()):
            session = h.membership.sessions[("j", worker)]
            report = StepReport(3, 0.2275, 0.034, None, 2, member.stage, member.dp_rank, 3.0)
            h.membership.step(session, report)
        assert h.membership.mark_lost(h.job, "j-w5", "killed", "process_exit", 4.0)
        assert await h.engine.tick(h.job, 5.0) == JobPhase.PLANNING
        assert await h.engine.tick(h.job, 5.1) == JobPhase.APPLYING
        _, plan, new = published(h)
        assert new.num_stages == 2 and new.dp_sizes == (4, 3), plan.reasons
        assert any(
            "of the median wall step 0.2275 s, the rest charged as 0.0645 s per mini-step" in r
            for r in plan.reasons
        ), plan.reasons
        assert 0.2275 < plan.predicted_step_time_s < 0.25

    run(scenario())
