"""Groups an edit drops are destroyed on the reaper's thread, not on the worker's (`executor.comm.reaper`).

Destroying a gloo group waits on its peers' connections (59-85 ms a survivor after one kill at
PP=2 x DP=4, ~95 ms for three 7-member groups here, 2 ms of it CPU): inside `apply_edit` that was
on every recovery's path. Here real workers edit their communicator and the dropped and rebuilt
groups must be finalized on the reaper's thread, every one of them, with the new groups right.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import pytest
import torch

from executor.comm import Communicator
from executor.comm.reaper import GroupReaper
from executor.store_server import connect_store
from tests.executor.ft_procs import run_on_store

BEFORE = {"world": (0, 1, 2), "dp/0": (0, 1), "dp/1": (1, 2)}
AFTER = {"world": (0, 1), "dp/0": (0, 1)}  # worker 2 leaves: world rebuilt, dp/1 dropped


def _worker(worker: int, port: int) -> dict[str, Any]:
    store = connect_store("127.0.0.1", port)
    comm = Communicator(store, worker, BEFORE, timeout_s=30.0)
    for name in comm.names():
        comm.all_reduce(name, torch.ones(1))
    if worker == 2:
        return {}
    finalized: dict[str, str] = {}

    def record_finalizer_thread(n: str) -> None:
        finalized[n] = threading.current_thread().name

    for name in comm.names():
        if name != "dp/0":  # dp/0 keeps its members: reused as it is
            # the thread that destroys the group runs its finalizer
            weakref.finalize(comm.group(name), record_finalizer_thread, name)
    report = comm.apply_edit(AFTER)
    drained = comm.drain_retired(20.0)
    sums = {}
    for name in comm.names():
        t = torch.full((1,), float(worker + 1))
        comm.all_reduce(name, t)
        sums[name] = t.item()
    return {"finalized": finalized, "drained": drained, "sums": sums, "rebuilt": sorted(report.rebuilt)}


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_dropped_and_rebuilt_groups_are_destroyed_on_the_reapers_thread() -> None:
    got = run_on_store(_worker, [0, 1, 2], 90)
    for w in (0, 1):
        r = got[w]
        assert r["drained"]
        assert r["rebuilt"] == ["world"]
        held = {"world", "dp/1"} if w == 1 else {"world"}
        assert set(r["finalized"]) == held, (w, r["finalized"])
        assert set(r["finalized"].values()) == {"elaswave-group-reaper"}, (w, r["finalized"])
        assert r["sums"] == {"world": 3.0, "dp/0": 3.0}


class _Slow:
    """Stands for a group whose destruction waits on its peers."""

    def __init__(self, seconds: float, log: list[str]) -> None:
        self.seconds, self.log = seconds, log

    def __del__(self) -> None:
        time.sleep(self.seconds)
        self.log.append(threading.current_thread().name)


def test_retire_returns_at_once_and_drain_waits_for_the_destruction() -> None:
    log: list[str] = []
    reaper = GroupReaper(name="test-reaper")
    started = time.monotonic()
    reaper.retire([_Slow(0.3, log), _Slow(0.3, log)])
    assert time.monotonic() - started < 0.1
    assert reaper.drain(5.0)
    assert log == ["test-reaper", "test-reaper"]


def test_drain_gives_up_after_its_timeout_and_refuses_a_bad_one() -> None:
    log: list[str] = []
    reaper = GroupReaper()
    reaper.retire([_Slow(1.0, log)])
    assert not reaper.drain(0.1)
    assert reaper.drain(5.0)
    with pytest.raises(ValueError, match="positive"):
        reaper.drain(0)
