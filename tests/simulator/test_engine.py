"""The replay engine: timelines, downtime accounting, time-averaged throughput, the CLI."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from elaswave.cli import main
from planners.chameleon.policy import POLICIES
from planners.chameleon.state import ClusterState, JobProfile, JobShape, MttrModel
from simulator.engine import dead_device_timeline, run_policy, simulated_candidate
from simulator.jobs import JOBS, node_of_rank, ranks_of_devices
from simulator.traces import TraceEvent

SPEC = JOBS["llama2-13b"]
NODE = SPEC.devices_per_node


def test_node_trace_fills_slots_and_spares_replace_lost_nodes() -> None:
    events = [TraceEvent(0, "add", f"n{i:02d}") for i in range(SPEC.num_nodes + 1)]  # n12 is a spare
    events += [
        TraceEvent(10, "remove", "n03"),
        TraceEvent(20, "remove", "n05"),
        TraceEvent(30, "add", "fresh"),
    ]
    timeline = dead_device_timeline(events, SPEC)
    assert timeline[0] == (0.0, frozenset())
    # n3 is replaced by the spare at once, so the first change is n5's slot at t=20.
    assert timeline[1] == (20.0, frozenset(range(5 * NODE, 6 * NODE)))
    assert timeline[2] == (30.0, frozenset())


def test_device_events_and_rank_mapping() -> None:
    spec = JOBS["chameleon-7b"]
    timeline = dead_device_timeline([TraceEvent(5, "remove", "dev3"), TraceEvent(9, "add", "dev3")], spec)
    assert timeline == [(0.0, frozenset()), (5.0, frozenset({3})), (9.0, frozenset())]
    assert ranks_of_devices(SPEC, {0, 1, 9}) == {0, 2}  # TP=4: devices 0-3 -> rank 0, 8-11 -> rank 2
    assert node_of_rank(SPEC, 3) == [1]


def test_time_average_counts_downtime_and_steady_state_by_hand() -> None:
    mttr = MttrModel()
    lost = frozenset(range(NODE))  # node 0: ranks 0 and 1 (stages 0, 1 of replica 0)
    timeline = [(0.0, frozenset()), (1000.0, lost), (3000.0, frozenset())]
    run = run_policy("torchft", SPEC, timeline, 4000.0, 3600.0, mttr)
    shape, prof = SPEC.shape, SPEC.profile()
    full = POLICIES["torchft"](ClusterState(shape, prof)).throughput
    shrunk = POLICIES["torchft"](
        ClusterState(shape, prof, failed=ranks_of_devices(SPEC, set(lost)))
    ).throughput
    down = mttr.torchft_restart_s
    expected = (1000 * full + (2000 - down) * shrunk + (1000 - down) * full) / 4000
    assert run.time_averaged_throughput == pytest.approx(expected)
    assert run.downtime_s == pytest.approx(2 * down)
    assert run.lse_after_changes[1] == pytest.approx(shrunk / (full * (1 - NODE / shape.num_devices)))


def test_an_event_during_recovery_restarts_it_unless_the_plan_is_unchanged() -> None:
    mttr = MttrModel(torchft_restart_s=50.0)
    node0, node1, node3 = (frozenset(range(n * NODE, (n + 1) * NODE)) for n in (0, 1, 3))
    # Node 3 is in another replica (13B: 3 nodes per replica): TorchFT drops a second replica.
    timeline = [(0.0, frozenset()), (100.0, node0), (120.0, node0 | node3)]
    run = run_policy("torchft", SPEC, timeline, 400.0, 3600.0, mttr)
    assert [(s.start_s, s.end_s, s.throughput) for s in run.segments[1:3]] == [
        (100.0, 120.0, 0.0),
        (120.0, 170.0, 0.0),
    ]
    # Node 1 is in the replica already dropped: the plan is unchanged, the recovery just continues.
    timeline = [(0.0, frozenset()), (100.0, node0), (120.0, node0 | node1)]
    run = run_policy("torchft", SPEC, timeline, 400.0, 3600.0, mttr)
    assert [(s.start_s, s.end_s) for s in run.segments if s.throughput == 0.0] == [
        (100.0, 120.0),
        (120.0, 150.0),
    ]


def test_simulate_cli_writes_table_csv_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.txt"
    lines = [f"0,add,n{i}" for i in range(12)] + ["1800000,remove,n0", "5400000,add,n12"]
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    code = main(
        [
            "simulate",
            "--trace",
            str(trace),
            "--hours",
            "2",
            "--job",
            "llama2-34b",
            "--policies",
            "elaswave,recycle,torchft",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "elaswave" in printed and "time_avg_samples_per_s" in printed
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [r["policy"] for r in rows] == ["elaswave", "recycle", "torchft"]  # sorted by throughput
    assert float(rows[0]["min_lse"]) >= 0.89
    assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    timeline = list(csv.DictReader((out / "timeline.csv").open()))
    assert {r["policy"] for r in timeline} == {"elaswave", "recycle", "torchft"}
    assert json.dumps(rows)  # plain strings and numbers


def test_simulate_cli_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--poisson", "0.1", "--policies", "magic", "--out", str(tmp_path)]) == 2
    assert "--policies" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_text("0,add\n")
    assert main(["simulate", "--trace", str(bad), "--out", str(tmp_path)]) == 2
    assert "bad.txt:1" in capsys.readouterr().err


def test_recycle_restarts_without_damaged_replicas_when_rerouting_would_not_fit() -> None:
    shape = JobShape(pp=2, dp=3, micro_batch=1, global_batch=12)
    # Stage 0 of 2 holds 2 layers: static 2 * 8 B + 2 micro-batches in flight x 2 layers x 100 B.
    prof = JobProfile(
        layer_fwd_s=(0.01,) * 4,
        layer_bwd_s=(0.02,) * 4,
        layer_param_bytes=(1.0,) * 4,
        layer_act_bytes=(100.0,) * 4,
        mem_cap_bytes=500.0,
    )
    state = ClusterState(shape, prof, failed=frozenset({shape.rank(0, 0)}))
    rerouted = POLICIES["recycle"](state)
    assert not rerouted.feasible and "memory" in rerouted.reason  # peers would hold 1.5x activations
    fallback = simulated_candidate("recycle", state)
    assert fallback.feasible and fallback.policy == "recycle" and "restarted" in fallback.reason
    assert fallback.throughput == pytest.approx(POLICIES["torchft"](state).throughput)
