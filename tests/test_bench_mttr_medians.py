"""`bench.mttr --repeats N`: the medians per case and issue 23's goals judged on them."""

from __future__ import annotations

from typing import Any

from bench.mttr import PHASES, medians


def _run(
    case: str, mttr: float | None, step: float | None, first: float | None, *, bad: bool = False
) -> dict[str, Any]:
    return {
        "config": "PP=2 x DP=4",
        "case": case,
        "mttr_s": mttr,
        "phases": {p: (mttr or 0.0) / len(PHASES) for p in PHASES},
        "fault_free_step_s": step,  # later steps, on the recovered layout: 2x slower here
        "pre_fault_step_s": None if step is None else step / 2,
        "first_step_s": first,
        "problems": ["final state differs"] if bad else [],
    }


def test_medians_group_by_case_and_judge_the_goals_on_the_medians() -> None:
    rows = [
        _run("one kill", 0.40, 0.10, 0.20),
        _run("one kill", 0.25, 0.10, 0.12),
        _run("one kill", 0.28, 0.12, 0.11),
        _run("whole stage", 0.50, 0.10, 0.30, bad=True),
        _run("whole stage", None, None, None),  # a run that did not recover: left out of medians
    ]
    kill, stage = medians(rows)

    assert (kill["case"], kill["runs"], kill["failed_checks"]) == ("one kill", 3, 0)
    assert kill["mttr_s"] == 0.28 and kill["pre_fault_step_s"] == 0.05
    # judged against the step before the fault: 0.28 s > 0.2 + 0.05 s
    assert abs(kill["mttr_goal_s"] - 0.25) < 1e-12 and kill["mttr_goal_met"] is False
    assert abs(kill["first_step_ratio"] - 1.2) < 1e-12 and kill["first_step_goal_met"] is True
    assert abs(kill["phases"]["state"] - 0.28 / len(PHASES)) < 1e-12

    assert (stage["case"], stage["runs"], stage["failed_checks"]) == ("whole stage", 2, 1)
    assert stage["unrecovered"] == 1 and kill["unrecovered"] == 0
    assert stage["mttr_s"] == 0.50 and stage["mttr_goal_met"] is False
    assert abs(stage["first_step_ratio"] - 3.0) < 1e-12 and stage["first_step_goal_met"] is False


def test_a_run_that_never_recovered_fails_the_goal_however_fast_the_others_were() -> None:
    rows = [
        _run("one kill", 0.21, 0.10, 0.10),
        _run("one kill", 0.22, 0.10, 0.10),
        _run("one kill", None, None, None),
    ]
    (kill,) = medians(rows)
    assert kill["mttr_s"] == 0.215 and kill["unrecovered"] == 1 and kill["mttr_goal_met"] is False


def test_a_case_with_no_recovered_run_has_no_verdict() -> None:
    (only,) = medians([_run("the store", None, None, None)])
    assert only["mttr_s"] is None and only["mttr_goal_met"] is None
    assert only["first_step_ratio"] is None and only["first_step_goal_met"] is None
