"""The commit vote of one step, decided in the store that no training rank hosts.

The step protocol (`executor.step_protocol`) asks once per step whether every worker of the
layout finished its optimizer update; this module is how the store answers. Under one base key
per decision, ``<namespace>/decide/p<plan epoch>/s<step>/a<attempt>``, there are two keys:

- ``<base>/ok``, a counter: a worker that finished its step adds 1 (``Store.add``, atomic);
- ``<base>/decision``: COMMIT or ABORT, written once (``compare_set`` on an absent key: the
  first writer wins, every later writer and reader gets the same value).

The worker whose add brings the counter to the number of voters knows that every vote is ok and
writes COMMIT, unless the epoch's abort flag is set by then (it reads the flag: a worker that
skipped its step for a waiting plan flagged it without failing). A worker whose step failed, or
that flagged the abort itself (the caller knows both without the store), writes ABORT without
voting. Every other worker waits for the decision, and writes ABORT itself when it sees the
epoch's abort flag (a peer's socket closed, a plan losing a rank arrived; read every
ABORT_CHECK_S of its wait) or when its deadline passes (a hung peer). A late ok vote after an
ABORT reads that ABORT.

A waiter learns of the decision from the store itself: a helper thread blocks in the store's
`wait` for the decision key on a connection of its own (`DecisionWatch`; the server answers the
moment the key is written, in ~0.04 ms on the CI machine), and wakes the voter, which reads
the decision. Polling with back-off found it 0.5 ms late at the median on a fault-free step
(issue 23), a delay every step of a job paid on all but one worker. The voter's own thread
still reads the abort flag every ABORT_CHECK_S, which a blocked `wait` cannot; where the store
gives no second connection it polls as before.

Per worker and step this is a constant number of store requests, whatever the number of workers
(reading every worker's vote key cost each worker N requests per step, N^2 for the store): the
last voter makes three (add, the abort flag, the decision), a waiter one add, its helper's wait
and a read or two (`read_decision`: a read that finds the decision returns it), and no request
of a fault-free step waits on another's reply in the store. The keys do not pile up over a long
job: the worker that writes a COMMIT deletes both keys of every decision before it, on a
background thread (`DecisionCollector`), so its next step does not wait for those requests. That
is safe because a COMMIT on base B means every voter of B added its ok to B, after reading every
earlier decision of its own: nobody reads them again. A worker that is no longer a voter
(planned out while alive) and still waits for an old decision finds it gone and decides ABORT
for itself, which no voter reads.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from torch.distributed import DistError, Store

COMMIT, ABORT = b"commit", b"abort"
# The decision is polled from POLL_FIRST_S, doubling to POLL_S: the workers of a fault-free step
# vote within a few ms of each other, and a fixed 10 ms sleep cost ~5 ms of every step (the
# fixed-cost profile in docs/benchmarks.md); a long wait (a straggler) still polls every 10 ms.
POLL_FIRST_S, POLL_S = 0.0005, 0.01
# A waiter reads the epoch's abort flag at most this often (one store request each): it only
# matters when a voter died without voting, where a few ms are nothing beside the recovery, and
# reading it at every poll doubled a fault-free wait's requests.
ABORT_CHECK_S = 0.004
# The watch's wait outlives the voter's deadline by this much, so that the voter, not the
# watch, decides ABORT when it passes (its write then ends the watch's wait).
WATCH_GRACE_S = 1.0
# Never a decision: `compare_set` with it as both the expected and the new value writes nothing
# and returns the decision where there is one, this value where there is none (torch's
# TCPStore, HashStore, FileStore and PrefixStore alike; tests/executor/test_commit_vote.py).
_PENDING = b"\x00pending"


def decision_base(namespace: str, plan_epoch: int, step: int, attempt: int) -> str:
    """The store prefix of one decision: a replayed step (attempt + 1) or a step under a new
    plan epoch gets keys of its own."""
    return f"{namespace}/decide/p{plan_epoch}/s{step}/a{attempt}"


def ok_key(base: str) -> str:
    return f"{base}/ok"


def decision_key(base: str) -> str:
    return f"{base}/decision"


def read_decision(store: Store, base: str) -> bytes | None:
    """The decision of `base`, or None while there is none: one store request, no write."""
    value = bytes(store.compare_set(decision_key(base), _PENDING, _PENDING))  # type: ignore[arg-type]  # bytes are fine
    return None if value == _PENDING else value


class DecisionCollector:
    """Deletes the keys of decisions nobody reads any more, on a daemon thread of its own, so a
    COMMIT's writer starts its next step at once. Best effort, as the deletion always was: a
    store lost meanwhile loses keys that were garbage anyway. The thread starts with the first
    batch; TCPStore serialises a client's requests, so it shares the voter's connection."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Store, list[str]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pending = 0
        self._idle = threading.Condition()

    def collect(self, store: Store, bases: list[str]) -> None:
        """Queue the two keys of each of `bases` for deletion (returns at once)."""
        if not bases:
            return
        with self._idle:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="commit-vote-collector", daemon=True)
            self._thread.start()
        self._queue.put((store, bases))

    def settle(self, timeout_s: float = 10.0) -> bool:
        """Block until every queued deletion is done (at most `timeout_s`); True if it is."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def _run(self) -> None:
        while True:
            store, bases = self._queue.get()
            try:
                with contextlib.suppress(DistError):
                    for base in bases:
                        store.delete_key(decision_key(base))
                        store.delete_key(ok_key(base))
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


@dataclass
class _Watched:
    """One decision a voter waits for: `waiting` once the watch's wait is on its way to the
    store, `woken` once it has ended (the decision written, or the wait given up)."""

    store: Store
    key: str
    timeout_s: float
    woken: threading.Event = field(default_factory=threading.Event)
    waiting: bool = False
    abandoned: bool = False  # the voter has its decision: the wait is no longer wanted


class DecisionWatch:
    """Wakes a waiting voter the moment its decision is written (module docstring): a daemon
    thread of its own, started with the first watch, blocks in the store's `wait` on a second
    connection (`Store.clone`: TCPStore serialises a connection's requests, and the voter's
    thread must still read the abort flag meanwhile). The connection is made on that thread, so
    a store that died a moment ago cannot hold the voter in its connect. The voter's own reads
    stay the truth: a wait that ended for another reason (a timeout, a lost store) only wakes
    it early."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Watched] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._store: Store | None = None  # the voter's store that `_clone` connects to
        self._clone: Store | None = None
        self._unusable: Store | None = None  # a store that gave no second connection

    def watch(self, store: Store, base: str, timeout_s: float) -> _Watched | None:
        """Start waiting (at most `timeout_s`) for the decision of `base` in `store`; returns at
        once. None where `store` gave no second connection: the caller polls."""
        if store is self._unusable:
            return None
        watched = _Watched(store, decision_key(base), timeout_s)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="commit-vote-watch", daemon=True)
            self._thread.start()
        self._queue.put(watched)
        return watched

    def _run(self) -> None:
        while True:
            watched = self._queue.get()
            try:
                if watched.abandoned:  # a wait no longer wanted could block until its timeout
                    continue
                connection = self._connection(watched.store)
                if connection is None:
                    continue
                watched.waiting = True
                connection.wait([watched.key], timedelta(seconds=watched.timeout_s))
            except Exception:  # noqa: BLE001, S110 - the voter's own reads report what happened
                pass
            finally:
                watched.woken.set()

    def _connection(self, store: Store) -> Store | None:
        """The second connection to `store` (made once per store; the watch's thread only)."""
        if store is not self._store:
            self._store, self._clone = store, None
            clone = getattr(store, "clone", None)  # torch's own stores have it; not in its stubs
            with contextlib.suppress(Exception):
                self._clone = None if clone is None else clone()
            if self._clone is None:
                self._unusable = store
        return self._clone


class CommitVote:
    """One worker's votes, one decision after another (the training loop's thread only)."""

    def __init__(self) -> None:
        # The bases decided since the last COMMIT this worker read, that COMMIT's included:
        # what this worker deletes when it writes the next COMMIT.
        self._since_commit: list[str] = []
        self.collector = DecisionCollector()
        self.watch = DecisionWatch()

    @property
    def kept(self) -> tuple[str, ...]:
        """The decisions this worker would delete on its next COMMIT (oldest first)."""
        return tuple(self._since_commit)

    def decide(
        self,
        store: Store,
        base: str,
        voters: int,
        ok: bool,
        should_abort: Callable[[], bool],
        deadline: float,
    ) -> bool:
        """Vote `ok` on `base` among `voters` workers and return the decision (True: COMMIT).
        `ok`: False when this worker's step failed or it flagged the epoch's abort itself.
        Blocks until the decision exists, or until `deadline` (time.monotonic()) passes, when it
        decides ABORT; `should_abort` (the epoch's abort flag, a store request) is asked by the
        last voter before it writes COMMIT and every ABORT_CHECK_S of a wait. Store errors
        propagate."""
        if voters < 1:
            raise ValueError(f"a decision needs at least one voter, got {voters}")
        if not ok:
            committed = self._write(store, base, ABORT)
        elif store.add(ok_key(base), 1) >= voters:
            # An abort flagged after every vote still aborts: the flag is read after the count.
            committed = self._write(store, base, ABORT if should_abort() else COMMIT)
            if committed:
                self.collector.collect(store, list(self._since_commit))
        else:
            committed = self._wait(store, base, should_abort, deadline)
        if committed:
            self._since_commit = [base]
        else:
            self._since_commit.append(base)
        return committed

    @staticmethod
    def _write(store: Store, base: str, outcome: bytes) -> bool:
        """Write `outcome` unless a decision exists; True when the decision is COMMIT."""
        return store.compare_set(decision_key(base), "", outcome) == COMMIT  # type: ignore[arg-type]  # bytes are fine

    def _wait(self, store: Store, base: str, should_abort: Callable[[], bool], deadline: float) -> bool:
        now = time.monotonic()
        watched = self.watch.watch(store, base, max(deadline - now, 0.0) + WATCH_GRACE_S)
        pause, check_abort_at = POLL_FIRST_S, now + ABORT_CHECK_S
        try:
            decision = read_decision(store, base)
            while decision is None:
                now = time.monotonic()
                if now > deadline:
                    return self._write(store, base, ABORT)
                if now >= check_abort_at:
                    if should_abort():
                        return self._write(store, base, ABORT)
                    check_abort_at = now + ABORT_CHECK_S
                if watched is not None and not watched.woken.is_set():
                    # read when the watch wakes this thread, not on a timer (while the watch is
                    # still connecting, or busy, the timer reads it every ABORT_CHECK_S)
                    woken = watched.woken.wait(max(min(check_abort_at, deadline) - now, 0.0))
                    if woken or not watched.waiting:
                        decision = read_decision(store, base)
                    continue
                time.sleep(pause)  # no watch, or its wait ended without a decision: poll
                pause = min(POLL_S, pause * 2)
                decision = read_decision(store, base)
            return decision == COMMIT
        finally:
            if watched is not None:
                watched.abandoned = True
