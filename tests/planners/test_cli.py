"""`elaswave plan` through the real CLI entry point, checked against the library calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elaswave.cli import main
from planners.cli import plan
from planners.partition import solve_partition_request

EXAMPLES = Path(__file__).resolve().parents[2] / "planners" / "examples"
STATE = json.loads((EXAMPLES / "llama2-34b-one-node-lost.json").read_text())


def small_state(**changes: object) -> dict:
    state = {
        "job": {"pp": 4, "dp": 3, "micro_batch": 1, "global_batch": 24, "tp": 1},
        "profile": {
            "num_layers": 12,
            "layer_fwd_s": 0.01,
            "layer_bwd_s": 0.02,
            "layer_param_bytes": 1e8,
            "layer_act_bytes": 5e7,
            "mem_cap_bytes": 16e9,
            "p2p_s_per_sample": 1e-4,
        },
        "failed_ranks": [1],
        "expected_time_to_next_event_s": 3600,
    }
    state.update(changes)
    return state


def run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], payload: object
) -> tuple[int, str, str]:
    path = tmp_path / "in.json"
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    code = main([*args, "--input", str(path)])
    out = capsys.readouterr()
    return code, out.out, out.err


def check_schema(result: dict, num_layers: int) -> None:
    assert set(result) == {
        "policy",
        "reason",
        "plan",
        "alive_devices",
        "fault_free_samples_per_s",
        "alternatives",
    }
    p = result["plan"]
    for key in (
        "pipelines",
        "predicted_step_time_s",
        "samples_per_s",
        "lse",
        "memory_per_stage_bytes",
        "bytes_moved",
        "transition_s",
        "devices_used",
    ):
        assert key in p
    for pipe in p["pipelines"]:
        layers = [s["layers"] for s in pipe["stages"]]
        assert layers[0][0] == 0 and layers[-1][1] == num_layers
        assert pipe["boundaries"] == [stop for _, stop in layers[:-1]]
        for s in pipe["stages"]:
            assert len(s["ranks"]) == len(s["micro_batch_sizes"]) and s["freq_mhz"] > 0
    scores = [a["score"] for a in result["alternatives"]]
    assert scores == sorted(scores, reverse=True)
    assert result["policy"] == result["alternatives"][0]["policy"]


def test_plan_prints_the_library_decision(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(capsys, tmp_path, ["plan"], STATE)
    assert code == 0
    result = json.loads(out)
    check_schema(result, STATE["profile"]["num_layers"])
    assert result == json.loads(json.dumps(plan(STATE)))
    assert {a["policy"] for a in result["alternatives"]} == {
        "elaswave",
        "reparallelise",
        "recycle",
        "torchft",
    }
    assert result["alive_devices"] == 96 - 8
    failed = set(STATE["failed_ranks"])
    used = {r for pipe in result["plan"]["pipelines"] for s in pipe["stages"] for r in s["ranks"]}
    assert not used & failed


def test_plan_restricted_to_elaswave_reports_its_layout(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = run(capsys, tmp_path, ["plan"], small_state(policies=["elaswave"]))
    assert code == 0
    result = json.loads(out)
    check_schema(result, 12)
    stages = result["plan"]["pipelines"][0]["stages"]
    ranks = sorted(r for s in stages for r in s["ranks"])
    # Rank 1 failed; the 11 survivors all serve (regrouped or thinned, planners.elaswave_replicas).
    assert ranks == [0, *range(2, 12)] and 0 < result["plan"]["lse"] <= 1.2


def test_slow_ranks_shift_layers_off_their_stage(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    slow = [[4 * d + 2, 1.6] for d in range(3)]  # stage 2 of every replica is 1.6x slower
    code, out, _ = run(
        capsys, tmp_path, ["plan"], small_state(failed_ranks=[], slow_ranks=slow, policies=["elaswave"])
    )
    assert code == 0
    stages = json.loads(out)["plan"]["pipelines"][0]["stages"]
    sizes = [stop - start for start, stop in (s["layers"] for s in stages)]
    assert sizes[2] == min(sizes) < 3


@pytest.mark.parametrize(
    "change,field",
    [
        ({"job": {"dp": 3, "micro_batch": 1, "global_batch": 24}}, "job.pp"),
        ({"job": {"pp": 4, "dp": 5, "micro_batch": 1, "global_batch": 24}}, "global_batch"),
        ({"failed_ranks": [99]}, "failed ranks [99]"),
        ({"failed_ranks": ["a"]}, "failed_ranks"),
        ({"policies": ["magic"]}, "policies"),
        ({"expected_time_to_next_event_s": -1}, "expected_time_to_next_event_s"),
        ({"slow_ranks": [[1]]}, "slow_ranks"),
        ({"boundaries": [3, 2, 9]}, "boundaries"),
        ({"colour": 1}, "colour"),
        (
            {"job": {"pp": 4, "dp": 3, "micro_batch": 1, "global_batch": 24, "ranks": 3}},
            "job: unknown field(s) ['ranks']",
        ),
    ],
)
def test_bad_state_exits_2_naming_the_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, change: dict, field: str
) -> None:
    code, out, err = run(capsys, tmp_path, ["plan"], small_state(**change))
    assert code == 2 and out == ""
    assert field in err


def test_unrunnable_state_exits_1_with_every_reason(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = run(capsys, tmp_path, ["plan"], small_state(failed_ranks=list(range(12))))
    assert code == 1
    result = json.loads(out)
    assert result["policy"] is None and result["plan"] is None
    assert "no policy can run" in result["reason"]
    assert all(not a["feasible"] and a["score"] == 0 for a in result["alternatives"])


def test_bad_profile_and_bad_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    state = small_state()
    state["profile"]["layer_fwd_s"] = [0.01] * 5
    code, _, err = run(capsys, tmp_path, ["plan"], state)
    assert code == 2 and "profile.layer_fwd_s has 5 entries" in err
    code, _, err = run(capsys, tmp_path, ["plan"], "{not json")
    assert code == 2 and "not valid JSON" in err
    assert main(["plan", "--input", str(tmp_path / "missing.json")]) == 2


def test_partition_mode_is_algorithm_1(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    request = json.loads((EXAMPLES / "partition-request.json").read_text())
    code, out, _ = run(capsys, tmp_path, ["plan", "partition"], request)
    assert code == 0
    result = json.loads(out)
    assert result == json.loads(json.dumps(solve_partition_request(request)))
    assert set(result) == {"feasible", "boundaries", "worst_stage_time", "stage_times", "stage_mem", "reason"}
    assert len(result["boundaries"]) == len(request["mem_cap"]) - 1
    del request["mem_cap"]
    code, _, err = run(capsys, tmp_path, ["plan", "partition"], request)
    assert code == 2 and "mem_cap" in err


def test_scale_table_mode(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(
        capsys, tmp_path, ["plan", "scale-table"], small_state(failed_ranks=[], max_devices=24)
    )
    assert code == 0
    table = json.loads(out)
    assert table["entries"][0]["devices"] == 12 and table["entries"][0]["speedup"] == 1.0
    assert all(e["devices"] <= 24 for e in table["entries"])
    code, _, err = run(capsys, tmp_path, ["plan", "scale-table"], small_state(max_devices=4))
    assert code == 2 and "max_devices" in err
