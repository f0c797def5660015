"""Per-step snapshots of ZeRO-1 shards (ElasWave §5.1, Fig. 6).

Every worker's shard has `Layout.backup_copies` backups (one in §5.1), each kept in host memory by
one of its *holders*; `planners.backup` says who they are (the first on the DP predecessor of
Fig. 6a where it runs on another node, else a rank of a neighbouring stage; further copies on
further nodes), so a worker may protect none, one or several shards. All copies follow the same
protocol: the gradient shard goes to every holder each step, and each applies the update. `RingSnapshot` is
the ring of §5.1 over one DP group: worker w_i keeps the shard owned by w_{(i+1) mod D}.
Every step, each worker sends its *gradient* shard (not
its three times larger optimizer state) to the worker that backs it up; that worker applies the
same update as the live optimizer (`Trainer.update_slices`: the same code path on the
same operands, hence bitwise equal) to
its copy in a background thread, off the critical path. The update of step s is applied only when
step s commits, so a rolled-back step never reaches a snapshot. `verify` compares checksums.

Off the critical path, as in Fig. 6b: `exchange_grads` only posts the send and the receive right
after the gradient reduce-scatter and returns; the transfer overlaps the optimizer update and the
parameter all-gather, and `finish_exchange` (called by the step protocol just before the commit
vote) waits for it. On an accelerator the received gradients are staged to host memory on a side
stream, and it is the background updater that waits for the copy, right before it replays the
update (`device_copy`): the commit does not. The updater may fall behind by at most
`max_lag` committed steps (the host replay of a GPU step can take longer than the step); past
that, `commit` waits for it, so the gradients kept for it stay bounded, and `stats.lag_wait_s`
says how long the step waited. `stats` says where the remaining cost goes.

Re-protection after a plan (issue 23, item 2, `planners.reprotect`): `start_seed` keeps the
copies that are still up to date, posts the full shard to the holders whose copy moved and the
receives of the shards it must now keep, and returns; training resumes at once. The gradient
exchange runs for every pair from the first step; a holder whose seed has not arrived keeps the
committed gradients of its shard in order and applies them right after the seed lands, so the
copy catches up exactly. `finish_seed` (called at the step that closes the window, or before a
checksum check) waits for the seed.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from executor.comm.communicator import Communicator, PendingOps
from executor.fabric.device_copy import HostStager, StagedCopies
from executor.fabric.state import ShardState
from executor.flat_units import as_flat_view
from executor.optim import UnitSlice

SNAPSHOT_TAG = 7100


class UpdateFn(Protocol):
    """The live optimizer's update `step` of every one of `slices` (`Trainer.update_slices`):
    a copy's units in one call, so a holder pays the update's fixed cost once per step and
    shard, not per unit. A slice's `carried`: its gradient holds only these runs, back to back
    (set only where the exchange carried a unit's trainable runs, `CarriedFn`)."""

    def __call__(self, slices: Sequence[UnitSlice], step: int, /) -> None: ...


# (unit, lo, hi) -> the runs of elements [lo, hi) of the unit that train: what its gradient
# exchange carries (a unit that trains in part, LoRA or BitFit, sends its trainable runs only)
CarriedFn = Callable[[str, int, int], tuple[tuple[int, int], ...]]
SEED_TAG = SNAPSHOT_TAG + 6  # a background seed's payload (start_seed)
SKETCH_TAG = SNAPSHOT_TAG + 7  # a round-off tolerant verify's sketches (after their lengths)
Grads = dict[int, dict[str, torch.Tensor]]  # protected worker -> unit -> its gradient slice
# Committed updates the background updater may be behind by before `commit` waits for it (module
# docstring): two, so that one step's replay can overlap the next step's compute and exchange.
MAX_UPDATE_LAG = 2
# `commit` waits at most this long for the updater to catch up: the updater only computes on
# host memory (and waits for copies already issued), so this is a bound, never an expected wait.
# Past it the update is queued all the same (stats.lag_overruns): the step has committed on every
# rank, and its backups must follow it.
LAG_WAIT_S = 30.0


@dataclass(frozen=True)
class _Update:
    """A committed step's gradients, to replay on the copies once `copies` have landed on the host."""

    step: int
    grads: Grads
    copies: StagedCopies
    holds_slot: bool = True  # False: queued past the lag bound (LAG_WAIT_S), no slot to give back


@dataclass(frozen=True)
class _Seed:
    """A seed that landed: install it as `owner`'s copy, then apply the gradients kept for it."""

    owner: int
    state: ShardState


@dataclass
class SnapshotStats:
    """Where the snapshot's time goes, summed over steps (seconds)."""

    steps: int = 0  # gradient exchanges posted
    sent_numel: int = 0  # gradient elements posted to each holder, summed over the exchanges
    post_s: float = 0.0  # critical path: concatenating the gradient shards and posting the ops
    finish_wait_s: float = 0.0  # critical path: waiting for the exchange before the commit vote
    update_s: float = 0.0  # background thread: AdamW on the host copy, after its staged gradients land
    update_cpu_s: float = 0.0  # background thread: the CPU time of the same (what it takes from the step)
    lag_wait_s: float = 0.0  # critical path: `commit` waiting for an updater `max_lag` steps behind
    lag_overruns: int = 0  # updates queued past the lag bound after LAG_WAIT_S (never expected)
    verify_s: float = 0.0  # critical path, every `verify_every` steps: checksums and their all-reduce
    verifies: int = 0  # checksum checks run (verify_s / verifies is the cost of one)
    verify_drift: float = 0.0  # the last round-off tolerant check: its largest relative drift estimate


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


class ShardBackups:
    """This worker's side of the backup pairs: sends its gradient shards to each of its holders
    (`holder`: one rank, a tuple of them, first copy first, or None / () when its shard has no
    backup) and maintains the backups of the workers in `protected`. Each pair
    talks over the first group that holds both (`Communicator.group_with`).

    Blocking behaviour: `seed` blocks on one send and one receive per pair (bounded by the
    communicator timeout; PeerFailure on a dead peer); `exchange_grads` never blocks;
    `finish_exchange` blocks until that exchange completes (bounded the same way); `commit`
    enqueues the update (after finishing a still-posted exchange), and blocks only while the
    background updater is `max_lag` committed steps behind (at most LAG_WAIT_S: then it queues
    the update past the bound); `flush(timeout_s)` blocks until the background updates are
    applied or raises TimeoutError.
    """

    def __init__(
        self,
        comm: Communicator,
        holder: int | tuple[int, ...] | None,
        protected: tuple[int, ...],
        update_fn: UpdateFn,
        max_lag: int = MAX_UPDATE_LAG,
        carried: CarriedFn | None = None,
    ) -> None:
        """`carried`: which elements of a unit's interval its gradient exchange carries (every
        worker of the job must pass the same); None: all of them."""
        if max_lag < 1:
            raise SnapshotError(f"max_lag must be >= 1 committed step, got {max_lag}")
        holders = () if holder is None else (holder,) if isinstance(holder, int) else tuple(holder)
        if comm.worker in protected or comm.worker in holders:
            raise SnapshotError(f"worker {comm.worker} cannot keep a backup of its own shard")
        if len(set(holders)) != len(holders):
            raise SnapshotError(f"worker {comm.worker}: holders {list(holders)} name a rank twice")
        self.comm, self.update_fn = comm, update_fn
        self._carried_fn = carried
        self._carried: dict[tuple[str, int, int], tuple[tuple[int, int], ...]] = {}
        self._own: dict[str, tuple[int, int]] = {}  # my units' intervals, from the last seed
        self.holders, self.protected_ranks = holders, tuple(protected)
        self.holder = holders[0] if holders else None  # the first copy
        self._states: dict[int, ShardState] = {}
        # protected worker -> unit -> the interval its copy holds (known before a seed lands)
        self._intervals: dict[int, dict[str, tuple[int, int]]] = {}
        # committed (step, gradients) of a protected worker whose seed has not landed yet
        self._backlog: dict[int, list[tuple[int, dict[str, torch.Tensor]]]] = {}
        # a posted background seed: (ops, receive buffer per protected worker, sent payload, step)
        self._seeding: tuple[PendingOps, dict[int, torch.Tensor], torch.Tensor, int] | None = None
        self._pending: _Update | None = None
        # posted exchange: (step, ops, incoming buffer per protected worker, outgoing buffer)
        self._inflight: tuple[int, PendingOps, dict[int, torch.Tensor], torch.Tensor] | None = None
        self._bad: set[int] = set()  # pairs (peer ids) whose last verify found a mismatch
        self.stats = SnapshotStats()
        self._seeded = False
        self._committed = 0  # last committed step (the background update may still be running)
        # committed (step, gradients per protected worker) to apply, an Event that flush()
        # waits on, or None (close())
        self._queue: queue.Queue[_Update | _Seed | threading.Event | None] = queue.Queue()
        self._lag = threading.Semaphore(max_lag)  # one slot per committed update not yet applied
        self.max_lag = max_lag
        self._errors: list[BaseException] = []
        self._closed = False
        self._lock = threading.Lock()
        self._stager = HostStager()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _group(self, peer: int) -> str:
        return self.comm.group_with(self.comm.worker, peer)

    def _runs(self, unit: str, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
        """The runs of `[lo, hi)` of `unit` its gradient exchange carries (all of it by default)."""
        key = (unit, lo, hi)
        runs = self._carried.get(key)
        if runs is None:
            runs = ((lo, hi),) if self._carried_fn is None else self._carried_fn(unit, lo, hi)
            self._carried[key] = runs
        return runs

    def _wire_numel(self, intervals: Mapping[str, tuple[int, int]]) -> int:
        return sum(b - a for k, (lo, hi) in intervals.items() for a, b in self._runs(k, lo, hi))

    # ----- protocol ------------------------------------------------------------------------
    def seed(self, mine: ShardState) -> None:
        """Send my full shard state to my holder and receive each protected worker's (at start,
        and after every re-layout, when the pairs and the shard intervals change)."""
        self.flush()
        received = self._transfer_states(mine, self.holders, self.protected_ranks)
        self._own = mine.intervals()
        with self._lock:
            self._states = received
            self._intervals = {p: st.intervals() for p, st in received.items()}
            self._pending = None
            self._committed = mine.step
            self._seeded = True

    def start_seed(
        self,
        mine: ShardState,
        kept: Mapping[int, ShardState],
        send_to: tuple[int, ...],
        receive: Mapping[int, Mapping[str, tuple[int, int]]],
    ) -> None:
        """Re-protect in the background (module docstring): keep the up-to-date copies `kept`
        (protected worker -> its shard at `mine.step`), post `mine` to the holders `send_to` and
        the receives of the shards in `receive` (protected worker -> its units' intervals);
        returns without waiting. Every protected worker is in exactly one of `kept`, `receive`."""
        if set(kept) & set(receive) or set(kept) | set(receive) != set(self.protected_ranks):
            raise SnapshotError(
                f"worker {self.comm.worker}: kept {sorted(kept)} and seeded {sorted(receive)} copies "
                f"must split the protected workers {list(self.protected_ranks)}"
            )
        if not set(send_to) <= set(self.holders):
            raise SnapshotError(
                f"worker {self.comm.worker}: seeds to {list(send_to)} are not all its holders"
            )
        payload = mine.payload() if send_to else torch.empty(0)
        bufs = {p: torch.empty(sum(3 * (b - a) for a, b in ivs.values())) for p, ivs in receive.items()}
        sends = [(self._group(h), payload, h, SEED_TAG) for h in send_to]
        recvs = [(self._group(p), buf, p, SEED_TAG) for p, buf in bufs.items()]
        ops = self.comm.post_exchange(sends, recvs)
        self._own = mine.intervals()
        with self._lock:
            self._states = {p: st.clone() for p, st in kept.items()}
            self._intervals = {p: st.intervals() for p, st in kept.items()}
            self._intervals.update({p: dict(ivs) for p, ivs in receive.items()})
            self._pending = None
            self._committed = mine.step
            self._seeded = True
        self._seeding = (ops, bufs, payload, mine.step)

    @property
    def seeding(self) -> bool:
        """A background seed is posted and not finished."""
        return self._seeding is not None

    def finish_seed(self) -> None:
        """Wait for the posted background seed (if any) and install the copies it brought, each
        caught up with the committed gradients kept for it. Bounded like any op (PeerFailure)."""
        if self._seeding is None:
            return
        ops, bufs, _payload, step = self._seeding
        self.comm.complete(ops)
        self._seeding = None
        for p, buf in bufs.items():
            self._queue.put(_Seed(p, ShardState.from_payload(step, self._intervals[p], buf)))

    def _transfer_states(
        self, mine: ShardState, send_to: tuple[int, ...], receive_from: tuple[int, ...]
    ) -> dict[int, ShardState]:
        """Full states over the pairs: mine to each of `send_to`, one from each of `receive_from`."""
        header = mine.header()
        sizes = {p: torch.zeros(1, dtype=torch.int64) for p in receive_from}
        self._pairwise(torch.tensor([header.numel()]), send_to, sizes, SNAPSHOT_TAG)
        headers = {p: torch.zeros(int(sizes[p].item()), dtype=torch.uint8) for p in receive_from}
        self._pairwise(header, send_to, headers, SNAPSHOT_TAG + 1)
        payloads = {p: torch.zeros(ShardState.payload_numel(headers[p])) for p in receive_from}
        self._pairwise(mine.payload(), send_to, payloads, SNAPSHOT_TAG + 2)
        return {p: ShardState.from_wire(headers[p], payloads[p]) for p in receive_from}

    def _pairwise(
        self, out: torch.Tensor, send_to: tuple[int, ...], into: dict[int, torch.Tensor], tag: int
    ) -> None:
        sends = [(self._group(h), out, h, tag) for h in send_to]
        recvs = [(self._group(p), buf, p, tag) for p, buf in into.items()]
        self.comm.exchange_many(sends, recvs)

    def exchange_grads(self, step: int, mine: Mapping[str, torch.Tensor]) -> None:
        """Post the send of this step's reduced gradient shards (unit -> flat grad of my interval)
        to every holder and the receives of the protected workers'; returns without waiting.
        `mine` must not change until `finish_exchange`."""
        self._require_seeded()
        if step != self._committed + 1 or self._inflight is not None:
            raise SnapshotError(
                f"snapshot is at step {self._committed}; gradients of step {step} are out of order"
            )
        t0 = time.perf_counter()
        pieces = [t for k in sorted(mine) for t in self._on_wire(k, mine[k])]
        # sent as it lies where the pieces are back to back (the ZeRO stage's `reduced_slices`)
        view = as_flat_view(pieces)
        out = view if view is not None else torch.cat(pieces) if pieces else torch.empty(0)
        incoming = {  # received where the sent gradients live (device memory on NCCL/HCCL)
            p: torch.empty(self._wire_numel(ivs), device=out.device) for p, ivs in self._intervals.items()
        }
        sends = [(self._group(h), out, h, SNAPSHOT_TAG + 3) for h in self.holders]
        recvs = [(self._group(p), buf, p, SNAPSHOT_TAG + 3) for p, buf in incoming.items()]
        ops = self.comm.post_exchange(sends, recvs)
        self._inflight = (step, ops, incoming, out)
        self.stats.steps += 1
        self.stats.sent_numel += out.numel()
        self.stats.post_s += time.perf_counter() - t0

    def _on_wire(self, unit: str, grad: torch.Tensor) -> list[torch.Tensor]:
        """My reduced slice of `unit` as the exchange carries it: views of its carried runs."""
        if unit not in self._own:
            raise SnapshotError(f"worker {self.comm.worker} was seeded without unit {unit!r}; seed again")
        lo, hi = self._own[unit]
        return [grad.reshape(-1)[a - lo : b - lo] for a, b in self._runs(unit, lo, hi)]

    def finish_exchange(self) -> None:
        """Wait for the posted exchange (if any) and keep the received gradients pending until
        `commit(step)`. Blocks at most the communicator timeout; PeerFailure on a dead peer."""
        if self._inflight is None:
            return
        t0 = time.perf_counter()
        step, ops, incoming, _out = self._inflight
        self.comm.complete(ops)
        self._inflight = None
        grads: Grads = {}
        for p, device_buf in incoming.items():
            # to pinned host memory on a side stream; the updater waits for the copy (device_copy)
            buf = self._stager.stage(device_buf)
            units, pos = self._intervals[p], 0
            grads[p] = {}
            for k in sorted(units):
                n = self._wire_numel({k: units[k]})
                grads[p][k] = buf[pos : pos + n]  # read in place by the replay (`_apply`)
                pos += n
        # the updater waits for the copies, not the commit (module docstring)
        self._pending = _Update(step, grads, self._stager.take())
        self.stats.finish_wait_s += time.perf_counter() - t0

    def commit(self, step: int) -> None:
        """Step `step` committed: apply its pending gradients to the backups in the background.
        An exchange still posted is finished first (the step protocol has already done that
        before its vote, so there this only enqueues). Waits while the updater is `max_lag`
        steps behind (stats.lag_wait_s), at most LAG_WAIT_S: the step has committed on every
        rank, so its update is then queued past the bound (stats.lag_overruns), never dropped."""
        self.finish_exchange()
        if self._pending is None and step == self._committed:
            return  # the step applied no update (fp16 overflow skip): the backups stay as they are
        if self._pending is None or self._pending.step != step:
            raise SnapshotError(f"commit({step}) without the gradients of step {step}")
        t0 = time.perf_counter()
        if not self._lag.acquire(timeout=LAG_WAIT_S):
            self.stats.lag_overruns += 1
            self._pending = replace(self._pending, holds_slot=False)
        self.stats.lag_wait_s += time.perf_counter() - t0
        self._queue.put(self._pending)
        self._pending = None
        self._committed = step

    def discard(self) -> None:
        """Step rolled back: its gradients never reach the backups. Call it after
        `finish_exchange` (the step protocol does, before its vote); an exchange still posted is
        abandoned, and its groups must be rebuilt (the communicator's ledger makes the next
        edit do so) before the pairs are used again. Never blocks: copies of the step's gradients
        still landing keep their pinned host buffers until they complete (torch's caching host
        allocator records each non-blocking copy's event)."""
        self._pending = None
        self._inflight = None

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every committed update is applied to the backups."""
        if self._closed:
            raise SnapshotError("snapshot closed: its pairs were replaced")
        done = threading.Event()
        self._queue.put(done)
        if not done.wait(timeout_s):
            raise TimeoutError(f"snapshot updates not applied within {timeout_s}s")
        if self._errors:
            raise SnapshotError(f"background snapshot update failed: {self._errors[0]!r}")

    def close(self) -> None:
        """Stop the background updater once the queued updates are applied (the pairs are being
        replaced after a re-layout). The backups are unusable afterwards."""
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=30.0)

    def states(self) -> dict[int, ShardState]:
        """Copies of the backups, protected worker -> its shard (after all committed updates)."""
        self.flush()
        with self._lock:
            self._require_seeded()
            return {p: st.clone() for p, st in self._states.items()}

    def held_bytes(self) -> int:
        """Host bytes of the backups this worker keeps for others (every copy it holds, three
        fp32 rows per element: what `planners.backup.backup_cost` predicts for it)."""
        with self._lock:
            return sum(
                sum(t.numel() * t.element_size() for t in (u.param, u.exp_avg, u.exp_avg_sq))
                for st in self._states.values()
                for u in st.units.values()
            )

    def state(self) -> ShardState:
        """A copy of the one backup this worker keeps (SnapshotError unless it keeps exactly one)."""
        states = self.states()
        if len(states) != 1:
            raise SnapshotError(f"worker {self.comm.worker} keeps {len(states)} backups, not one")
        return next(iter(states.values()))

    def verify(self, mine: ShardState, drift_rel: float | None = None) -> bool:
        """Periodic integrity check of my pairs: does each holder's backup equal my live shard, and
        does each backup I keep equal its owner's? Bitwise (digests, `ShardState.checksum`) where
        `drift_rel` is None; else within `drift_rel` (relative; sketches, `ShardState.sketch`),
        for backups replayed on the host from a shard updated on an accelerator, which differ by
        round-off (stats.verify_drift: the largest estimate). The holder tells the owner its
        verdict, so both sides of a pair know; `repair` re-seeds the pairs that failed. Blocks on
        the background updates and one exchange per pair (the communicator timeout)."""
        t0 = time.perf_counter()
        self.finish_seed()  # a copy still being seeded has nothing to compare yet
        self.flush()
        held_bad = (
            self._held_bad_digests(mine) if drift_rel is None else self._held_bad_sketches(mine, drift_rel)
        )
        # verdicts travel the other way: holder -> owner
        sends = [
            (self._group(p), torch.tensor([1 if p in held_bad else 0]), p, SNAPSHOT_TAG + 5)
            for p in self.protected_ranks
        ]
        mine_bad = {h: torch.zeros(1, dtype=torch.int64) for h in self.holders}
        recvs = [(self._group(h), mine_bad[h], h, SNAPSHOT_TAG + 5) for h in self.holders]
        self.comm.exchange_many(sends, recvs)
        self._bad = held_bad | {h for h, bad in mine_bad.items() if bad.item()}
        self.stats.verify_s += time.perf_counter() - t0
        self.stats.verifies += 1
        return not self._bad

    def _held_bad_digests(self, mine: ShardState) -> set[int]:
        """The owners whose backup here differs from their live shard in any bit."""
        digest_out = torch.frombuffer(bytearray(bytes.fromhex(mine.checksum())), dtype=torch.uint8)
        digests = {p: torch.zeros(32, dtype=torch.uint8) for p in self.protected_ranks}
        self._pairwise(digest_out, self.holders, digests, SNAPSHOT_TAG + 4)
        with self._lock:
            self._require_seeded()
            return {p for p, d in digests.items() if bytes(d.tolist()).hex() != self._states[p].checksum()}

    def _held_bad_sketches(self, mine: ShardState, drift_rel: float) -> set[int]:
        """The owners whose backup here is estimated further than `drift_rel` from their shard.
        The sketches' lengths travel first (as `_transfer_states`' headers do): an owner whose
        units differ from its copy's is a mismatch, not a receive of the wrong size."""
        self._require_seeded()
        out = mine.sketch()
        sizes = {p: torch.zeros(1, dtype=torch.int64) for p in self.protected_ranks}
        self._pairwise(torch.tensor([out.numel()]), self.holders, sizes, SNAPSHOT_TAG + 4)
        sketches = {p: torch.zeros(int(n.item()), dtype=torch.float64) for p, n in sizes.items()}
        self._pairwise(out, self.holders, sketches, SKETCH_TAG)
        with self._lock:
            self._require_seeded()
            drift = {p: ShardState.sketch_drift(s, self._states[p].sketch()) for p, s in sketches.items()}
        self.stats.verify_drift = max(drift.values(), default=0.0)
        return {p for p, d in drift.items() if not d <= drift_rel}

    def repair(self, mine: ShardState) -> None:
        """Re-seed the pairs the last `verify` found broken (both sides of each call this)."""
        send_to = tuple(h for h in self.holders if h in self._bad)
        receive_from = tuple(p for p in self.protected_ranks if p in self._bad)
        self.flush()
        fresh = self._transfer_states(mine, send_to, receive_from)
        with self._lock:
            self._states.update(fresh)
        self._bad = set()

    # ----- background updater --------------------------------------------------------------
    def _require_seeded(self) -> None:
        if not self._seeded:
            raise SnapshotError("snapshot not seeded: call seed() with the initial shard state first")

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                if isinstance(item, _Update):
                    item.copies.wait()  # its gradients on the host, off the step (module docstring)
                with self._lock:
                    if isinstance(item, _Seed):
                        self._states[item.owner] = item.state
                        for step, grads in self._backlog.pop(item.owner, []):
                            self._apply(item.owner, item.state, grads, step)
                    else:
                        self._replay(item)
            except BaseException as exc:  # noqa: BLE001 - surfaced by flush()
                self._errors.append(exc)
            finally:
                if isinstance(item, _Update) and item.holds_slot:
                    self._lag.release()
            self.stats.update_s += time.perf_counter() - t0
            self.stats.update_cpu_s += time.thread_time() - c0

    def _replay(self, update: _Update) -> None:
        """A committed step's update on every copy it reaches (its gradients already on the host)."""
        for p, grads in update.grads.items():
            state = self._states.get(p)
            if state is None:  # its seed has not landed: apply after it, in order
                self._backlog.setdefault(p, []).append((update.step, grads))
            else:
                self._apply(p, state, grads, update.step)

    def _apply(self, owner: int, state: ShardState, grads: Mapping[str, torch.Tensor], step: int) -> None:
        """The live optimizer's own update of committed step `step` on `owner`'s copy."""
        slices = []
        for k, shard in state.units.items():
            lo, numel = shard.start, shard.param.numel()
            runs = self._runs(k, lo, lo + numel)
            if not runs:
                continue  # nothing of it trains (a frozen unit): the update would touch nothing
            # A unit that trains in part arrives as its trainable runs: the update reads them
            # where they lie in the wire buffer, no full-length gradient is kept for the copy.
            carried = None if grads[k].numel() == numel else runs
            slices.append(UnitSlice(k, lo, shard.param, grads[k], shard.exp_avg, shard.exp_avg_sq, carried))
        if slices:
            self.update_fn(slices, step)
        state.step = step


class RingSnapshot(ShardBackups):
    """The ring of §5.1 over DP group `group`: I back up my DP successor's shard and my DP
    predecessor backs up mine. `verify` answers for the whole group (an all-reduce)."""

    def __init__(
        self, comm: Communicator, group: str, update_fn: UpdateFn, max_lag: int = MAX_UPDATE_LAG
    ) -> None:
        workers = comm.workers(group)
        if len(workers) < 2:
            raise SnapshotError(f"group {group!r} has one worker: a ring snapshot needs at least two")
        self.group = group
        holder, protected = ring_holder(workers, comm.worker), (ring_protected(workers, comm.worker),)
        super().__init__(comm, holder, protected, update_fn, max_lag)
        self.protected = self.protected_ranks[0]

    def _group(self, peer: int) -> str:
        return self.group

    def verify(self, mine: ShardState, drift_rel: float | None = None) -> bool:
        ok = super().verify(mine, drift_rel)
        mismatches = torch.tensor([0.0 if ok else 1.0])
        self.comm.all_reduce(self.group, mismatches)
        return mismatches.item() == 0.0
