"""The commit vote of one step, decided in the store that no training rank hosts.

The step protocol (`executor.step_protocol`) asks once per step whether every worker of the
layout finished its optimizer update; this module is how the store answers. Under one base key
per decision, ``<namespace>/decide/p<plan epoch>/s<step>/a<attempt>``, there are two keys:

- ``<base>/ok``, a counter: a worker that finished its step adds 1 (``Store.add``, atomic);
- ``<base>/decision``: COMMIT or ABORT, written once (``compare_set`` on an absent key: the
  first writer wins, every later writer and reader gets the same value).

The worker whose add brings the counter to the number of voters knows that every vote is ok and
writes COMMIT, unless the epoch's abort flag is set by then. A worker whose step failed, or that
sees the abort flag before it votes, writes ABORT without voting. Every other worker polls
the decision, and writes ABORT itself when it sees the epoch's abort flag (a peer's socket
closed, a plan losing a rank arrived) or when its deadline passes (a hung peer). A late ok vote
after an ABORT reads that ABORT.

Per worker and step this is a constant number of store requests, whatever the number of workers
(reading every worker's vote key cost each worker N requests per step, N^2 for the store), and
the keys do not pile up over a long job: the worker that writes a COMMIT deletes both keys of
every decision before it. That is safe because a COMMIT on base B means every voter of B added
its ok to B, after reading every earlier decision of its own: nobody reads them again. A worker
that is no longer a voter (planned out while alive) and still polls an old decision finds it
gone and decides ABORT for itself, which no voter reads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from torch.distributed import DistError, Store

COMMIT, ABORT = b"commit", b"abort"
# The decision is polled from POLL_FIRST_S, doubling to POLL_S: the workers of a fault-free step
# vote within a few ms of each other, and a fixed 10 ms sleep cost ~5 ms of every step (the
# fixed-cost profile in docs/benchmarks.md); a long wait (a straggler) still polls every 10 ms.
POLL_FIRST_S, POLL_S = 0.0005, 0.01


def decision_base(namespace: str, plan_epoch: int, step: int, attempt: int) -> str:
    """The store prefix of one decision: a replayed step (attempt + 1) or a step under a new
    plan epoch gets keys of its own."""
    return f"{namespace}/decide/p{plan_epoch}/s{step}/a{attempt}"


def ok_key(base: str) -> str:
    return f"{base}/ok"


def decision_key(base: str) -> str:
    return f"{base}/decision"


class CommitVote:
    """One worker's votes, one decision after another (the training loop's thread only)."""

    def __init__(self) -> None:
        # The bases decided since the last COMMIT this worker read, that COMMIT's included:
        # what this worker deletes when it writes the next COMMIT.
        self._since_commit: list[str] = []

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
        Blocks until the decision exists, or until `deadline` (time.monotonic()) passes, when it
        decides ABORT; `should_abort` is asked between polls. Store errors propagate."""
        if voters < 1:
            raise ValueError(f"a decision needs at least one voter, got {voters}")
        if not ok or should_abort():
            # The abort flag is read before the vote: a worker that skipped its step because a
            # plan was waiting flagged the abort itself and has no failure to vote.
            committed = self._write(store, base, ABORT)
        elif store.add(ok_key(base), 1) >= voters:
            # ... and again by the last voter: an abort flagged after every vote still aborts.
            committed = self._write(store, base, ABORT if should_abort() else COMMIT)
            if committed:
                self._delete_earlier(store)
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
        key, pause = decision_key(base), POLL_FIRST_S
        while True:
            if store.check([key]):
                return store.get(key) == COMMIT
            if should_abort() or time.monotonic() > deadline:
                return self._write(store, base, ABORT)
            time.sleep(pause)
            pause = min(POLL_S, pause * 2)

    def _delete_earlier(self, store: Store) -> None:
        """Best effort: a store lost here loses keys that were garbage anyway, and the COMMIT
        just written stands (this worker read it)."""
        with contextlib.suppress(DistError):
            for base in self._since_commit:
                store.delete_key(decision_key(base))
                store.delete_key(ok_key(base))
