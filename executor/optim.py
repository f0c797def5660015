"""Elementwise optimizers over ZeRO-1 slices: AdamW, Adam and SGD with momentum (docs/api.md).

Every update here is elementwise, so applying it to a slice `[lo, hi)` of a unit's flat
parameter vector is the same arithmetic as applying it to the whole vector: that is what lets
the optimizer state stay sharded (ZeRO-1, ElasWave §6.3), be snapshotted on a ring neighbour and
replayed there (§5.1), and be remapped onto any layout (§5.2). The live shard and its snapshot
call the very same `OptimizerConfig.update_slice`.

Adam and AdamW run torch's fused CPU/CUDA kernel (`torch._fused_adamw_`, 2-3x faster on a host
core than the single-tensor arithmetic past ~50 k elements; a snapshot holder replays it every
step). Its CPU kernel computes a vector loop and a scalar tail that round the last bit
differently, and which elements fall in the tail depends on where a slice ends. So every call
here hands the kernel lengths that are multiples of `FUSED_PAD` (a multiple of every CPU vector
width torch dispatches to): the rest of a run goes through a slot of that length in a
zero-padded scratch block. Every element then takes the vector loop, and its bits depend only on
its own values and the step, never on the layout that cut the slice
(`tests/executor/test_optim_update.py`). SGD keeps torch.optim's single-tensor arithmetic.
Devices other than the CPU and CUDA keep that arithmetic for Adam too.

Two state vectors per element are kept for every optimizer (`exp_avg`, `exp_avg_sq`): Adam's
two moments; for SGD the first holds the momentum buffer and the second stays zero (one unused
fp32 vector per element: the price of one state format for the fabric).

Per-parameter-group weight decay is a per-element property: `decay_segments` cuts a unit's flat
vector into runs of parameters with and without decay (`no_decay(name, param)`, the usual "no
decay on norms and biases" is `no_decay_norms_and_biases`). The learning rate of update `t`
(1-based) is `lr * schedule(t - 1)`. Gradient clipping by the global norm is computed exactly
across stages and shards by the engine (`executor.zero`), which scales the reduced gradient slices
before they reach this module or the snapshots.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from executor.fused_update import FUSED_PAD as FUSED_PAD  # re-exported: the update's length quantum
from executor.fused_update import Piece, SlicePlan, plan_slice

OptimizerKind = Literal["adamw", "adam", "sgd"]
Schedule = Callable[[int], float]
NoDecay = Callable[[str, nn.Parameter], bool]
# (start, stop, weight decay) runs of a unit's flat parameter vector; FROZEN marks parameters
# that do not require grad, which no update touches (torch.optim's optimizers are never given them)
Segments = tuple[tuple[int, int, float], ...]
FROZEN = -1.0


@dataclass(frozen=True)
class UnitSlice:
    """Elements `[lo, lo + len(param))` of unit `unit` and their gradient and moments, 1-D: the
    operands of one slice's update (`OptimizerConfig.update_slices`; a snapshot holder replays
    a list of them, `Trainer.update_slices`). `carried`: see `OptimizerConfig.update_slice`."""

    unit: str
    lo: int
    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    carried: Sequence[tuple[int, int]] | None = None


def trainable_runs(segments: Segments, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
    """The runs of elements `[lo, hi)` of a unit with `segments` that train (not FROZEN),
    merged where adjacent: what a gradient exchange of a unit that trains in part carries."""
    runs: list[tuple[int, int]] = []
    for start, stop, wd in segments:
        a, b = max(lo, start), min(hi, stop)
        if a < b and wd != FROZEN:
            if runs and runs[-1][1] == a:
                runs[-1] = (runs[-1][0], b)
            else:
                runs.append((a, b))
    return tuple(runs)


def _update_pieces(
    segments: Segments, lo: int, hi: int, carried: Sequence[tuple[int, int]] | None, grad_numel: int
) -> list[tuple[int, int, float, int]]:
    """(start, stop, weight decay, offset in the gradient) of every trainable piece of `[lo, hi)`:
    each segment's part, cut by the `carried` runs where the gradient holds those only."""
    # (start, stop, offset in the gradient of start) of what the gradient holds
    spans = [(lo, hi, 0)]
    if carried is not None:
        spans, at = [], 0
        for a, b in carried:
            spans.append((a, b, at))
            at += b - a
        if at != grad_numel:
            raise ValueError(f"a gradient of {grad_numel} elements does not hold the runs {tuple(carried)}")
    pieces = []
    for start, stop, wd in segments:
        if wd == FROZEN:
            continue
        for a0, b0, at in spans:
            a, b = max(a0, start), min(b0, stop)
            if a < b:
                pieces.append((a, b, wd, at + a - a0))
    return pieces


@functools.lru_cache(maxsize=1024)
def _slice_layout(
    segments: Segments, lo: int, numel: int, carried: tuple[tuple[int, int], ...] | None, grad_numel: int
) -> tuple[tuple[Piece, ...], SlicePlan]:
    """`_update_pieces` of a slice, relative to its first element, and its fused plan: a rank
    updates the same slices every step, so both are worked out once per shape (cached)."""
    pieces = tuple(
        (a - lo, b - lo, wd, at)
        for a, b, wd, at in _update_pieces(segments, lo, lo + numel, carried, grad_numel)
    )
    return pieces, plan_slice(pieces, numel)


_FUSED_DEVICES = frozenset({"cpu", "cuda"})


def no_decay_norms_and_biases(name: str, param: nn.Parameter) -> bool:
    """The usual rule: no weight decay on biases and normalisation weights (every tensor of
    fewer than two dimensions)."""
    return param.dim() < 2


def warmup_cosine(warmup_steps: int, total_steps: int, min_factor: float = 0.0) -> Schedule:
    """Linear warm-up from 1/warmup to 1 over `warmup_steps`, then cosine decay to `min_factor`
    at `total_steps` (held there after). Returns the factor of update `t` (0-based)."""
    if warmup_steps < 0 or total_steps < 1 or warmup_steps > total_steps or not 0.0 <= min_factor <= 1.0:
        raise ValueError(
            f"warmup_cosine needs 0 <= warmup <= total, total >= 1 and 0 <= min_factor <= 1; got "
            f"warmup={warmup_steps}, total={total_steps}, min_factor={min_factor}"
        )

    def factor(t: int) -> float:
        if t < warmup_steps:
            return (t + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (t - warmup_steps) / span)
        return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


@dataclass(frozen=True)
class OptimizerConfig:
    """One optimizer and its hyper-parameters; `kind` picks the update rule."""

    kind: OptimizerKind = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    schedule: Schedule | None = None
    no_decay: NoDecay | None = None
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.kind not in ("adamw", "adam", "sgd"):
            problems.append(f"kind must be adamw, adam or sgd, got {self.kind!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            problems.append(f"lr must be a positive number, got {self.lr}")
        if not all(0.0 <= b < 1.0 for b in self.betas) or len(self.betas) != 2:
            problems.append(f"betas must be two numbers in [0, 1), got {self.betas}")
        if not self.eps > 0:
            problems.append(f"eps must be positive, got {self.eps}")
        if not 0.0 <= self.weight_decay < 1.0 / self.lr:
            problems.append(f"weight_decay must be in [0, 1/lr), got {self.weight_decay}")
        if not 0.0 <= self.momentum < 1.0 or not 0.0 <= self.dampening <= 1.0:
            problems.append(
                f"momentum must be in [0, 1) and dampening in [0, 1], got {self.momentum}, {self.dampening}"
            )
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            problems.append("nesterov needs momentum > 0 and dampening 0")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            problems.append(f"max_grad_norm must be positive (or None), got {self.max_grad_norm}")
        if problems:
            raise ValueError("invalid optimizer settings: " + "; ".join(problems))

    def lr_at(self, step: int) -> float:
        """Learning rate of update `step` (1-based)."""
        if self.schedule is None:
            return self.lr
        factor = float(self.schedule(step - 1))
        if not (math.isfinite(factor) and factor >= 0):
            raise ValueError(f"the learning-rate schedule returned {factor} for update {step - 1}")
        return self.lr * factor

    def decay_segments(self, named_params: Iterable[tuple[str, nn.Parameter]]) -> Segments:
        """A unit's flat vector (its `named_parameters()` in order) as runs of (start, stop,
        weight decay), merged where equal."""
        runs: list[tuple[int, int, float]] = []
        pos = 0
        for pname, p in named_params:
            wd = 0.0 if self.no_decay is not None and self.no_decay(pname, p) else self.weight_decay
            if not p.requires_grad:
                wd = FROZEN
            if runs and runs[-1][1] == pos and runs[-1][2] == wd:
                runs[-1] = (runs[-1][0], pos + p.numel(), wd)
            else:
                runs.append((pos, pos + p.numel(), wd))
            pos += p.numel()
        return tuple(runs)

    def update_slice(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        state1: torch.Tensor,
        state2: torch.Tensor,
        step: int,
        segments: Segments,
        lo: int,
        carried: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Apply update `step` (1-based) in place to elements `[lo, lo + len(param))` of a unit
        whose flat vector has `segments`; `param`, `grad` and the states are 1-D slices.
        `carried`: `grad` holds only these element runs (absolute, inside the slice, covering
        every trainable element: `trainable_runs`), back to back, as a snapshot's gradient
        exchange carries them; the update reads each run where it lies in `grad`, with the same
        bits as from a gradient aligned with `param` (every update is elementwise)."""
        self.update_slices([UnitSlice("", lo, param, grad, state1, state2, carried)], {"": segments}, step)

    def update_slices(self, slices: Sequence[UnitSlice], segments: Mapping[str, Segments], step: int) -> None:
        """`update_slice` of every one of `slices` (`segments`: of each unit), all at update
        `step`: the same bits, the fused kernel called once per device, dtype and weight decay
        over all of them (`executor.fused_update`; a snapshot holder replays a stage in one go)."""
        lr = self.lr_at(step)
        batches: dict[
            tuple[Callable[..., None], torch.device, torch.dtype, float], list[tuple[torch.Tensor, ...]]
        ]
        batches = {}
        written: list[tuple[UnitSlice, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = []
        for u in slices:
            p, g, m, v = u.param, u.grad, u.exp_avg, u.exp_avg_sq
            carried = None if u.carried is None else tuple(u.carried)
            pieces, plan = _slice_layout(segments[u.unit], u.lo, p.numel(), carried, g.numel())
            fused = self._fused_kernel(p, g, m, v)
            if fused is None:
                for a, b, wd, at in pieces:
                    self._update(p[a:b], g[at : at + b - a], m[a:b], v[a:b], step, lr, wd)
                continue
            # Gathered before any in-place call writes over the elements they hold.
            for gathered in plan.gathered:
                src, grad_src, kept, dest = gathered.on(p.device)
                rows = (
                    p.index_select(0, src),
                    g.index_select(0, grad_src),
                    m.index_select(0, src),
                    v.index_select(0, src),
                )
                batches.setdefault((fused, p.device, p.dtype, gathered.wd), []).append(rows)
                written.append((u, (kept, dest), rows))
            for part in plan.in_place:
                n = part.length
                views = (
                    p.narrow(0, part.start, n),
                    g.narrow(0, part.grad_at, n),
                    m.narrow(0, part.start, n),
                    v.narrow(0, part.start, n),
                )
                batches.setdefault((fused, p.device, p.dtype, part.wd), []).append(views)
        steps: dict[torch.device, torch.Tensor] = {}
        for (kernel, device, _, wd), runs in batches.items():
            if device not in steps:
                steps[device] = torch.tensor(float(step), device=device)
            self._fused_call(kernel, runs, steps[device], lr, wd)
        for u, (kept, dest), out in written:  # the parameters and both moments back
            for into, updated in ((u.param, out[0]), (u.exp_avg, out[2]), (u.exp_avg_sq, out[3])):
                into.index_copy_(0, dest, updated.index_select(0, kept))

    def _fused_kernel(self, *tensors: torch.Tensor) -> Callable[..., None] | None:
        """torch's fused kernel for this update, or None where the single-tensor arithmetic runs
        (SGD, another device, mixed dtypes or strides the kernel does not take)."""
        if self.kind == "sgd":
            return None
        first = tensors[0]
        if first.device.type not in _FUSED_DEVICES or first.dtype not in (torch.float32, torch.float64):
            return None
        if any(t.dtype != first.dtype or t.device != first.device or not t.is_contiguous() for t in tensors):
            return None
        return torch._fused_adamw_ if self.kind == "adamw" else torch._fused_adam_

    def _fused_call(
        self,
        kernel: Callable[..., None],
        runs: list[tuple[torch.Tensor, ...]],
        step: torch.Tensor,
        lr: float,
        wd: float,
    ) -> None:
        """The runs (p, g, m, v) of one weight decay, each a multiple of FUSED_PAD long, through
        one call of `kernel`."""
        beta1, beta2 = self.betas
        kernel(
            *([run[j] for run in runs] for j in range(4)),
            [],
            [step] * len(runs),
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=wd,
            eps=self.eps,
            amsgrad=False,
            maximize=False,
        )

    def _update(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        step: int,
        lr: float,
        wd: float,
    ) -> None:
        # The arithmetic of torch.optim's single-tensor implementations, in the same order (SGD
        # everywhere; Adam and AdamW where the fused kernel does not run).
        if self.kind == "sgd":
            if wd:
                g = g.add(p, alpha=wd)
            if self.momentum:
                if step == 1:
                    m.copy_(g)
                else:
                    m.mul_(self.momentum).add_(g, alpha=1.0 - self.dampening)
                g = g.add(m, alpha=self.momentum) if self.nesterov else m
            p.add_(g, alpha=-lr)
            return
        beta1, beta2 = self.betas
        if self.kind == "adamw":
            p.mul_(1.0 - lr * wd)
        elif wd:
            g = g.add(p, alpha=wd)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        bias1 = 1.0 - beta1**step
        bias2_sqrt = math.sqrt(1.0 - beta2**step)
        # One temporary, divided in place: the same arithmetic as `(v.sqrt() / c).add_(eps)`
        # with one allocation fewer (a snapshot holder runs this on a host core every step).
        denom = v.sqrt().div_(bias2_sqrt).add_(self.eps)
        p.addcdiv_(m, denom, value=-lr / bias1)
