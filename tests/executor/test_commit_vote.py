"""The commit vote in the store (executor.commit_vote): one decision for all, a constant number of
store requests per worker and step whatever the number of workers, and no keys left behind by a
long job; the step protocol's own tests (tests/executor/test_failstop.py) cover it end to end."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pytest
from torch.distributed import HashStore, Store

from executor.comm import PeerFailure
from executor.commit_vote import CommitVote, decision_base, decision_key, ok_key
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
    # The last voter: per decision one add and one compare_set, and from the second on the two
    # keys of the decision before (it read every voter's key, `voters` requests, before).
    assert store.by("last") == {"add": 3, "compare_set": 3, "delete_key": 4}
    # A waiter: one add, its polls of the decision alone, one get.
    for i in range(voters - 1):
        calls = store.by(f"w{i}")
        assert set(calls) == {"add", "check", "get"} and calls["add"] == calls["get"] == 3, calls
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
    flags = iter([False, True])  # clear when it votes, set when it completes the count
    assert (
        CommitVote().decide(store, late, 2, ok=True, should_abort=lambda: next(flags), deadline=now + 5)
        is False
    )
    assert store.get(decision_key(late)) == b"abort"


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


def test_a_long_job_leaves_a_bounded_number_of_keys_in_the_store() -> None:
    """Three workers' step protocols over a real store server: the store holds as many keys after
    20 steps as after 5, and again after an aborted attempt, the plan that follows it and 20
    more steps; every worker committed every step."""
    server = start_store()
    try:
        protos = _protocols(server.port, 3)
        store = protos[0].comm.store
        _run_steps(protos, 0, 5)
        after_five = store.num_keys()
        _run_steps(protos, 5, 20)
        assert store.num_keys() == after_five
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
        after_plan = store.num_keys()
        _run_steps(protos, 25, 45)
        assert store.num_keys() == after_plan
        assert [p.committed_step for p in protos] == [44, 44, 44]
    finally:
        server.stop()
