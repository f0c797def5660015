"""Blocking layer migration at a step boundary (ElasWave §6.2 baseline, §6.3 shard transfers).

A pipeline-only change keeps every stage's ranks and moves stage boundaries, so whole blocks move
to an adjacent stage. What moves is exactly the overlap matrix of old and new ZeRO ownership,
`planners.zero.shard_transfers(old, new)`: under the interleaved layout that is D disjoint
rank-to-rank sends per moved block (rank j of the source stage -> rank j of the destination);
under the contiguous layout every cut point of both stages shifts and ranks inside each stage
reshuffle their slices as well. Each transfer carries the Adam moments of its element interval,
plus the parameters when the block changes stage; the destination stage then all-gathers the
parameters of the blocks it received.

All ranks walk the same globally ordered transfer list and do only their own sends/receives, so
the blocking rendezvous sends cannot deadlock (the earliest unfinished transfer always has both
ends waiting on it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from executor.engine_comm import all_to_all_v, dp_group_name, pp_group_name
from executor.trainer import Trainer
from executor.zero import ShardState, unit_ownership
from planners.layout import Layout
from planners.zero import ShardTransfer, shard_transfers


@dataclass(frozen=True)
class MigrationReport:
    mode: str
    moved_layers: tuple[tuple[int, int, int], ...]  # (layer, from stage, to stage)
    transfers: int  # rank-to-rank messages this rank took part in
    elements_sent: int
    elements_received: int
    seconds: float  # time the step boundary stalled for the migration on this rank
    shadow_slots_run: int = 0  # non-blocking: slots this rank ran a departing block's shadow for
    payback_slots: int = 0  # non-blocking: own slots folded onto a received payback gradient
    wait_seconds: float = 0.0  # non-blocking: time spent waiting inside the step for transfers

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def moved_layers(old: Layout, new: Layout) -> tuple[tuple[int, int, int], ...]:
    """Blocks whose stage changes; raises ValueError unless `new` is a pipeline-only change of `old`."""
    if [s.ranks for s in old.stages] != [s.ranks for s in new.stages]:
        raise ValueError("a pipeline-only change keeps every stage's ranks; this one does not")
    same = ("num_layers", "global_batch", "num_micro_batches", "layer_numel", "zero_layout", "rng_mode")
    diff = [f for f in same if getattr(old, f) != getattr(new, f)]
    if diff or [s.sample_weights for s in old.stages] != [s.sample_weights for s in new.stages]:
        raise ValueError(
            f"a pipeline-only change may only move stage boundaries; it also changes {diff or 'samples'}"
        )
    moves = []
    for layer in range(old.num_layers):
        src, dst = old.stage_of_layer(layer), new.stage_of_layer(layer)
        if abs(src - dst) > 1:
            raise ValueError(
                f"layer {layer} would jump from stage {src} to stage {dst}; move it one stage at a time"
            )
        if src != dst:
            moves.append((layer, src, dst))
    return tuple(moves)


def _link(old: Layout, t: ShardTransfer) -> str:
    a, b = old.stage_of_rank(t.src_rank), old.stage_of_rank(t.dst_rank)
    return dp_group_name(a) if a == b else pp_group_name(min(a, b))


def migrate(trainer: Trainer, new: Layout, mode: str = "blocking") -> MigrationReport:
    """Move `trainer` (and, collectively, every rank of the job) from its layout to `new`."""
    if mode != "blocking":
        raise ValueError(f"unknown migration mode {mode!r} (supported: 'blocking')")
    start = time.perf_counter()
    old, me = trainer.layout, trainer.rank
    moves = moved_layers(old, new)
    moving = {layer for layer, _, _ in moves}
    old_params = trainer.unit_params()
    old_shards = trainer.optimizer.shards
    incoming: dict[tuple[int, int, int], torch.Tensor] = {}
    sent = received = count = 0
    for t in shard_transfers(old, new):
        if me not in (t.src_rank, t.dst_rank):
            continue
        count += 1
        name, n = trainer.unit_names[t.layer], t.stop - t.start
        width = 3 if t.layer in moving else 2
        if t.src_rank == me:
            sh = old_shards[name]
            lo, hi = t.start - sh.lo, t.stop - sh.lo
            parts = [sh.exp_avg[lo:hi], sh.exp_avg_sq[lo:hi]]
            if width == 3:
                parts.append(old_params[name][t.start : t.stop])
            trainer.comm.send(_link(old, t), torch.cat(parts), t.dst_rank)
            sent += width * n
        else:
            buf = torch.empty(width * n, device=trainer.device)
            trainer.comm.recv(_link(old, t), buf, t.src_rank)
            incoming[(t.layer, t.start, t.stop)] = buf
            received += width * n
    stage = new.stage_layout_of_rank(me)
    numel = {trainer.unit_names[layer]: new.layer_numel[layer] for layer in stage.layers}
    ownership = unit_ownership(new, stage, trainer.unit_names)
    j = stage.dp_index(me)
    shards, params = {}, {}
    for name, iv in ownership.items():
        lo, hi = iv[j]
        shards[name] = ShardState(
            lo, hi, torch.zeros(hi - lo, device=trainer.device), torch.zeros(hi - lo, device=trainer.device)
        )
        params[name] = (
            old_params[name] if name in old_params else torch.zeros(numel[name], device=trainer.device)
        )
    _fill_from_local(shards, old_shards)
    _fill_from_incoming(shards, params, incoming, moving, trainer.unit_names)
    arrived = sorted(layer for layer, _, dst in moves if dst == stage.stage)
    _gather_arrived_params(trainer, stage.stage, ownership, params, arrived, j)
    trainer.reset_layout(new, trainer.comm, params, shards, trainer.optimizer.step_count, trainer.next_step)
    return MigrationReport(mode, moves, count, sent, received, time.perf_counter() - start)


def _fill_from_local(shards: dict[str, ShardState], old: dict[str, ShardState]) -> None:
    """Copy the part of my new slices that I already owned."""
    for name, sh in shards.items():
        if name not in old:
            continue
        o = old[name]
        lo, hi = max(sh.lo, o.lo), min(sh.hi, o.hi)
        if lo < hi:
            sh.exp_avg[lo - sh.lo : hi - sh.lo] = o.exp_avg[lo - o.lo : hi - o.lo]
            sh.exp_avg_sq[lo - sh.lo : hi - sh.lo] = o.exp_avg_sq[lo - o.lo : hi - o.lo]


def _fill_from_incoming(
    shards: dict[str, ShardState],
    params: dict[str, torch.Tensor],
    incoming: dict[tuple[int, int, int], torch.Tensor],
    moving: set[int],
    names: Sequence[str],
) -> None:
    for (layer, lo, hi), buf in incoming.items():
        sh, n = shards[names[layer]], hi - lo
        sh.exp_avg[lo - sh.lo : hi - sh.lo] = buf[:n]
        sh.exp_avg_sq[lo - sh.lo : hi - sh.lo] = buf[n : 2 * n]
        if layer in moving:
            params[names[layer]][lo:hi] = buf[2 * n :]


def _gather_arrived_params(
    trainer: Trainer,
    stage: int,
    ownership: dict[str, list[tuple[int, int]]],
    params: dict[str, torch.Tensor],
    arrived: list[int],
    j: int,
) -> None:
    """Every rank of the destination stage holds one slice of each arrived block: all-gather them."""
    if not arrived:
        return
    names = [trainer.unit_names[layer] for layer in arrived]
    d = len(ownership[names[0]])
    mine = torch.cat([params[n][ownership[n][j][0] : ownership[n][j][1]] for n in names])
    sizes = [sum(ownership[n][k][1] - ownership[n][k][0] for n in names) for k in range(d)]
    pieces = all_to_all_v(trainer.comm, dp_group_name(stage), [mine] * d, sizes)
    for k, piece in enumerate(pieces):
        pos = 0
        for n in names:
            lo, hi = ownership[n][k]
            params[n][lo:hi] = piece[pos : pos + hi - lo]
            pos += hi - lo
