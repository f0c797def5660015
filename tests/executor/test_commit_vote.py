"""The commit vote in the store (executor.commit_vote): one decision for all, a constant number of
store requests per worker and step whatever the number of workers, and no keys left behind by a
long job; the step protocol's own tests (tests/executor/test_failstop.py) cover it end to end."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
from torch.distributed import FileStore, HashStore, PrefixStore, Store, TCPStore

from executor.comm import PeerFailure
from executor.commit_vote import (
    ABORT_CHECK_S,
    COMMIT,
    CommitVote,
    decision_base,
    decision_key,
    ok_key,
    read_decision,
)
from executor.step_protocol import StepProtocol
from planners.layout import Plan, make_uniform_layout
from tests.executor.stores import start_store
from tests.executor.test_failstop import _decide_all, _protocols

pytestmark = pytest.mark.timeout(90)
LAYOUT = make_uniform_layout(4, 1, 3, global_batch=6, num_micro_batches=1, layer_numel=(8,) * 4)


class CountingStore:
    """A store that counts the requests it serves, by calling thread and method."""

    def __init__(self, store: Store) -> None:
        self.store, self.calls = store, Counter[tuple[str, str]]()
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any, **kw: Any) -> Any:
            with self._lock:
                self.calls[(threading.current_thread().name, name)] += 1
            return method(*args, **kw)

        return counted

    def by(self, thread: str) -> dict[str, int]:
        return {m: n for (t, m), n in self.calls.items() if t == thread}


def _one_decision(store: CountingStore, voters: int, base: str, votes: list[CommitVote]) -> list[bool]:
    """Every worker but the last votes and waits; the last votes once the others have added."""
    deadline = time.monotonic() + 30.0

    store_api = cast(Store, store)  # a counting proxy of a Store, by duck typing

    def waiter(i: int) -> bool:
        threading.current_thread().name = f"w{i}"
        return votes[i].decide(
            store_api, base, voters, ok=True, should_abort=lambda: False, deadline=deadline
        )

    with ThreadPoolExecutor(voters - 1) as pool:
        waiting = [pool.submit(waiter, i) for i in range(voters - 1)]
        while int(store.store.add(ok_key(base), 0)) < voters - 1:
            time.sleep(0.001)
        last = votes[-1].decide(
            store_api, base, voters, ok=True, should_abort=lambda: False, deadline=deadline
        )
        return [f.result() for f in waiting] + [last]


@pytest.mark.parametrize("voters", [2, 16])
def test_requests_per_worker_do_not_grow_with_the_workers(voters: int) -> None:
    store = CountingStore(HashStore())
    votes = [CommitVote() for _ in range(voters)]
    main, name = threading.current_thread(), threading.current_thread().name
    main.name = "last"
    try:
        for step in range(3):
            assert _one_decision(store, voters, decision_base("ns", 0, step, 0), votes) == [True] * voters
    finally:
        main.name = name
    # The last voter: per decision one add and one compare_set (it read every voter's key,
    # `voters` requests, before); its collector thread, from the second decision on, deletes
    # the two keys of the decision before.
    assert store.by("last") == {"add": 3, "compare_set": 3}
    assert votes[-1].collector.settle()
    assert store.by("commit-vote-collector") == {"delete_key": 4}
    # A waiter: one add and a read or two of the decision (before its wait, and when the watch
    # wakes it; its timer reads it only while the watch is still connecting). Each watch makes
    # one second connection for all of its decisions.
    for i in range(voters - 1):
        calls = store.by(f"w{i}")
        assert set(calls) == {"add", "compare_set"} and calls["add"] == 3 <= calls["compare_set"] <= 9, calls
    assert store.by("commit-vote-watch") == {"clone": voters - 1}  # the last voter never waits
    # Only the last decision's two keys remain.
    assert store.store.num_keys() == 2
    assert store.store.check([decision_key(decision_base("ns", 0, 2, 0))])


def test_a_failed_vote_aborts_and_a_late_ok_reads_the_abort() -> None:
    store = HashStore()
    a, b, late = CommitVote(), CommitVote(), CommitVote()
    base = decision_base("ns", 0, 0, 0)
    now = time.monotonic()
    assert a.decide(store, base, 3, ok=True, should_abort=lambda: False, deadline=now) is False  # timed out
    assert b.decide(store, base, 3, ok=False, should_abort=lambda: False, deadline=now + 5) is False
    # the third vote completes the count, but the decision exists: it reads ABORT
    assert late.decide(store, base, 3, ok=True, should_abort=lambda: False, deadline=now + 5) is False
    assert store.get(ok_key(base)) == b"2"
    # an abort flag seen while waiting decides ABORT at once
    second = decision_base("ns", 0, 0, 1)
    assert a.decide(store, second, 2, ok=True, should_abort=lambda: True, deadline=now + 60) is False
    assert a.kept == (base, second)  # aborted decisions are kept until the next COMMIT


def test_an_abort_flag_aborts_whoever_votes_last() -> None:
    """A worker that flagged the abort itself (it skipped its step: a plan was waiting) has no
    failure to vote; the flag alone makes the decision ABORT, whether it votes first or last."""
    store, now = HashStore(), time.monotonic()
    base = decision_base("ns", 0, 0, 0)
    assert CommitVote().decide(store, base, 1, ok=True, should_abort=lambda: True, deadline=now + 5) is False
    late = decision_base("ns", 0, 1, 0)
    store.add(ok_key(late), 1)  # the other voter's ok is in
    reads: list[float] = []

    def flagged() -> bool:  # set by the time this worker completes the count
        reads.append(time.monotonic())
        return True

    assert CommitVote().decide(store, late, 2, ok=True, should_abort=flagged, deadline=now + 5) is False
    assert store.get(decision_key(late)) == b"abort"
    assert len(reads) == 1  # read once, after the count


def test_a_step_skipped_for_a_waiting_plan_is_rolled_back_everywhere() -> None:
    """As the worker loop does when a plan is waiting: one worker flags the abort instead of
    running the step and votes without a failure; it votes last, and no one commits."""
    server = start_store()
    try:
        protos = _protocols(server.port, 3)
        for p in protos:
            p.begin_step(0)
        base = decision_base(protos[0].comm.namespace, 0, 0, 0)
        with ThreadPoolExecutor(2) as pool:
            first = [pool.submit(p.should_commit) for p in protos[:2]]  # they vote ok and wait
            while int(protos[2].comm.store.add(ok_key(base), 0)) < 2:
                time.sleep(0.001)
            protos[2].comm.signal_abort("plan epoch 1 is waiting")
            assert protos[2].should_commit() is False
            assert [f.result() for f in first] == [False, False]
    finally:
        server.stop()


def test_a_waiter_reads_the_abort_flag_every_few_ms_and_the_decision_once() -> None:
    """A voter that died without voting leaves the decision to the flag: the waiter finds it
    within ABORT_CHECK_S (and the machine's scheduling), reads it at most that often, and in
    the meantime reads the decision only before it waits: the watch would wake it for one."""
    store = CountingStore(HashStore())
    base, reads = decision_base("ns", 0, 0, 0), []
    flagged_at = time.monotonic() + 0.05

    def flag() -> bool:
        reads.append(time.monotonic())
        return reads[-1] >= flagged_at

    decided = CommitVote().decide(
        cast(Store, store), base, 2, ok=True, should_abort=flag, deadline=flagged_at + 30
    )
    assert decided is False and store.store.get(decision_key(base)) == b"abort"
    assert reads[-1] - flagged_at < ABORT_CHECK_S + 0.05  # + the machine's scheduling
    assert all(b - a >= ABORT_CHECK_S for a, b in zip(reads, reads[1:], strict=False))
    # a read of the decision before the wait (and one more if the watch was not yet waiting at
    # the first abort check), and the compare_set that wrote ABORT
    assert store.calls[("MainThread", "compare_set")] <= 3


@pytest.mark.parametrize("store_kind", ["tcp", "no-clone"])
def test_a_waiter_wakes_when_the_decision_is_written(store_kind: str) -> None:
    """The waiter of a long wait reads the decision about twice, before waiting and once written
    (the watch's `wait` on a second connection wakes it); a store without a second connection is
    polled with back-off instead, and the decision is the same."""
    server = start_store()
    try:
        client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
        other = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
        store = CountingStore(client) if store_kind == "tcp" else NoClone(client)
        base, deadline = decision_base("ns", 0, 0, 0), time.monotonic() + 30
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(
                CommitVote().decide, cast(Store, store), base, 2, True, lambda: False, deadline
            )
            while int(other.add(ok_key(base), 0)) < 1:
                time.sleep(0.001)
            time.sleep(0.3)  # a straggler: with back-off polling, ~30 reads meanwhile
            assert CommitVote().decide(other, base, 2, ok=True, should_abort=lambda: False, deadline=deadline)
            assert waiting.result(timeout=10) is True
        reads = sum(n for (_t, m), n in store.calls.items() if m == "compare_set")
        if store_kind == "tcp":
            assert reads <= 4, store.calls  # 2 once the watch waits (module docstring)
        else:
            assert reads > 10, store.calls  # back-off polling: about 35 reads in 0.3 s
    finally:
        server.stop()


class NoClone(CountingStore):
    """A store that gives no second connection (as a Store subclass written in Python may not)."""

    def __getattr__(self, name: str) -> Any:
        if name == "clone":
            raise AttributeError(name)
        return super().__getattr__(name)


@pytest.mark.parametrize("kind", ["tcp", "prefix", "hash", "file"])
def test_a_poll_reads_the_decision_without_writing_one(kind: str, tmp_path: Path) -> None:
    """`read_decision` relies on how torch's stores answer a compare_set whose expected value is
    not there; pinned for every store the vote runs on."""
    server = start_store() if kind in ("tcp", "prefix") else None
    try:
        store: Store
        if server is not None:
            client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
            store = PrefixStore("job", client) if kind == "prefix" else client
        else:
            store = HashStore() if kind == "hash" else FileStore(str(tmp_path / "store"), 1)
        base = decision_base("ns", 0, 0, 0)
        assert read_decision(store, base) is None
        assert not store.check([decision_key(base)])  # nothing written
        assert CommitVote().decide(
            store, base, 1, ok=True, should_abort=lambda: False, deadline=time.monotonic() + 5
        )
        assert read_decision(store, base) == COMMIT
        other = decision_base("ns", 0, 1, 0)
        assert (
            CommitVote().decide(
                store, other, 1, ok=False, should_abort=lambda: False, deadline=time.monotonic() + 5
            )
            is False
        )
        assert read_decision(store, other) == b"abort"
    finally:
        if server is not None:
            server.stop()


class BlockedDeletes:
    """A HashStore whose deletions wait until `release` is set."""

    def __init__(self) -> None:
        self.store, self.release = HashStore(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def delete_key(self, key: str) -> bool:
        assert self.release.wait(30)
        return bool(self.store.delete_key(key))


def test_the_commit_writer_does_not_wait_for_the_old_keys_deletion() -> None:
    store = BlockedDeletes()
    vote, api = CommitVote(), cast(Store, store)
    first, second = decision_base("ns", 0, 0, 0), decision_base("ns", 0, 1, 0)
    started = time.monotonic()
    assert vote.decide(api, first, 1, ok=True, should_abort=lambda: False, deadline=started + 30)
    assert vote.decide(api, second, 1, ok=True, should_abort=lambda: False, deadline=started + 30)
    assert time.monotonic() - started < 5 and not vote.collector.settle(0.05)  # deletion still blocked
    store.release.set()
    assert vote.collector.settle()
    assert not store.store.check([decision_key(first)]) and not store.store.check([ok_key(first)])
    assert read_decision(api, second) == COMMIT


def test_refuses_a_decision_without_voters() -> None:
    with pytest.raises(ValueError, match="at least one voter"):
        CommitVote().decide(HashStore(), "b", 0, ok=True, should_abort=lambda: False, deadline=0.0)


def _run_steps(protos: list[StepProtocol], first: int, last: int) -> None:
    for step in range(first, last):
        for p in protos:
            p.begin_step(step)
        assert _decide_all(protos) == [True] * len(protos)
        for p in protos:
            p.commit()


def _settled_keys(protos: list[StepProtocol]) -> int:
    """The store's key count once every worker's queued deletions are done."""
    assert all(p.vote.collector.settle() for p in protos)
    return int(protos[0].comm.store.num_keys())


def test_a_long_job_leaves_a_bounded_number_of_keys_in_the_store() -> None:
    """Three workers' step protocols over a real store server: the store holds as many keys after
    20 steps as after 5, and again after an aborted attempt, the plan that follows it and 20
    more steps; every worker committed every step."""
    server = start_store()
    try:
        protos = _protocols(server.port, 3)
        _run_steps(protos, 0, 5)
        after_five = _settled_keys(protos)
        _run_steps(protos, 5, 20)
        assert _settled_keys(protos) == after_five
        for p in protos:
            p.begin_step(20)
        protos[1].report_failure(PeerFailure("dp/0", "connection closed"))
        assert _decide_all(protos) == [False, False, False]
        for p in protos:
            p.rollback()
        plan = Plan(1, LAYOUT, LAYOUT, ("transient failure",), 0.0)
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda p: p.apply_plan(plan), protos))
        _run_steps(protos, 20, 25)
        after_plan = _settled_keys(protos)
        _run_steps(protos, 25, 45)
        assert _settled_keys(protos) == after_plan
        assert [p.committed_step for p in protos] == [44, 44, 44]
    finally:
        server.stop()


class SlowClone(CountingStore):
    """A store whose second connection takes `delay_s` to open (a store that just died retries
    its connect until its timeout)."""

    def __init__(self, store: Store, delay_s: float) -> None:
        super().__init__(store)
        self.delay_s = delay_s

    def clone(self) -> Store:
        time.sleep(self.delay_s)
        return self.store


def test_a_slow_second_connection_does_not_hold_the_voter() -> None:
    """The watch connects on its own thread: while it cannot, the voter reads the decision on
    its abort-check timer and returns once the decision is written."""
    store = SlowClone(HashStore(), delay_s=5.0)
    base = decision_base("ns", 0, 0, 0)
    with ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        waiting = pool.submit(CommitVote().decide, cast(Store, store), base, 2, True, lambda: False, t0 + 30)
        time.sleep(0.05)
        assert CommitVote().decide(
            store.store, base, 2, ok=True, should_abort=lambda: False, deadline=t0 + 30
        )
        assert waiting.result(timeout=3) is True
        assert time.monotonic() - t0 < 3  # not the 5 s the connection takes
