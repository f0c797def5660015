"""Per-step ring snapshots of ZeRO-1 shards (ElasWave §5.1, Fig. 6).

In a stage's DP group (workers w_0..w_{D-1} in DP order), worker w_i keeps in host memory a copy
of the shard owned by w_{(i+1) mod D}. Every step, each worker sends its *gradient* shard (not
its three times larger optimizer state) to the worker that backs it up; that worker applies the
same update as the live optimizer (`Trainer.update_slice`: the same code path on the
same operands, hence bitwise equal) to
its copy in a background thread, off the critical path. The update of step s is applied only when
step s commits, so a rolled-back step never reaches a snapshot. `verify` compares checksums.

Off the critical path, as in Fig. 6b: `exchange_grads` only posts the send and the receive right
after the gradient reduce-scatter and returns; the transfer overlaps the optimizer update and the
parameter all-gather, and `finish_exchange` (called by the step protocol just before the commit
vote) waits for it. `stats` says where the remaining cost goes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from executor.comm.communicator import Communicator, PendingOps
from executor.fabric.state import ShardState

SNAPSHOT_TAG = 7100
# (unit, lo, param, grad, exp_avg, exp_avg_sq, step): the live optimizer's own update of a slice
UpdateFn = Callable[[str, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], None]


@dataclass
class SnapshotStats:
    """Where the snapshot's time goes, summed over steps (seconds)."""

    steps: int = 0  # gradient exchanges posted
    post_s: float = 0.0  # critical path: concatenating the gradient shards and posting the ops
    finish_wait_s: float = 0.0  # critical path: waiting for the exchange before the commit vote
    update_s: float = 0.0  # background thread: AdamW on the host copy (competes for host cores)
    verify_s: float = 0.0  # critical path, every `verify_every` steps: checksums and their all-reduce
    verifies: int = 0  # checksum checks run (verify_s / verifies is the cost of one)


class SnapshotError(RuntimeError):
    """The snapshot protocol was used out of order or the ring cannot be formed."""


def ring_holder(dp_workers: tuple[int, ...], worker: int) -> int:
    """The worker that keeps `worker`'s snapshot: its predecessor in DP order (Fig. 6a)."""
    i = dp_workers.index(worker)
    return dp_workers[(i - 1) % len(dp_workers)]


def ring_protected(dp_workers: tuple[int, ...], worker: int) -> int:
    """The worker whose shard `worker` backs up: its successor in DP order."""
    i = dp_workers.index(worker)
    return dp_workers[(i + 1) % len(dp_workers)]


class RingSnapshot:
    """This worker's side of the ring in DP group `group`: sends its gradient shards to its
    holder and maintains the snapshot of the worker it protects.

    Blocking behaviour: `seed` blocks on one send and one receive in the group (bounded by the
    communicator timeout; PeerFailure on a dead peer); `exchange_grads` never blocks;
    `finish_exchange` blocks until that exchange completes (bounded the same way); `commit`
    enqueues the update (after finishing a still-posted exchange); `flush(timeout_s)` blocks until the background updates are applied or raises
    TimeoutError.
    """

    def __init__(self, comm: Communicator, group: str, update_fn: UpdateFn) -> None:
        self.comm, self.group, self.update_fn = comm, group, update_fn
        workers = comm.workers(group)
        if len(workers) < 2:
            raise SnapshotError(f"group {group!r} has one worker: a ring snapshot needs at least two")
        self.holder = ring_holder(workers, comm.worker)
        self.protected = ring_protected(workers, comm.worker)
        self._state: ShardState | None = None
        self._pending: tuple[int, dict[str, torch.Tensor]] | None = None
        # posted exchange: (step, ops, incoming buffer, outgoing buffer kept alive until completion)
        self._inflight: tuple[int, PendingOps, torch.Tensor, torch.Tensor] | None = None
        self.stats = SnapshotStats()
        self._committed = 0  # last committed step (the background update may still be running)
        # committed (step, gradients) to apply, an Event that flush() waits on, or None (close())
        self._queue: queue.Queue[tuple[int, dict[str, torch.Tensor]] | threading.Event | None] = queue.Queue()
        self._errors: list[BaseException] = []
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    # ----- protocol ------------------------------------------------------------------------
    def seed(self, mine: ShardState) -> None:
        """Send my full shard state to my holder and receive the protected worker's (at start,
        and after every remap, when the ring and the shard intervals change)."""
        self.flush()
        sizes_out, sizes_in = torch.tensor([mine.header().numel()]), torch.zeros(1, dtype=torch.int64)
        self.comm.exchange(
            self.group, [(sizes_out, self.holder, SNAPSHOT_TAG)], [(sizes_in, self.protected, SNAPSHOT_TAG)]
        )
        header_in = torch.zeros(int(sizes_in.item()), dtype=torch.uint8)
        self.comm.exchange(
            self.group,
            [(mine.header(), self.holder, SNAPSHOT_TAG + 1)],
            [(header_in, self.protected, SNAPSHOT_TAG + 1)],
        )
        payload_in = torch.zeros(ShardState.payload_numel(header_in))
        self.comm.exchange(
            self.group,
            [(mine.payload(), self.holder, SNAPSHOT_TAG + 2)],
            [(payload_in, self.protected, SNAPSHOT_TAG + 2)],
        )
        with self._lock:
            self._state = ShardState.from_wire(header_in, payload_in)
            self._pending = None
            self._committed = self._state.step

    def exchange_grads(self, step: int, mine: Mapping[str, torch.Tensor]) -> None:
        """Post the send of this step's reduced gradient shards (unit -> flat grad of my interval)
        to my holder and the receive of the protected worker's; returns without waiting.
        `mine` must not change until `finish_exchange`."""
        state = self._require_state()
        if step != self._committed + 1 or self._inflight is not None:
            raise SnapshotError(
                f"snapshot is at step {self._committed}; gradients of step {step} are out of order"
            )
        t0 = time.perf_counter()
        out = torch.cat([mine[k].reshape(-1) for k in sorted(mine)]) if mine else torch.empty(0)
        incoming = torch.empty(sum(s.stop - s.start for s in state.units.values()))
        ops = self.comm.post_exchange(
            [(self.group, out, self.holder, SNAPSHOT_TAG + 3)],
            [(self.group, incoming, self.protected, SNAPSHOT_TAG + 3)],
        )
        self._inflight = (step, ops, incoming, out)
        self.stats.steps += 1
        self.stats.post_s += time.perf_counter() - t0

    def finish_exchange(self) -> None:
        """Wait for the posted exchange (if any) and keep the received gradients pending until
        `commit(step)`. Blocks at most the communicator timeout; PeerFailure on a dead peer."""
        if self._inflight is None:
            return
        t0 = time.perf_counter()
        step, ops, incoming, _out = self._inflight
        self.comm.complete(ops)
        self._inflight = None
        units, grads, pos = self._require_state().units, {}, 0
        for k in sorted(units):
            n = units[k].stop - units[k].start
            grads[k] = incoming[pos : pos + n]
            pos += n
        self._pending = (step, grads)
        self.stats.finish_wait_s += time.perf_counter() - t0

    def commit(self, step: int) -> None:
        """Step `step` committed: apply its pending gradients to the snapshot in the background.
        An exchange still posted is finished first (the step protocol has already done that
        before its vote, so there this only enqueues)."""
        self.finish_exchange()
        if self._pending is None or self._pending[0] != step:
            raise SnapshotError(f"commit({step}) without the gradients of step {step}")
        self._queue.put(self._pending)
        self._pending = None
        self._committed = step

    def discard(self) -> None:
        """Step rolled back: its gradients never reach the snapshot. Call it after
        `finish_exchange` (the step protocol does, before its vote); an exchange still posted is
        abandoned, and its group must be rebuilt (the communicator's ledger makes the next edit
        do so) before the ring is used again."""
        self._pending = None
        self._inflight = None

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every committed update is applied to the snapshot."""
        if self._closed:
            raise SnapshotError("snapshot closed: its ring was replaced")
        done = threading.Event()
        self._queue.put(done)
        if not done.wait(timeout_s):
            raise TimeoutError(f"snapshot updates not applied within {timeout_s}s")
        if self._errors:
            raise SnapshotError(f"background snapshot update failed: {self._errors[0]!r}")

    def close(self) -> None:
        """Stop the background updater once the queued updates are applied (the ring is being
        replaced after a re-layout). The snapshot is unusable afterwards."""
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=30.0)

    def state(self) -> ShardState:
        """A copy of the snapshot of `self.protected` (after all committed updates)."""
        self.flush()
        with self._lock:
            return self._require_state().clone()

    def verify(self, mine: ShardState) -> bool:
        """Periodic integrity check: does every snapshot in the group equal its live shard?

        I send the checksum of my live shard to my holder, compare the one I receive with my
        snapshot, and the group all-reduces the mismatches so every member gets the same answer.
        """
        t0 = time.perf_counter()
        self.flush()
        digest_out = torch.frombuffer(bytearray(bytes.fromhex(mine.checksum())), dtype=torch.uint8)
        digest_in = torch.zeros(32, dtype=torch.uint8)
        self.comm.exchange(
            self.group,
            [(digest_out, self.holder, SNAPSHOT_TAG + 4)],
            [(digest_in, self.protected, SNAPSHOT_TAG + 4)],
        )
        with self._lock:
            ok = bytes(digest_in.tolist()).hex() == self._require_state().checksum()
        mismatches = torch.tensor([0.0 if ok else 1.0])
        self.comm.all_reduce(self.group, mismatches)
        self.stats.verify_s += time.perf_counter() - t0
        self.stats.verifies += 1
        return mismatches.item() == 0.0

    # ----- background updater --------------------------------------------------------------
    def _require_state(self) -> ShardState:
        if self._state is None:
            raise SnapshotError("snapshot not seeded: call seed() with the initial shard state first")
        return self._state

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            step, grads = item
            t0 = time.perf_counter()
            try:
                with self._lock:
                    state = self._require_state()
                    for k, shard in state.units.items():
                        self.update_fn(
                            k, shard.start, shard.param, grads[k], shard.exp_avg, shard.exp_avg_sq, step
                        )
                    state.step = step
            except BaseException as exc:  # noqa: BLE001 - surfaced by flush()
                self._errors.append(exc)
            self.stats.update_s += time.perf_counter() - t0
