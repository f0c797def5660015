"""The cluster model, the replay engine, its costs and outputs, and the CLI."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from elaswave.cli import main
from planners.applicability import judge
from simulator.cluster import ClusterChange, cluster_timeline
from simulator.costs import RecoveryCosts, parse_overrides
from simulator.engine import fault_free_throughput, run_policy
from simulator.jobs import JOBS
from simulator.layouts import initial_layout, rank_state_bytes
from simulator.traces import TraceEvent, poisson_device_failures, spot_cluster_trace

SPEC = JOBS["llama2-34b"]
NODE = SPEC.devices_per_node
SLOTS = SPEC.num_nodes


def start_nodes(n: int) -> list[TraceEvent]:
    return [TraceEvent(0, "add", f"n{i:02d}") for i in range(n)]


def test_a_spare_swap_is_a_join_that_costs_the_state_transfer_and_shows_in_the_timeline() -> None:
    events = [*start_nodes(SLOTS + 1), TraceEvent(1000, "remove", "n03")]  # n12 waits as a spare
    cluster = cluster_timeline(events, SPEC)
    assert cluster.preemptions_of_running == 1 and cluster.absorbed_by_spares == 1 == cluster.spares_used
    swap = cluster.changes[1]
    assert (swap.time_s, swap.kind, swap.swapped_slots, swap.dead_devices) == (
        1000,
        "swap",
        (3,),
        frozenset(),
    )
    costs = RecoveryCosts()
    run = run_policy("torchft", SPEC, cluster.changes, 4000.0, costs)
    healthy, recovery, healing, after = run.segments
    # TorchFT (its docs): survivors reconfigure, replay the step in flight; the new replica heals
    # from a peer while the others train at the shrunk throughput.
    step = 768 / fault_free_throughput(SPEC)
    assert recovery.kind == "recovery" and recovery.start_s == 1000
    assert recovery.duration_s == pytest.approx(costs.detection_s + costs.partial_communicator_s + step / 2)
    layout = initial_layout(SPEC)
    heal = max(rank_state_bytes(SPEC, layout, r) for r in (6, 7)) / costs.link_bytes_per_s
    assert healing.kind == "healing" and healing.duration_s == pytest.approx(heal)
    assert (
        0.6 * run.fault_free_throughput < healing.throughput < 0.7 * run.fault_free_throughput
    )  # 2 replicas
    assert after.throughput == pytest.approx(run.fault_free_throughput)
    # Spares left idle: the slot waits, the job runs shrunk, nothing joins.
    idle = cluster_timeline(events, SPEC, spares="idle")
    assert idle.changes[1].kind == "loss" and idle.absorbed_by_spares == 0
    assert idle.changes[1].dead_devices == frozenset(range(3 * NODE, 4 * NODE))


def test_horizon_is_the_traces_last_event_unless_hours_say_otherwise(tmp_path: Path) -> None:
    trace = tmp_path / "t.txt"
    lines = [f"0,add,n{i}" for i in range(SLOTS)] + ["1800000,remove,n0", "5400000,add,n12"]
    trace.write_text("\n".join(lines) + "\n")
    for extra, hours in (([], 1.5), (["--hours", "2"], 2.0)):
        out = tmp_path / f"out{hours}"
        args = [
            "simulate",
            "--trace",
            str(trace),
            "--job",
            "llama2-34b",
            "--policies",
            "torchft",
            "--out",
            str(out),
        ]
        assert main(args + extra) == 0
        rows = list(csv.DictReader((out / "timeline.csv").open()))
        assert float(rows[-1]["end_s"]) == hours * 3600
        summary = next(csv.DictReader((out / "summary.csv").open()))
        assert float(summary["config_horizon_h"]) == hours and float(summary["config_trace_end_h"]) == 1.5


def test_time_weighted_lse_counts_stalls_as_zero_by_hand() -> None:
    lost = frozenset(range(11 * NODE, 12 * NODE))  # node 11: ranks 22, 23 (replica 2, stages 6, 7)
    changes = [ClusterChange(0.0, frozenset()), ClusterChange(1000.0, lost, lost_slots=(11,))]
    costs = RecoveryCosts(torchft_model="paper", torchft_restart_s=50.0, replay_fraction=0.0)
    run = run_policy("torchft", SPEC, changes, 3000.0, costs)
    full = run.fault_free_throughput
    shrunk = run.segments[-1].throughput
    assert 0.6 * full < shrunk < 0.7 * full  # one of three replicas dropped
    n = SPEC.shape.num_devices
    by_hand = (1000 * 1.0 + 50 * 0.0 + 1950 * (shrunk / (full * (n - NODE) / n))) / 3000
    assert run.time_weighted_lse == pytest.approx(by_hand)
    assert run.time_averaged_throughput == pytest.approx((1000 * full + 1950 * shrunk) / 3000)
    assert run.seconds("recovery") == 50.0


@pytest.mark.parametrize("policy", ["elaswave", "elaswave-migrate", "elaswave-resize"])
def test_elaswave_is_credited_only_for_plans_the_executor_applies(policy: str) -> None:
    node_trace = cluster_timeline(spot_cluster_trace(seed=3, hours=4.0), SPEC).changes
    spec7 = JOBS["chameleon-7b"]  # single-device failures (TP=1): ranks of one node are not all lost
    device_trace = cluster_timeline(poisson_device_failures(32, 0.1, 4.0, 1, repair_hours=0.5), spec7).changes
    joined_in_place = 0
    for spec, changes in ((SPEC, node_trace), (spec7, device_trace)):
        run = run_policy(policy, spec, changes, 4 * 3600.0)
        planned = [s for s in run.segments if s.kind == "recovery" and s.layout is not None]
        assert planned and {s.mode for s in planned} <= {"in place", "restore"}
        for seg in planned:
            assert seg.previous_layout is not None and seg.layout is not None
            if seg.mode == "in place":
                assert judge(seg.previous_layout, seg.layout).in_place, seg.reason
                joined_in_place += bool(set(seg.layout.ranks()) - set(seg.previous_layout.ranks()))
            else:  # a RESTORE pays the checkpoint reload and the steps since the last checkpoint
                assert dict(seg.costs)["restore"] >= RecoveryCosts().checkpoint_interval_s / 2
        assert run.restores == sum(1 for s in planned if s.mode == "restore")
    if policy == "elaswave":
        assert joined_in_place  # nodes that come back join in place (the executor's growth)


def test_costs_are_overridable_and_bad_ones_rejected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parse_overrides(["detection_s=5", "torchft_model=paper"]) == RecoveryCosts(
        detection_s=5.0, torchft_model="paper"
    )
    for bad, said in (
        ("nope=1", "NAME=VALUE"),
        ("detection_s=x", "not a number"),
        ("detection_s=-1", ">= 0"),
    ):
        with pytest.raises(ValueError, match=said):
            parse_overrides([bad])
    assert (
        main(["simulate", "--poisson", "0.1", "--cost", "torchft_model=maybe", "--out", str(tmp_path)]) == 2
    )
    assert "torchft_model" in capsys.readouterr().err
    assert main(["simulate", "--poisson", "0.1", "--policies", "magic", "--out", str(tmp_path)]) == 2
    assert "--policies" in capsys.readouterr().err
    bad_trace = tmp_path / "bad.txt"
    bad_trace.write_text("0,add\n")
    assert main(["simulate", "--trace", str(bad_trace), "--out", str(tmp_path)]) == 2
    assert "bad.txt:1" in capsys.readouterr().err
    assert not (tmp_path / "summary.csv").exists()


def test_simulate_cli_writes_summary_with_ratios_config_and_a_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.txt"
    lines = [f"0,add,n{i}" for i in range(SLOTS + 1)] + ["1800000,remove,n0", "3600000,remove,n5"]
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    args = ["simulate", "--trace", str(trace), "--hours", "2", "--policies", "elaswave,recycle,torchft"]
    assert main([*args, "--cost", "detection_s=3", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "absorbed by spares 1" in printed.out
    assert "torchft done (3/3)" in printed.err  # progress when stderr is not a terminal
    rows = {r["policy"]: r for r in csv.DictReader((out / "summary.csv").open())}
    assert set(rows) == {"elaswave", "recycle", "torchft"}
    tf = rows["torchft"]
    assert float(tf["vs_torchft"]) == 1.0 and tf["config_detection_s"] == "3.0"
    assert float(rows["elaswave"]["vs_recycle"]) == pytest.approx(
        float(rows["elaswave"]["samples_per_s"]) / float(rows["recycle"]["samples_per_s"]), rel=1e-3
    )
    assert tf["preemptions_of_running"] == "2" and tf["spares_used"] == "1"
    events = list(csv.DictReader((out / "events.csv").open()))
    assert [e["kind"] for e in events] == ["swap", "loss"]
    assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
