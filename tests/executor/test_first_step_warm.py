"""The first step on a new layout as fast as any other (issue 23, item 3): what it would pay
first is paid during the edit.

- `Communicator.apply_edit` runs one op on every group it built (a backend's lazy setup: NCCL's
  communicator, gloo's first buffers), in the same order on every member, and none on the
  groups it reused; the groups then carry the step's ops as before.
- `executor.plan_acks.BackgroundAcks`: a plan phase's acknowledgement never waits on the Core
  (the RESUMED one ran inside the first step after a recovery, two more before the apply); they
  reach the Core in the order the worker went through them, and closing sends what is queued.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from executor.comm import Communicator, groups_for_stages
from executor.plan_acks import BackgroundAcks
from executor.step_phases import KEPT, StepPhases
from executor.store_server import connect_store
from tests.executor.ft_procs import collect, spawn
from tests.executor.stores import start_store

BEFORE = [[0, 1], [2, 3]]
AFTER = [[0, 1, 4], [2, 3]]  # worker 4 joins stage 0: dp/0 and the links to stage 1 are new


def _worker(worker: int, port: int) -> dict[str, Any]:
    store = connect_store("127.0.0.1", port)
    if worker == 4:
        comm = Communicator.for_joiner(store, worker, timeout_s=30.0)
    else:
        comm = Communicator(store, worker, groups_for_stages(BEFORE), timeout_s=30.0)
        for name in comm.names():
            comm.all_reduce(name, torch.ones(1))
    before = {name: comm.ops_on(name) for name in comm.names()}
    report = comm.apply_edit(groups_for_stages(AFTER), epoch=1)
    after = {name: comm.ops_on(name) for name in comm.names()}
    sums = {}
    for name in comm.names():  # the groups work as before
        t = torch.full((1,), float(worker + 1))
        comm.all_reduce(name, t)
        sums[name] = t.item()
    return {
        "before": before,
        "after": after,
        "rebuilt": list(report.rebuilt),
        "reused": list(report.reused),
        "sums": sums,
    }


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_an_edit_runs_one_op_on_every_group_it_built_and_none_on_those_it_kept() -> None:
    server = start_store()
    try:
        procs, results = spawn(_worker, list(range(5)), server.port)
        got = collect(procs, results, list(range(5)), timeout_s=90)
    finally:
        server.stop()
    for w, r in got.items():
        assert r["rebuilt"], w
        for name in r["rebuilt"]:
            assert r["after"][name] == 1, (w, name, r)  # the warm-up op, nothing else
        for name in r["reused"]:
            assert r["after"][name] == r["before"][name], (w, name, r)  # untouched
    assert "dp/1" in got[2]["reused"] and "dp/0" in got[0]["rebuilt"] and "dp/0" in got[4]["rebuilt"]
    assert got[0]["sums"]["dp/0"] == 1.0 + 2.0 + 5.0


class _SlowCore:
    """Stands in for the Core's side of `PlanClient.ack` only: each call takes `delay_s`."""

    rpc_timeout_s = 2.0

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.closed = delay_s, False
        self.calls: list[tuple[int, str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def ack(self, epoch: int, phase: str, seconds: float, **kwargs: Any) -> bool:
        time.sleep(self.delay_s)
        with self.lock:
            self.calls.append((epoch, phase, kwargs))
        return True

    def newest_epoch(self) -> int:
        return 7

    def close(self) -> None:
        self.closed = True


def test_acks_never_block_the_worker_go_in_order_and_are_sent_before_closing() -> None:
    core = _SlowCore(delay_s=0.05)
    acks = BackgroundAcks(core)
    t0 = time.perf_counter()
    for phase in ("RECEIVED", "PAUSED", "APPLIED", "RESUMED"):
        assert acks.ack(3, phase, 0.0, steps_replayed=0)
    assert time.perf_counter() - t0 < 0.05  # four round trips of 50 ms each, none waited on
    assert acks.newest_epoch() == 7  # everything else is the client's own
    acks.close()
    assert [c[1] for c in core.calls] == ["RECEIVED", "PAUSED", "APPLIED", "RESUMED"]
    assert core.closed and acks.sent == [(3, p, True) for p in ("RECEIVED", "PAUSED", "APPLIED", "RESUMED")]


def test_the_first_steps_after_each_plan_are_kept_itemised_and_no_more() -> None:
    phases = StepPhases()
    for step in range(3):  # before any plan: nothing kept
        phases.begin()
        phases.mark("train")
        phases.committed(step)
    assert phases.after_plan == {}
    phases.plan_applied(1)
    for step in range(3, 3 + KEPT + 4):
        phases.begin()
        time.sleep(0.002 if step == 3 else 0.0)
        phases.mark("train")
        phases.mark("vote")
        phases.committed(step)
    kept = phases.after_plan["1"]
    assert [r["step"] for r in kept] == list(range(3, 3 + KEPT))  # bounded: the first KEPT only
    assert set(kept[0]) == {"step", "train", "vote"} and kept[0]["train"] >= 0.002
    phases.plan_applied(2)
    assert phases.after_plan["2"] == [] and len(phases.after_plan["1"]) == KEPT
