"""Warm spares (issue 23, item 4): a spare warms up before it tells the Core it is ready.

- In one process: `executor.spare_warmup.warm_up` connects the store, runs the dry run, builds
  every unit and runs it forward and backward once, leaving the units exactly as built (same
  weights and buffers, no gradients, training mode back): the stage a plan gives the spare takes
  them as they are.
- Real processes (Core, store, agents, GPT-example workers; `harness.demo_story`): a spare that
  is killed while it waits, warm and ready, is noticed by the Core (LOST) and never planned for,
  and the job finishes with the fault-free state; a warm spare taken in after a loss gives the
  fault-free state too, and it finished its warm-up before the Core saw it ready.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed import TCPStore
from torch.utils.data import TensorDataset

from executor.spare_warmup import exercise, warm_up
from executor.trainer import TrainSpec
from executor.units import UnitModel, fingerprint
from harness.chaos import ChaosRun, ChaosScenario, fault_free_run, judge
from harness.demo_report import build_report, problems
from harness.demo_story import StoryConfig, StoryRun, run_story
from tests.executor.engine_cases import gpt_spec


def test_the_warm_up_leaves_every_unit_as_built_and_hands_a_stage_its_units() -> None:
    spec = gpt_spec(dropout=0.1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    warm = warm_up(spec, [f"127.0.0.1:{store.port}"], timeout_s=10.0)
    assert set(warm.seconds) == {"device_s", "store_s", "dry_run_s", "build_s", "exercise_s"}
    assert warm.warmed_unix <= time.time()
    names = spec.model.names
    assert list(warm.units) == list(names)
    for i, name in enumerate(names):
        unit = warm.units[name]
        fresh = spec.model.build(i)
        assert fingerprint(unit) == fingerprint(fresh), name  # the exercise changed no weight
        for (key, a), (_, b) in zip(unit.state_dict().items(), fresh.state_dict().items(), strict=True):
            assert torch.equal(a, b), (name, key)  # nor any buffer
        assert all(p.grad is None for p in unit.parameters()), name
        assert all(m.training for m in unit.modules()), name
    # Its store connection is live: the trainer's groups are built over it.
    warm.store.set("probe", "1")
    assert store.get("probe") == b"1"
    stage = warm.take_units(names[1:3])
    assert list(stage) == list(names[1:3]) and warm.units == {}


def _free_port() -> int:
    """A port nothing listens on (bound, then closed): a store that died."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_spare_warms_up_on_the_first_store_of_the_list_that_answers() -> None:
    # The list came with the spare's node when it joined; the job's first store died since.
    spec = gpt_spec(dropout=0.0)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    listed = [f"127.0.0.1:{_free_port()}", f"127.0.0.1:{store.port}"]
    warm = warm_up(spec, listed, timeout_s=20.0)
    assert warm.store_index == 1
    warm.store.set("probe", "2")
    assert store.get("probe") == b"2"
    with pytest.raises(TimeoutError, match="no store of"):
        warm_up(spec, listed[:1], timeout_s=1.0)
    with pytest.raises(ValueError, match="non-empty list"):
        warm_up(spec, listed[1], timeout_s=1.0)


def _norm_unit(name: str) -> nn.Module:
    return nn.Linear(3, 3) if name == "lin" else nn.BatchNorm1d(4)  # on (batch, 4, 3)


def test_the_exercise_leaves_running_statistics_alone() -> None:
    # A unit with running statistics: they move on every forward in training mode. The dry run
    # refuses such units (tests/executor/test_model.py), so they are built here directly: the
    # exercise itself must leave every module's state as it found it, whatever the units hold.
    model = UnitModel(("lin", "norm"), _norm_unit)
    data = TensorDataset(torch.randn(8, 4, 3), torch.randn(8, 4, 3))
    spec = TrainSpec(model, lambda out, y: ((out - y) ** 2).sum(dim=(1, 2)), data)
    units = {name: model.build(i) for i, name in enumerate(model.names)}
    exercise(spec, units, torch.device("cpu"))
    norm = units["norm"]
    assert isinstance(norm, nn.BatchNorm1d)
    assert norm.running_mean is not None and norm.num_batches_tracked is not None
    assert torch.equal(norm.running_mean, torch.zeros(4)) and int(norm.num_batches_tracked) == 0
    assert norm.training and norm.weight.grad is None
    assert units["lin"].weight.grad is None


def _spare_ready(run: ChaosRun) -> bool:
    return any(s["worker_id"] == "spare-0" for s in run.job().get("spares", []))


def _create_with_room_for_a_spare(run: ChaosRun) -> None:
    """`harness.training.launch_job` with one spare admitted beside the full layout (the Core
    keeps it waiting: no rank is missing and the job is at its maximum size)."""
    info = run.start_core()
    layout = run.layout()
    assert run.http is not None
    body = {
        "name": "demo",
        "expected_workers": run.workers,
        "spare_workers": 1,
        "max_workers": run.workers,
        "layout": json.loads(layout.to_json()),
    }
    answer = run.http.post(
        "/api/v1/jobs", json=body, headers={"Authorization": f"Bearer {run.scheduler_token}"}
    )
    answer.raise_for_status()
    run.start_training(info["grpc_port"], run.start_store(), answer.json()["token"], layout)


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_a_warm_spare_killed_while_it_waits_is_noticed_and_never_planned_for(tmp_path: Path) -> None:
    scenario = ChaosScenario("spare killed", pp=2, dp=2, faults=(), steps=160)
    run = ChaosRun(tmp_path, scenario, timeout_s=300.0)
    try:
        _create_with_room_for_a_spare(run)
        agent = run.start_spare(0)
        run.wait_for("the spare to be warm and ready", lambda _job: _spare_ready(run))
        assert agent.poll() is None
        # the spare's worker (forked from the zygote: the Core's member view has its pid), as it
        # waits for a plan
        [pid] = [m["pid"] for m in run.job()["members"] if m["worker_id"] == "spare-0"]
        os.kill(pid, signal.SIGKILL)
        run.wait_for(
            "the Core to notice the spare is gone",
            lambda j: any(m["worker_id"] == "spare-0" and m["state"] == "LOST" for m in j["members"]),
        )
        assert not _spare_ready(run)
        results = run.wait_results(list(range(scenario.pp * scenario.dp)))
        assert run.http is not None
        events = run.http.get("/api/v1/jobs/demo/events").json()["events"]
        final, phase = {m["worker_id"]: m["state"] for m in run.job()["members"]}, run.job()["phase"]
    finally:
        run.stop()
    # On a loaded machine the Core may re-balance the four ranks for the OS scheduler's noise (at
    # most two plans, tests/test_plans_settle_e2e.py); no plan may take the dead spare in.
    plans = [e for e in events if e["kind"] == "plan_published"]
    taken_in = [e for e in plans if e["data"].get("joiners") or "spare-0" in json.dumps(e)]
    assert not taken_in, "a plan was published for a spare that was never taken in"
    assert [e["worker_id"] for e in events if e["kind"] == "spare_ready"] == ["spare-0"]
    outcome = judge(scenario, [], results, events, final, phase, fault_free_run(run), tmp_path)
    # The one loss the Core recorded is the spare's, which `judge` (that knows of no spare) flags.
    assert outcome.problems == ["workers ['spare-0'] were marked LOST but never killed"], outcome.problems
    assert final["spare-0"] == "LOST"


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_a_warm_spare_joins_after_a_loss_with_the_fault_free_state(tmp_path: Path) -> None:
    cfg = StoryConfig(steps=150, chapters=("kill", "join"))
    run = StoryRun(tmp_path, cfg)
    try:
        record = run_story(run)
    finally:
        run.stop()
    report = build_report(record, *fault_free_run(run))
    assert problems(report, record) == []
    assert report["consistency"]["params_equal_after_recovery"] is True
    spare = json.loads((tmp_path / "spare-0.json").read_text())
    warm = spare["warm_up"]
    assert warm["prebuilt_units"] > 0 and warm["seconds"]["dry_run_s"] > 0
    ready = [e for e in record.core_events if e["kind"] == "spare_ready" and e["worker_id"] == "spare-0"]
    assert ready and warm["warmed_unix"] <= ready[0]["time_unix"], (warm, ready)
