"""Live remap of ZeRO-1 state after a membership change (ElasWave §5.2, Fig. 7).

Four steps: (1) integrity check — every lost shard has a surviving snapshot and every survivor is
at the same committed step; (2) transfer plan — the overlap matrix of old vs new ownership with
lost owners read from snapshots (`overlap.remap_plan`); (3) redistribution — only intervals whose
owner changes travel, all sends and receives posted at once; (4) finalisation — each worker
assembles its new intervals from what it kept, what it read from its own snapshot and what it
received. Nothing else moves.

What travels. Under ZeRO-1 every DP rank holds the full parameters of its stage, and at the
rollback point every survivor has restored the committed ones (the step protocol rolls back
before a plan is applied), so the engine passes them in (`params`) and only the Adam moments
travel (2 rows per interval), each interval with a SHA-256 digest of the sender's parameter
slice (its live shard, or for a lost owner its snapshot), which the receiver checks against its
own replicated copy: a snapshot that drifted from the job is refused, not installed. A caller
whose workers hold only their own parameter slice (the synthetic fabric workload of the tests)
passes no `params`, and parameters travel with the moments (3 rows). All workers of one remap
must use the same mode (the integrity check compares it).

Backups replayed off the live device. A backup is a host copy that its holder updates on the
host CPU (§5.1); the live optimizer runs where the parameters live. On the CPU both run the same
code on the same kind of core, so a backup is bitwise its owner's shard and the check above is
bitwise. On a GPU they are not: the GPU's AdamW rounds differently (fused multiply-adds), so a
backup drifts from its shard by round-off each step (`make gpu-check` (c) on an H200 found its
parameters unequal). With `backups_exact=False` an interval read from a backup then carries its
parameter row too (3 rows), the receiver checks that it is within `BACKUP_DRIFT_REL` of its own
replicated copy, and installs its replicated parameters with the backup's moments: parameters
stay bitwise consistent, the recovered moments are round-off close. Intervals read from a live
shard stay bitwise checked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

import torch

from executor.comm.communicator import Communicator
from executor.fabric.device_copy import tensor_digest
from executor.fabric.overlap import Ownership, RemapTransfer, block_ownership, owned_by, remap_plan
from executor.fabric.state import ShardState, UnitShard
from planners.layout import Layout

REMAP_TAG = 9000
# How far (relative, in the 2-norm) a backup's parameters replayed on the host may be from the
# replicated copy on a device: round-off is about 1e-7 a step, a verify repairs the drift every
# `verify_every` steps, and one missed AdamW step moves typical parameters by 1e-3 or more.
BACKUP_DRIFT_REL = 1e-4
# The periodic verify re-seeds a backup replayed off the live device once its drift passes a
# quarter of that: round-off of ~1e-7 a step takes hundreds of steps to get there, and a backup is
# re-seeded well before a remap would refuse it (`ShardBackups.verify(drift_rel=...)`).
VERIFY_DRIFT_REL = BACKUP_DRIFT_REL / 4

# The backups a worker keeps: owner -> its shard, or the single ring snapshot, or none.
Backups = Mapping[int, ShardState] | ShardState | None


class Sourced(Protocol):
    """An interval read from a worker's live shard or from a backup it keeps."""

    @property
    def unit(self) -> str: ...
    @property
    def lo(self) -> int: ...
    @property
    def hi(self) -> int: ...
    @property
    def owner(self) -> int: ...
    @property
    def src(self) -> int: ...
    @property
    def from_snapshot(self) -> bool: ...


class RemapError(RuntimeError):
    """Survivors disagree on the committed step, or a new interval could not be assembled."""


def live_remap(
    comm: Communicator,
    old: Layout,
    new: Layout,
    lost: Collection[int],
    mine: ShardState | None,
    snapshot: Backups,
    step: int,
    timeout_s: float = 30.0,
    old_own: Ownership | None = None,
    new_own: Ownership | None = None,
    params: Mapping[str, torch.Tensor] | None = None,
    device: torch.device | str = "cpu",
    backups_exact: bool = True,
) -> ShardState:
    """Return this worker's state under `new` (all workers of `new` call this after
    `comm.apply_edit`). `mine` is its live state at committed step `step` (None for a joining
    worker), `snapshot` the backups it keeps (owner -> shard; a bare ShardState is its ring
    snapshot, of the one worker it protects), `params` the full
    replicated parameters of its units under `new` (moments-only mode, see the module
    docstring). Blocks on the store and on p2p transfers, each bounded by `timeout_s` / the
    communicator timeout (PeerFailure). Ownership maps default to the planners' block ownership.
    What arrives is received into and assembled on `device` (the trainer's). `backups_exact`:
    whether backups are bitwise their owners' shards (every worker of the remap passes the
    same; module docstring, "Backups replayed off the live device")."""
    old_own = block_ownership(old) if old_own is None else old_own
    new_own = block_ownership(new) if new_own is None else new_own
    plan = remap_plan(old, new, lost, old_own, new_own)
    check_integrity(
        comm, new, plan, mine, snapshot, step, timeout_s, "moments" if params is not None else "all"
    )

    def rows_of(t: RemapTransfer) -> int:
        return 3 if params is None or (t.from_snapshot and not backups_exact) else 2

    sends: list[tuple[str, torch.Tensor, int, int]] = []
    recvs: list[tuple[str, torch.Tensor, int, int]] = []
    pieces: list[tuple[str, int, torch.Tensor]] = []
    received: list[tuple[RemapTransfer, torch.Tensor, torch.Tensor]] = []
    for i, t in enumerate(plan):
        tag = REMAP_TAG + 2 * i  # + 1: the parameter digest of the same interval
        rows = rows_of(t)
        if t.src == comm.worker:
            data = _read(backup_of(snapshot, t.owner) if t.from_snapshot else mine, t)
            if t.dst == comm.worker:
                if params is not None:
                    data = _checked_moments(params, t, data, comm.worker, exact=rows == 2)
                pieces.append((t.unit, t.lo, data))
                continue
            group = comm.group_with(t.src, t.dst)
            sends.append((group, data[3 - rows :].reshape(-1).contiguous(), t.dst, tag))
            if params is not None and rows == 2:
                sends.append((group, _digest(data[0]), t.dst, tag + 1))
        elif t.dst == comm.worker:
            group = comm.group_with(t.src, t.dst)
            buf, digest = torch.empty(rows * t.size, device=device), torch.zeros(32, dtype=torch.uint8)
            recvs.append((group, buf, t.src, tag))
            if params is not None and rows == 2:
                recvs.append((group, digest, t.src, tag + 1))
            received.append((t, buf, digest))
    comm.exchange_many(sends, recvs)
    for t, buf, digest in received:
        if params is None:
            pieces.append((t.unit, t.lo, buf.view(3, t.size)))
        elif rows_of(t) == 3:
            pieces.append(
                (t.unit, t.lo, _checked_moments(params, t, buf.view(3, t.size), comm.worker, False))
            )
        else:
            _check_param_digest(params, t, digest, comm.worker)
            pieces.append((t.unit, t.lo, _with_replica_params(params, t, buf.view(2, t.size))))
    if mine is not None:
        for unit, lo, hi in owned_by(new_own, comm.worker):
            kept = mine.units.get(unit)
            if kept is not None and max(lo, kept.start) < min(hi, kept.stop):
                a, b = max(lo, kept.start), min(hi, kept.stop)
                pieces.append((unit, a, kept.slice(a, b)))
    return _assemble(new_own, comm.worker, step, pieces, device)


def _digest(values: torch.Tensor) -> torch.Tensor:
    """SHA-256 of the float32 values' bit digest, computed where they live (device_copy
    .tensor_digest: bitwise identity, not approximate; only 16 bytes leave a device)."""
    raw = tensor_digest(values.detach().to(dtype=torch.float32))
    return torch.frombuffer(bytearray(hashlib.sha256(raw).digest()), dtype=torch.uint8)


def _check_param_digest(
    params: Mapping[str, torch.Tensor], t: RemapTransfer, digest: torch.Tensor, worker: int
) -> None:
    """Integrity: the sender's parameter slice (live or snapshot) equals my replicated copy."""
    _require_params(params, t, worker)
    if not torch.equal(_digest(params[t.unit][t.lo : t.hi]), digest):
        where = f"snapshot of worker {t.owner} on worker {t.src}" if t.from_snapshot else f"worker {t.src}"
        raise RemapError(
            f"worker {worker}: parameters of {t.unit} [{t.lo}, {t.hi}) in the {where} differ "
            "from the replicated copy (not at the same committed step?)"
        )


def _checked_moments(
    params: Mapping[str, torch.Tensor], t: RemapTransfer, rows: torch.Tensor, worker: int, exact: bool
) -> torch.Tensor:
    """`rows` (parameters, exp_avg, exp_avg_sq of one interval) with my replicated parameters in
    place of the sender's, once its parameters passed the check: bitwise (`exact`), else within
    `BACKUP_DRIFT_REL` (a backup replayed on the host, module docstring)."""
    if exact:
        _check_param_digest(params, t, _digest(rows[0]), worker)
    else:
        _check_param_drift(params, t, rows[0], worker)
    return _with_replica_params(params, t, rows[1:])


def _with_replica_params(
    params: Mapping[str, torch.Tensor], t: RemapTransfer, moments: torch.Tensor
) -> torch.Tensor:
    """My replicated parameters of `t`'s interval on top of its two moment rows."""
    param = params[t.unit][t.lo : t.hi].detach().to(moments.device, torch.float32).reshape(1, -1)
    return torch.cat([param, moments])


def _check_param_drift(
    params: Mapping[str, torch.Tensor], t: RemapTransfer, sent: torch.Tensor, worker: int
) -> None:
    """Integrity of a backup replayed on the host: its parameter slice is within
    `BACKUP_DRIFT_REL` of my replicated copy."""
    _require_params(params, t, worker)
    mine = params[t.unit][t.lo : t.hi].detach().to(sent.device, torch.float64)
    drift = float((sent.double() - mine).norm() / mine.norm().clamp_min(1e-30))
    if not drift <= BACKUP_DRIFT_REL:  # NaN fails too
        raise RemapError(
            f"worker {worker}: parameters of {t.unit} [{t.lo}, {t.hi}) in the snapshot of worker "
            f"{t.owner} on worker {t.src} are {drift:.1e} (relative) from the replicated copy, more "
            f"than a host replay's round-off ({BACKUP_DRIFT_REL:.0e}): not at the same committed step?"
        )


def _require_params(params: Mapping[str, torch.Tensor], t: RemapTransfer, worker: int) -> None:
    if t.unit not in params:
        raise RemapError(f"worker {worker} receives {t.unit} [{t.lo}, {t.hi}) but holds no parameters of it")


def backup_of(backups: Backups, owner: int) -> ShardState | None:
    """The backup of `owner`'s shard among `backups` (a bare ShardState: the only one kept)."""
    if backups is None or isinstance(backups, ShardState):
        return backups
    return backups.get(owner)


def _read(state: ShardState | None, t: Sourced) -> torch.Tensor:
    if state is None or t.unit not in state.units:
        what = f"snapshot of worker {t.owner}" if t.from_snapshot else "live state"
        raise RemapError(
            f"worker {t.src} must send {t.unit} [{t.lo}, {t.hi}) from its {what}, which it does not hold"
        )
    return state.units[t.unit].slice(t.lo, t.hi)


def check_integrity(
    comm: Communicator,
    new: Layout,
    plan: Sequence[Sourced],
    mine: ShardState | None,
    snapshot: Backups,
    step: int,
    timeout_s: float,
    mode: str,
    adopt: bool = False,
) -> int:
    """Fig. 7a: my live state and every backup I must serve are at committed step `step`, and
    every worker of `new` announces the same step and `mode` (what travels: a mixed mode would
    mismatch message sizes); returns that step. `adopt`: this worker joins and holds no state
    yet, so it announces none and takes the others' (`step` is ignored). Blocks on the store,
    bounded by `timeout_s`."""
    if mine is not None and not adopt and mine.step != step:
        raise RemapError(f"worker {comm.worker}: live state is at step {mine.step}, remap expects {step}")
    for owner in sorted({t.owner for t in plan if t.from_snapshot and t.src == comm.worker}):
        held = backup_of(snapshot, owner)
        if held is None or held.step != step:
            raise RemapError(
                f"worker {comm.worker} must serve the snapshot of {owner} at step {step}, "
                f"but its snapshot is at step {None if held is None else held.step}"
            )
    key = f"{comm.namespace}/e{comm.epoch}/remap-step/"
    comm.store.set(key + str(comm.worker), f"{'?' if adopt else step} {mode}")
    keys = [key + str(w) for w in new.ranks()]
    comm.wait_keys(keys, "remap integrity check", timeout_s=timeout_s)
    said = {w: comm.store.get(key + str(w)).decode().split() for w in new.ranks()}
    steps = {w: int(v[0]) for w, v in said.items() if v[0] != "?"}
    if len(set(steps.values())) != 1:
        raise RemapError(f"survivors disagree on the committed step: {steps}")
    modes = {w: v[1] for w, v in said.items()}
    if len(set(modes.values())) != 1:
        raise RemapError(f"workers disagree on what travels: {modes}")
    return next(iter(steps.values()))


def _assemble(
    new_own: Ownership,
    worker: int,
    step: int,
    pieces: list[tuple[str, int, torch.Tensor]],
    device: torch.device | str = "cpu",
) -> ShardState:
    state = ShardState(step=step)
    for unit, lo, hi in owned_by(new_own, worker):
        rows = torch.empty(3, hi - lo, device=device)
        covered = 0
        for name, start, data in pieces:
            if name == unit and lo <= start and start + data.shape[1] <= hi:
                rows[:, start - lo : start - lo + data.shape[1]] = data
                covered += data.shape[1]
        if covered != hi - lo:
            raise RemapError(
                f"worker {worker}: {unit} [{lo}, {hi}) assembled {covered} of {hi - lo} elements"
            )
        state.units[unit] = UnitShard(lo, hi, rows[0].clone(), rows[1].clone(), rows[2].clone())
    return state
