"""ZeRO-1 sharded AdamW over one stage's DP group (ElasWave §6.3, Fig. 10).

Every rank of a stage holds the full fp32 parameters of the stage's units and computes full
gradients for its own samples; the optimizer state (Adam moments) of each unit is split among
the DP ranks by element intervals. A step is

1. reduce-scatter: one personalised exchange (`all_to_all_v`) sends each owner its slice of every
   unit's gradient; the owner sums the D contributions *in DP-rank order*, so the reduction
   order is fixed by the layout and does not depend on which other units share the stage — a
   pipeline-only change leaves every unit's update bit-identical;
2. the owner applies AdamW to its slices (`adamw_update`, the same function the single-process
   reference uses);
3. all-gather: the updated parameter slices go back to every rank of the stage.

Ownership of the blocks is exactly `planners.zero.stage_ownership` (interleaved: DP rank j owns
shard j of every layer; contiguous: the stage's blocks concatenated and cut into D chunks), so the
planners' transfer plans describe this state. The embedding and head never migrate; they are
split evenly among the stage's ranks under both layouts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from executor.engine_comm import EngineComm, all_to_all_v
from executor.model import EMBED, HEAD, block_name
from planners.layout import Layout, SampleRange, StageLayout, split_evenly
from planners.zero import stage_ownership

Interval = tuple[int, int]
# Called with (step number being applied, {unit: my reduced gradient slice}) before the update:
# how the parameter fabric's ring snapshots see each step's gradient shards (ElasWave §5.1).
GradHook = Callable[[int, dict[str, torch.Tensor]], None]


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        if self.lr <= 0 or not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1) or self.eps <= 0:
            raise ValueError(f"invalid AdamW hyper-parameters: {self}")


def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, step: int, cfg: AdamWConfig) -> None:
    """One decoupled-weight-decay Adam step on 1-D slices, in place (`step` counts from 1)."""
    param.mul_(1.0 - cfg.lr * cfg.weight_decay)
    exp_avg.mul_(cfg.beta1).add_(grad, alpha=1.0 - cfg.beta1)
    exp_avg_sq.mul_(cfg.beta2).addcmul_(grad, grad, value=1.0 - cfg.beta2)
    bias1 = 1.0 - cfg.beta1 ** step
    bias2 = 1.0 - cfg.beta2 ** step
    denom = (exp_avg_sq / bias2).sqrt_().add_(cfg.eps)
    param.addcdiv_(exp_avg, denom, value=-cfg.lr / bias1)


# ---------------------------------------------------------------------------- flat unit views


def flat_params(unit: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in unit.parameters()])


def flat_grads(unit: nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in unit.parameters()])


def assign_flat(unit: nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat vector into the unit's parameters (exact bits)."""
    numel = sum(p.numel() for p in unit.parameters())
    if flat.numel() != numel:
        raise ValueError(f"flat vector has {flat.numel()} elements, unit has {numel}")
    offset = 0
    with torch.no_grad():
        for p in unit.parameters():
            p.copy_(flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()


# ---------------------------------------------------------------------------------- ownership


def unit_ownership(layout: Layout, stage: StageLayout,
                   unit_numel: Mapping[str, int]) -> dict[str, list[Interval]]:
    """unit name -> `[lo, hi)` owned by each DP index of the stage (possibly empty)."""
    d = stage.dp_size
    owned: dict[str, list[Interval]] = {}
    for name in (EMBED, HEAD):
        if name in unit_numel:
            owned[name] = [(r.start, r.stop) for r in split_evenly(SampleRange(0, unit_numel[name]), d)]
    for layer in stage.layers:
        owned[block_name(layer)] = [(0, 0)] * d
    for iv in stage_ownership(layout, stage):
        owned[block_name(iv.layer)][stage.dp_index(iv.rank)] = (iv.start, iv.stop)
    return owned


@dataclass
class ShardState:
    """Adam moments of the owned slice `[lo, hi)` of one unit."""

    lo: int
    hi: int
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class ShardedAdamW:
    """ZeRO-1 AdamW for the units of one stage; see the module docstring."""

    def __init__(self, comm: EngineComm, group: str, units: Mapping[str, nn.Module],
                 ownership: Mapping[str, list[Interval]], dp_index: int, cfg: AdamWConfig,
                 step_count: int = 0, grad_hook: GradHook | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.comm, self.group, self.cfg, self.grad_hook = comm, group, cfg, grad_hook
        self.device = torch.device(device)
        self.units = dict(units)
        self.ownership = {n: list(ownership[n]) for n in self.units}
        self.dp_index, self.dp_size = dp_index, len(next(iter(self.ownership.values())))
        self.step_count = step_count
        self.shards: dict[str, ShardState] = {}
        for name in self.units:
            lo, hi = self.ownership[name][dp_index]
            self.shards[name] = ShardState(lo, hi, torch.zeros(hi - lo, device=self.device),
                                           torch.zeros(hi - lo, device=self.device))

    def _size_owned_by(self, k: int) -> int:
        return sum(iv[k][1] - iv[k][0] for iv in self.ownership.values())

    def reduce_scatter_grads(self) -> dict[str, torch.Tensor]:
        """Sum of every DP rank's gradient over my owned slices, added in DP-rank order."""
        grads = {n: flat_grads(u) for n, u in self.units.items()}
        to_rank = [torch.cat([grads[n][iv[k][0]: iv[k][1]] for n, iv in self.ownership.items()])
                   for k in range(self.dp_size)]
        mine = self._size_owned_by(self.dp_index)
        pieces = all_to_all_v(self.comm, self.group, to_rank, [mine] * self.dp_size)
        total = pieces[0].clone()
        for piece in pieces[1:]:
            total += piece
        out, pos = {}, 0
        for name, sh in self.shards.items():
            out[name] = total[pos: pos + sh.hi - sh.lo]
            pos += sh.hi - sh.lo
        return out

    def step(self) -> None:
        """reduce-scatter -> update my slices -> all-gather the parameters."""
        grads = self.reduce_scatter_grads()
        if self.grad_hook is not None:
            self.grad_hook(self.step_count + 1, grads)
        self.step_count += 1
        updated = []
        for name, sh in self.shards.items():
            param = flat_params(self.units[name])[sh.lo: sh.hi].clone()
            adamw_update(param, grads[name], sh.exp_avg, sh.exp_avg_sq, self.step_count, self.cfg)
            updated.append(param)
        self._all_gather_params(torch.cat(updated) if updated else torch.empty(0, device=self.device))

    def _all_gather_params(self, my_slices: torch.Tensor) -> None:
        sizes = [self._size_owned_by(k) for k in range(self.dp_size)]
        pieces = all_to_all_v(self.comm, self.group, [my_slices] * self.dp_size, sizes)
        flats = {n: flat_params(u) for n, u in self.units.items()}
        for k, piece in enumerate(pieces):
            pos = 0
            for name, iv in self.ownership.items():
                lo, hi = iv[k]
                flats[name][lo:hi] = piece[pos: pos + hi - lo]
                pos += hi - lo
        for name, unit in self.units.items():
            assign_flat(unit, flats[name])

    def gather_moments(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Full (exp_avg, exp_avg_sq) of every unit, assembled on every rank of the stage."""
        mine = torch.cat([torch.cat([sh.exp_avg, sh.exp_avg_sq]) for sh in self.shards.values()]
                         or [torch.empty(0, device=self.device)])
        sizes = [2 * self._size_owned_by(k) for k in range(self.dp_size)]
        pieces = all_to_all_v(self.comm, self.group, [mine] * self.dp_size, sizes)
        numel = {n: sum(p.numel() for p in u.parameters()) for n, u in self.units.items()}
        full = {n: (torch.zeros(k, device=self.device), torch.zeros(k, device=self.device)) for n, k in numel.items()}
        for k, piece in enumerate(pieces):
            pos = 0
            for name, iv in self.ownership.items():
                lo, hi = iv[k]
                full[name][0][lo:hi] = piece[pos: pos + hi - lo]
                full[name][1][lo:hi] = piece[pos + hi - lo: pos + 2 * (hi - lo)]
                pos += 2 * (hi - lo)
        return full

    def state(self) -> dict[str, Any]:
        """Copy of my shards and the step count (for rollback)."""
        return {"step_count": self.step_count,
                "shards": {n: (sh.lo, sh.hi, sh.exp_avg.clone(), sh.exp_avg_sq.clone())
                           for n, sh in self.shards.items()}}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore `state()`; raises ValueError (changing nothing) if it describes other slices."""
        shards = state["shards"]
        if set(shards) != set(self.shards):
            raise ValueError(f"rollback state has units {sorted(shards)}, optimizer has {sorted(self.shards)}")
        for name, (lo, hi, _m, _v) in shards.items():
            sh = self.shards[name]
            if (lo, hi) != (sh.lo, sh.hi):
                raise ValueError(f"rollback state owns [{lo}, {hi}) of {name}, this rank owns [{sh.lo}, {sh.hi})")
        for name, (_lo, _hi, m, v) in shards.items():
            self.shards[name].exp_avg.copy_(m)
            self.shards[name].exp_avg_sq.copy_(v)
        self.step_count = int(state["step_count"])
