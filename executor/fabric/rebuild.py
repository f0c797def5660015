"""Rebuild the committed state onto any layout over the surviving ranks (a whole stage lost).

The live remap (§5.2) keeps every block in its stage and the migration (§6.2) moves blocks one
stage over from live owners. A plan that drops a whole stage (its blocks go to the neighbouring
stages) or moves blocks further needs neither restriction: every element of every unit is read
from where it lives now (the live shard of its owner, or the backup of a lost owner kept by its
holder, `planners.backup`) and sent to the ranks that need it under the new layout:

* a rank that did not hold the unit before receives its full parameters, interval by interval
  (ZeRO-1 replicates a stage's parameters, so every rank of the new stage needs all of them);
* every rank receives the Adam moments of its new interval that it does not own already.

All sends and receives are posted at once; each goes over the group the new layout gives the
pair (same or adjacent stages: `planners.applicability` refuses other plans before they are
published). Nothing is lost as long as each lost shard has a live backup, so no step is replayed.
A worker that joins (growth, `Plan.joiners`) is a destination that holds nothing: it receives the
full parameters of its new units and its new shard's moments from their live owners, several
peers at once; only the intervals that change owner move for everyone else. Non-parameter
buffers of a unit that changes rank come from the model's constructor (they are not part of the
ZeRO state the backups keep).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from executor.comm.communicator import Communicator
from executor.fabric.remap import Backups, RemapError, backup_of, check_integrity
from executor.fabric.state import ShardState, UnitShard
from planners.layout import Layout

REBUILD_TAG = 9500
Rows = Literal["param", "moments"]
# unit -> (worker, lo, hi) intervals with elements, sorted by lo
Ownership = Mapping[str, Sequence[tuple[int, int, int]]]


@dataclass(frozen=True, order=True)
class StateTransfer:
    """Rows `rows` of elements [lo, hi) of `unit`, owned by `owner` at the committed step, read
    by `src` (the owner, or the holder of its backup) and needed by `dst`."""

    unit: str
    lo: int
    hi: int
    owner: int
    src: int
    dst: int
    rows: Rows

    @property
    def from_snapshot(self) -> bool:
        return self.src != self.owner

    @property
    def size(self) -> int:
        return self.hi - self.lo


def rebuild_plan(
    old: Layout,
    new: Layout,
    lost: Collection[int],
    holders: Mapping[int, int],  # lost owner -> the surviving holder its copy is read from
    names: Sequence[str],
    old_own: Ownership,
    new_own: Ownership,
) -> tuple[StateTransfer, ...]:
    """Every transfer the rebuild needs, the same list on every worker (pure)."""
    out: list[StateTransfer] = []
    for layer, unit in enumerate(names):
        had = set(old.stages[old.stage_of_layer(layer)].ranks) - set(lost)
        mine_new = {w: (lo, hi) for w, lo, hi in new_own[unit]}
        for owner, lo, hi in old_own[unit]:
            src = holders.get(owner) if owner in lost else owner
            if src is None or src in lost:
                raise RemapError(f"{unit} [{lo}, {hi}) of lost worker {owner} has no surviving backup")
            for dst in new.stages[new.stage_of_layer(layer)].ranks:
                if dst not in had:
                    out.append(StateTransfer(unit, lo, hi, owner, src, dst, "param"))
                a, b = mine_new.get(dst, (0, 0))
                a, b = max(a, lo), min(b, hi)
                if a < b and owner != dst:
                    out.append(StateTransfer(unit, a, b, owner, src, dst, "moments"))
    return tuple(sorted(out))


@dataclass
class RebuiltState:
    """What a worker holds under the new layout: full parameters of its units, and its shard."""

    params: dict[str, torch.Tensor]
    shard: ShardState
    received_bytes: int = 0  # what this worker received from others (a joiner: everything it holds)


def rebuild(
    comm: Communicator,
    new: Layout,
    plan: tuple[StateTransfer, ...],
    mine: ShardState,
    backups: Backups,
    params: Mapping[str, torch.Tensor],
    units: Mapping[str, int],
    new_own: Ownership,
    timeout_s: float = 30.0,
    joining: bool = False,
    device: torch.device | str = "cpu",
) -> RebuiltState:
    """Run `plan` (every worker of `new` calls this after `comm.apply_edit`): `mine` is my live
    shard at the committed step, `backups` the shards I keep for others, `params` my committed
    full parameters (of my old units), `units` my units under `new` (name -> element count).
    `joining`: I join in this plan and hold nothing (`mine` empty, `params` empty): every
    element I need is read from its live owner, and the committed step is the others'.
    Blocks on the store and on p2p transfers, bounded by `timeout_s` / the communicator
    timeout (PeerFailure). The state is received into and assembled on `device` (the trainer's:
    on NCCL/HCCL nothing the live shards send passes through host memory)."""
    step = check_integrity(comm, new, plan, mine, backups, mine.step, timeout_s, "rebuild", adopt=joining)
    me = comm.worker
    sends: list[tuple[str, torch.Tensor, int, int]] = []
    recvs: list[tuple[str, torch.Tensor, int, int]] = []
    pieces: list[tuple[StateTransfer, torch.Tensor]] = []
    for i, t in enumerate(plan):
        if t.src == me:
            data = _rows(backup_of(backups, t.owner) if t.from_snapshot else mine, t)
            if t.dst == me:
                pieces.append((t, data))
            else:
                sends.append((comm.group_with(me, t.dst), data, t.dst, REBUILD_TAG + i))
        elif t.dst == me:
            buf = torch.empty(t.size if t.rows == "param" else 2 * t.size, device=device)
            recvs.append((comm.group_with(t.src, me), buf, t.src, REBUILD_TAG + i))
            pieces.append((t, buf))
    comm.exchange_many(sends, recvs)
    received = sum(buf.numel() * buf.element_size() for _, buf, _, _ in recvs)
    out = RebuiltState({}, ShardState(step), received)
    for unit, n in units.items():
        got = [(t, d) for t, d in pieces if t.unit == unit]
        full = (
            params[unit]
            if unit in params
            else _filled(unit, 0, n, 1, [p for p in got if p[0].rows == "param"], device)
        )
        out.params[unit] = full.detach().to(device, torch.float32).reshape(-1).clone()
        lo, hi = next(((a, b) for w, a, b in new_own.get(unit, ()) if w == me), (0, 0))
        moments = [p for p in got if p[0].rows == "moments"]
        kept = mine.units.get(unit)
        if kept is not None and max(lo, kept.start) < min(hi, kept.stop):
            a, b = max(lo, kept.start), min(hi, kept.stop)
            moments.append((StateTransfer(unit, a, b, me, me, me, "moments"), kept.slice(a, b)[1:]))
        m = _filled(unit, lo, hi, 2, moments, device)
        out.shard.units[unit] = UnitShard(lo, hi, out.params[unit][lo:hi].clone(), m[0].clone(), m[1].clone())
    return out


def _rows(shard: ShardState | None, t: StateTransfer) -> torch.Tensor:
    if shard is None or t.unit not in shard.units:
        what = f"backup of worker {t.owner}" if t.from_snapshot else "live shard"
        raise RemapError(
            f"worker {t.src} must send {t.unit} [{t.lo}, {t.hi}) from its {what}, which it lacks"
        )
    data = shard.units[t.unit].slice(t.lo, t.hi)
    return data[0].clone() if t.rows == "param" else data[1:].reshape(-1).clone()


def _filled(
    unit: str,
    lo: int,
    hi: int,
    rows: int,
    pieces: list[tuple[StateTransfer, torch.Tensor]],
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """`rows` x [lo, hi) assembled on `device` from pieces that must cover it exactly."""
    out = torch.empty(rows, hi - lo, device=device)
    covered = 0
    for t, data in pieces:
        out[:, t.lo - lo : t.hi - lo] = data.reshape(rows, t.size)
        covered += t.size
    if covered != hi - lo:
        raise RemapError(f"{unit} [{lo}, {hi}): the rebuild assembled {covered} of {hi - lo} elements")
    return out if rows > 1 else out[0]
