"""Dynamic communicator (ElasWave §6.1): partial rebuild reuses untouched groups by identity,
collectives on the edited groups are right, full rebuild agrees, a kill -9'd peer releases
a survivor blocked in an all-reduce with PeerFailure within seconds instead of a hang, and on a
backend that can shrink communicators (NCCL) exactly the quiescent groups that only lost members
are shrunk in place."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from executor.comm import Communicator, MembershipError, PeerFailure, groups_for_stages
from executor.comm.groups import WORLD_GROUP, decide_edit, physical_groups, shrink_exclusions
from executor.engine_comm import groups_for_stage_ranks
from executor.store_server import connect_store
from tests.executor.ft_procs import collect, kill9, spawn
from tests.executor.stores import start_store

BEFORE = [[0, 1], [2, 3], [4, 5]]
GROUP_TIMEOUT_S = 30.0
RELEASE_BOUND_S = 5.0  # generous for a loaded 2-core machine, still 6x below the group timeout
AFTER = [[0, 1], [2, 3], [4]]
VICTIM = 5


def _expected_sum(workers: tuple[int, ...]) -> list[float]:
    return [float(sum(w + 1 for w in workers))] * 3


def _edit_worker(worker: int, port: int, mode: str) -> dict[str, object]:
    store = connect_store("127.0.0.1", port)
    comm = Communicator(store, worker, groups_for_stages(BEFORE), timeout_s=GROUP_TIMEOUT_S, mode=mode)
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
    except PeerFailure as exc:  # wall clock: compared with the parent's time of the kill
        failure = {"type": type(exc).__name__, "group": exc.group, "reason": exc.reason, "at": time.time()}
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
        "report_shrunk": sorted(report.shrunk),
        "sums": sums,
        "p2p": p2p,
    }


@pytest.mark.multiproc
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["partial", "full"])
def test_edit_after_kill(mode: str) -> None:
    """Stages [[0,1],[2,3],[4,5]]: groups dp/0..2 and one link per adjacent-stage worker pair."""
    server = start_store()
    try:
        procs, results = spawn(_edit_worker, list(range(6)), server.port, mode)
        store = server.connect()
        store.wait([f"ready/{w}" for w in range(6)], timedelta(seconds=90))
        time.sleep(0.3)  # let 4, 2 and 3 enter their blocking ops
        killed_at = time.time()
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
        assert r["report_shrunk"] == []  # gloo cannot shrink: unchanged behaviour
    # the survivor blocked in an all-reduce with the killed peer is released with PeerFailure
    assert got[4]["failure"]["type"] == "PeerFailure" and got[4]["failure"]["group"] == "dp/2"
    assert got[2]["failure"]["group"] == "link/2-5"
    assert got[3]["failure"]["group"] == "dp/1" and "aborted" in got[3]["failure"]["reason"]
    assert got[0]["failure"] == {} and got[1]["failure"] == {}
    # "released quickly": the closed socket (4, 2) and the abort flag it raises (3) end the blocked
    # ops within seconds of the kill, far below the 30 s group timeout that would otherwise apply.
    for w in (2, 3, 4):
        assert got[w]["failure"]["at"] - killed_at < RELEASE_BOUND_S, (w, got[w]["failure"]["at"] - killed_at)
    assert got[2]["p2p"] == [20.0, 21.0, 22.0] and got[3]["p2p"] == [30.0, 31.0, 32.0]


def test_groups_for_stages_and_bad_input() -> None:
    g = groups_for_stages([[0, 1], [2, 3]])
    assert g == {"dp/0": (0, 1), "dp/1": (2, 3), "pp/0-1": (0, 1, 2, 3)}
    assert physical_groups(g, pp_links=True) == {
        "dp/0": (0, 1),
        "dp/1": (2, 3),
        "link/0-2": (0, 2),
        "link/0-3": (0, 3),
        "link/1-2": (1, 2),
        "link/1-3": (1, 3),
    }
    assert physical_groups(g, pp_links=False) == g
    # With `world` (gradient clipping's global norm): one more group of every worker, stage-major,
    # served by one physical group of its own; the stage groups and links are unchanged.
    w = groups_for_stages([[0, 1], [2, 3]], world=True)
    assert w == {**g, WORLD_GROUP: (0, 1, 2, 3)}
    assert physical_groups(w, pp_links=True) == {
        **physical_groups(g, pp_links=True),
        WORLD_GROUP: (0, 1, 2, 3),
    }
    assert groups_for_stage_ranks([[0, 1], [2, 3]], world=True) == w  # the static comm's groups agree
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


def _quiet(collectives: int = 3, **changes: object) -> dict[str, object]:
    return {"collectives": collectives, "sent": {}, "received": {}, "pending": 0, "failed": False, **changes}


# Worker 5 (stage 2) leaves [[0, 1], [2, 3], [4, 5]]; worker 4 decides, with every survivor's ledger.
OLD_6 = physical_groups(groups_for_stages([[0, 1], [2, 3], [4, 5]]), pp_links=True)
NEW_5 = physical_groups(groups_for_stages([[0, 1], [2, 3], [4]]), pp_links=True)
QUIET_LEDGERS = {w: {n: _quiet() for n, ws in NEW_5.items() if w in ws} for w in range(5)}


def test_shrink_exclusions() -> None:
    assert shrink_exclusions((2, 3, 4, 5), (2, 4)) == (1, 3)  # group ranks of the lost workers
    assert shrink_exclusions((2, 3), (2, 3)) is None  # nothing lost: reuse, not shrink
    assert shrink_exclusions((2, 3), (3, 2)) is None  # reordered: a shrink keeps the old order
    assert shrink_exclusions((2, 3), (2, 6)) is None  # a newcomer needs a new communicator


@pytest.mark.parametrize(
    "backend, can_shrink, full, shrunk",
    [
        ("nccl", True, False, ("dp/2",)),  # the only group that just lost a member
        ("nccl", False, False, ()),  # torch/NCCL too old (no ncclCommShrink): rebuild
        ("nccl", True, True, ()),  # the full-rebuild baseline never shrinks
        ("gloo", True, False, ()),  # gloo cannot shrink whatever the flag says
        ("hccl", True, False, ()),  # not a backend whose shrink we use
    ],
)
def test_which_groups_shrink(backend: str, can_shrink: bool, full: bool, shrunk: tuple[str, ...]) -> None:
    d = decide_edit(OLD_6, NEW_5, 4, QUIET_LEDGERS, full=full, backend=backend, can_shrink=can_shrink)
    mine = sorted(n for n, ws in NEW_5.items() if 4 in ws)  # dp/2 and the links to stage 1
    assert d.shrink == shrunk
    assert d.reuse == (() if full else ("link/2-4", "link/3-4"))
    assert sorted(d.rebuild) == sorted(set(mine) - set(d.reuse) - set(shrunk))
    assert d.drop == tuple(sorted(set(mine) - set(d.reuse) - set(shrunk)))  # a shrunk group is carried over
    # worker 2 (stage 1) only loses its link to 5; its DP group and other link are untouched
    d2 = decide_edit(OLD_6, NEW_5, 2, QUIET_LEDGERS, full=full, backend=backend, can_shrink=can_shrink)
    assert d2.shrink == () and d2.drop == (
        ("dp/1", "link/0-2", "link/1-2", "link/2-4", "link/2-5") if full else ("link/2-5",)
    )


@pytest.mark.parametrize(
    "ledger, why",
    [
        (_quiet(pending=1), "a survivor is still blocked in an op on it"),
        (_quiet(failed=True), "an op on it failed"),
        (_quiet(collectives=0), "never used: its NCCL communicator does not exist yet"),
        (_quiet(collectives=2), "survivors disagree on the collectives issued"),
    ],
)
def test_a_group_that_is_not_quiet_is_rebuilt_not_shrunk(ledger: dict[str, object], why: str) -> None:
    old = groups_for_stages([[0, 1, 2, 3]])
    new = groups_for_stages([[0, 1, 3]])  # worker 2 left dp/0
    ledgers = {0: {"dp/0": _quiet()}, 1: {"dp/0": ledger}, 3: {"dp/0": _quiet()}}
    d = decide_edit(old, new, 0, ledgers, full=False, backend="nccl", can_shrink=True)
    assert d.shrink == () and d.rebuild == ("dp/0",), why
    clean = {w: {"dp/0": _quiet()} for w in (0, 1, 3)}
    assert decide_edit(old, new, 0, clean, full=False, backend="nccl", can_shrink=True).shrink == ("dp/0",)
    # unmatched sends among survivors also forbid it; sends to the lost worker do not matter
    to_lost = {**clean, 1: {"dp/0": _quiet(sent={"2": 1})}}
    assert decide_edit(old, new, 0, to_lost, full=False, backend="nccl", can_shrink=True).shrink == ("dp/0",)
    among = {**clean, 1: {"dp/0": _quiet(sent={"3": 1})}}
    assert decide_edit(old, new, 0, among, full=False, backend="nccl", can_shrink=True).shrink == ()


def test_backend_is_validated_and_passed_to_the_group_builder() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    with pytest.raises(ValueError, match="backend must be one of"):
        Communicator(store, 0, {"dp/0": (0,)}, backend="mpi")
    if not torch.cuda.is_available():  # the NCCL build path is reached, and refuses without CUDA
        with pytest.raises(RuntimeError, match="needs CUDA"):
            Communicator(store, 0, {"dp/0": (0,)}, backend="nccl")
    comm = Communicator(store, 0, {"dp/0": (0,)})  # gloo by default
    assert comm.backend == "gloo" and type(comm.group("dp/0")).__name__ == "ProcessGroupGloo"


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
    server = start_store()
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


class _ResetConnection:
    """A process group whose peer's connection is already reset: gloo raises when the op is issued."""

    def send(self, *_args: object) -> object:
        raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection reset by peer\nmore")

    recv = send
    allreduce = send


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["send", "all_reduce"])
def test_an_op_that_fails_when_issued_is_a_peer_failure_and_aborts_the_epoch(op: str) -> None:
    server = start_store()
    try:
        # Both members build the group together (two threads, one store); then worker 0's peer
        # connection is "reset".
        comms: dict[int, Communicator] = {}

        def build(worker: int) -> None:
            comms[worker] = Communicator(
                server.connect(),
                worker,
                groups_for_stages([[0, 1]]),
                timeout_s=GROUP_TIMEOUT_S,
                pp_links=False,
            )

        builders = [threading.Thread(target=build, args=(w,)) for w in (0, 1)]
        for t in builders:
            t.start()
        for t in builders:
            t.join(timeout=30)
        comm = comms[0]
        comm._groups["dp/0"].pg = _ResetConnection()  # type: ignore[assignment]
        with pytest.raises(PeerFailure, match="Connection reset by peer") as failure:
            if op == "send":
                comm.send("dp/0", torch.ones(3), dst_worker=1)
            else:
                comm.all_reduce("dp/0", torch.ones(3))
        assert failure.value.group == "dp/0"
        assert comm.aborted()  # every survivor learns of it, not only this one
        assert comm._groups["dp/0"].ledger.failed  # the next edit rebuilds this group
    finally:
        server.stop()
