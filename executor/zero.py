"""ZeRO-1 sharded optimizer over one stage's DP group (ElasWave §6.3, Fig. 10).

Every rank of a stage holds the full fp32 parameters of the stage's units and computes full
gradients for its own samples; the optimizer state (Adam moments) of each unit is split among
the DP ranks by element intervals. A step is

1. reduce-scatter: one personalised exchange (`alltoall_base`) per unit sends each owner its
   slice of the unit's gradient; the owner sums the D contributions *in DP-rank order*, so the
   reduction order is fixed by the layout and does not depend on which other units share the
   stage — a pipeline-only change leaves every unit's update bit-identical;
2. gradient clipping by the global norm (when configured): every rank's sum of squares of its
   reduced slices is gathered over the job's "world" group and summed in rank order, so every
   rank computes the same norm, exactly the norm of the full gradient up to summation order;
   the slices are scaled before anything else (the snapshots included) sees them;
3. the owner applies the optimizer to its slices (`OptimizerConfig.update_slices`, the same
   function the snapshots replay; the units of one all-gather bucket in one batch);
4. all-gather: the updated parameter slices go back to every rank of the stage.

A unit's parameters and gradients are views of one flat buffer each (`executor.flat_units`), so
steps 1, 3 and 4 address the owners' intervals in place: the exchanges (`executor.zero_exchange`)
send the gradient buffer as it is and receive straight into the parameter buffer, and the owner
updates its slice where it lies (issue 23: no flatten, concatenation or copy-back per step). The
reduce-scatters may start during the backward (`overlap_backward`, executor.grad_overlap) and
each unit's all-gather is posted right after its update; the sums are the same either way.

Ownership of the units is exactly `planners.zero.stage_ownership` (interleaved: DP rank j owns
shard j of every unit; contiguous: the stage's units concatenated and cut into D chunks), so the
planners' transfer plans describe this state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from executor.comm.groups import WORLD_GROUP
from executor.engine_comm import EngineComm, all_to_all_v
from executor.flat_units import FlatUnit, copy_reusing
from executor.flat_units import assign_flat as assign_flat  # re-exported: the flat-vector helpers
from executor.flat_units import flat_grads as flat_grads
from executor.flat_units import flat_params as flat_params
from executor.flat_units import flat_slice as flat_slice
from executor.flat_units import range_views as range_views
from executor.optim import OptimizerConfig, Segments, UnitSlice
from executor.precision import LossScaler, PrecisionConfig, has_overflow, unscale_
from executor.zero_exchange import Interval, UnitExchange
from planners.layout import Layout, StageLayout
from planners.zero import stage_ownership

# Elements per fp64 chunk of `sum_of_squares`: 512 KiB of fp64, which stays in a core's cache
# between the conversion and the dot product. Converted and squared whole, a slice needs two fp64
# temporaries of its size; from 4 M elements (32 MB) glibc maps them afresh on every call: 8 M
# elements took 65 ms whole and 4 ms in pieces on the benchmark host (`bench.clip_norm`,
# docs/benchmarks.md, "Clipping by the global norm").
SQUARES_CHUNK = 1 << 16

# Called with (step number being applied, {unit: my reduced gradient slice}) before the update:
# how the parameter fabric's ring snapshots see each step's gradient shards (ElasWave §5.1).
GradHook = Callable[[int, dict[str, torch.Tensor]], None]


# ---------------------------------------------------------------------------- flat unit views


# ---------------------------------------------------------------------------------- ownership


def unit_ownership(layout: Layout, stage: StageLayout, names: Sequence[str]) -> dict[str, list[Interval]]:
    """unit name -> `[lo, hi)` owned by each DP index of the stage (possibly empty); `names[i]` is
    the name of layer (unit) i of the model."""
    d = stage.dp_size
    owned: dict[str, list[Interval]] = {names[layer]: [(0, 0)] * d for layer in stage.layers}
    for iv in stage_ownership(layout, stage):
        owned[names[iv.layer]][stage.dp_index(iv.rank)] = (iv.start, iv.stop)
    return owned


def gather_world(comm: EngineComm, value: float, device: torch.device | str = "cpu") -> list[float]:
    """Every rank's `value`, in world-group rank order (the same list on every rank). The
    tensors live on `device`: an NCCL/HCCL group only moves device memory."""
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    ranks = comm.workers(WORLD_GROUP)
    parts = [torch.empty(1, dtype=torch.float64, device=device) for _ in ranks]
    if len(ranks) == 1:
        parts[0] = mine
    else:
        comm.all_gather(WORLD_GROUP, parts, mine)
    return [float(p) for p in parts]


def sum_of_squares(t: torch.Tensor) -> float:
    """The sum of `t`'s squared elements, squared and added in fp64 (the square of an fp32 or
    narrower value is exact there): the same to fp64 round-off however the elements are split
    among ranks, so the clipping coefficient does not depend on the layout. On the host it runs
    in `SQUARES_CHUNK` pieces. On an accelerator it is still one pass over two fp64 temporaries
    of the whole slice, as before: device memory is fast there and the path is unmeasured (no
    device in CI); `reshape` copies a non-contiguous `t` once (the reduced slices never are)."""
    if t.device.type != "cpu":
        return float(t.double().pow(2).sum())
    total = torch.zeros((), dtype=torch.float64)
    for piece in t.reshape(-1).split(SQUARES_CHUNK):
        wide = piece.double()
        total += torch.dot(wide, wide)
    return float(total)


def global_grad_norm(comm: EngineComm, sum_sq: float, device: torch.device | str = "cpu") -> float:
    """The norm of the whole model's gradient from every rank's sum of squares over the slices it
    owns: gathered over the world group and added in rank order (the same bits on every rank)."""
    return math.sqrt(math.fsum(gather_world(comm, sum_sq, device)))


def agree_overflow(comm: EngineComm, mine: bool, device: torch.device | str = "cpu") -> bool:
    """Whether any rank found inf/NaN in its reduced gradient slices: one verdict, every rank."""
    return any(flag != 0.0 for flag in gather_world(comm, 1.0 if mine else 0.0, device))


@dataclass
class ShardState:
    """Adam moments of the owned slice `[lo, hi)` of one unit."""

    lo: int
    hi: int
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class ShardedOptimizer:
    """ZeRO-1 optimizer for the units of one stage; see the module docstring."""

    def __init__(
        self,
        comm: EngineComm,
        group: str,
        units: Mapping[str, nn.Module],
        ownership: Mapping[str, list[Interval]],
        dp_index: int,
        cfg: OptimizerConfig,
        step_count: int = 0,
        grad_hook: GradHook | None = None,
        device: torch.device | str = "cpu",
        segments: Mapping[str, Segments] | None = None,
        precision: PrecisionConfig | None = None,
        scaler: LossScaler | None = None,
        flat: bool = True,
        bucket_min: int | None = None,
    ) -> None:
        """`precision` sets the gradients' wire dtype; `scaler` (fp16) turns on the overflow
        check and the unscaling of the reduced slices (executor.precision). `flat=False` keeps
        every unit on the copying path and `bucket_min` sets the size below which units share an
        exchange (executor.zero_exchange; the same results either way)."""
        self.comm, self.group, self.cfg, self.grad_hook = comm, group, cfg, grad_hook
        self.precision = precision or PrecisionConfig()
        self.scaler = scaler
        self.last_overflow = False  # the last step's agreed verdict (fp16): its update was skipped
        self.device = torch.device(device)
        self.units = dict(units)
        segments = segments or {}
        self.segments = {
            n: segments[n] if n in segments else cfg.decay_segments(u.named_parameters())
            for n, u in self.units.items()
        }
        self.last_grad_norm: float | None = None
        self.piggybacked: list[torch.Tensor] | None = None  # see step()
        # unit -> flat [lo, hi) left out of the global norm (a tied weight's second copy, executor.tied)
        self.norm_skip: dict[str, tuple[int, int]] = {}
        self.ownership = {n: list(ownership[n]) for n in self.units}
        self.dp_index, self.dp_size = dp_index, len(next(iter(self.ownership.values())))
        # The per-unit exchanges over the DP group, on flat per-unit buffers (executor.zero_exchange)
        self.exchange = UnitExchange(
            comm,
            group,
            self.units,
            self.ownership,
            dp_index,
            self.segments,
            self.precision.wire_dtype,
            self.device,
            flat,
            bucket_min,
        )
        self.step_count = step_count
        self.shards: dict[str, ShardState] = {}
        for name in self.units:
            lo, hi = self.ownership[name][dp_index]
            self.shards[name] = ShardState(
                lo, hi, torch.zeros(hi - lo, device=self.device), torch.zeros(hi - lo, device=self.device)
            )

    def _size_owned_by(self, k: int) -> int:
        return sum(iv[k][1] - iv[k][0] for iv in self.ownership.values())

    # ------------------------------------------------------------------ per-unit flat vectors
    def zero_grads(self) -> None:
        """Before a step's backward: clear the gradients (flat units: their buffers, which
        backward then accumulates into; executor.zero_exchange)."""
        self.exchange.zero_grads()

    def abandon_step(self) -> None:
        """The step raised, or a new layout replaces this optimizer: drop what the step armed
        and posted (executor.zero_exchange.UnitExchange.abandon_step)."""
        self.exchange.abandon_step()

    def overlap_backward(self) -> None:
        """Right before this step's last backward: start each unit's reduce-scatter as autograd
        finishes its gradients (executor.grad_overlap)."""
        self.exchange.overlap_backward()

    @property
    def flats(self) -> dict[str, FlatUnit]:
        return self.exchange.flats

    def reduce_scatter_grads(self) -> dict[str, torch.Tensor]:
        """Sum of every DP rank's gradient over my owned slices, added in DP-rank order."""
        return self.exchange.reduce_scatter()

    def step(self, piggyback: torch.Tensor | None = None) -> bool:
        """reduce-scatter -> update my slices -> all-gather the parameters. Returns False when
        fp16's agreed overflow check skipped the update (every rank returns the same).

        `piggyback` (every rank of the group passes one of the same size and dtype, or none
        does): a small 1-D tensor that travels with the parameter all-gather, so a per-step
        all-gather of its own (the step's per-sample losses) costs no extra round. Every rank's,
        in DP order, is in `piggybacked` afterwards (None when the update was skipped)."""
        self.piggybacked = None
        # The flat units are checked for re-pointed parameters again now, after the backward
        # (once, not at each read: UnitExchange._flat), and again by every use after the step.
        self.exchange.end_step()
        try:
            return self._step(piggyback)
        finally:
            self.exchange.end_step()

    def _step(self, piggyback: torch.Tensor | None) -> bool:
        grads = self.reduce_scatter_grads()
        if self.scaler is not None and not self._unscale(grads):
            return False
        if self.cfg.max_grad_norm is not None:
            self._clip(grads, self.cfg.max_grad_norm)
        if self.grad_hook is not None:
            self.grad_hook(self.step_count + 1, grads)
        self.step_count += 1
        self.exchange.begin_gather(piggyback)
        for names in self.exchange.update_groups(list(self.shards)):
            slices = [self._owned_slice(name, grads[name]) for name in names]
            self.cfg.update_slices(slices, self.segments, self.step_count)
            for s in slices:
                self.exchange.updated(s.unit, s.param)  # posts a bucket's all-gather once it is whole
        self.piggybacked = self.exchange.finish_gather()
        return True

    def _owned_slice(self, name: str, grad: torch.Tensor) -> UnitSlice:
        """My slice of `name` to update: where it lies in a flat unit (a view), else a copy."""
        sh = self.shards[name]
        vec = self.exchange.param_vector(name)
        param = vec[sh.lo : sh.hi] if vec is not None else flat_slice(self.units[name], sh.lo, sh.hi)
        return UnitSlice(name, sh.lo, param, grad, sh.exp_avg, sh.exp_avg_sq)

    def _unscale(self, grads: dict[str, torch.Tensor]) -> bool:
        """fp16: agree on overflow over the world group, update the scale; on a finite step
        unscale my slices (before clipping, hooks and snapshots see them) and return True."""
        assert self.scaler is not None
        self.last_overflow = agree_overflow(self.comm, has_overflow(grads.values()), self.device)
        scale = self.scaler.scale
        self.scaler.update(self.last_overflow, self.precision)
        if self.last_overflow:
            return False
        unscale_(grads.values(), scale)
        return True

    def _clip(self, grads: dict[str, torch.Tensor], max_norm: float) -> None:
        """Scale the reduced slices by torch's `clip_grad_norm_` coefficient of the global norm."""
        sum_sq = math.fsum(sum_of_squares(part) for n, g in grads.items() for part in self._counted(n, g))
        norm = global_grad_norm(self.comm, sum_sq, self.device)
        self.last_grad_norm = norm
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads.values():
                g.mul_(coef)

    def _counted(self, name: str, grad: torch.Tensor) -> list[torch.Tensor]:
        """My reduced slice of `name` without the elements `norm_skip` leaves out, as views (a
        tied weight's follower copy can be most of a large slice: it is not copied out)."""
        lo, hi = self.norm_skip.get(name, (0, 0))
        sh = self.shards[name]
        a, b = max(lo, sh.lo) - sh.lo, min(hi, sh.hi) - sh.lo
        return [grad[:a], grad[b:]] if a < b else [grad]

    def gather_moments(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Full (exp_avg, exp_avg_sq) of every unit, assembled on every rank of the stage."""
        mine = torch.cat(
            [torch.cat([sh.exp_avg, sh.exp_avg_sq]) for sh in self.shards.values()]
            or [torch.empty(0, device=self.device)]
        )
        sizes = [2 * self._size_owned_by(k) for k in range(self.dp_size)]
        pieces = all_to_all_v(self.comm, self.group, [mine] * self.dp_size, sizes)
        numel = {n: sum(p.numel() for p in u.parameters()) for n, u in self.units.items()}
        full = {
            n: (torch.zeros(k, device=self.device), torch.zeros(k, device=self.device))
            for n, k in numel.items()
        }
        for k, piece in enumerate(pieces):
            pos = 0
            for name, iv in self.ownership.items():
                lo, hi = iv[k]
                full[name][0][lo:hi] = piece[pos : pos + hi - lo]
                full[name][1][lo:hi] = piece[pos + hi - lo : pos + 2 * (hi - lo)]
                pos += 2 * (hi - lo)
        return full

    def state(self) -> dict[str, Any]:
        """Copy of my shards and the step count (for rollback)."""
        return self.state_copier()()

    def state_copier(self, reuse: Mapping[str, Any] | None = None) -> Callable[[], dict[str, Any]]:
        """`state()` with the step count read now and the moments copied when the returned
        function runs (before the next update writes them; see Trainer.rollback_state_copier),
        into the tensors of `reuse` (an earlier `state()` nothing reads any more) where they fit."""
        step_count, shards, frozen = self.step_count, dict(self.shards), self.exchange.frozen
        old = {} if reuse is None else reuse["shards"]
        # A unit that trains in part: only its trainable runs' moments change (the rest stay zero)
        runs = {n: r[self.dp_index] for n, r in self.exchange.owned_runs.items()}

        def copy_moments() -> dict[str, Any]:
            out = {}
            for n, sh in shards.items():
                lo, hi, m, v = old.get(n, (0, 0, None, None))
                if (lo, hi) != (sh.lo, sh.hi) or m is None or v is None or n not in frozen | set(runs):
                    out[n] = (sh.lo, sh.hi, copy_reusing(sh.exp_avg, m), copy_reusing(sh.exp_avg_sq, v))
                    continue
                for a, b in runs.get(n, ()):  # a frozen unit's moments stay zero: the copy holds them
                    m[a - lo : b - lo].copy_(sh.exp_avg[a - lo : b - lo])
                    v[a - lo : b - lo].copy_(sh.exp_avg_sq[a - lo : b - lo])
                out[n] = (lo, hi, m, v)
            return {"step_count": step_count, "shards": out}

        return copy_moments

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore `state()`; raises ValueError (changing nothing) if it describes other slices."""
        shards = state["shards"]
        if set(shards) != set(self.shards):
            raise ValueError(
                f"rollback state has units {sorted(shards)}, optimizer has {sorted(self.shards)}"
            )
        for name, (lo, hi, _m, _v) in shards.items():
            sh = self.shards[name]
            if (lo, hi) != (sh.lo, sh.hi):
                raise ValueError(
                    f"rollback state owns [{lo}, {hi}) of {name}, this rank owns [{sh.lo}, {sh.hi})"
                )
        for name, (_lo, _hi, m, v) in shards.items():
            self.shards[name].exp_avg.copy_(m)
            self.shards[name].exp_avg_sq.copy_(v)
        self.step_count = int(state["step_count"])
