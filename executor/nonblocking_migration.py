"""Non-blocking layer migration with a shadow layer and gradient payback (ElasWave §6.2, Fig. 9).

At the step boundary nothing stalls: every source rank j *posts* an asynchronous send of the
moving block (full parameters + its interleaved optimizer shard j) to rank j of the destination
stage, every destination rank posts the matching receive, and all ranks adopt the new layout at
once. During the first `shadow_slots` (k) micro-batch slots of the step:

* the source still runs the block as a *shadow* for slots 0..k-1 (activations crossing the stage
  boundary are the ones the old layout would send) and accumulates its gradient;
* the destination skips the block for those slots, and waits for the parameters only before its
  first forward of slot k, by which time the transfer has overlapped k forwards;
* after its last backward of a slot < k the source sends the accumulated "payback" gradient.

Exactness. Autograd accumulates a parameter's gradient as a left fold over the slots,
`((g0 + g1) + g2) + ...`. The shadow's gradient is exactly `g0 + ... + g(k-1)` (the same bits, since
the same samples meet the same weights), so the destination keeps its own per-slot gradients
`g_k, ...` apart and folds them onto the payback in slot order: the result is bit-identical to
a blocking migration or to no migration at all. This needs the two stages to split samples the
same way (rank j's samples are the same on both) and the interleaved ZeRO layout (D disjoint
rank-to-rank transfers, no intra-stage resharding), which is the combination the paper evaluates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroupGloo

from executor.engine_comm import EngineComm, p2p_channel, pp_group_name
from executor.migration import MigrationReport, moved_layers
from executor.trainer import Trainer
from executor.zero import ShardState, assign_flat, flat_grads, unit_ownership
from planners.layout import Layout

MIGRATE_TAG = 1000
PAYBACK_TAG = 2000


@dataclass
class _Outgoing:
    layer: int
    shadow: nn.Module
    in_front: bool  # the block moves to the previous stage: its shadow runs before our blocks
    peer: int
    group: str  # logical group (pp/<s>-<s+1>)
    works: list[Any] = field(default_factory=list)  # post_exchange handles of the async sends
    payback_sent: bool = False


@dataclass
class _Incoming:
    layer: int
    peer: int
    lo: int
    hi: int
    payload: torch.Tensor
    payload_work: Any  # post_exchange handles of the async receives
    payback: torch.Tensor
    payback_work: Any
    loaded: bool = False
    stash: list[torch.Tensor] = field(default_factory=list)  # own per-slot gradients, slots >= k


def check_nonblocking(old: Layout, moves: tuple[tuple[int, int, int], ...], k: int) -> None:
    """Raise ValueError unless these moves can migrate without blocking (module docstring)."""
    if not 1 <= k <= old.num_micro_batches:
        raise ValueError(f"shadow_slots must be in [1, {old.num_micro_batches}], got {k}")
    if old.zero_layout != "interleaved":
        raise ValueError(
            "non-blocking migration needs the interleaved ZeRO layout (no intra-stage reshuffle)"
        )
    for layer, src, dst in moves:
        a, b = old.stages[src], old.stages[dst]
        if a.dp_size != b.dp_size or a.sample_weights != b.sample_weights:
            raise ValueError(
                f"layer {layer}: stages {src} and {dst} split samples differently, so a "
                "shadow's gradient cannot be paid back rank to rank; use blocking migration"
            )


def _require_tagged_p2p(comm: EngineComm, group: str, peer: int) -> None:
    # The transfer and the payback run concurrently with the pipeline's own sends on the same
    # pair of ranks, kept apart by tags: gloo matches by tag, NCCL/HCCL only by order.
    _, pg, _ = p2p_channel(comm, group, peer)
    if not isinstance(pg, ProcessGroupGloo):
        raise ValueError(
            f"non-blocking migration needs tagged point-to-point (gloo), got {type(pg).__name__}; "
            "use blocking migration on this backend"
        )


class NonBlockingMigration:
    """One rank's part of a non-blocking migration; pass it to `Trainer.train_step` as the overlay
    of the first step under the new layout (every rank of the job must do the same)."""

    def __init__(self, trainer: Trainer, new: Layout, shadow_slots: int = 1) -> None:
        start = time.perf_counter()
        old, me, comm = trainer.layout, trainer.rank, trainer.comm
        moves = moved_layers(old, new)
        check_nonblocking(old, moves, shadow_slots)
        self.trainer, self.k, self.moves = trainer, shadow_slots, moves
        self.sent = self.received = 0
        self.wait_seconds = 0.0
        self.shadow_slots_run = 0
        j, my_stage = old.stage_layout_of_rank(me).dp_index(me), old.stage_of_rank(me)
        old_params, old_shards = trainer.unit_params(), trainer.optimizer.shards
        self.outgoing: list[_Outgoing] = []
        self.incoming: list[_Incoming] = []
        new_stage = new.stages[my_stage]
        ownership = unit_ownership(new, new_stage, trainer.unit_names)
        numel = dict(zip(trainer.unit_names, new.layer_numel, strict=True))
        for layer, src, dst in moves:
            name, group = trainer.unit_names[layer], pp_group_name(min(src, dst))
            if src == my_stage:
                out = _Outgoing(layer, trainer.model.units[name], dst < src, new.stages[dst].ranks[j], group)
                for p in out.shadow.parameters():
                    p.grad = None
                sh = old_shards[name]
                payload = torch.cat([old_params[name], sh.exp_avg, sh.exp_avg_sq])
                _require_tagged_p2p(comm, group, out.peer)
                # Posted through the communicator, not on the raw group: the op is counted in the
                # group's ledger from now on, so a step that fails before it completes leaves the
                # link marked dirty and an edit rebuilds it instead of reusing it half-matched.
                out.works.append(comm.post_exchange([(group, payload, out.peer, MIGRATE_TAG + layer)], []))
                self.sent += payload.numel()
                self.outgoing.append(out)
            elif dst == my_stage:
                peer, (lo, hi) = old.stages[src].ranks[j], ownership[name][j]
                payload = torch.empty(numel[name] + 2 * (hi - lo), device=trainer.device)
                payback = torch.empty(numel[name], device=trainer.device)
                _require_tagged_p2p(comm, group, peer)
                self.incoming.append(
                    _Incoming(
                        layer,
                        peer,
                        lo,
                        hi,
                        payload,
                        comm.post_exchange([], [(group, payload, peer, MIGRATE_TAG + layer)]),
                        payback,
                        comm.post_exchange([], [(group, payback, peer, PAYBACK_TAG + layer)]),
                    )
                )
        dev = trainer.device
        params = {n: old_params.get(n, torch.zeros(numel[n], device=dev)) for n in ownership}
        shards = {
            n: old_shards[n]
            if n in old_shards
            else ShardState(
                iv[j][0],
                iv[j][1],
                torch.zeros(iv[j][1] - iv[j][0], device=dev),
                torch.zeros(iv[j][1] - iv[j][0], device=dev),
            )
            for n, iv in ownership.items()
        }
        trainer.reset_layout(new, comm, params, shards, trainer.optimizer.step_count, trainer.next_step)
        self.boundary_seconds = time.perf_counter() - start
        self._last_shadow_slot = max(
            (m for m in range(shadow_slots) if len(new.samples_of(me, m))), default=None
        )

    # -------------------------------------------------------------------- StepOverlay hooks
    def units_for_slot(self, slot: int, units: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
        if slot >= self.k:
            return units
        self.shadow_slots_run += 1 if self.outgoing else 0
        skipped = {self.trainer.unit_names[inc.layer] for inc in self.incoming}
        units = [(n, u) for n, u in units if n not in skipped]
        front = [
            (self.trainer.unit_names[o.layer], o.shadow)
            for o in sorted(self.outgoing, key=lambda o: o.layer)
            if o.in_front
        ]
        back = [
            (self.trainer.unit_names[o.layer], o.shadow)
            for o in sorted(self.outgoing, key=lambda o: o.layer)
            if not o.in_front
        ]
        return front + units + back

    def before_forward(self, slot: int) -> None:
        if slot >= self.k:
            self._load()

    def after_backward(self, slot: int) -> None:
        if slot == self._last_shadow_slot:
            self._send_payback()
        if slot >= self.k:
            for inc in self.incoming:
                unit = self.trainer.model.units[self.trainer.unit_names[inc.layer]]
                inc.stash.append(flat_grads(unit))
                for p in unit.parameters():
                    p.grad = None

    def before_optimizer(self) -> None:
        self._load()
        self._send_payback()
        for inc in self.incoming:
            self._wait(inc.payback_work)
            self.received += inc.payback.numel()
            total = inc.payback.clone()
            for g in inc.stash:  # the same left fold over slots that autograd would have done
                total += g
            offset = 0
            for p in self.trainer.model.units[self.trainer.unit_names[inc.layer]].parameters():
                p.grad = total[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()

    def finish(self) -> None:
        for out in self.outgoing:
            for work in out.works:
                self._wait(work)

    # ------------------------------------------------------------------------------ internals
    def _wait(self, ops: Any) -> None:
        """Bounded wait for posted ops: on the dynamic communicator a dead or hung peer raises
        PeerFailure (and flags the abort) like any other op, instead of blocking."""
        t = time.perf_counter()
        self.trainer.comm.complete(ops)
        self.wait_seconds += time.perf_counter() - t

    def _load(self) -> None:
        for inc in self.incoming:
            if inc.loaded:
                continue
            self._wait(inc.payload_work)
            name, n = self.trainer.unit_names[inc.layer], inc.hi - inc.lo
            numel = inc.payload.numel() - 2 * n
            assign_flat(self.trainer.model.units[name], inc.payload[:numel])
            shard = self.trainer.optimizer.shards[name]
            shard.exp_avg.copy_(inc.payload[numel : numel + n])
            shard.exp_avg_sq.copy_(inc.payload[numel + n :])
            self.received += inc.payload.numel()
            inc.loaded = True

    def _send_payback(self) -> None:
        comm = self.trainer.comm
        for out in self.outgoing:
            if out.payback_sent:
                continue
            payback = flat_grads(out.shadow)
            out.works.append(
                comm.post_exchange([(out.group, payback, out.peer, PAYBACK_TAG + out.layer)], [])
            )
            self.sent += payback.numel()
            out.payback_sent = True

    def report(self) -> MigrationReport:
        transfers = len(self.outgoing) + len(self.incoming)
        return MigrationReport(
            "nonblocking",
            self.moves,
            transfers,
            self.sent,
            self.received,
            self.boundary_seconds,
            self.shadow_slots_run,
            max((len(inc.stash) for inc in self.incoming), default=0),
            self.wait_seconds,
        )
