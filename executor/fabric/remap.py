"""Live remap of ZeRO-1 state after a membership change (ElasWave §5.2, Fig. 7).

Four steps: (1) integrity check — every lost shard has a surviving snapshot and every survivor is
at the same committed step; (2) transfer plan — the overlap matrix of old vs new ownership with
lost owners read from snapshots (`overlap.remap_plan`); (3) redistribution — only intervals whose
owner changes travel, all sends and receives posted at once; (4) finalisation — each worker
assembles its new intervals from what it kept, what it read from its own snapshot and what it
received. Nothing else moves.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import timedelta

import torch

from executor.comm.communicator import Communicator
from executor.fabric.overlap import Ownership, RemapTransfer, block_ownership, owned_by, remap_plan
from executor.fabric.state import ShardState, UnitShard
from planners.layout import Layout

REMAP_TAG = 9000


class RemapError(RuntimeError):
    """Survivors disagree on the committed step, or a new interval could not be assembled."""


def live_remap(
    comm: Communicator,
    old: Layout,
    new: Layout,
    lost: Collection[int],
    mine: ShardState | None,
    snapshot: ShardState | None,
    step: int,
    timeout_s: float = 30.0,
    old_own: Ownership | None = None,
    new_own: Ownership | None = None,
) -> ShardState:
    """Return this worker's state under `new` (all workers of `new` call this after
    `comm.apply_edit`). `mine` is its live state at committed step `step` (None for a joining
    worker), `snapshot` its ring snapshot (of the worker it protects). Blocks on the store and on
    p2p transfers, each bounded by `timeout_s` / the communicator timeout (PeerFailure).
    Ownership maps default to the planners' block ownership of the two layouts."""
    old_own = block_ownership(old) if old_own is None else old_own
    new_own = block_ownership(new) if new_own is None else new_own
    plan = remap_plan(old, new, lost, old_own, new_own)
    _check_integrity(comm, new, plan, mine, snapshot, step, timeout_s)
    sources = {"live": mine, "snapshot": snapshot}
    sends, recvs, pieces = [], [], []
    for tag, t in enumerate(plan, start=REMAP_TAG):
        if t.src == comm.worker:
            data = _read(sources["snapshot" if t.from_snapshot else "live"], t)
            if t.dst == comm.worker:
                pieces.append((t.unit, t.lo, data))
            else:
                sends.append((comm.group_with(t.src, t.dst), data.reshape(-1).contiguous(), t.dst, tag))
        elif t.dst == comm.worker:
            buf = torch.empty(3 * t.size)
            recvs.append((comm.group_with(t.src, t.dst), buf, t.src, tag))
            pieces.append((t.unit, t.lo, buf.view(3, t.size)))
    comm.exchange_many(sends, recvs)
    if mine is not None:
        for unit, lo, hi in owned_by(new_own, comm.worker):
            kept = mine.units.get(unit)
            if kept is not None and max(lo, kept.start) < min(hi, kept.stop):
                a, b = max(lo, kept.start), min(hi, kept.stop)
                pieces.append((unit, a, kept.slice(a, b)))
    return _assemble(new_own, comm.worker, step, pieces)


def _read(state: ShardState | None, t: RemapTransfer) -> torch.Tensor:
    if state is None or t.unit not in state.units:
        what = f"snapshot of worker {t.owner}" if t.from_snapshot else "live state"
        raise RemapError(f"worker {t.src} must send {t.unit} [{t.lo}, {t.hi}) from its {what}, "
                         "which it does not hold")
    return state.units[t.unit].slice(t.lo, t.hi)


def _check_integrity(comm: Communicator, new: Layout, plan: tuple[RemapTransfer, ...],
                     mine: ShardState | None, snapshot: ShardState | None, step: int, timeout_s: float) -> None:
    if mine is not None and mine.step != step:
        raise RemapError(f"worker {comm.worker}: live state is at step {mine.step}, remap expects {step}")
    owners = {t.owner for t in plan if t.from_snapshot and t.src == comm.worker}
    if owners and (snapshot is None or snapshot.step != step):
        raise RemapError(f"worker {comm.worker} must serve the snapshot of {sorted(owners)} at step {step}, "
                         f"but its snapshot is at step {None if snapshot is None else snapshot.step}")
    # Every worker of the new layout announces the step it remaps to; all must agree.
    key = f"{comm.namespace}/e{comm.epoch}/remap-step/"
    comm.store.set(key + str(comm.worker), str(step))
    keys = [key + str(w) for w in new.ranks()]
    comm.store.wait(keys, timedelta(seconds=timeout_s))
    steps = {w: int(comm.store.get(key + str(w))) for w in new.ranks()}
    if len(set(steps.values())) != 1:
        raise RemapError(f"survivors disagree on the committed step: {steps}")


def _assemble(new_own: Ownership, worker: int, step: int,
              pieces: list[tuple[str, int, torch.Tensor]]) -> ShardState:
    state = ShardState(step=step)
    for unit, lo, hi in owned_by(new_own, worker):
        rows = torch.empty(3, hi - lo)
        covered = 0
        for name, start, data in pieces:
            if name == unit and lo <= start and start + data.shape[1] <= hi:
                rows[:, start - lo: start - lo + data.shape[1]] = data
                covered += data.shape[1]
        if covered != hi - lo:
            raise RemapError(f"worker {worker}: {unit} [{lo}, {hi}) assembled {covered} of {hi - lo} elements")
        state.units[unit] = UnitShard(lo, hi, rows[0].clone(), rows[1].clone(), rows[2].clone())
    return state
