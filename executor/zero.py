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
3. the owner applies the optimizer to its slices (`OptimizerConfig.update_slice`, the same
   function the snapshots replay);
4. all-gather: the updated parameter slices go back to every rank of the stage.

A unit's parameters and gradients are views of one flat buffer each (`executor.flat_units`), so
steps 1, 3 and 4 address the owners' intervals in place: the exchanges send the gradient buffer
as it is and receive straight into the parameter buffer, and the owner updates its slice where
it lies (issue 23: no flatten, concatenation or copy-back per step).

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
from torch.distributed import AllToAllOptions

from executor.comm.groups import WORLD_GROUP
from executor.engine_comm import EngineComm, WorkSet, all_to_all_v
from executor.flat_units import FlatUnit, as_flat_view, flat_units
from executor.grad_overlap import OverlapLauncher
from executor.optim import OptimizerConfig, Segments
from executor.precision import LossScaler, PrecisionConfig, has_overflow, unscale_
from planners.layout import Layout, StageLayout
from planners.zero import stage_ownership

Interval = tuple[int, int]
# Called with (step number being applied, {unit: my reduced gradient slice}) before the update:
# how the parameter fabric's ring snapshots see each step's gradient shards (ElasWave §5.1).
GradHook = Callable[[int, dict[str, torch.Tensor]], None]


# ---------------------------------------------------------------------------- flat unit views


def flat_params(unit: nn.Module) -> torch.Tensor:
    """A copy of the unit's parameters concatenated in `parameters()` order (empty for a unit
    without any): one clone of its flat buffer where it has one (executor.flat_units)."""
    params = [p.detach() for p in unit.parameters()]
    view = as_flat_view(params)
    if view is not None:
        return view.clone()
    return torch.cat([p.reshape(-1) for p in params]) if params else torch.empty(0)


def range_views(tensors: Sequence[torch.Tensor], lo: int, hi: int) -> list[torch.Tensor]:
    """Elements `[lo, hi)` of the tensors' flat concatenation, as pieces of the tensors
    themselves (views where a tensor is contiguous), in order: what the ZeRO glue reads and
    writes instead of flattening a whole unit first."""
    pieces, pos = [], 0
    for t in tensors:
        n = t.numel()
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            pieces.append(t.reshape(-1)[a - pos : b - pos])
        pos += n
        if pos >= hi:
            break
    return pieces


def flat_slice(unit: nn.Module, lo: int, hi: int) -> torch.Tensor:
    """A copy of elements `[lo, hi)` of the unit's flat parameters, without flattening the rest."""
    params = [p.detach() for p in unit.parameters()]
    view = as_flat_view(params)
    if view is not None:
        return view[lo:hi].clone()
    pieces = range_views(params, lo, hi)
    return torch.cat(pieces) if pieces else torch.empty(0)


def flat_grads(unit: nn.Module) -> torch.Tensor:
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in unit.parameters()]
    return torch.cat(grads) if grads else torch.empty(0)


def assign_flat(unit: nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat vector into the unit's parameters (exact bits)."""
    numel = sum(p.numel() for p in unit.parameters())
    if flat.numel() != numel:
        raise ValueError(f"flat vector has {flat.numel()} elements, unit has {numel}")
    offset = 0
    with torch.no_grad():
        for p in unit.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


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


def global_grad_norm(comm: EngineComm, sum_sq: float, device: torch.device | str = "cpu") -> float:
    """The norm of the whole model's gradient from every rank's sum of squares over the slices it
    owns: gathered over the world group and added in rank order (the same bits on every rank)."""
    return math.sqrt(math.fsum(gather_world(comm, sum_sq, device)))


def agree_overflow(comm: EngineComm, mine: bool, device: torch.device | str = "cpu") -> bool:
    """Whether any rank found inf/NaN in its reduced gradient slices: one verdict, every rank."""
    return any(flag != 0.0 for flag in gather_world(comm, 1.0 if mine else 0.0, device))


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
    ) -> None:
        """`precision` sets the gradients' wire dtype; `scaler` (fp16) turns on the overflow
        check and the unscaling of the reduced slices (executor.precision). `flat=False` keeps
        every unit on the copying path (the same results; for comparisons)."""
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
        self._numel = {n: sum(p.numel() for p in u.parameters()) for n, u in self.units.items()}
        # Parameters and gradients as views of one flat buffer per unit (executor.flat_units):
        # the reduce-scatter sends the gradient buffer as it is and the all-gather writes into
        # the parameter buffer, for every unit whose owners' intervals follow DP order.
        self.flats: dict[str, FlatUnit] = flat_units(self.units) if flat else {}
        self.last_grad_norm: float | None = None
        self.piggybacked: list[torch.Tensor] | None = None  # see step()
        # unit -> flat [lo, hi) left out of the global norm (a tied weight's second copy, executor.tied)
        self.norm_skip: dict[str, tuple[int, int]] = {}
        self.ownership = {n: list(ownership[n]) for n in self.units}
        self.dp_index, self.dp_size = dp_index, len(next(iter(self.ownership.values())))
        self._ordered = {n: _in_dp_order(self.ownership[n], self._numel[n]) for n in self.units}
        # The reduce-scatters start in reverse stage order (the order a backward finishes the
        # units), during the backward where `overlap_backward` armed them (executor.grad_overlap).
        self._posted: dict[str, tuple[torch.Tensor, Any]] = {}
        self.launcher = OverlapLauncher(list(reversed(self._active())), self._launch)
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
        """Before a step's backward: every flat unit's gradient buffer cleared and made its
        parameters' `.grad` (backward accumulates into it in place); other units' grads dropped.
        Forgets exchanges a failed step started and never waited for."""
        self.launcher.reset()
        self._posted = {}
        for name, unit in self.units.items():
            flat = self.flats.get(name)
            if flat is not None:
                flat.zero_grads()
            else:
                for p in unit.parameters():
                    p.grad = None

    def _grad_vector(self, name: str) -> torch.Tensor:
        """The unit's flat gradient: the buffer itself for a flat unit, else a concatenated copy."""
        flat = self.flats.get(name)
        return flat.grads() if flat is not None else flat_grads(self.units[name])

    def _param_vector(self, name: str) -> torch.Tensor | None:
        """The unit's flat parameters as a view (a flat unit), else None."""
        flat = self.flats.get(name)
        if flat is None:
            return None
        flat.ensure()
        return flat.flat

    def _active(self) -> list[str]:
        """Units with parameters, in stage order: each has one exchange per direction."""
        return [n for n in self.units if self._numel[n] > 0]

    def overlap_backward(self) -> None:
        """Right before this step's last backward: start each flat unit's reduce-scatter as soon
        as autograd has finished its gradients (executor.grad_overlap), overlapping the rest of
        the backward. Nothing to overlap in a group of one."""
        if self.dp_size > 1:
            self.launcher.arm({n: f.params for n, f in self.flats.items() if self._ordered[n]})

    def _launch(self, name: str) -> None:
        """Post the reduce-scatter of one unit: my DP peers' intervals of its flat gradient to
        them, theirs of mine to me (summed in `reduce_scatter_grads`)."""
        ivs, wire = self.ownership[name], self.precision.wire_dtype
        vec = self._grad_vector(name)
        if not self._ordered[name]:
            vec = torch.cat([vec[lo:hi] for lo, hi in ivs])
        if wire != torch.float32:  # fewer bytes on the wire; the sum below stays fp32
            vec = vec.to(wire)
        mine = ivs[self.dp_index][1] - ivs[self.dp_index][0]
        if self.dp_size == 1:
            self._posted[name] = (vec[ivs[self.dp_index][0] : ivs[self.dp_index][1]], None)
            return
        recv = torch.empty(mine * self.dp_size, dtype=vec.dtype, device=vec.device)
        self._posted[name] = (
            recv,
            self._alltoall(recv, vec, [mine] * self.dp_size, [hi - lo for lo, hi in ivs]),
        )

    def reduce_scatter_grads(self) -> dict[str, torch.Tensor]:
        """Sum of every DP rank's gradient over my owned slices, added in DP-rank order.

        One personalised exchange per unit, started along one fixed order on every rank (some
        may have started during the backward: `overlap_backward`), all posted before the first
        is waited for. A flat unit's gradient buffer is the exchange's input as it is (ownership
        cuts every unit into intervals in DP order, `_in_dp_order`): nothing is concatenated."""
        self.launcher.finish()
        posted, self._posted = self._posted, {}
        self.launcher.reset()
        works = [work for _recv, work in posted.values() if work is not None]
        if works:
            self.comm.wait(self.group, WorkSet(works))  # one guarded op, as one exchange was
        out: dict[str, torch.Tensor] = {}
        for name, sh in self.shards.items():
            if name not in posted:
                out[name] = torch.zeros(sh.hi - sh.lo, device=self.device)
                continue
            recv, _work = posted[name]
            pieces = recv.split([sh.hi - sh.lo] * self.dp_size)
            total = pieces[0].clone() if pieces[0].dtype == torch.float32 else pieces[0].float()
            for piece in pieces[1:]:
                total += piece
            out[name] = total
        return out

    def step(self, piggyback: torch.Tensor | None = None) -> bool:
        """reduce-scatter -> update my slices -> all-gather the parameters. Returns False when
        fp16's agreed overflow check skipped the update (every rank returns the same).

        `piggyback` (every rank of the group passes one of the same size and dtype, or none
        does): a small 1-D tensor that travels with the parameter all-gather, so a per-step
        all-gather of its own (the step's per-sample losses) costs no extra round. Every rank's,
        in DP order, is in `piggybacked` afterwards (None when the update was skipped)."""
        self.piggybacked = None
        grads = self.reduce_scatter_grads()
        if self.scaler is not None and not self._unscale(grads):
            return False
        if self.cfg.max_grad_norm is not None:
            self._clip(grads, self.cfg.max_grad_norm)
        if self.grad_hook is not None:
            self.grad_hook(self.step_count + 1, grads)
        self.step_count += 1
        carrier, extra = self._carrier(piggyback)
        updated: dict[str, torch.Tensor] = {}
        posted: list[tuple[str, torch.Tensor, Any]] = []
        for name, sh in self.shards.items():
            vec = self._param_vector(name)
            # A flat unit's owned slice is updated where it lies (a view); others on a copy.
            param = vec[sh.lo : sh.hi] if vec is not None else flat_slice(self.units[name], sh.lo, sh.hi)
            self.cfg.update_slice(
                param, grads[name], sh.exp_avg, sh.exp_avg_sq, self.step_count, self.segments[name], sh.lo
            )
            updated[name] = param
            if self.dp_size > 1 and self._numel[name] > 0:  # its all-gather overlaps the next update
                posted.append(self._post_gather(name, param, carrier, extra))
        self._all_gather_params(updated, posted, carrier, extra)
        return True

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
        sum_sq = math.fsum(float(self._counted(n, g).double().pow(2).sum()) for n, g in grads.items())
        norm = global_grad_norm(self.comm, sum_sq, self.device)
        self.last_grad_norm = norm
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads.values():
                g.mul_(coef)

    def _counted(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """My reduced slice of `name` without the elements `norm_skip` leaves out."""
        lo, hi = self.norm_skip.get(name, (0, 0))
        sh = self.shards[name]
        a, b = max(lo, sh.lo) - sh.lo, min(hi, sh.hi) - sh.lo
        return torch.cat([grad[:a], grad[b:]]) if a < b else grad

    def _carrier(self, extra: torch.Tensor | None) -> tuple[str | None, torch.Tensor | None]:
        """Which unit's all-gather carries `extra` (the smallest; None: a stage without
        parameters sends it alone), and `extra` itself, or (None, None) when it cannot ride
        (not 1-D, or not the parameters' dtype: the caller then gathers it itself)."""
        active = self._active()
        if extra is None or extra.dim() != 1:
            return None, None
        if not active:
            return None, extra
        carrier = min(active, key=lambda n: self._numel[n])
        dtype = next(self.units[carrier].parameters()).dtype
        return (carrier, extra) if extra.dtype == dtype else (None, None)

    def _post_gather(
        self, name: str, mine: torch.Tensor, carrier: str | None, extra: torch.Tensor | None
    ) -> tuple[str, torch.Tensor, Any]:
        """Post the all-gather of one unit: my updated slice to every rank, every owner's into
        the unit's parameter buffer (a flat unit in DP order) or a scratch buffer. Returns (unit,
        or "" when written in place; the receiving tensor; the work)."""
        sizes = [hi - lo for lo, hi in self.ownership[name]]
        out = self._param_vector(name) if self._ordered[name] and name != carrier else None
        if name == carrier:
            assert extra is not None
            mine = torch.cat([mine, extra.to(mine.device)])
            sizes = [n + extra.numel() for n in sizes]
        recv = out if out is not None else torch.empty(sum(sizes), dtype=mine.dtype, device=mine.device)
        work = self._alltoall(recv, mine.repeat(self.dp_size), sizes)
        return ("" if out is not None else name), recv, work

    def _all_gather_params(
        self,
        updated: Mapping[str, torch.Tensor],
        posted: list[tuple[str, torch.Tensor, Any]],
        carrier: str | None,
        extra: torch.Tensor | None,
    ) -> None:
        """Complete the all-gather `step` posted unit by unit (waited for as one op): copy what
        did not land in place into the parameters and keep the carried `extra` (`piggybacked`)."""
        if self.dp_size == 1:
            self._write_back({n: [v] for n, v in updated.items() if self._param_vector(n) is None})
            self.piggybacked = None if extra is None else [extra.to(self.device)]
            return
        if extra is not None and carrier is None:  # a stage without parameters: the extra alone
            recv = torch.empty(extra.numel() * self.dp_size, dtype=extra.dtype, device=self.device)
            sent = extra.to(self.device).repeat(self.dp_size)
            posted.append(("", recv, self._alltoall(recv, sent, [extra.numel()] * self.dp_size)))
            self.piggybacked = list(recv.chunk(self.dp_size))
        if posted:
            self.comm.wait(self.group, WorkSet([work for _n, _r, work in posted]))
        received: dict[str, list[torch.Tensor]] = {}
        for name, recv, _work in posted:
            if not name:
                continue
            cut = 0 if name != carrier or extra is None else extra.numel()
            pieces = list(recv.split([hi - lo + cut for lo, hi in self.ownership[name]]))
            if cut:
                self.piggybacked = [p[p.numel() - cut :] for p in pieces]
                pieces = [p[: p.numel() - cut] for p in pieces]
            received[name] = pieces
        self._write_back(received)

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
        return self.comm.group(self.group).alltoall_base(
            out, sent, list(out_sizes), list(sent_sizes), AllToAllOptions()
        )

    def _write_back(self, received: Mapping[str, Sequence[torch.Tensor]]) -> None:
        """Owner k's slice `received[unit][k]` into its interval of the unit's parameters, for the
        units whose exchange could not write in place (owner by owner, as the stage-wide
        exchange did, which decides a parameter shared by two units on the stage)."""
        if not received:
            return
        params = {n: [p.detach() for p in self.units[n].parameters()] for n in received}
        vecs = {n: self._param_vector(n) for n in received}
        if not all(vecs[n] is not None or all(p.is_contiguous() for p in params[n]) for n in received):
            flats = {n: flat_params(self.units[n]) for n in received}
            for name, pieces in received.items():
                for (lo, hi), piece in zip(self.ownership[name], pieces, strict=True):
                    flats[name][lo:hi] = piece
                assign_flat(self.units[name], flats[name])
            return
        for k in range(self.dp_size):
            for name, pieces in received.items():
                lo, hi = self.ownership[name][k]
                vec = vecs[name]
                pos = 0
                for view in range_views([vec] if vec is not None else params[name], lo, hi):
                    view.copy_(pieces[k][pos : pos + view.numel()])
                    pos += view.numel()

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

    def state_copier(self) -> Callable[[], dict[str, Any]]:
        """`state()` with the step count read now and the moments copied when the returned
        function runs (before the next update writes them; see Trainer.rollback_state_copier)."""
        step_count, shards = self.step_count, dict(self.shards)

        def copy_moments() -> dict[str, Any]:
            return {
                "step_count": step_count,
                "shards": {
                    n: (sh.lo, sh.hi, sh.exp_avg.clone(), sh.exp_avg_sq.clone()) for n, sh in shards.items()
                },
            }

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
