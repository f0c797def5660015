"""The pure ElasWave policy the Core, `elaswave plan` and the simulator share."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import planners.elaswave_graph as graph
import planners.elaswave_policy as policy_module
import planners.elaswave_replicas as replicas_module
from elaswave.cli import main
from planners.applicability import judge
from planners.chameleon.state import JobProfile
from planners.elaswave_model import JobModel, RankReport, job_model, uniform_model
from planners.elaswave_policy import ElasWaveInput, ElasWavePlan, plan_elaswave
from planners.elaswave_reasons import Outcome, Step
from planners.layout import make_uniform_layout

EXAMPLE = Path(__file__).resolve().parents[2] / "planners" / "examples" / "llama2-34b-one-node-lost.json"


def test_a_loss_is_planned_with_typed_reasons_and_the_tables_built_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout = make_uniform_layout(num_layers=4, num_stages=2, dp=3, global_batch=12, num_micro_batches=2)
    built, calls = [], []
    original, run = graph.segment_tables, graph.repartition
    monkeypatch.setattr(graph, "segment_tables", lambda *a: built.append(1) or original(*a))
    for module in (policy_module, replicas_module):
        monkeypatch.setattr(module, "repartition", lambda *a: calls.append(1) or run(*a))
    plan = plan_elaswave(ElasWaveInput(layout, (4,), uniform_model(layout, [], "test")))
    # Algorithm 1 and the adjacency search share one set of tables per re-partition (the DP
    # shape step prices its candidates after one each, planners.elaswave_replicas).
    assert len(built) == len(calls) >= 1
    assert plan.action == "publish" and plan.layout is not None and judge(layout, plan.layout).in_place
    steps = [(r.step, r.outcome) for r in plan.reasons]
    assert steps[0] == (Step.MODEL, Outcome.INFO) and (Step.GRAPH, Outcome.CHANGED) in steps
    assert plan.summary == "; ".join(
        [*(r.headline for r in plan.reasons if r.headline), plan.reasons[-1].text]
    )
    assert plan.summary.startswith("lost ranks [4]; re-partition (Algorithm 1, §4.2): unit 2 stage 1->0")


def test_elaswave_plan_chooses_only_plans_the_executor_applies(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["plan", "--input", str(EXAMPLE)]) == 0
    result = json.loads(capsys.readouterr().out)
    alternatives = {a["policy"]: a for a in result["alternatives"]}
    assert result["policy"] == "elaswave" and alternatives["elaswave"]["applicable"]
    assert not alternatives["reparallelise"]["applicable"]  # several pipelines: no Layout
    assert alternatives["reparallelise"]["reason"].startswith("not applicable: ")
    chosen = max((a for a in result["alternatives"] if a["applicable"]), key=lambda a: a["score"])
    assert chosen["policy"] == result["policy"]


def test_elaswave_plan_with_no_applicable_plan_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    state = json.loads(EXAMPLE.read_text()) | {"policies": ["reparallelise", "oobleck"]}
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    assert main(["plan", "--input", str(path)]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["policy"] is None and result["plan"] is None
    assert result["reason"].startswith("no policy's plan applies: ")
    assert [a["applicable"] for a in result["alternatives"]] == [False, False]


def _after_one_kill(walls: list[float | None]) -> tuple[ElasWavePlan, JobModel]:
    """PP=4 x DP=2 over 6 units, rank 7 lost; every survivor reports 30 ms of its own compute
    and the given wall step (`bench.mttr`'s one kill at this shape, on 2 shared cores)."""
    layout = make_uniform_layout(num_layers=6, num_stages=4, dp=2, global_batch=16, num_micro_batches=2)
    layout = layout.replace(layer_numel=(5000,) * 6)
    reports = tuple(RankReport(r, 0.03, False, wall) for r, wall in zip(range(7), walls, strict=True))
    model = job_model(layout, None, "test", reports)
    return plan_elaswave(ElasWaveInput(layout, (7,), model)), model


def test_a_wall_step_beyond_the_pipeline_prices_the_dp_exchange_that_widening_stages_grows() -> None:
    # Own compute alone: the uniform model sees no exchange and regroups the 7 survivors into
    # one stage of DP 7 (no bubble), which ran 1.4-1.6x slower on the 2-core machine.
    blind, model = _after_one_kill([None] * 7)
    assert blind.layout is not None and blind.layout.num_stages == 1
    assert math.isinf(model.cost.link.dp_bytes_per_s) and "scaled to the reported median" in model.reason
    # The same compute with a 160 ms wall step: 80 ms are the 1F1B pipeline (bubble included),
    # the other 80 ms the widest exchange's 2 x 1/2 x 10,000 elements x 2 bytes.
    priced, model = _after_one_kill([0.16] * 7)
    assert model.cost.link.dp_bytes_per_s == pytest.approx(20_000 / 0.08)
    assert "0.08 s at 2.5e+05 B/s per device" in model.reason
    assert priced.layout is not None and priced.layout.num_stages > 1
    widest = max(s.dp_size for s in priced.layout.stages)
    assert widest <= 2 and model.cost.step_time(priced.layout) < model.cost.step_time(blind.layout)
    assert priced.predicted_step_time_s == pytest.approx(model.cost.step_time(priced.layout))
    # A wall step the pipeline alone explains leaves nothing to price the exchange from.
    _, model = _after_one_kill([0.06] * 7)
    assert math.isinf(model.cost.link.dp_bytes_per_s)


def test_reports_lower_a_registered_profiles_exchange_bandwidth_never_raise_it() -> None:
    layout = make_uniform_layout(num_layers=6, num_stages=4, dp=2, global_batch=16, num_micro_batches=2)
    layout = layout.replace(layer_numel=(5000,) * 6)
    # 1 + 2 ms per sample per unit, 4 bytes per element: a rank's busy time is 2 micro-batches
    # x 3 ms x its units x 4 samples, 48 ms on the 2-unit stages and 24 on the others.
    profile = JobProfile(
        layer_fwd_s=(1e-3,) * 6,
        layer_bwd_s=(2e-3,) * 6,
        layer_param_bytes=(20_000.0,) * 6,
        layer_act_bytes=(100.0,) * 6,
        mem_cap_bytes=1e9,
    )

    def plan(walls: list[float | None]) -> tuple[ElasWavePlan, JobModel]:
        reports = tuple(RankReport(r, 0.03, False, wall) for r, wall in zip(range(7), walls, strict=True))
        model = job_model(layout, profile, "", reports)
        return plan_elaswave(ElasWaveInput(layout, (7,), model)), model

    # At the profile's default 25 GB/s the exchange is free enough to regroup into DP 7.
    blind, model = plan([None] * 7)
    assert model.cost.link.dp_bytes_per_s == profile.allreduce_bytes_per_s
    assert blind.layout is not None and [s.dp_size for s in blind.layout.stages] == [7]
    # Workers measure 30 ms of compute (the profile predicts a median 36 ms of busy time: x5/6)
    # in 160 ms steps. The pipeline (96 ms of the profile's, 80 measured) leaves 80 ms to the
    # widest exchange's 2 x 1/2 x 10,000 elements x 4 bytes: 5e5 B/s, x5/6 at the profile's times.
    priced, model = plan([0.16] * 7)
    assert model.cost.link.dp_bytes_per_s == pytest.approx(40_000 / 0.08 * 5 / 6)
    assert "measured: the DP exchange to the median wall step 0.16 s" in model.reason
    assert priced.layout is not None and max(s.dp_size for s in priced.layout.stages) <= 2
    # A measured bandwidth above the profile's (1 us beyond the pipeline: 3.3e10 B/s) leaves it.
    _, model = plan([0.080001] * 7)
    assert model.cost.link.dp_bytes_per_s == profile.allreduce_bytes_per_s
    assert "measured" not in model.reason
