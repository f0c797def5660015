"""The dynamic communicator (ElasWave §6.1, Fig. 8): one group per logical group, edited in place.

Each stage's DP group is one gloo group; a pair of adjacent stages (`pp/s-t`, only ever used point
to point by the pipeline) is served by one two-worker group per link (`link/a-b`), so losing a
worker touches only its DP group and its own links (`pp_links=False` keeps one group per pair).
Groups are built directly (``executor.engine_comm.make_group``: ``ProcessGroupGloo`` by default,
``ProcessGroupNCCL``/``ProcessGroupHCCL`` on accelerators) over ``PrefixStore(prefix, store)``, a
store that no training rank hosts (executor.store_server), without ``init_process_group``: there
is no world communicator to tear down when a rank leaves. Each edit is an epoch; groups built in
epoch e live under the prefix ``<ns>/e<e>/<name>``, so a rebuilt group never meets a stale
rendezvous key. On NCCL, where the installed torch and NCCL can shrink a communicator
(``Backend.shrink``, ncclCommShrink), a group that only lost members is shrunk in place instead of
rebuilt (`groups.decide_edit` says which).

Every op goes through `_wait`, which returns as soon as the op completes and otherwise converts a
closed peer socket, an abort flagged in the store by another survivor, or the group timeout into
`PeerFailure`: a survivor never blocks without a deadline (docs/architecture.md ("Promises and rules"), pytorch#111646).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from functools import partial
from typing import Any, NoReturn, Self, TypeVar, cast

import torch
from torch.distributed import (
    AllreduceOptions,
    BroadcastOptions,
    DistNetworkError,
    PrefixStore,
    ProcessGroup,
    ReduceOp,
    Store,
)

from executor.comm import ledger as ledger_mod
from executor.comm.device_groups import abort_group, apply_error_handling_env
from executor.comm.errors import Interrupted, MembershipError, PeerFailure, StoreLost
from executor.comm.groups import (
    EditDecision,
    Membership,
    all_workers,
    decide_edit,
    link_name,
    physical_groups,
    shrink_exclusions,
    shrink_is_possible,
    validate_membership,
)
from executor.comm.interruptible import calls_interruptibly
from executor.comm.ledger import GroupLedger
from executor.comm.reaper import GroupReaper
from executor.comm.waiter import Waiter, WaitJob
from executor.engine_comm import BACKENDS, make_group
from executor.staging import Staging, backend_device

T = TypeVar("T")

ABORT_POLL_S = 0.02
# Gloo groups an edit builds at once, each over a store connection of its own (`_build`).
PARALLEL_BUILDS = 4
# Polling of store keys during recovery: fast at first (the keys are usually there within ms),
# never slower than the abort poll.
KEY_POLL_FIRST_S, KEY_POLL_MAX_S = 0.001, ABORT_POLL_S
# torch.distributed.distributed_c10d.SHRINK_DEFAULT (torch >= 2.10). Not SHRINK_ABORT: the abort
# mode hangs with NCCL >= 2.31 (docs/architecture.md ("Promises and rules"), pytorch#194679), and a group is only ever shrunk when
# no survivor has an op in flight on it (ledger.survivors_are_quiet), so there is nothing to abort.
SHRINK_DEFAULT = 0


class RebuildMode(StrEnum):
    PARTIAL = "partial"  # rebuild only groups containing a changed rank (the dynamic communicator)
    FULL = "full"  # rebuild every group of the new membership (baseline)


@dataclass(frozen=True)
class EditReport:
    epoch: int
    rebuilt: tuple[str, ...]
    reused: tuple[str, ...]
    dropped: tuple[str, ...]
    reason: str
    seconds: float
    shrunk: tuple[str, ...] = ()  # shrunk in place (NCCL with shrink support), neither rebuilt nor reused


@dataclass
class _Group:
    name: str
    workers: tuple[int, ...]
    pg: ProcessGroup
    ledger: GroupLedger
    waiter: Waiter | None = None


@dataclass
class PendingOps:
    """Point-to-point ops issued by `Communicator.post_exchange` and not completed yet."""

    works: list[tuple[_Group, object]]
    staging: Staging | None = None  # receives staged through host/device memory (executor.staging)

    @property
    def done(self) -> bool:
        return not self.works


class Communicator:
    """The groups of one worker, their guarded ops, and in-place edits.

    Blocking behaviour: construction and `apply_edit` block until every member of each group being
    built has joined (bounded by `timeout_s`); each op blocks until it completes or raises
    `PeerFailure` (bounded by `timeout_s` plus one abort-poll interval).
    """

    def __init__(
        self,
        store: Store,
        worker: int,
        membership: Membership,
        timeout_s: float = 10.0,
        mode: RebuildMode | str = RebuildMode.PARTIAL,
        namespace: str = "ew",
        pp_links: bool = True,
        backend: str = "gloo",
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        validate_membership(membership)
        if membership and worker not in all_workers(membership):
            raise MembershipError(f"worker {worker} is in no group of {dict(membership)}")
        self.store = store
        self.worker = worker
        self.timeout_s = timeout_s
        self.mode = RebuildMode(mode)
        self.namespace = namespace
        self.epoch = 0
        self._flagged_epoch: int | None = None  # the epoch this worker flagged aborted itself
        self.pp_links = pp_links
        self.backend = backend
        apply_error_handling_env(backend)  # before the first device group (comm.device_groups)
        self.membership: dict[str, tuple[int, ...]] = {k: tuple(v) for k, v in membership.items()}
        self.physical = physical_groups(self.membership, pp_links)
        self._groups: dict[str, _Group] = {}
        self._graveyard: list[ProcessGroup] = []  # groups with abandoned ops; never destroyed
        self._reaper: GroupReaper | None = None  # destroys dropped groups (`_retire_dropped`)
        # Asked at every poll of every wait: a reason (str) makes the wait raise `Interrupted`. The
        # worker sets it to "a newer plan exists", so no wait of a superseded recovery runs on.
        self.interrupt: Callable[[], str | None] | None = None
        self.store_generation = 0  # how many times `replace_store` moved this worker to a new store
        # Seconds the thread that built this communicator (the training loop) spent blocked on
        # ops: a step's own compute is its wall time minus this (what a straggler shows, while
        # its peers wait for it at the collectives). Helper threads' waits block no compute.
        self.blocked_s = 0.0
        self._owner_thread = threading.get_ident()
        self._build_stores: list[Store] = []  # see _build_connections
        self._build_stores_of: Store | None = None
        self._build(sorted(n for n, ws in self.physical.items() if worker in ws))

    # ----- introspection -------------------------------------------------------------------
    @classmethod
    def for_joiner(cls, store: Store, worker: int, timeout_s: float = 10.0, **kwargs: Any) -> Self:
        """The communicator of a worker joining a running job (growth: a spare taken in). It holds
        no group: the `apply_edit` of the plan that takes it in, called at that plan's epoch like
        every other member's, builds each group it belongs to (they all gain a member, so every
        other member rebuilds them too). Never blocks."""
        return cls(store, worker, {}, timeout_s=timeout_s, **kwargs)

    def names(self) -> list[str]:
        """The gloo groups this worker is in (logical groups, and `link/a-b` pipeline links)."""
        return sorted(self._groups)

    def group(self, name: str) -> ProcessGroup:
        if name in self.membership and name not in self.physical:
            raise MembershipError(
                f"{name!r} is served by point-to-point links here: use send/recv/exchange, "
                "or p2p_group for a peer's link"
            )
        return self._handle(name).pg

    def p2p_group(self, name: str, peer: int) -> tuple[str, ProcessGroup, int]:
        """(physical group name, process group, `peer`'s rank in it) that carries point-to-point
        traffic with `peer` inside logical group `name`: the pair's `link/a-b` group when pipeline
        pairs are served by links, else `name` itself. Ops issued on it directly are unguarded:
        prefer `post_exchange`/`complete`, or at least wait through `wait(<physical name>, ...)`."""
        g = self._route(name, peer)
        if peer not in g.workers:
            raise MembershipError(f"worker {peer} is not in group {name!r} {g.workers}")
        return g.name, g.pg, g.workers.index(peer)

    def ops_on(self, name: str) -> int:
        """Collectives issued on group `name` (a physical group: `names()`) since it was built."""
        return self._handle(name).ledger.collectives

    def workers(self, name: str) -> tuple[int, ...]:
        """Members of a logical group (or of a physical one such as a link), in rank order."""
        ws = self.membership.get(name) or self.physical.get(name)
        if ws is None or self.worker not in ws:
            raise MembershipError(
                f"worker {self.worker} has no group {name!r} (has {sorted(self.membership)})"
            )
        return ws

    def group_rank(self, name: str, worker: int | None = None) -> int:
        ws = self.workers(name)
        w = self.worker if worker is None else worker
        if w not in ws:
            raise MembershipError(f"worker {w} is not in group {name!r} {ws}")
        return ws.index(w)

    def abort_key(self, epoch: int | None = None) -> str:
        """Store key that, once set, makes every op of that epoch raise PeerFailure."""
        return f"{self.namespace}/e{self.epoch if epoch is None else epoch}/abort"

    def signal_abort(self, reason: str) -> None:
        """Tell every survivor to abandon its current ops (non-blocking, one store write; best
        effort: with the store gone nobody could read the flag, and every worker finds out)."""
        self._flagged_epoch = self.epoch
        with contextlib.suppress(DistNetworkError):
            self.store.set(self.abort_key(), f"{self.worker}: {reason}")

    def flagged_abort(self) -> bool:
        """Whether this worker flagged this epoch aborted itself, from any thread (local: no store
        request; what the commit vote needs to know before it votes)."""
        return self._flagged_epoch == self.epoch

    def aborted(self) -> bool:
        """Whether this epoch is flagged aborted; StoreLost when the store cannot be reached."""
        with _store_errors():
            return self.store.check([self.abort_key()])

    def replace_store(self, store: Store) -> None:
        """Use `store` from now on (the previous one is gone). Groups already built keep working:
        a backend needs its store only to connect. The next edit (under a new plan epoch) meets
        the other workers on this store."""
        self.store = store
        self.store_generation += 1

    # ----- guarded ops ---------------------------------------------------------------------
    def all_reduce(self, name: str, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:  # type: ignore[assignment]
        g = self._handle(name)
        opts = AllreduceOptions()
        opts.reduceOp = op
        self._collective(g, lambda: g.pg.allreduce([tensor], opts))

    def broadcast(self, name: str, tensor: torch.Tensor, src_worker: int) -> None:
        g = self._handle(name)
        opts = BroadcastOptions()
        opts.rootRank = self.group_rank(name, src_worker)
        opts.rootTensor = 0
        self._collective(g, lambda: g.pg.broadcast([tensor], opts))

    def all_gather(self, name: str, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> None:
        g = self._handle(name)
        if len(outputs) != len(g.workers):
            raise ValueError(f"all_gather on {name!r} needs {len(g.workers)} outputs, got {len(outputs)}")
        self._collective(g, lambda: g.pg.allgather([list(outputs)], [tensor]))

    def barrier(self, name: str) -> None:
        self.all_reduce(name, torch.zeros(1, device=_op_device(self.backend)))

    def send(self, name: str, tensor: torch.Tensor, dst_worker: int, tag: int = 0) -> None:
        self.exchange_many([(name, tensor, dst_worker, tag)], [])

    def recv(self, name: str, tensor: torch.Tensor, src_worker: int, tag: int = 0) -> None:
        self.exchange_many([], [(name, tensor, src_worker, tag)])

    def exchange(
        self,
        name: str,
        sends: Sequence[tuple[torch.Tensor, int, int]],
        recvs: Sequence[tuple[torch.Tensor, int, int]],
    ) -> None:
        """Issue every (tensor, dst_worker, tag) send, then every (tensor, src_worker, tag) receive
        in group `name`, then wait for all of them (see `exchange_many`)."""
        self.exchange_many([(name, *s) for s in sends], [(name, *r) for r in recvs])

    def exchange_many(
        self,
        sends: Sequence[tuple[str, torch.Tensor, int, int]],
        recvs: Sequence[tuple[str, torch.Tensor, int, int]],
    ) -> None:
        """Point-to-point ops over several groups: (group, tensor, peer_worker, tag) each.

        Everything is issued before anything is waited on, so a pattern in which every worker
        both sends and receives cannot deadlock on the order of blocking calls."""
        self.complete(self.post_exchange(sends, recvs))

    def post_exchange(
        self,
        sends: Sequence[tuple[str, torch.Tensor, int, int]],
        recvs: Sequence[tuple[str, torch.Tensor, int, int]],
    ) -> PendingOps:
        """Issue the ops of `exchange_many` and return without waiting (never blocks): the
        transfers proceed in gloo's threads while the caller computes. The tensors must stay
        untouched until `complete`. Ops never completed count as pending in the group's ledger,
        so an edit rebuilds that group instead of reusing it half-matched."""
        works: list[tuple[_Group, object]] = []
        staging = Staging(self.backend)  # a no-op for tensors already where the backend wants them
        ops = [(name, staging.send(tensor), peer, tag, True) for name, tensor, peer, tag in sends]
        ops += [(name, staging.recv(tensor), peer, tag, False) for name, tensor, peer, tag in recvs]
        for name, tensor, peer, tag, is_send in ops:
            g = self._route(name, peer)
            try:
                if is_send:
                    g.ledger.sent[peer] += 1
                    works.append((g, g.pg.send([tensor], g.workers.index(peer), tag)))
                else:
                    g.ledger.received[peer] += 1
                    works.append((g, g.pg.recv([tensor], g.workers.index(peer), tag)))
            except Exception as exc:  # noqa: BLE001 - gloo raises at issue time on a reset connection
                for issued, _work in works:
                    issued.ledger.pending += 1  # issued, never completed: those groups are half-used
                self._fail(g, str(exc).splitlines()[0][:300])
        for g, _work in works:
            g.ledger.pending += 1
        return PendingOps(works, staging if staging.copy_back else None)

    def complete(self, ops: PendingOps) -> None:
        """Block until every op of `ops` has completed: bounded like any op, PeerFailure on a
        dead peer or an abort (the ops not yet completed then stay pending in the ledger). The
        ops of one group are waited for as one job of its waiter thread (executor.comm.waiter)."""
        while ops.works:
            g = ops.works[0][0]
            run = next((i for i, (h, _w) in enumerate(ops.works) if h is not g), len(ops.works))
            job = self._waiter(g).submit([w for _g, w in ops.works[:run]])
            try:
                self._wait_job(g, job)
            finally:
                # On a failure the ops the waiter had not finished stay pending (one it finishes
                # later is counted pending too: the edit then rebuilds a group it could reuse).
                finished = job.completed  # all `run` of them once `done` is set without errors
                g.ledger.pending -= finished
                del ops.works[:finished]
        if ops.staging is not None:
            ops.staging.finish()

    def group_with(self, a: int, b: int) -> str:
        """The first logical group (by name) that holds both workers; both pick the same one."""
        for name in sorted(self.membership):
            if a in self.membership[name] and b in self.membership[name] and self.worker in (a, b):
                return name
        raise MembershipError(f"no group of worker {self.worker} holds both workers {a} and {b}")

    def issue(self, name: str, op: Callable[[ProcessGroup], T]) -> T:
        """`op(group(name))`: a collective the caller issues itself and waits for later, through
        `wait(name, ..., issued=n)`. Never blocks. It counts in the group's ledger at once, as
        a collective and as pending, until that wait: a step abandoned between the two (a
        bucket's reduce-scatter posted by the backward's hook, then a pipeline peer lost) leaves
        its members with different numbers of ops on the group, which gloo matches by order,
        so the edit must rebuild it; reused, its next op would pair with a stale one and hang
        until the group timeout. PeerFailure if the backend refuses the op (a dead peer)."""
        g = self._handle(name)
        work = self._issue_counted(g, lambda: op(g.pg))
        g.ledger.pending += 1
        return work

    def wait(self, name: str, work: object, has_future: bool = True, issued: int = 0) -> None:
        """Guard a work the caller issued on `group(name)` (counted as one collective), or the
        `issued` ops it posted through `issue` (already counted, waited for here as one)."""
        g = self._handle(name)
        g.ledger.collectives += 1
        g.ledger.pending -= issued  # now pending as the one op `_wait` counts
        self._wait(g, work, has_future)

    # ----- edits ---------------------------------------------------------------------------
    def apply_edit(self, new_membership: Membership, epoch: int | None = None) -> EditReport:
        """Move to `new_membership` at communicator epoch `epoch` (default: the next one): every
        worker in it must call this with the same arguments. Callers that follow plans pass the
        plan's epoch, so workers whose earlier edits diverged (one abandoned an edit another
        finished) still meet under the same prefixes.

        Publishes this worker's op ledger, waits (bounded by timeout_s) for the ledgers of the
        members of every group it might reuse, rebuilds only the groups whose member list changed
        or whose ops were left unmatched (all of them in FULL mode) under the next epoch's prefix,
        and keeps every other group object as is. Raises MembershipError (changing nothing) if
        this worker is not in the new membership. On a backend that can shrink (NCCL), a group
        that only lost members and is quiescent is shrunk in place instead (`EditReport.shrunk`).
        """
        validate_membership(new_membership)
        new = {k: tuple(v) for k, v in new_membership.items()}
        if self.worker not in all_workers(new):
            raise MembershipError(f"worker {self.worker} is not in the new membership {new}")
        target = self.epoch + 1 if epoch is None else epoch
        if target <= self.epoch:
            raise MembershipError(
                f"edit to epoch {target}: the communicator is already at epoch {self.epoch}"
            )
        t0 = time.perf_counter()
        physical = physical_groups(new, self.pp_links)
        with _store_errors():
            decision = self._decide(physical, target)
        old_groups = self._groups
        self.epoch = target
        self.membership, self.physical = new, physical
        self._groups = {n: old_groups[n] for n in decision.reuse}
        for name in decision.drop:
            dropped = old_groups[name]
            if self.backend != "gloo":
                abort_group(dropped.pg)  # free its device communicator first (comm.device_groups)
            elif dropped.ledger.pending or dropped.ledger.failed:
                self._graveyard.append(dropped.pg)
            del dropped  # a name left holding the last one would destroy it here, at return
        try:
            with _store_errors():
                self._build(list(decision.rebuild), shrink={n: old_groups[n] for n in decision.shrink})
            self._warm(sorted([*decision.rebuild, *decision.shrink]))
        finally:
            self._retire_dropped(old_groups)
        return EditReport(
            epoch=self.epoch,
            rebuilt=decision.rebuild,
            reused=decision.reuse,
            dropped=decision.drop,
            reason=decision.reason,
            seconds=time.perf_counter() - t0,
            shrunk=decision.shrink,
        )

    def _retire_dropped(self, old_groups: dict[str, _Group]) -> None:
        """Hand every group of `old_groups` that this worker no longer holds (dropped, rebuilt
        under a new epoch, or shrunk into a new handle) to the reaper's thread, which destroys
        it there (`executor.comm.reaper`: 59-85 ms a recovery on the worker's path before). The
        entries leave `old_groups`, so the reaper holds the last reference; a group in the
        graveyard (ops left unmatched) stays alive there, as before."""
        kept = {id(g) for g in self._groups.values()}
        retired = [old_groups.pop(name) for name in list(old_groups) if id(old_groups[name]) not in kept]
        if retired:
            if self._reaper is None:
                self._reaper = GroupReaper()
            self._reaper.retire(retired)

    def drain_retired(self, timeout_s: float = 10.0) -> bool:
        """Whether every group dropped so far has been destroyed, waiting at most `timeout_s`."""
        return self._reaper is None or self._reaper.drain(timeout_s)

    def _decide(self, new: Membership, target: int) -> EditDecision:
        full = self.mode is RebuildMode.FULL
        can_shrink = self._can_shrink()
        key = f"{self.namespace}/e{target}/ledger/"
        # c10d stores take bytes as well as str (torch's stubs say str only)
        self.store.set(
            key + str(self.worker),
            ledger_mod.encode({n: g.ledger for n, g in self._groups.items()}),  # type: ignore[arg-type]
        )
        needed: set[int] = set()
        for name, g in self._groups.items():  # members whose ledgers decide reuse or shrink
            members = new.get(name)
            if members is None or full:
                continue
            if members == g.workers or (can_shrink and shrink_exclusions(g.workers, members) is not None):
                needed.update(members)
        self.wait_keys(
            [key + str(w) for w in sorted(needed)], f"ledger exchange of epoch {target}", epoch=target
        )
        ledgers = {w: ledger_mod.decode(self.store.get(key + str(w))) for w in sorted(needed)}
        # The groups this worker actually holds, not the membership it last aimed for: an edit
        # interrupted part-way through `_build` holds only some of that membership's groups.
        held = {name: g.workers for name, g in self._groups.items()}
        return decide_edit(
            held, new, self.worker, ledgers, full=full, backend=self.backend, can_shrink=can_shrink
        )

    def _can_shrink(self) -> bool:
        """Whether this worker's groups can shrink in place: a shrinking backend whose installed
        build (torch >= 2.10, NCCL >= 2.27) says so. One verdict for all groups, so every member of
        a group decides alike."""
        if not shrink_is_possible(self.backend, True, self.mode is RebuildMode.FULL):
            return False
        return all(bool(getattr(g.pg, "supports_shrinking", False)) for g in self._groups.values())

    def _build(self, names: list[str], shrink: dict[str, _Group] | None = None) -> None:
        """Build `names` under this epoch's prefix and shrink the groups in `shrink` (old handles)
        to their new member lists.

        Every member first announces itself on every group, and one wait covers them all: a
        member that died or left for a newer plan is a recorded absence (bounded,
        interruptible), not a wait inside the backend's rendezvous. Gloo's rendezvous, which
        connects every pair of members in its constructor, then runs for up to
        `PARALLEL_BUILDS` groups at once, started in sorted order as earlier ones finish: the
        smallest group not yet built is in flight on each of its members, so the builds cannot
        wait on each other in a cycle, and an edit costs about its slowest group's rendezvous,
        not the sum of them all (issue 23: most of a recovery's communicator phase). Shrinks,
        collective over the survivors, run one by one in the same sorted order on every worker."""
        shrink = shrink or {}
        order = sorted([*names, *shrink])
        prefix = {name: f"{self.namespace}/e{self.epoch}/{name}" for name in order}
        for name in order:
            self.store.set(f"{prefix[name]}/joined/{self.worker}", "1")
        self.wait_keys(
            [f"{prefix[n]}/joined/{w}" for n in order for w in self.physical[n]],
            f"building {', '.join(repr(n) for n in order)}",
        )
        built = self._rendezvous_all([n for n in order if n not in shrink], prefix)
        for name in order:
            workers = self.physical[name]
            pg = self._shrink(shrink[name], workers) if name in shrink else built[name]
            ledger = GroupLedger(built=self.epoch, workers=workers)
            self._groups[name] = _Group(name=name, workers=workers, pg=pg, ledger=ledger)

    def _rendezvous_all(self, names: list[str], prefix: dict[str, str]) -> dict[str, ProcessGroup]:
        """The backend's groups `names` (sorted), each over its members. Gloo's rendezvous cannot
        be interrupted (`executor.comm.interruptible`): each runs on a helper thread, over a
        connection to the store of its own (a store client serves one call at a time, and gloo's
        waits would hold the other builds' and this thread's checks), while this waits as
        `wait_keys` does, ended at once by a newer plan (Interrupted) or the epoch's abort
        (PeerFailure). Other backends connect at their first collective, guarded like any op, so
        they are built here, as are groups over a store that cannot open more connections."""
        conns = self._build_connections(min(len(names), PARALLEL_BUILDS)) if self.backend == "gloo" else []
        free: queue.SimpleQueue[Store] = queue.SimpleQueue()
        for conn in conns:
            free.put(conn)

        def build(name: str, store: Store | None = None) -> ProcessGroup:
            workers = self.physical[name]
            own = store if store is not None else free.get_nowait()  # one per build in flight
            try:
                return make_group(
                    self.backend,
                    PrefixStore(prefix[name], own),
                    workers.index(self.worker),
                    len(workers),
                    timedelta(seconds=self.timeout_s),
                )
            finally:
                if store is None:
                    free.put(own)

        if not conns:
            return {name: build(name, self.store) for name in names}
        check = partial(self._check_stop, f"building {names}", self.abort_key(None))
        calls = {name: partial(build, name) for name in names}
        try:
            return calls_interruptibly(calls, check, KEY_POLL_MAX_S, len(conns))
        except BaseException:
            self._build_stores = []  # abandoned builds may still hold them: the next opens others
            raise

    def _build_connections(self, count: int) -> list[Store]:
        """`count` connections of the builds' own to the store, opened as the edits need them and
        kept (a connection per group would pile up on the store server; a group holds the store
        it was built over); reopened after abandoned builds and when the worker moves to another
        store. Empty where the store has no clone."""
        if self._build_stores_of is not self.store:
            self._build_stores, self._build_stores_of = [], self.store
        clone = getattr(self.store, "clone", None)  # c10d stores have it; torch's stubs do not
        while len(self._build_stores) < count and clone is not None:
            try:
                self._build_stores.append(cast(Store, clone()))
            except (NotImplementedError, RuntimeError):
                return []
        return self._build_stores[:count] if clone is not None else []

    def _warm(self, names: list[str]) -> None:
        """One 1-element all-reduce on each group just built or shrunk, in the same sorted order
        on every member (no two members wait on each other's second group; as in `_build`): a
        group's first op pays what its backend sets up lazily (NCCL creates its communicator at
        the first collective; gloo its first buffers), and paying it here, inside the edit, keeps
        it off the first step on the new layout (issue 23, item 3). Guarded like every op: a
        member that died or left for a newer plan fails the edit, which is then retried."""
        probe = torch.zeros(1, device=_op_device(self.backend))
        for name in names:
            self.all_reduce(name, probe)

    def _shrink(self, old: _Group, workers: tuple[int, ...]) -> ProcessGroup:
        """The backend's own shrink (what `torch.distributed.shrink_group` calls after its checks;
        its remaining steps only re-register the group with c10d's world, which ours never were).
        The new communicator numbers the survivors in their old order, which is `workers`."""
        excluded = shrink_exclusions(old.workers, workers)
        if excluded is None:  # decide_edit only picks groups that lost members; anything else is a bug
            raise MembershipError(f"group {old.name!r}: {workers} is not {old.workers} minus lost workers")
        pg = old.pg.shrink(list(excluded), SHRINK_DEFAULT, None)  # type: ignore[attr-defined]
        if pg.size() != len(workers) or pg.rank() != workers.index(self.worker):
            raise RuntimeError(
                f"shrinking {old.name!r} gave rank {pg.rank()} of {pg.size()}, "
                f"expected {workers.index(self.worker)} of {len(workers)}"
            )
        return pg

    def wait_keys(
        self, keys: Sequence[str], what: str, timeout_s: float | None = None, epoch: int | None = None
    ) -> None:
        """Block until every store key in `keys` exists: at most `timeout_s` (default the group
        timeout), raising PeerFailure naming the missing keys or as soon as epoch `epoch`
        (default: the current one) is flagged aborted, or `Interrupted` as soon as `interrupt`
        gives a reason. Returns at once when the keys are there."""
        if not keys:
            return
        abort = self.abort_key(epoch)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        pause = KEY_POLL_FIRST_S
        while True:
            # check(), not a sliced wait(): a c10d wait that times out logs a warning each time
            with _store_errors():
                if self.store.check(list(keys)):
                    return
            self._check_stop(what, abort)
            if time.monotonic() > deadline:
                missing = [k for k in keys if not self.store.check([k])]
                raise PeerFailure(what, f"no answer within {self.timeout_s}s from {missing}")
            time.sleep(pause)
            pause = min(KEY_POLL_MAX_S, pause * 2)

    def _check_stop(self, what: str, abort: str) -> None:
        """Raise `Interrupted` if a newer plan ends this wait, `PeerFailure` if `abort` is set."""
        self._check_interrupt(what)
        with _store_errors():
            if self.store.check([abort]):
                raise PeerFailure(what, f"aborted: {self.store.get(abort).decode()}")

    def _check_interrupt(self, what: str) -> None:
        reason = self.interrupt() if self.interrupt is not None else None
        if reason:
            raise Interrupted(what, reason)

    # ----- internals -----------------------------------------------------------------------
    def _route(self, name: str, peer: int) -> _Group:
        """The gloo group that carries a p2p op of logical group `name` to or from `peer`."""
        if name in self._groups:
            return self._groups[name]
        if peer not in self.workers(name):
            raise MembershipError(f"worker {peer} is not in group {name!r} {self.workers(name)}")
        return self._handle(link_name(self.worker, peer))

    def _handle(self, name: str) -> _Group:
        try:
            return self._groups[name]
        except KeyError:
            raise MembershipError(
                f"worker {self.worker} has no group {name!r} (has {self.names()})"
            ) from None

    def _collective(self, g: _Group, issue: Callable[[], object]) -> None:
        self._wait(g, self._issue_counted(g, issue), has_future=True)

    def _issue_counted(self, g: _Group, issue: Callable[[], T]) -> T:
        """`issue()`, counted as one collective on `g`; PeerFailure if the backend refuses it."""
        g.ledger.collectives += 1
        try:
            return issue()
        except Exception as exc:  # noqa: BLE001 - a dead peer can fail the op before it is queued
            self._fail(g, str(exc).splitlines()[0][:300])

    def _waiter(self, g: _Group) -> Waiter:
        if g.waiter is None:
            g.waiter = Waiter()
        return g.waiter

    def _wait(self, g: _Group, work: object, has_future: bool) -> None:
        """Wait for one op, counted pending in `g`'s ledger while it is waited for."""
        if has_future:
            job = WaitJob([])
            work.get_future().add_done_callback(lambda _f: job.done.set())  # type: ignore[attr-defined]
        else:
            job = self._waiter(g).submit([work])
        g.ledger.pending += 1
        self._wait_job(g, job, work if has_future else None)
        g.ledger.pending -= 1

    def _wait_job(self, g: _Group, job: WaitJob, future_work: object | None = None) -> None:
        started = time.perf_counter()
        try:
            self._wait_done(g, future_work, job.done, job.errors)
        finally:
            if threading.get_ident() == self._owner_thread:
                self.blocked_s += time.perf_counter() - started

    def _wait_done(
        self, g: _Group, future_work: object | None, done: threading.Event, errors: list[BaseException]
    ) -> None:
        """Return once `done` is set without errors (for `future_work`, a collective whose future
        set it: once its `wait()` returns); raise otherwise (module docstring)."""
        deadline = time.monotonic() + self.timeout_s + 2 * ABORT_POLL_S
        while not done.wait(ABORT_POLL_S):
            reason = self.interrupt() if self.interrupt is not None else None
            if reason:
                g.ledger.failed = True
                raise Interrupted(g.name, reason)
            try:
                aborted = self.aborted() and self.store.get(self.abort_key()).decode()
            except (StoreLost, DistNetworkError) as exc:
                g.ledger.failed = True  # the op itself may still complete; the step cannot commit
                raise StoreLost(f"during an op on {g.name}: {exc}") from exc
            if aborted:
                g.ledger.failed = True
                raise PeerFailure(g.name, f"epoch {self.epoch} aborted: {aborted}")
            if time.monotonic() > deadline:
                self._fail(g, f"no completion within {self.timeout_s}s")
        if future_work is not None:
            try:
                future_work.wait()  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001 - any backend error means the group is broken
                errors.append(exc)
        if errors:
            self._fail(g, str(errors[0]).splitlines()[0][:300])

    def _fail(self, g: _Group, reason: str) -> NoReturn:
        g.ledger.failed = True
        # The store being unreachable must not mask the failure itself.
        with contextlib.suppress(Exception):
            self.signal_abort(f"{g.name}: {reason}")
        raise PeerFailure(g.name, reason)


@contextlib.contextmanager
def _store_errors() -> Iterator[None]:
    """Turn the store client's network errors (its server is gone) into StoreLost."""
    try:
        yield
    except DistNetworkError as exc:
        raise StoreLost(str(exc).splitlines()[0][:200]) from exc


def _op_device(backend: str) -> torch.device:
    """Where this communicator's own small tensors live (gloo: host; NCCL/HCCL: the current device)."""
    return backend_device(backend)
