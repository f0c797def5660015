"""Waiting for point-to-point ops as one job per group (executor.comm.waiter, issue 23): the works
are waited for in order on the group's waiter thread, the caller wakes once, and on a failure the
ops not finished stay pending in the group's ledger (the next edit rebuilds that group)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from executor.comm import Communicator, PeerFailure, groups_for_stages
from executor.comm.communicator import PendingOps
from executor.comm.waiter import Waiter, WaitJob
from executor.store_server import StoreServer
from tests.executor.stores import start_store


class _Work:
    """A work whose `wait()` returns, blocks until released, or raises (gloo's p2p work has no
    future and reports completion only from `wait()`)."""

    def __init__(self, log: list[int], index: int, fails: bool = False) -> None:
        self.log, self.index, self.fails = log, index, fails
        self.release = threading.Event()
        self.release.set()

    def wait(self) -> bool:
        assert self.release.wait(30)
        if self.fails:
            raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection reset by peer")
        self.log.append(self.index)
        return True


def test_a_job_waits_its_works_in_order_and_is_done_once() -> None:
    log: list[int] = []
    works = [_Work(log, i) for i in range(4)]
    works[2].release.clear()
    job = Waiter().submit(works)
    assert not job.done.wait(0.2)  # the third blocks: not done, the first two have completed
    assert job.completed == 2 and log == [0, 1]
    works[2].release.set()
    assert job.done.wait(10)
    assert job.completed == 4 and log == [0, 1, 2, 3] and not job.errors


def test_a_job_stops_at_the_first_failure_and_says_how_far_it_got() -> None:
    log: list[int] = []
    works = [_Work(log, 0), _Work(log, 1, fails=True), _Work(log, 2)]
    job = Waiter().submit(works)
    assert job.done.wait(10)
    assert job.completed == 1 and log == [0]
    assert len(job.errors) == 1 and "Connection reset" in str(job.errors[0])


def _communicators(server: StoreServer) -> dict[int, Communicator]:
    """Workers 0 and 1 of one group, built together on two threads."""
    comms: dict[int, Communicator] = {}

    def build(worker: int) -> None:
        comms[worker] = Communicator(
            server.connect(), worker, groups_for_stages([[0, 1]]), timeout_s=30.0, pp_links=False
        )

    builders = [threading.Thread(target=build, args=(w,)) for w in (0, 1)]
    for t in builders:
        t.start()
    for t in builders:
        t.join(timeout=30)
    assert sorted(comms) == [0, 1]
    return comms


@pytest.mark.timeout(60)
def test_complete_waits_an_exchange_of_several_ops_as_one_job_and_balances_the_ledger(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jobs: list[int] = []
    real_submit = Waiter.submit

    def counted(self: Waiter, works: Sequence[object]) -> WaitJob:
        jobs.append(len(works))
        return real_submit(self, works)

    monkeypatch.setattr(Waiter, "submit", counted)
    server = start_store()
    try:
        comms = _communicators(server)
        sent = [torch.full((5,), float(i)) for i in range(3)]
        got = [torch.zeros(5) for _ in range(3)]
        ops0 = comms[0].post_exchange([("dp/0", t, 1, 7 + i) for i, t in enumerate(sent)], [])
        ops1 = comms[1].post_exchange([], [("dp/0", t, 0, 7 + i) for i, t in enumerate(got)])
        assert comms[0]._groups["dp/0"].ledger.pending == 3
        done = threading.Thread(target=comms[1].complete, args=(ops1,))
        done.start()
        comms[0].complete(ops0)
        done.join(30)
        assert all(torch.equal(a, b) for a, b in zip(sent, got, strict=True))
        assert jobs == [3, 3]  # one job of three ops per worker, not one job per op
        for comm, ops in ((comms[0], ops0), (comms[1], ops1)):
            assert ops.done and comm._groups["dp/0"].ledger.pending == 0
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_a_failed_op_leaves_it_and_the_ops_after_it_pending() -> None:
    server = start_store()
    try:
        comm = _communicators(server)[0]
        g = comm._groups["dp/0"]
        log: list[int] = []
        works: list[object] = [_Work(log, 0), _Work(log, 1), _Work(log, 2, fails=True), _Work(log, 3)]
        ops = PendingOps([(g, w) for w in works])
        g.ledger.pending += len(works)  # as post_exchange counts them
        with pytest.raises(PeerFailure, match="Connection reset"):
            comm.complete(ops)
        assert log == [0, 1]
        assert g.ledger.pending == 2 and g.ledger.failed  # the failed op and the one never waited
        assert [w for _g, w in ops.works] == works[2:]
        assert comm.aborted()
    finally:
        server.stop()
