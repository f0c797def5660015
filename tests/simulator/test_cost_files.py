"""Cost files: the paper-scale constants with their sources, one `bench.calibrate` writes, and
`elaswave simulate --costs FILE` reading them."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from bench.calibrate import from_bandwidth, from_comm, from_join, from_mttr
from elaswave.cli import main
from simulator.costs import RecoveryCosts, cost_file, load_costs

FILES = Path(__file__).resolve().parents[2] / "simulator" / "cost_files"
TRACE = Path(__file__).resolve().parents[2] / "simulator" / "traces" / "spot_a.txt"


def test_the_paper_scale_file_is_the_defaults_with_a_source_for_each() -> None:
    doc = json.loads((FILES / "paper_scale.json").read_text())
    assert load_costs(FILES / "paper_scale.json") == RecoveryCosts()
    assert all(entry.get("source") for entry in doc["costs"].values())


def test_a_cost_file_round_trips_and_bad_files_say_what_is_wrong(tmp_path: Path) -> None:
    costs = RecoveryCosts(detection_s=0.05, link_bytes_per_s=1e9, join_start_s=2.0)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cost_file(costs, "test", {"detection_s": "here"})))
    assert load_costs(path) == costs
    path.write_text(json.dumps({"costs": {"detection_sec": 1}}))
    with pytest.raises(ValueError, match="detection_sec"):
        load_costs(path)
    path.write_text("[]")
    with pytest.raises(ValueError, match="'costs' object"):
        load_costs(path)


def test_calibration_maps_benchmark_rows_to_costs() -> None:
    rows = [
        {
            "mttr_s": 0.5,
            "modes": ["in_place"],
            "fault_free_step_s": 0.2,
            "phases": {"detect": 0.05, "plan": 0.02, "communicator": 0.1, "state": 0.03, "replay": 0.3},
        },
        {"mttr_s": 2.0, "modes": ["restore"], "phases": {"detect": 0.9, "state": 1.5}},
    ]
    got = from_mttr(rows)
    assert got["detection_s"][0] == 0.05 and got["replay_fraction"][0] == 1.0  # capped at a step
    assert got["restore_reload_s"][0] == 1.5
    comm = from_comm({"partial_s": 0.1, "full_s": 0.4, "restart_s": 5.0})
    assert comm["full_communicator_s"][0] == 5.0 and comm["elaswave_communicator_s"][0] == 0.1
    join = from_join({"phases_s": {"start_s": 3.0, "state_s": 0.5}, "bytes": {"4": {"received": 1e6}}})
    # A join of a few MB is fixed cost: its time is the transfers' fixed part, not a bandwidth.
    assert join["join_start_s"][0] == 3.0 and join["transfer_fixed_s"][0] == 0.5
    assert "link_bytes_per_s" not in join
    assert from_join([{"phases_s": {"start_s": 3.0}}])["join_start_s"][0] == 3.0  # bench.join's rows
    bw = from_bandwidth({"mib": 256, "link": 1.5e9, "storage": 3e9})
    assert bw["link_bytes_per_s"][0] == 1.5e9 and bw["storage_bytes_per_s"][0] == 3e9


def test_a_transfer_is_its_fixed_part_plus_its_bytes_at_the_link_bandwidth() -> None:
    costs = RecoveryCosts(link_bytes_per_s=1e9, transfer_fixed_s=2.0)
    assert costs.transfer_s(0.0) == 0.0  # nothing to move, nothing to pay
    assert costs.transfer_s(5e9) == pytest.approx(7.0)
    assert RecoveryCosts().transfer_s(25e9) == pytest.approx(1.0)  # paper scale: no fixed part


def test_simulate_reads_a_cost_file_and_names_it(tmp_path: Path) -> None:
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(cost_file(RecoveryCosts(detection_s=30.0, join_start_s=60.0), "slow", {})))
    rates = {}
    for name, extra in (("default", []), ("slow", ["--costs", str(slow)])):
        out = tmp_path / name
        argv = ["simulate", "--trace", str(TRACE), "--job", "llama2-7b", "--policies", "elaswave,torchft"]
        assert main([*argv, *extra, "--out", str(out)]) == 0
        with (out / "summary.csv").open() as f:
            rows = {r["policy"]: r for r in csv.DictReader(f)}
        rates[name] = {p: float(r["samples_per_s"]) for p, r in rows.items()}
        assert rows["elaswave"]["config_costs_file"] == (str(slow) if extra else "defaults (paper scale)")
    assert all(rates["slow"][p] < rates["default"][p] for p in ("elaswave", "torchft"))
