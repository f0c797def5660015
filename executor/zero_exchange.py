"""The ZeRO-1 stage's gradient and parameter exchanges, one per unit (ElasWave §6.3; issue 23).

`executor.zero.ShardedOptimizer` owns the math (the DP-order sum, clipping, the update of its
slices); this module moves the bytes. Each unit of the stage has one personalised exchange
(`alltoall_base`) per direction and step:

- reduce-scatter: the unit's flat gradient goes out as it is, cut into the owners' intervals
  (interleaved and contiguous ownership both cut a unit into intervals in DP order); each owner
  receives the D contributions to its interval and adds them in DP-rank order. The exchanges
  start along one fixed order, on every rank the same (the stage's units in reverse), either
  during the step's last backward as autograd finishes each unit (`executor.grad_overlap`) or
  after it;
- all-gather: posted right after the owner updated the unit's slice (so it overlaps the next
  unit's update), received straight into the unit's flat parameter buffer. On the host (gloo)
  the owner's slice goes to each other rank as it lies, point to point (`comm.post_exchange`,
  one tag per bucket): a personalised exchange needs one send buffer holding the slice D times,
  a copy of the stage's whole parameter vector every step, and gloo's `alltoall_base` costs
  more of its threads' CPU than the same bytes sent point to point (docs/benchmarks.md). On an
  accelerator the slice repeated D times goes out in one `alltoall_base`, as NCCL's all-to-all
  batches what separate sends would not, and a device copy is cheap.

The reduce-scatter is waited for as one guarded op (`engine_comm.WorkSet`), the all-gather as
one (its collective) or through `comm.complete` (its point-to-point messages): to failure
detection a step still has one reduce-scatter and one all-gather. Every exchange is posted
through `comm.issue` or `comm.post_exchange`, so the op ledger counts it from then on: one
posted and never waited for (a step abandoned mid-backward) makes the next edit rebuild the DP
group (docs/engine.md).

Units smaller than `BUCKET_MIN_ELEMENTS` are bucketed with their neighbours in launch order (a
fixed cost per exchange, as DDP's buckets): a bucket of several units, or of a unit without a
flat buffer (one sharing a parameter with another unit of the stage: a tie) or whose ownership
does not follow DP order, takes the copying path: its gradients concatenated per owner, its
parameters received into a scratch buffer and copied in (the other owners' slices: a flat unit's
own slice was updated where it lies). A bucket is summed element by element
in DP order like a single unit, so bucketing changes no bit.

A wholly frozen unit (no parameter with `requires_grad`: a frozen embedding, the first blocks of
a fine-tune) is in no bucket, as DDP's buckets hold trainable parameters only: its gradient is
zero and its parameters never change, so every rank of the stage already holds what either
exchange would bring. Its reduced slice is zeros (the optimizer's update skips frozen elements,
`OptimizerConfig.decay_segments`), and its gradient buffer is not cleared every step (nothing
accumulates into it), nor its rollback copy taken again (`Trainer.rollback_state_copier`).
Freezing half of a model's elements used to exchange all of them twice a step.

A unit that trains in part (a LoRA or BitFit fine-tune: frozen weights beside trainable adapters
or biases) exchanges its trainable elements only, as DDP's buckets hold only those: each owner's
interval is cut to its trainable runs (`owned_runs`), those go on the wire back to back (the
copying path), and the owner's reduced slice gets zeros at its frozen elements, which the update
skips. A unit whose trainable runs are a few adapters of a large frozen weight then moves the
adapters, not the weight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed import AllToAllOptions

from executor.engine_comm import EngineComm, WorkSet
from executor.flat_units import FlatUnit, assign_flat, flat_grads, flat_params, flat_units, range_views
from executor.grad_overlap import OverlapLauncher
from executor.optim import Segments, trainable_runs

Interval = tuple[int, int]
# Units smaller than this (elements) share an exchange with their neighbours in launch order,
# concatenated, until the bucket reaches it: a gloo exchange costs a fixed ~0.1 ms of CPU on
# each side, more than copying a small unit (a small model's units would otherwise pay more in
# exchanges than the zero-copy path saves). 2^18 elements = 1 MiB of fp32.
BUCKET_MIN_ELEMENTS = 1 << 18
# Point-to-point tags of the all-gather on the host: this + the bucket's index, far above every
# other point-to-point tag the executor uses (tied weights, migration, snapshots, remap and
# rebuild all stay under 10,000 plus two per transfer).
GATHER_TAG = 1 << 24


def _in_dp_order(intervals: Sequence[Interval], numel: int) -> bool:
    """Whether the owners' intervals of a unit, in DP order, tile `[0, numel)` (empty ones
    anywhere): then the unit's flat vector is already the exchange's per-owner layout."""
    pos = 0
    for lo, hi in intervals:
        if hi > lo:
            if lo != pos:
                return False
            pos = hi
    return pos == numel


class UnitExchange:
    """The per-unit (per-bucket) exchanges of one stage's DP group (module docstring)."""

    def __init__(
        self,
        comm: EngineComm,
        group: str,
        units: Mapping[str, nn.Module],
        ownership: Mapping[str, list[Interval]],
        dp_index: int,
        segments: Mapping[str, Segments],
        wire_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        flat: bool = True,
        bucket_min: int | None = None,
    ) -> None:
        """`flat=False` keeps every unit on the copying path, `bucket_min=0` gives every unit its
        own exchange (the same results either way; for comparisons; None: `BUCKET_MIN_ELEMENTS`
        as it is when the exchange is built). `segments`: every unit's
        decay segments (`OptimizerConfig.decay_segments`, whose FROZEN runs say what does not
        train), as the optimizer resolved them."""
        self.comm, self.group, self.wire_dtype = comm, group, wire_dtype
        self.device = torch.device(device)
        self.units = dict(units)
        self.ownership = {n: list(ownership[n]) for n in self.units}
        self.dp_index, self.dp_size = dp_index, len(next(iter(self.ownership.values())))
        self._numel = {n: sum(p.numel() for p in u.parameters()) for n, u in self.units.items()}
        # Units with a trainable element (a trainable parameter of no elements trains nothing)
        self.segments = {n: segments[n] for n in self.units}
        runs = {n: trainable_runs(self.segments[n], 0, self._numel[n]) for n in self.units}
        self._trains = {n for n, r in runs.items() if r}
        # Units without a trainable parameter: their parameters and moments never change.
        self.frozen = frozenset(self.units) - self._trains
        # Units that train in part: every owner's trainable runs, what goes on the wire for them
        self.partial_runs = {n: r for n, r in runs.items() if r and r != ((0, self._numel[n]),)}
        self.owned_runs: dict[str, list[tuple[Interval, ...]]] = {
            n: [trainable_runs(self.segments[n], lo, hi) for lo, hi in self.ownership[n]]
            for n in self.partial_runs
        }
        self._wire = {
            n: [sum(b - a for a, b in self._spans(n, k)) for k in range(self.dp_size)] for n in self.units
        }
        # Parameters and gradients as views of one flat buffer per unit (executor.flat_units)
        self.flats: dict[str, FlatUnit] = flat_units(self.units) if flat else {}
        self._ordered = {n: _in_dp_order(self.ownership[n], self._numel[n]) for n in self.units}
        self.buckets = self._bucket(BUCKET_MIN_ELEMENTS if bucket_min is None else bucket_min)
        self._bucket_of = {n: i for i, b in enumerate(self.buckets) for n in b}
        self._posted: dict[int, tuple[torch.Tensor, Any]] = {}
        self._reduced: dict[str, torch.Tensor] | None = None  # `reduced_slices`
        # Flat units checked (`FlatUnit.ensure`) since `zero_grads` or `end_step` (`_flat`)
        self._ensured: set[str] = set()
        self.launcher = OverlapLauncher([str(i) for i in range(len(self.buckets))], self._launch)
        self._gather: _Gather | None = None
        # Buffers an abandoned all-gather's receives were posted into (`_release_receiving`):
        # kept until this exchange is replaced, which happens after the plan's edit has aborted
        # the groups those receives belong to, so no collective still running writes freed memory.
        self._orphans: list[torch.Tensor] = []

    def _bucket(self, bucket_min: int) -> list[tuple[str, ...]]:
        """Runs of consecutive units in launch order (the stage's units in reverse): a unit of
        at least `bucket_min` elements alone, smaller ones together up to that size."""
        buckets: list[tuple[str, ...]] = []
        small: list[str] = []
        for name in reversed(self.active()):
            if sum(self._wire[name]) >= bucket_min:
                if small:
                    buckets.append(tuple(small))
                    small = []
                buckets.append((name,))
                continue
            small.append(name)
            if sum(sum(self._wire[n]) for n in small) >= bucket_min:
                buckets.append(tuple(small))
                small = []
        return buckets + ([tuple(small)] if small else [])

    def _direct(self, bucket: Sequence[str]) -> bool:
        """Whether a bucket is one wholly trainable flat unit in DP order: exchanged in place,
        nothing copied."""
        name = bucket[0]
        return len(bucket) == 1 and name in self.flats and self._ordered[name] and name not in self.owned_runs

    def carried(self, name: str, k: int) -> int:
        """How many elements of `name` owner k's part of either exchange carries: its interval's
        length, or its trainable elements only (a unit that trains in part)."""
        return self._wire[name][k]

    def _spans(self, name: str, k: int) -> tuple[Interval, ...]:
        """The element runs of `name` that owner k's part of an exchange carries, in order: its
        interval, or that interval's trainable runs (a unit that trains in part)."""
        runs = self.owned_runs.get(name)
        lo, hi = self.ownership[name][k]
        return runs[k] if runs is not None else ((lo, hi),)

    def _on_wire(self, name: str, k: int, vec: torch.Tensor, offset: int = 0) -> list[torch.Tensor]:
        """Owner k's part of `vec` (a unit's flat vector; `offset`: the element of the unit that
        `vec[0]` is, e.g. the interval's start for the owner's own slice), as views."""
        return [vec[a - offset : b - offset] for a, b in self._spans(name, k)]

    def reduced_slices(self) -> dict[str, torch.Tensor]:
        """My reduced slice of every unit, as views of one fp32 buffer kept across steps, in
        sorted unit order (a snapshot's gradient exchange sends it as it lies,
        `executor.fabric.snapshot`). A fresh host allocation of a shard's size every step would
        fault its pages in again (`flat_units.copy_reusing`). Elements no exchange writes (a
        frozen unit's, the frozen runs of one that trains in part) stay zero: clipping scales
        them, so the global norm counts only what trains. Valid until the next reduce-scatter."""
        if self._reduced is None:
            names = sorted(self.units)
            sizes = [self._mine(n) for n in names]
            buf = torch.zeros(sum(sizes), dtype=torch.float32, device=self.device)
            self._reduced = dict(zip(names, buf.split(sizes), strict=True))
        return self._reduced

    def _split(self, name: str, wire: torch.Tensor, k: int | None = None) -> list[torch.Tensor]:
        """Owner k's (default: my) wire form of `name` cut into its spans."""
        spans = self._spans(name, self.dp_index if k is None else k)
        return list(wire.split([b - a for a, b in spans]))

    def zero_grads(self) -> None:
        """Before a step's backward: every flat unit's gradient buffer cleared and made its
        parameters' `.grad` (backward accumulates into it in place); other units' grads dropped.
        Forgets exchanges a failed step started and never waited for; the overlap's hooks stay
        on the parameters (`executor.grad_overlap`)."""
        self._forget_step()
        for name, unit in self.units.items():
            flat = self._flat(name) if name in self._trains else None
            if flat is not None:
                flat.zero_grads()
            else:
                for p in unit.parameters():
                    p.grad = None

    def abandon_step(self) -> None:
        """A step that raised (a peer lost in the middle of the backward, say), or this exchange
        replaced by a new layout's: remove the hooks an armed backward left on the parameters and
        forget posted exchanges. Left behind, they fire in a later backward that belongs to
        another exchange and count its gradients as second accumulations of this one's."""
        self.launcher.release()
        self._forget_step()

    def _forget_step(self) -> None:
        """Nothing posted, nothing armed: the exchanges a step started and never waited for are
        dropped (an all-gather's receives moved off the parameters, `_release_receiving`)."""
        self.end_step()
        self.launcher.reset()
        if self._gather is not None:
            self._release_receiving(self._gather)
        self._posted, self._gather = {}, None

    def _release_receiving(self, g: _Gather) -> None:
        """An all-gather that did not finish: move every unit that it receives into in place off
        the buffer its receives were posted into (`FlatUnit.relocate`). A peer that had not yet
        seen the failure may still send it its slice of the failed step, after this rank rolled
        the unit back (tests/executor/test_failstop.py, the straggling survivor). The posted works
        are dropped (gloo then cancels their pending receives); the old buffers stay referenced
        here, for a device collective that runs on until its group is aborted."""
        for name in g.in_place:
            self._orphans.append(self.flats[name].relocate())
        g.in_place.clear()
        g.posted.clear()

    def _flat(self, name: str) -> FlatUnit | None:
        """The unit's flat buffers, or None; checked for re-pointed parameters (`FlatUnit.ensure`)
        at its first use after `zero_grads` and after `end_step`, not at every use: a step reads
        a unit five times, and each check walks its module tree. The optimizer ends a "step" for
        this purpose right before its update and right after it, so a parameter re-pointed
        between the backward and the update (a load with `assign=True`, a tie) and anything done
        between steps is noticed as before; the forwards cannot re-point one (the dry run refuses
        a unit whose forward writes a parameter, `executor.dry_run`)."""
        flat = self.flats.get(name)
        if flat is not None and name not in self._ensured:
            flat.ensure()
            self._ensured.add(name)
        return flat

    def end_step(self) -> None:
        """The next use of each flat unit checks it again (`_flat`)."""
        self._ensured.clear()

    def grad_vector(self, name: str) -> torch.Tensor:
        """The unit's flat gradient: the buffer itself for a flat unit, else a concatenated copy."""
        flat = self._flat(name)
        return flat.grads() if flat is not None else flat_grads(self.units[name])

    def param_vector(self, name: str) -> torch.Tensor | None:
        """The unit's flat parameters as a view (a flat unit), else None."""
        flat = self._flat(name)
        return None if flat is None else flat.flat

    def active(self) -> list[str]:
        """Units with a trainable parameter, in stage order: each is in one bucket (a wholly
        frozen unit is in none, module docstring)."""
        return [n for n in self.units if self._numel[n] > 0 and n in self._trains]

    def _mine(self, name: str) -> int:
        lo, hi = self.ownership[name][self.dp_index]
        return hi - lo

    # ---------------------------------------------------------------------------- reduce-scatter
    def overlap_backward(self) -> None:
        """Right before this step's last backward: start each bucket's reduce-scatter as soon as
        autograd has finished its units' gradients (executor.grad_overlap), overlapping the rest
        of the backward. Buckets of flat units only; nothing to overlap in a group of one."""
        if self.dp_size > 1:
            self.launcher.arm(
                {
                    str(i): [p for n in b for p in self.flats[n].params]
                    for i, b in enumerate(self.buckets)
                    if all(n in self.flats for n in b)
                }
            )

    def _launch(self, key: str) -> None:
        """Post the reduce-scatter of one bucket: my DP peers' intervals of its units' gradients
        to them, theirs of mine to me (summed in `reduce_scatter`)."""
        i = int(key)
        bucket = self.buckets[i]
        if self._direct(bucket):
            vec = self.grad_vector(bucket[0])  # the gradient buffer itself, in DP order
            sizes = [hi - lo for lo, hi in self.ownership[bucket[0]]]
        else:
            grads = {n: self.grad_vector(n) for n in bucket}
            per_owner = [
                [t for n in bucket for t in self._on_wire(n, k, grads[n])] for k in range(self.dp_size)
            ]
            sizes = [sum(t.numel() for t in parts) for parts in per_owner]
            vec = torch.cat([t for parts in per_owner for t in parts])
        if self.wire_dtype != torch.float32:  # fewer bytes on the wire; the sum stays fp32
            vec = vec.to(self.wire_dtype)
        mine = sizes[self.dp_index]
        if self.dp_size == 1:
            self._posted[i] = (vec, None)
            return
        recv = torch.empty(mine * self.dp_size, dtype=vec.dtype, device=vec.device)
        self._posted[i] = (recv, self._alltoall(recv, vec, [mine] * self.dp_size, sizes))

    def reduce_scatter(self) -> dict[str, torch.Tensor]:
        """Sum of every DP rank's gradient over my owned slices, added in DP-rank order.

        One personalised exchange per bucket, started along one fixed order on every rank (some
        may have started during the backward: `overlap_backward`), all posted before the first
        is waited for. A flat unit's gradient buffer is the exchange's input as it is (ownership
        cuts every unit into intervals in DP order, `_in_dp_order`): nothing is concatenated."""
        self.launcher.finish()
        posted, self._posted = self._posted, {}
        self.launcher.reset()
        works = [work for _recv, work in posted.values() if work is not None]
        if works:
            self.comm.wait(self.group, WorkSet(works), issued=len(works))  # one guarded op
        reduced = self.reduced_slices()
        for i, bucket in enumerate(self.buckets):
            recv, _work = posted[i]
            mine = [self._wire[n][self.dp_index] for n in bucket]
            per_owner = [piece.split(mine) for piece in recv.split([sum(mine)] * self.dp_size)]
            for j, name in enumerate(bucket):
                partial = name in self.owned_runs
                total = (
                    torch.empty(mine[j], dtype=torch.float32, device=self.device)
                    if partial
                    else reduced[name]
                )
                first, rest = per_owner[0][j], per_owner[1:]
                if rest and first.dtype == total.dtype:  # one pass for the first two: same bits
                    torch.add(first, rest[0][j], out=total)
                    rest = rest[1:]
                else:
                    total.copy_(first)  # fp32 whatever the wire's dtype
                for parts in rest:
                    total += parts[j]
                if partial:  # its trainable runs, into the slice where they lie
                    lo = self.ownership[name][self.dp_index][0]
                    views = self._on_wire(name, self.dp_index, reduced[name], lo)
                    for view, piece in zip(views, self._split(name, total), strict=True):
                        view.copy_(piece)
        return dict(reduced)

    # -------------------------------------------------------------------------------- all-gather
    def begin_gather(self, extra: torch.Tensor | None) -> None:
        """Before the owner's updates: where the step's `extra` rides (the smallest bucket's
        exchange; alone on a stage without parameters), or nowhere when it cannot (not 1-D, or
        not the parameters' dtype: `finish_gather` then returns None and the caller gathers it)."""
        carrier: int | None = None
        if extra is not None and extra.dim() == 1 and self.buckets:
            carrier = min(
                range(len(self.buckets)), key=lambda i: sum(sum(self._wire[n]) for n in self.buckets[i])
            )
            if extra.dtype != next(self.units[self.buckets[carrier][0]].parameters()).dtype:
                extra, carrier = None, None
        elif extra is not None and extra.dim() != 1:
            extra = None
        self._gather = _Gather(carrier, extra)

    def update_groups(self, names: Sequence[str]) -> list[list[str]]:
        """`names` (the owner's units, in update order) grouped as their all-gathers go: a
        bucket's units together, at its first unit's place; a unit in no bucket alone. One
        group's updates run as one batch (`OptimizerConfig.update_slices`), then `updated` posts
        the bucket: the post comes when it came with unit-by-unit updates, after its last."""
        groups: list[list[str]] = []
        at: dict[int, list[str]] = {}
        for name in names:
            i = self._bucket_of.get(name)
            if i is None:
                groups.append([name])
            elif i in at:
                at[i].append(name)
            else:
                at[i] = [name]
                groups.append(at[i])
        return groups

    def updated(self, name: str, mine: torch.Tensor) -> None:
        """The owner updated its slice `mine` of `name`: post its bucket's all-gather once every
        unit of the bucket is updated (it overlaps the next units' updates)."""
        g = self._gather
        assert g is not None, "begin_gather first"
        g.updated[name] = mine
        i = self._bucket_of.get(name)
        if self.dp_size == 1 or i is None or not all(n in g.updated for n in self.buckets[i]):
            return
        bucket = self.buckets[i]
        sizes = [sum(self._wire[n][k] for n in bucket) for k in range(self.dp_size)]
        lo = {n: self.ownership[n][self.dp_index][0] for n in bucket}
        parts = [t for n in bucket for t in self._on_wire(n, self.dp_index, g.updated[n], lo[n])] or [
            mine[:0]
        ]
        out = self.param_vector(bucket[0]) if self._direct(bucket) and i != g.carrier else None
        if i == g.carrier:
            assert g.extra is not None
            parts.append(g.extra.to(parts[0].device))
            sizes = [n + g.extra.numel() for n in sizes]
        sent = parts[0] if len(parts) == 1 else torch.cat(parts)
        recv = out if out is not None else torch.empty(sum(sizes), dtype=sent.dtype, device=sent.device)
        if out is not None:  # before posting: the post can fail after issuing some receives
            g.in_place.append(bucket[0])
        try:
            posted = self._allgather(recv, sent, sizes, i)
        except BaseException:
            self.abandon_step()
            raise
        g.posted.append((i if out is None else -1, recv, posted))

    def _allgather(
        self, recv: torch.Tensor, sent: torch.Tensor, sizes: Sequence[int], bucket: int
    ) -> _Posted:
        """Post bucket `bucket`'s all-gather: `sent` (my part) to every rank of the group, rank
        k's part into its `sizes[k]` elements of `recv`, in DP order (module docstring: point to
        point on the host, one personalised exchange elsewhere). Never blocks."""
        if self.device.type != "cpu":  # an accelerator: one all-to-all of the slice repeated D times
            return _Posted(work=self._alltoall(recv, sent.repeat(self.dp_size), sizes))
        pieces = recv.split(list(sizes))
        mine = pieces[self.dp_index]
        if mine.data_ptr() != sent.data_ptr():  # in place when the owner updated it where it lies
            mine.copy_(sent)
        peers = [(k, w) for k, w in enumerate(self.comm.workers(self.group)) if k != self.dp_index]
        tag = GATHER_TAG + bucket
        return _Posted(
            ops=self.comm.post_exchange(
                [(self.group, sent, w, tag) for _k, w in peers],
                [(self.group, pieces[k], w, tag) for k, w in peers],
            )
        )

    def finish_gather(self) -> list[torch.Tensor] | None:
        """Complete the all-gather (one guarded op to failure detection; on the host its
        point-to-point messages through `comm.complete`): copy what did not land in place into
        the parameters. Returns every rank's carried `extra`, in DP order (None without one)."""
        g, self._gather = self._gather, None
        assert g is not None, "begin_gather first"
        if self.dp_size == 1:
            self.write_back(
                {
                    n: [torch.cat(self._on_wire(n, 0, v, self.ownership[n][0][0]) or [v[:0]])]
                    for n, v in g.updated.items()
                    if self.param_vector(n) is None
                }
            )
            return None if g.extra is None else [g.extra.to(self.device)]
        piggybacked: list[torch.Tensor] | None = None
        if g.extra is not None and g.carrier is None:  # a stage without parameters: the extra alone
            e = g.extra.numel()
            recv = torch.empty(e * self.dp_size, dtype=g.extra.dtype, device=self.device)
            extra = g.extra.to(self.device)
            g.posted.append(
                (-1, recv, _Posted(self._alltoall(recv, extra.repeat(self.dp_size), [e] * self.dp_size)))
            )
            piggybacked = list(recv.chunk(self.dp_size))
        try:
            self._wait_all([p for _i, _r, p in g.posted])
        except BaseException:
            self._release_receiving(g)
            raise
        received: dict[str, list[torch.Tensor]] = {}
        for i, recv, _work in g.posted:
            if i < 0:
                continue
            bucket = self.buckets[i]
            cut = g.extra.numel() if i == g.carrier and g.extra is not None else 0
            sizes = [[self._wire[n][k] for n in bucket] for k in range(self.dp_size)]
            pieces = recv.split([sum(s) + cut for s in sizes])
            if cut:
                piggybacked = [p[p.numel() - cut :] for p in pieces]
            for k, piece in enumerate(pieces):
                for n, part in zip(bucket, piece[: piece.numel() - cut].split(sizes[k]), strict=True):
                    received.setdefault(n, []).append(part)
        self.write_back(received)
        return piggybacked

    def _wait_all(self, posted: Sequence[_Posted]) -> None:
        """Wait for the all-gather: its collectives as one guarded op, its point-to-point
        messages through `comm.complete` (bounded; PeerFailure on a dead peer)."""
        works = [p.work for p in posted if p.work is not None]
        if works:
            self.comm.wait(self.group, WorkSet(works), issued=len(works))
        for p in posted:
            if p.ops is not None:
                self.comm.complete(p.ops)

    def _alltoall(
        self,
        out: torch.Tensor,
        sent: torch.Tensor,
        out_sizes: Sequence[int],
        sent_sizes: Sequence[int] | None = None,
    ) -> Any:
        """Post one personalised exchange on my DP group: `sent_sizes[k]` elements of `sent` (by
        default an equal share) go to rank k, `out_sizes[k]` from rank k land in `out`, in order.
        Returns the work to wait on (through `comm.wait`, which guards it)."""
        sent_sizes = [sent.numel() // self.dp_size] * self.dp_size if sent_sizes is None else sent_sizes
        return self.comm.issue(
            self.group,
            lambda pg: pg.alltoall_base(out, sent, list(out_sizes), list(sent_sizes), AllToAllOptions()),
        )

    def write_back(self, received: Mapping[str, Sequence[torch.Tensor]]) -> None:
        """Owner k's slice `received[unit][k]` (its wire form: the interval, or its trainable
        runs back to back) into the unit's parameters, for the units whose exchange could not
        write in place (owner by owner, as the stage-wide exchange did, which decides a
        parameter shared by two units on the stage)."""
        if not received:
            return
        received = {n: received[n] for n in self.units if n in received}  # stage order
        vecs = {n: self.param_vector(n) for n in received}
        # the parameters one by one only where the unit has no flat buffer to write into
        params = {n: [p.detach() for p in self.units[n].parameters()] for n in received if vecs[n] is None}
        if not all(all(p.is_contiguous() for p in params[n]) for n in params):
            flats = {n: flat_params(self.units[n]) for n in received}
            for name, pieces in received.items():
                for k, piece in enumerate(pieces):
                    for view, part in zip(
                        self._on_wire(name, k, flats[name]), self._split(name, piece, k), strict=True
                    ):
                        view.copy_(part)
                assign_flat(self.units[name], flats[name])
            return
        for k in range(self.dp_size):
            for name, pieces in received.items():
                vec = vecs[name]
                if k == self.dp_index and vec is not None:
                    continue  # my slice of a flat unit: the update wrote it where it lies
                for (lo, hi), part in zip(self._spans(name, k), self._split(name, pieces[k], k), strict=True):
                    pos = 0
                    for view in range_views([vec] if vec is not None else params[name], lo, hi):
                        view.copy_(part[pos : pos + view.numel()])
                        pos += view.numel()


@dataclass(frozen=True)
class _Posted:
    """A bucket's all-gather in flight: a collective issued through `comm.issue` (`work`), or
    point-to-point messages from `comm.post_exchange` (`ops`)."""

    work: Any = None
    ops: Any = None


class _Gather:
    """One step's all-gather in progress: where `extra` rides, the updated slices so far and the
    posted exchanges (bucket index, or -1 when received in place; receiving tensor; what to wait for)."""

    def __init__(self, carrier: int | None, extra: torch.Tensor | None) -> None:
        self.carrier, self.extra = carrier, extra
        self.updated: dict[str, torch.Tensor] = {}
        self.posted: list[tuple[int, torch.Tensor, _Posted]] = []
        self.in_place: list[str] = []  # units whose receives were posted into their parameters
