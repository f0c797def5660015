"""The pure ElasWave policy the Core, `elaswave plan` and the simulator share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import planners.elaswave_graph as graph
import planners.elaswave_policy as policy_module
import planners.elaswave_replicas as replicas_module
from elaswave.cli import main
from planners.applicability import judge
from planners.elaswave_model import uniform_model
from planners.elaswave_policy import ElasWaveInput, plan_elaswave
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
