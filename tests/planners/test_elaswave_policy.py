"""The pure ElasWave policy the Core, `elaswave plan` and the simulator share."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import planners.elaswave_graph as graph
import planners.elaswave_policy as policy_module
import planners.elaswave_replicas as replicas_module
from elaswave.cli import main
from planners.applicability import judge
from planners.chameleon.state import JobProfile
from planners.elaswave_model import JobModel, job_model, uniform_model
from planners.elaswave_policy import ElasWaveInput, ElasWavePlan, plan_elaswave
from planners.elaswave_reasons import Outcome, Step
from planners.layout import make_uniform_layout

EXAMPLE = Path(__file__).resolve().parents[2] / "planners" / "examples" / "llama2-34b-one-node-lost.json"


def test_a_loss_is_planned_with_typed_reasons_and_the_tables_built_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout = make_uniform_layout(num_layers=4, num_stages=2, dp=3, global_batch=12, num_micro_batches=2)
    built: list[int] = []
    calls: list[int] = []
    original, run = graph.segment_tables, graph.repartition

    def counting_tables(*a: Any) -> Any:
        built.append(1)
        return original(*a)

    def counting_repartition(*a: Any) -> Any:
        calls.append(1)
        return run(*a)

    monkeypatch.setattr(graph, "segment_tables", counting_tables)
    for module in (policy_module, replicas_module):
        monkeypatch.setattr(module, "repartition", counting_repartition)
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


def test_the_registered_profiles_exchange_bandwidth_prices_widening_the_stages() -> None:
    # PP=4 x DP=2 over 6 units (bench.mttr's one kill at this shape), rank 7 lost. 1 + 2 ms per
    # sample per unit, 4 bytes per element.
    layout = make_uniform_layout(num_layers=6, num_stages=4, dp=2, global_batch=16, num_micro_batches=2)
    layout = layout.replace(layer_numel=(5000,) * 6)
    profile = JobProfile(
        layer_fwd_s=(1e-3,) * 6,
        layer_bwd_s=(2e-3,) * 6,
        layer_param_bytes=(20_000.0,) * 6,
        layer_act_bytes=(100.0,) * 6,
        mem_cap_bytes=1e9,
    )

    def plan(bytes_per_s: float) -> tuple[ElasWavePlan, JobModel]:
        model = job_model(layout, replace(profile, allreduce_bytes_per_s=bytes_per_s), "", ())
        return plan_elaswave(ElasWaveInput(layout, (7,), model)), model

    # At 25 GB/s the exchange is nearly free: one stage of DP 7, no pipeline bubble.
    fast, model = plan(25e9)
    assert fast.layout is not None and [s.dp_size for s in fast.layout.stages] == [7]
    assert model.cost.sync_time(fast.layout) == pytest.approx(2 * 6 / 7 * 30_000 * 4 / 25e9)
    # At 500 kB/s one stage's exchange of all 30,000 elements would cost 0.41 s: stages stay narrow.
    slow, model = plan(5e5)
    assert slow.layout is not None and max(s.dp_size for s in slow.layout.stages) <= 2
    assert model.cost.step_time(slow.layout) < model.cost.step_time(fast.layout)
    assert slow.predicted_step_time_s == pytest.approx(model.cost.step_time(slow.layout))
