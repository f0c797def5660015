"""Dynamic communicator (ElasWave §6.1): partial rebuild reuses untouched groups by identity,
collectives on the edited groups are right, full rebuild agrees, and a kill -9'd peer releases
a survivor blocked in an all-reduce with PeerFailure instead of a hang."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch

from executor.comm import Communicator, MembershipError, PeerFailure, groups_for_stages
from executor.comm.groups import decide_edit, physical_groups
from executor.store_server import StoreServer, connect_store
from tests.executor.ft_procs import collect, kill9, spawn

BEFORE = [[0, 1], [2, 3], [4, 5]]
AFTER = [[0, 1], [2, 3], [4]]
VICTIM = 5


def _expected_sum(workers: tuple[int, ...]) -> list[float]:
    return [float(sum(w + 1 for w in workers))] * 3


def _edit_worker(worker: int, port: int, mode: str) -> dict[str, object]:
    store = connect_store("127.0.0.1", port)
    comm = Communicator(store, worker, groups_for_stages(BEFORE), timeout_s=30.0, mode=mode)
    for name in comm.names():  # phase 1: every group works
        t = torch.full((3,), float(worker + 1))
        comm.all_reduce(name, t)
        assert t.tolist() == _expected_sum(comm.workers(name)), (name, t)
    store.set(f"ready/{worker}", "1")
    before = {name: comm.group(name) for name in comm.names()}
    failure: dict[str, object] = {}
    try:  # phase 2: the victim is killed while some survivors are blocked on it
        if worker == 4:
            comm.all_reduce("dp/2", torch.ones(3))  # blocked on the victim
        elif worker == 2:
            comm.recv("pp/1-2", torch.zeros(3), src_worker=VICTIM)
        elif worker == 3:
            comm.all_reduce("dp/1", torch.ones(3))  # blocked on worker 2, released by the abort
        elif worker == VICTIM:
            time.sleep(60)
    except PeerFailure as exc:
        failure = {"type": type(exc).__name__, "group": exc.group, "reason": exc.reason}
    store.set(f"edit/{worker}", "1")
    report = comm.apply_edit(groups_for_stages(AFTER))
    sums = {}
    for name in comm.names():  # phase 4: every group of the new layout works
        t = torch.full((3,), float(worker + 1))
        comm.all_reduce(name, t)
        sums[name] = t.tolist()
    p2p = None
    if worker == 4:
        for dst in (2, 3):
            comm.send("pp/1-2", torch.arange(3.0) + 10 * dst, dst_worker=dst)
    elif worker in (2, 3):
        buf = torch.zeros(3)
        comm.recv("pp/1-2", buf, src_worker=4)
        p2p = buf.tolist()
    return {
        "failure": failure,
        "reused_identity": sorted(n for n in comm.names() if n in before and comm.group(n) is before[n]),
        "report_reused": sorted(report.reused),
        "report_rebuilt": sorted(report.rebuilt),
        "sums": sums,
        "p2p": p2p,
    }


@pytest.mark.multiproc
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["partial", "full"])
def test_edit_after_kill(mode: str) -> None:
    """Stages [[0,1],[2,3],[4,5]]: groups dp/0..2 and one link per adjacent-stage worker pair."""
    server = StoreServer.start()
    try:
        procs, results = spawn(_edit_worker, list(range(6)), server.port, mode)
        store = server.connect()
        store.wait([f"ready/{w}" for w in range(6)], timedelta(seconds=90))
        time.sleep(0.3)  # let 4, 2 and 3 enter their blocking ops
        kill9(procs, VICTIM)
        got = collect(procs, results, [0, 1, 2, 3, 4], timeout_s=90)
    finally:
        server.stop()

    after = physical_groups(groups_for_stages(AFTER), pp_links=True)
    for w, r in got.items():
        mine = sorted(n for n, ws in after.items() if w in ws)
        assert sorted(r["sums"]) == mine
        for name in mine:
            assert r["sums"][name] == _expected_sum(after[name]), (w, name)
        # partial: only dp/2 (lost the victim) and dp/1 (kept its members, but worker 3 abandoned
        # an all-reduce on it) are rebuilt; every surviving link and dp/0 are reused as they are.
        rebuilt = {"dp/1", "dp/2"}
        expect_reused = sorted(set(mine) - rebuilt) if mode == "partial" else []
        assert r["reused_identity"] == expect_reused, (w, r)
        assert r["report_reused"] == expect_reused
        assert sorted(r["report_rebuilt"]) == sorted(set(mine) - set(expect_reused))
    # the survivor blocked in an all-reduce with the killed peer is released with PeerFailure
    assert got[4]["failure"]["type"] == "PeerFailure" and got[4]["failure"]["group"] == "dp/2"
    assert got[2]["failure"]["group"] == "link/2-5"
    assert got[3]["failure"]["group"] == "dp/1" and "aborted" in got[3]["failure"]["reason"]
    assert got[0]["failure"] == {} and got[1]["failure"] == {}
    assert got[2]["p2p"] == [20.0, 21.0, 22.0] and got[3]["p2p"] == [30.0, 31.0, 32.0]


def test_groups_for_stages_and_bad_input() -> None:
    g = groups_for_stages([[0, 1], [2, 3]])
    assert g == {"dp/0": (0, 1), "dp/1": (2, 3), "pp/0-1": (0, 1, 2, 3)}
    assert physical_groups(g, pp_links=True) == {
        "dp/0": (0, 1), "dp/1": (2, 3), "link/0-2": (0, 2), "link/0-3": (0, 3), "link/1-2": (1, 2),
        "link/1-3": (1, 3)}
    assert physical_groups(g, pp_links=False) == g
    with pytest.raises(MembershipError, match="two stages"):
        groups_for_stages([[0, 1], [1, 2]])
    with pytest.raises(MembershipError, match="at least one worker"):
        groups_for_stages([[0], []])


def test_decide_edit_requires_balanced_ledgers() -> None:
    old = groups_for_stages([[0, 1], [2, 3]])
    new = groups_for_stages([[0, 1], [2]])
    clean = {"collectives": 1, "sent": {}, "received": {}, "pending": 0, "failed": False}
    ledgers = {0: {"dp/0": clean}, 1: {"dp/0": clean}}
    d = decide_edit(old, new, 0, ledgers, full=False)
    assert d.reuse == ("dp/0",) and d.rebuild == ("pp/0-1",) and d.drop == ("pp/0-1",)
    unmatched_send = dict(clean, sent={"1": 1})
    d = decide_edit(old, new, 0, {0: {"dp/0": unmatched_send}, 1: {"dp/0": clean}}, full=False)
    assert d.reuse == () and "dp/0" in d.rebuild
    assert decide_edit(old, new, 0, ledgers, full=True).reuse == ()


HUNG_TIMEOUT_S = 2.0


def _hung_peer_worker(worker: int, port: int) -> dict[str, object]:
    store = connect_store("127.0.0.1", port)
    comm = Communicator(store, worker, {"dp/0": (0, 1, 2)}, timeout_s=HUNG_TIMEOUT_S)
    comm.all_reduce("dp/0", torch.ones(1))
    store.set(f"ready/{worker}", "1")
    if worker == 2:
        time.sleep(60)  # SIGSTOPped by the test: alive, socket open, never answers
    store.wait(["stopped"], timedelta(seconds=30))
    t0 = time.monotonic()
    try:
        comm.all_reduce("dp/0", torch.ones(1))
    except PeerFailure as exc:
        return {"failure": exc.group, "reason": exc.reason, "seconds": time.monotonic() - t0}
    return {"failure": None, "seconds": time.monotonic() - t0}


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_hung_peer_releases_survivors_within_the_timeout() -> None:
    """A peer that hangs (SIGSTOP: no socket error ever comes) cannot block the others for
    longer than the communicator timeout: they get PeerFailure, not a hang."""
    server = StoreServer.start()
    try:
        procs, results = spawn(_hung_peer_worker, [0, 1, 2], server.port)
        store = server.connect()
        store.wait([f"ready/{w}" for w in range(3)], timedelta(seconds=60))
        os.kill(procs[2].pid, signal.SIGSTOP)
        store.set("stopped", "1")
        got = collect({w: procs[w] for w in (0, 1)}, results, [0, 1], timeout_s=30)
        kill9(procs, 2)
    finally:
        server.stop()
    for w in (0, 1):
        assert got[w]["failure"] == "dp/0", got[w]
        # released by its own deadline or by the other survivor's abort flag, never later
        assert got[w]["seconds"] < HUNG_TIMEOUT_S + 1.5, got[w]
