"""The parameter fabric wired to the engine's Trainer: its step participant for the step protocol.

Per step: the trainer's ZeRO-1 optimizer reduce-scatters gradients and hands the reduced slices to
its gradient hook (`Trainer.set_grad_hook`, kept across every layout change); this participant's
hook sends them to the rank that backs this shard up (`ShardBackups`; where, `planners.backup`:
the DP predecessor of §5.1 on another node, else a rank of a neighbouring stage), and the holder
applies `Trainer.update_slices` — the engine's own optimizer update — to its host copy once the
step commits. Every `verify_every` steps each pair compares backup and live shard: bitwise where the live
optimizer runs on the CPU, within round-off (`VERIFY_DRIFT_REL`) where it runs on an accelerator.

On a plan (`on_plan`) it is the one diff-and-apply path of the engine (`relayout.plan_relayout`):
live remap of the committed optimizer shards onto the new ranks with the old stage boundaries
(lost shards from snapshots, §5.2), then blocking migration of the blocks whose stage changes
(§4.2, §6.2), then new backup pairs seeded for the new layout. A pipeline-only plan (no rank
lost) skips the remap, a pure loss skips the migration. A plan outside those two steps (a whole
stage lost, so fewer stages; blocks moved further; a lost shard backed up in another stage) is
one rebuild from live shards and backups (`executor.fabric.rebuild`), with no step lost.

`migration="nonblocking"` selects Fig. 9's non-blocking migration (shadow layer and gradient
payback, `executor.nonblocking_migration`) for the plan path wherever it applies: gloo, the
interleaved ZeRO layout, and source and destination stages of equal DP size and sample split
(so in practice a pipeline-only plan; a plan that also loses a rank leaves the two stages with
different DP sizes and migrates blocking). The migration is armed on the trainer and runs inside
the next step, so the step boundary does not stall for it. Two costs of that step, both stated
by the code: it cannot be rolled back (the moved blocks' committed state is in flight; a failure
in it raises `MigrationInFlight`), and no ring snapshot protects the job from the plan until the
following step re-seeds the ring.

Resume first, re-protect after (issue 23, item 2; `planners.reprotect`): with `reprotect_steps`
n >= 1, a plan re-seeds only the copies its layout moved, in the background: the full shards are
posted right after the state moved and the step after the plan starts at once; the commit of
the n-th step on the new layout waits for them (`ReprotectWindow.until_step`), no earlier commit
does. The window (which copies, from which step to which) is recorded per plan in `windows`; a
plan that arrives inside it treats those copies as missing (`judge(..., unprotected=...)`, the
Core's rule too), so a loss whose only surviving copy is one of them is refused in place: a
RESTORE. n = 0 seeds every pair before the first step, as before (no window).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from executor.comm.communicator import Communicator
from executor.comm.groups import WORLD_GROUP
from executor.fabric.rebuild import rebuild, rebuild_plan
from executor.fabric.relayout import Relayout, RelayoutError, plan_relayout
from executor.fabric.remap import VERIFY_DRIFT_REL, live_remap
from executor.fabric.snapshot import ShardBackups, SnapshotError
from executor.fabric.state import ShardState, UnitShard
from executor.migration import MigrationReport, migrate
from executor.nonblocking_migration import NonBlockingMigration, check_nonblocking
from executor.precision import LossScaler
from executor.trainer import Trainer
from executor.zero import ShardState as ZeroShard
from executor.zero import flat_slice, unit_ownership
from planners.applicability import judge
from planners.backup import DEFAULT_VERIFY_EVERY, backup_holder_sets, protected_by, recovery_sources
from planners.layout import Layout, Plan, PlanMode
from planners.reprotect import Pair, ReprotectWindow, backup_pairs, reseed_pairs, shard_intervals


@dataclass(frozen=True)
class CommittedPoint:
    """The state of the last committed step, kept from the first plan after it until the next
    commit: every attempt to reach a new layout starts here, so a recovery cut short (a failure
    during a recovery, ElasWave's promise of consistency under cascades) is simply started again
    from it. `snapshot` holds the backups this worker kept then (owner -> shard); `unprotected`
    the copies of the layout then still being re-seeded (its re-protection window was open)."""

    state: dict[str, Any]
    snapshot: dict[int, ShardState] | None
    unprotected: frozenset[Pair] = frozenset()

    @property
    def layout(self) -> Layout:
        return self.state["layout"]

    @property
    def step(self) -> int:
        return int(self.state["next_step"]) - 1


# Where a RESTORE plan reads from: given the plan, the checkpoint directory every worker of the
# new layout agreed on (None: the job's initial state). Supplied by the worker, which owns the
# job's checkpoint directory and writer.
RestoreSource = Callable[[Plan], Path | None]


def engine_ownership(layout: Layout, names: Sequence[str]) -> dict[str, list[tuple[int, int, int]]]:
    """unit -> (worker, lo, hi) of the engine's ZeRO shards (per the planners), empty intervals
    left out; `names[i]` is unit i."""
    own: dict[str, list[tuple[int, int, int]]] = {}
    for stage in layout.stages:
        for name, ivs in unit_ownership(layout, stage, names).items():
            own[name] = sorted((stage.ranks[k], lo, hi) for k, (lo, hi) in enumerate(ivs) if hi > lo)
            own[name].sort(key=lambda t: t[1])
    return own


def shard_state_of(trainer: Trainer) -> ShardState:
    """This worker's owned parameter slices and Adam moments (copies)."""
    opt = trainer.optimizer
    state = ShardState(step=opt.step_count)
    for name, sh in opt.shards.items():
        param = flat_slice(trainer.model.units[name], sh.lo, sh.hi)  # a copy of the slice only
        state.units[name] = UnitShard(sh.lo, sh.hi, param, sh.exp_avg.clone(), sh.exp_avg_sq.clone())
    return state


def share_scaler(comm: Communicator, scaler: LossScaler, joining: bool, device: torch.device) -> None:
    """Give every rank of the new layout the committed loss scale of the first rank that was
    already in the job (collective over the world group: a joiner has none of its own)."""
    row = torch.cat([torch.tensor([1.0 if joining else 0.0], dtype=torch.float64), scaler.as_tensor()])
    ranks = comm.workers(WORLD_GROUP)
    rows = [torch.empty_like(row, device=device) for _ in ranks]
    comm.all_gather(WORLD_GROUP, rows, row.to(device))
    source = next((r.cpu() for r in rows if float(r[0]) == 0.0), None)
    if source is None:
        raise RuntimeError("no rank of the new layout was in the job before: nobody holds the loss scale")
    scaler.load_state_dict(LossScaler.from_tensor(source[1:]).state_dict())


MIGRATION_MODES = ("blocking", "nonblocking")


class MigrationInFlight(RuntimeError):
    """A step that carries a non-blocking migration failed: it cannot be rolled back in place."""


class FabricParticipant:
    """`StepParticipant` for the engine: rollback copies, ring snapshots, live remap, migration.

    Constructing it communicates with no peer: the first backup pairs are seeded inside the first
    step (`_first_seed`), where the step protocol recovers a peer's failure."""

    def __init__(
        self,
        trainer: Trainer,
        comm: Communicator,
        snapshots: bool = True,
        verify_every: int = DEFAULT_VERIFY_EVERY,
        migration: str = "blocking",
        shadow_slots: int = 1,
        restore_source: RestoreSource | None = None,
        joining: bool = False,
        reprotect_steps: int = 2,
    ) -> None:
        if verify_every < 1:
            raise ValueError(f"verify_every must be >= 1, got {verify_every}")
        if reprotect_steps < 0:
            raise ValueError(
                f"reprotect_steps must be >= 0 (0: re-seed every backup before the first step), got {reprotect_steps}"
            )
        if migration not in MIGRATION_MODES:
            raise ValueError(f"migration must be one of {MIGRATION_MODES}, got {migration!r}")
        self.trainer, self.comm = trainer, comm
        self.snapshots, self.verify_every = snapshots, verify_every
        self.migration, self.shadow_slots = migration, shadow_slots
        self.snapshot: ShardBackups | None = None
        self._retired_lag_wait_s = 0.0  # lag waits of the pairs of layouts left (backup_lag_wait_s)
        # Backups are replayed on the host CPU (§5.1): bitwise their shards only where the live
        # optimizer runs on the CPU too; on a GPU a remap accepts their round-off drift
        # (executor.fabric.remap, "Backups replayed off the live device").
        self.exact_backups = trainer.device.type == "cpu"
        self._seeded_layout: Layout | None = None
        # Re-protection after a plan (module docstring): the copies the last install re-seeds in
        # the background, the window of the layout in force while they are missing, every window
        # recorded (closed, open or superseded) and the closed ones not yet taken for reporting.
        self.reprotect_steps = reprotect_steps
        self._reseeding: frozenset[Pair] = frozenset()
        self._window: ReprotectWindow | None = None
        self.windows: list[ReprotectWindow] = []
        self._closed_windows: list[ReprotectWindow] = []
        # Where the last plan's apply went after the groups were edited (seconds): `state` (remap,
        # rebuild, migration or restore), `backups` (forming the pairs: posting the moved seeds,
        # or with reprotect_steps = 0 seeding every pair), `barrier` (waiting for the others).
        self.apply_phases: dict[str, float] = {}
        self._inflight: NonBlockingMigration | None = None  # armed by a plan, runs in the next step
        self._seed_pending = False  # re-seed the ring inside the next step (after a non-blocking move)
        # The first layout's copies, not seeded until the first step commits (`_first_seed`).
        self._unseeded: frozenset[Pair] = frozenset()
        self.checksum_mismatches = 0
        self.verified_steps: list[int] = []  # committed steps whose backups were verified
        # Verified inside the step in flight: recorded only when that step commits, so a replay
        # after a rollback verifies again on every rank (a pairwise check needs both sides).
        self._verified_in_step: int | None = None
        self.migrations: list[MigrationReport] = []  # one per plan that moved layers
        self.rebuilt_bytes = 0  # received by the last rebuild (a join: the joiner's whole state)
        self.handed_over: list[int] = []  # epochs of the plans that put this worker on standby
        self.restore_source = restore_source
        self.restored_from: list[tuple[int, str | None, int]] = []  # (plan epoch, checkpoint, its next step)
        # The rollback copy of the last commit; on a host device copied by a helper thread while
        # the next step runs forward and backward (`_committed` waits for it, and so does the
        # gradient hook, before the update can write what is being copied).
        self._committed_state: dict[str, Any] = trainer.get_state()
        self._committing: Future[dict[str, Any]] | None = None
        self._copier: ThreadPoolExecutor | None = None
        self.rollback_copy_cpu_s = 0.0  # the helper thread's CPU time for the copies, summed
        self._base: CommittedPoint | None = None  # set by the first plan after a commit
        # A joiner (growth) holds no group and no state until the plan that takes it in: its
        # trainer's fresh parameters are never used, and its backups are formed by that plan.
        self.joining = joining
        # The hook lives in the Trainer, so every optimizer it builds (any layout) calls it.
        trainer.set_grad_hook(self._on_grads)
        if not joining:
            self._first_seed()

    # ----- StepParticipant -----------------------------------------------------------------
    def before_vote(self) -> None:
        if self.snapshot is not None:
            self.snapshot.finish_exchange()
            window = self._window
            # The step that closes the re-protection window commits only with every seed landed.
            if window is not None and self.trainer.next_step - 1 >= window.until_step:
                self.snapshot.finish_seed()

    def on_commit(self, step: int) -> None:
        if self._verified_in_step is not None:
            self.verified_steps.append(self._verified_in_step)
            self._verified_in_step = None
        self._copy_committed_later()
        self._base = None  # the new layout is committed: later plans start from here
        self.joining = False
        self._unseeded = frozenset()  # the first step's seed landed with its commit
        if self._inflight is not None:  # the step that carried a non-blocking migration committed
            self.migrations.append(self._inflight.report())
            self._inflight, self._seed_pending = None, True
        elif (
            self._seed_pending
        ):  # the step that re-seeded the ring committed; a rolled-back one re-seeds again
            self._seed_pending = False
        if self.snapshot is not None:
            self.snapshot.commit(self.trainer.optimizer.step_count)
        window = self._window
        if window is not None and step >= window.until_step:
            if self.snapshot is not None:
                self.snapshot.finish_seed()  # done before the vote; a no-op here
            self._record_window(replace(window, closed_step=step))
            self._closed_windows.append(self.windows[-1])
            self._window = None

    # ----- re-protection windows -------------------------------------------------------------
    @property
    def window(self) -> ReprotectWindow | None:
        """The re-protection window of the layout in force, while it is open."""
        return self._window

    def take_closed_windows(self) -> list[ReprotectWindow]:
        """The windows closed since the last call (the worker reports each to the Core once)."""
        out, self._closed_windows = self._closed_windows, []
        return out

    def unprotected(self) -> frozenset[Pair]:
        """The copies of the committed layout that protect nothing yet: those of its window, if
        the window is open at the committed step (what a plan from here must treat as missing)."""
        if self._base is not None:
            return self._base.unprotected
        if self._unseeded:
            return self._unseeded
        window = self._window
        if window is None or not window.open_at(self.trainer.next_step - 1):
            return frozenset()
        return frozenset(window.pairs)

    def _record_window(self, window: ReprotectWindow) -> None:
        """Replace the newest record (the same plan's window) with `window`."""
        assert self.windows and self.windows[-1].epoch == window.epoch
        self.windows[-1] = window

    def _supersede_window(self, epoch: int) -> None:
        """A plan arrived while the window was open: its seeds are abandoned with the pairs."""
        if self._window is not None:
            self._record_window(replace(self._window, superseded_by=epoch))
            self._window = None

    def _open_window(self, epoch: int, committed: int) -> None:
        """Record the window of the plan just applied (nothing when no copy is re-seeded)."""
        pairs, self._reseeding = self._reseeding, frozenset()
        if not pairs:
            return
        self._window = ReprotectWindow(
            epoch, tuple(sorted(pairs)), committed + 1, committed + self.reprotect_steps
        )
        self.windows.append(self._window)

    def on_rollback(self) -> None:
        if self._inflight is not None:
            # The blocks that moved were committed on their old stage and are now in flight (or
            # half-received): no rank holds a committed copy in the new layout to roll back to.
            raise MigrationInFlight(
                f"worker {self.comm.worker}: the step carrying the non-blocking migration "
                f"of {self._inflight.moves} failed; it cannot be rolled back in place "
                "(use migration='blocking' where a failure must be survivable here)"
            )
        self.trainer.set_state(self._committed)
        self._verified_in_step = None
        if self.snapshot is not None:
            self.snapshot.discard()

    @property
    def _committed(self) -> dict[str, Any]:
        """The state of the last committed step (waits for its copy if still being taken)."""
        if self._committing is not None:
            self._committed_state = self._committing.result()
            self._committing = None
        return self._committed_state

    @_committed.setter
    def _committed(self, state: dict[str, Any]) -> None:
        self._wait_committed_copy()
        self._committed_state = state

    def _wait_committed_copy(self) -> None:
        _ = self._committed

    def _copy_committed_later(self) -> None:
        """Take the rollback copy of the step just committed off the critical path (ElasWave §5:
        the commit waits only for what it must). Host memory only: on an accelerator the copy
        stays on the main thread, whose stream orders it before the next update's writes."""
        self._wait_committed_copy()  # the previous copy (a step without an update never joined it)
        # The copy being replaced is dead once this step has committed: a rollback now goes to
        # this step, and the live state is not written until this copy lands (the gradient hook
        # waits for it). So it becomes the new copy's memory, unless the plan being left still
        # holds it as its committed point (`_base`, dropped with this commit: copy afresh once).
        retired = self._committed_state
        reuse = None if self._base is not None and self._base.state is retired else retired
        copier = self.trainer.rollback_state_copier(reuse)
        if self.trainer.device.type != "cpu":
            self._committed_state = copier()
            return
        if self._copier is None:
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollback-copy")
        self._committing = self._copier.submit(self._timed_copy, copier)

    def _timed_copy(self, copier: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run `copier` on the helper thread and count its CPU time (bench.vs_ddp itemises it)."""
        c0 = time.thread_time()
        try:
            return copier()
        finally:
            self.rollback_copy_cpu_s += time.thread_time() - c0

    @property
    def committed_layout(self) -> Layout:
        """The layout of the last committed step: what every plan is applied from."""
        return self._base.layout if self._base is not None else self.trainer.layout

    def check_plan(self, plan: Plan, lost: frozenset[int]) -> Relayout | None:
        """Raise RelayoutError (before any group is edited) unless `plan` starts from this
        worker's committed layout and, for an in-place plan, the engine can apply it in place;
        returns the diff (None for a RESTORE plan, which reloads state and needs none). A joiner
        has no committed layout: the plan must add its rank."""
        if self.joining:
            if plan.old is None or self.comm.worker in plan.old.ranks():
                raise RelayoutError(
                    f"plan {plan.epoch} does not add joining worker {self.comm.worker}'s rank"
                )
        elif plan.old is None or plan.old != self.committed_layout:
            raise RelayoutError(
                f"plan {plan.epoch} was made for another layout than worker {self.comm.worker}'s committed one"
            )
        if plan.mode is PlanMode.RESTORE:
            if self.restore_source is None:
                raise RelayoutError(
                    f"plan {plan.epoch} restores from a checkpoint, and this worker has no source"
                )
            return None
        standby = frozenset(plan.standby)
        # the Core's own rule (planners.applicability), with the copies still being re-seeded
        verdict = judge(plan.old, plan.new, standby, self.unprotected())
        if not verdict.in_place:
            raise RelayoutError(verdict.reason)
        steps = plan_relayout(plan.old, plan.new, standby)
        if steps.lost != lost:
            raise RelayoutError(
                f"plan {plan.epoch} drops ranks {sorted(steps.lost)}, the protocol says "
                f"{sorted(lost)} were lost"
            )
        return steps

    def on_plan(self, plan: Plan, lost: frozenset[int], committed_step: int) -> int:
        """Adopt `plan.new` (see `_adopt`), then warm what the first step on it would otherwise
        start cold: the load of its rows under the new layout (the step the failed attempt
        prefetched was for the old one)."""
        self._reseeding, self.apply_phases = frozenset(), {}
        t0 = time.perf_counter()
        committed = self._adopt(plan, lost, committed_step)
        self.apply_phases["state"] = time.perf_counter() - t0 - self.apply_phases.get("backups", 0.0)
        self._open_window(plan.epoch, committed)
        self.trainer.prefetch(committed + 1)
        if self.reprotect_steps > 0:
            t1 = time.perf_counter()
            self._applied_everywhere(plan)
            self.apply_phases["barrier"] = time.perf_counter() - t1
        return committed

    def _applied_everywhere(self, plan: Plan) -> None:
        """Wait until every worker of `plan.new` has adopted it (a store barrier under the plan's
        epoch: bounded, given up on an abort or a newer plan). Seeding every pair before the
        first step made an apply collective over the whole layout; with the seeds in the
        background a worker that moved nothing would otherwise end its apply without hearing of
        a peer that died during it."""
        prefix = f"{self.comm.namespace}/e{plan.epoch}/applied/"
        self.comm.store.set(prefix + str(self.comm.worker), "1")
        self.comm.wait_keys(
            [prefix + str(r) for r in plan.new.ranks()], "every worker applied the plan", epoch=plan.epoch
        )

    def _adopt(self, plan: Plan, lost: frozenset[int], committed_step: int) -> int:
        """Adopt `plan.new` from the last committed state (collective over the new layout's
        workers, after the communicator's edit); returns the last committed step afterwards.

        In place: (1) live remap onto the new ranks with the old stage boundaries (§5.2), (2)
        blocking migration of the blocks whose stage changes (§4.2, §6.2), (3) a new ring seeded
        for the new layout. RESTORE: every worker reloads its part of the agreed checkpoint for
        the new layout (any stage count) and seeds a new ring. Either way the committed point
        stays until the next commit, so an attempt that fails part-way is retried from it."""
        steps = self.check_plan(plan, lost)
        self.rebuilt_bytes = 0
        base = CommittedPoint(self._committed, None) if self.joining else self._enter_plan(plan.epoch)
        self._seed_pending, self._unseeded = False, frozenset()  # this plan seeds a ring of its own
        if steps is None:
            return self._restore(plan)
        if steps.rebuild:
            self._rebuild(plan, lost, base, committed_step)
            self._committed = self.trainer.get_state()
            self._reprotect(base, plan.old)
            return committed_step
        if steps.remap_to is not None:
            self._remap(plan, steps.remap_to, lost, base)
        if steps.moves and self._nonblocking_applies(steps.remap_to or plan.old, steps.moves):
            self._arm_nonblocking(plan.new)
            return committed_step
        if steps.moves:
            self.migrations.append(migrate(self.trainer, plan.new, "blocking"))
        self._committed = self.trainer.get_state()
        self._reprotect(base, plan.old)
        return committed_step

    def hand_over(self, plan: Plan, lost: frozenset[int]) -> None:
        """This worker's rank is dropped while it is alive (`Plan.standby`: its DP replica
        dropped, the other replicas take its samples). It takes part in the plan's one rebuild
        (`executor.fabric.rebuild`) as a source only: its committed live shard, and any backup it
        keeps of a lost rank, go where `plan.new` needs them, so nothing is read from a copy
        for it. Then it holds nothing the job uses: a spare, taken back by a later plan that
        names it in `Plan.joiners` (the joining path: everything from the live owners)."""
        assert plan.old is not None
        base = self._enter_plan(plan.epoch)
        names = self.trainer.unit_names
        transfers = rebuild_plan(
            plan.old,
            plan.new,
            lost,
            recovery_sources(plan.old, lost),
            names,
            engine_ownership(plan.old, names),
            engine_ownership(plan.new, names),
        )
        rebuild(
            self.comm,
            plan.new,
            transfers,
            shard_state_of(self.trainer),
            base.snapshot,
            self.trainer.unit_params(),
            {},  # it keeps no unit under plan.new
            engine_ownership(plan.new, names),
            device=self.trainer.device,
        )
        # a spare now, like a fresh joiner: no ring, no first seed still owed
        self._base, self.joining, self._seed_pending, self._unseeded = None, True, False, frozenset()
        self.handed_over.append(plan.epoch)

    def _enter_plan(self, epoch: int) -> CommittedPoint:
        """The committed point every attempt starts from: frozen at the first plan after a
        commit (the trainer was just rolled back to it); at a later attempt the trainer is put
        back to it, whatever the failed attempt left behind. The ring of a failed attempt is
        retired: the frozen snapshot is the one that matches the committed state. Copies still
        being re-seeded are frozen as missing (`CommittedPoint.unprotected`)."""
        if self._base is None:
            snap = self.snapshot.states() if self.snapshot is not None else None
            self._base = CommittedPoint(self._committed, snap, self.unprotected())
        else:
            self._revert_to(self._base)
        self._supersede_window(epoch)
        self._retire_snapshot()
        return self._base

    def _revert_to(self, base: CommittedPoint) -> None:
        state = base.state
        optim = state["optimizer"]
        shards = {
            name: ZeroShard(lo, hi, m.clone(), v.clone()) for name, (lo, hi, m, v) in optim["shards"].items()
        }
        params = {name: flat.clone() for name, flat in state["params"].items()}
        self.trainer.reset_layout(
            base.layout, self.comm, params, shards, optim["step_count"], int(state["next_step"])
        )
        self.trainer.load_scaler_state(state.get("scaler"))
        self._committed = self.trainer.get_state()

    def _restore(self, plan: Plan) -> int:
        """Reload the agreed checkpoint for `plan.new` (every copy of some state was lost)."""
        assert self.restore_source is not None
        where = self.restore_source(plan)
        meta = self.trainer.restore_layout(plan.new, self.comm, where)
        next_step = 0 if meta is None else meta.next_step
        self.restored_from.append((plan.epoch, None if where is None else str(where), next_step))
        self._committed = self.trainer.get_state()
        self._reprotect(None, None)  # nothing in memory carries over: every copy re-seeded
        return next_step - 1

    def _nonblocking_applies(self, before: Layout | None, moves: tuple[tuple[int, int, int], ...]) -> bool:
        """Whether this plan's moves migrate non-blocking: selected, and possible (module docstring).
        The same verdict on every worker: it depends only on the plan and the job's backend."""
        if self.migration != "nonblocking" or before is None or self.comm.backend != "gloo":
            return False
        try:
            check_nonblocking(before, moves, self.shadow_slots)
        except ValueError:
            return False
        return True

    def _arm_nonblocking(self, new: Layout) -> None:
        """Post the moves (§6.2, Fig. 9) and arm them for the next step; the ring is retired
        until the step after, whose gradient hook re-seeds it from committed shards."""
        self._retire_snapshot()
        self._inflight = NonBlockingMigration(self.trainer, new, self.shadow_slots)
        self.trainer.arm_overlay(self._inflight)

    def _remap(self, plan: Plan, target: Layout, lost: frozenset[int], base: CommittedPoint) -> None:
        """Live remap of the committed shards to `target` (same stage boundaries as now): only
        the Adam moments travel, the parameters are replicated on every rank of the stage."""
        assert plan.old is not None
        names = self.trainer.unit_names
        mine = shard_state_of(self.trainer)
        snap = base.snapshot
        params = self.trainer.unit_params()
        remapped = live_remap(
            self.comm,
            plan.old,
            target,
            lost,
            mine,
            snap,
            step=mine.step,
            old_own=engine_ownership(plan.old, names),
            new_own=engine_ownership(target, names),
            params=params,
            device=self.trainer.device,
            backups_exact=self.exact_backups,
        )
        shards = {name: ZeroShard(0, 0, torch.zeros(0), torch.zeros(0)) for name in params}
        for name, sh in remapped.units.items():
            shards[name] = ZeroShard(sh.start, sh.stop, sh.exp_avg.clone(), sh.exp_avg_sq.clone())
        self.trainer.reset_layout(
            target, self.comm, params, shards, step_count=mine.step, next_step=self.trainer.next_step
        )

    def _rebuild(self, plan: Plan, lost: frozenset[int], base: CommittedPoint, committed_step: int) -> None:
        """Every unit's committed state from where it lives (live shards, backups of lost
        shards) to where `plan.new` needs it, in one exchange (`executor.fabric.rebuild`). A
        joiner contributes nothing and receives everything it holds under `plan.new`."""
        assert plan.old is not None
        names, numels = self.trainer.unit_names, self.trainer.spec.unit_numels()
        new_own = engine_ownership(plan.new, names)
        transfers = rebuild_plan(
            plan.old,
            plan.new,
            lost,
            recovery_sources(plan.old, lost),
            names,
            engine_ownership(plan.old, names),
            new_own,
        )
        stage = plan.new.stage_layout_of_rank(self.comm.worker)
        units = {names[i]: numels[i] for i in stage.layers}
        joining = self.joining
        mine = ShardState(-1) if joining else shard_state_of(self.trainer)
        params = {} if joining else self.trainer.unit_params()
        state = rebuild(
            self.comm,
            plan.new,
            transfers,
            mine,
            base.snapshot,
            params,
            units,
            new_own,
            joining=joining,
            device=self.trainer.device,
        )
        shards = {
            n: ZeroShard(sh.start, sh.stop, sh.exp_avg, sh.exp_avg_sq) for n, sh in state.shard.units.items()
        }
        self.rebuilt_bytes = state.received_bytes
        next_step = committed_step + 1 if joining else self.trainer.next_step
        self.trainer.reset_layout(
            plan.new, self.comm, state.params, shards, step_count=state.shard.step, next_step=next_step
        )
        if self.trainer.scaler is not None:  # fp16: a joiner takes the survivors' loss scale
            share_scaler(self.comm, self.trainer.scaler, joining, self.trainer.device)

    # ----- shard backups -------------------------------------------------------------------
    def _first_seed(self) -> None:
        """Seed the first layout's pairs inside the first step, not here. Seeding is collective
        over the pairs: a peer lost while the job starts would fail it outside the step protocol,
        where nothing recovers it (the worker died with it). Inside the first step (its gradient
        hook, before the update: the shards are still the committed ones) a peer's failure fails
        the step like any other. Until that step commits, no copy protects anything: a loss then
        is planned from a layout whose every pair is missing (`unprotected`), a RESTORE of the
        committed state, the same on every worker."""
        self._seed_pending = True
        if self.snapshots:
            self._unseeded = backup_pairs(self.trainer.layout)

    def _install_snapshot(self) -> None:
        """(Re)form this worker's backup pairs for the current layout and seed every one before
        returning (inside the job's first step, and after a non-blocking migration)."""
        self._form_pairs(lambda snap: snap.seed(shard_state_of(self.trainer)))

    def _reprotect(self, base: CommittedPoint | None, old: Layout | None) -> None:
        """After a plan from `base` (None: a RESTORE, nothing in memory carries over), `old` its
        committed layout: form the new pairs and re-seed the moved copies in the background
        (`_start_seed`), or every pair at once with `reprotect_steps` = 0."""
        if self.reprotect_steps == 0:
            self._install_snapshot()
            return

        def start(snap: ShardBackups) -> None:
            self._reseeding = self._start_seed(snap, base, old)

        self._form_pairs(start)

    def _form_pairs(self, seed: Callable[[ShardBackups], None]) -> None:
        """Replace this worker's backup pairs with the current layout's, seeded by `seed`."""
        t0 = time.perf_counter()
        try:
            self._replace_pairs(seed)
        finally:
            self.apply_phases["backups"] = time.perf_counter() - t0

    @property
    def backup_lag_wait_s(self) -> float:
        """Seconds the commits waited for a backup updater `max_lag` steps behind, over every
        layout (where the host replay cannot keep up with the device's steps)."""
        live = self.snapshot.stats.lag_wait_s if self.snapshot is not None else 0.0
        return self._retired_lag_wait_s + live

    def _retire_snapshot(self) -> None:
        """Close the pairs of the layout being left (their updates applied first)."""
        if self.snapshot is not None:
            self.snapshot.close()
            self._retired_lag_wait_s += self.snapshot.stats.lag_wait_s
            self.snapshot = None

    def _replace_pairs(self, seed: Callable[[ShardBackups], None]) -> None:
        self._retire_snapshot()
        sets = backup_holder_sets(self.trainer.layout)  # all k copies (Layout.backup_copies)
        me = self.comm.worker
        holders, protected = sets.get(me, ()), protected_by(sets, me)
        if self.snapshots and (holders or protected):
            snap = ShardBackups(
                self.comm,
                holders,
                protected,
                update_fn=self.trainer.update_slices,
                carried=self.trainer.trainable_runs,
            )
            try:
                seed(snap)
            except BaseException:
                snap.close()  # a half-seeded ring must not be read by a later remap
                raise
            self.snapshot = snap
        self._seeded_layout = self.trainer.layout

    def _start_seed(
        self, snap: ShardBackups, base: CommittedPoint | None, old: Layout | None
    ) -> frozenset[Pair]:
        """Keep the copies `base` holds that the new layout keeps as they are, post the moved
        ones (`planners.reprotect.reseed_pairs`, the same pairs on every worker); returns them."""
        layout, me, names = self.trainer.layout, self.comm.worker, self.trainer.unit_names
        pairs = reseed_pairs(old, layout, base.unprotected if base is not None else ())
        held = (base.snapshot if base is not None else None) or {}
        intervals = shard_intervals(layout)
        expected = {p: {names[k]: (lo, hi) for k, lo, hi in intervals[p]} for p in snap.protected_ranks}
        kept = {p: held.get(p) for p in snap.protected_ranks if (p, me) not in pairs}
        for p, state in kept.items():
            if state is None or state.intervals() != expected[p]:
                raise SnapshotError(
                    f"worker {me} should keep its copy of worker {p}'s shard across the plan, but "
                    f"holds {None if state is None else state.intervals()}, not {expected[p]}"
                )
        send_to = tuple(h for h in snap.holders if (me, h) in pairs)
        receive = {p: expected[p] for p in snap.protected_ranks if (p, me) in pairs}
        snap.start_seed(
            shard_state_of(self.trainer), {p: s for p, s in kept.items() if s is not None}, send_to, receive
        )
        return pairs

    def _on_grads(self, step: int, grads: dict[str, torch.Tensor]) -> None:
        """Gradient hook (right after the reduce-scatter of step `step`): verify periodically,
        then post the snapshot exchange. Runs inside the step, so a peer failure here rolls the
        step back like any other."""
        self._wait_committed_copy()  # the update that follows writes the tensors being copied
        if self._seed_pending:
            # the job's first step, or the first after a non-blocking migration: the shards are
            # still the committed ones
            self._install_snapshot()
        snap = self.snapshot
        if snap is None:
            return
        layout = self.trainer.layout
        if layout is not self._seeded_layout and layout != self._seeded_layout:
            raise SnapshotError(
                "the trainer's layout changed outside FabricParticipant.on_plan: the ring "
                "snapshot still holds the old shard intervals; apply layout changes as plans"
            )
        committed = step - 1
        self._verified_in_step = None
        if committed > 0 and committed % self.verify_every == 0 and committed not in self.verified_steps:
            # the live shard is still the committed one here: compare it with the snapshot, bitwise
            # where the backups replay the live optimizer exactly, else within round-off
            drift_rel = None if self.exact_backups else VERIFY_DRIFT_REL
            if not snap.verify(shard_state_of(self.trainer), drift_rel):
                self.checksum_mismatches += 1
                snap.repair(shard_state_of(self.trainer))
            self._verified_in_step = committed
        snap.exchange_grads(step, grads)
