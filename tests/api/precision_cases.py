"""Mixed-precision cases for the tests: specs in bf16/fp16, a unit that overflows fp16 at chosen
steps, and the plain-PyTorch reference loop (torch.autocast, fp32 master weights, torch.optim,
torch.amp.GradScaler for fp16) every engine run is compared with.

`OverflowAt` is the forced-overflow hook: at the listed steps its backward sends the incoming
gradient through fp16 multiplied by 1e5, which overflows to inf (a loss-scaled gradient of
magnitude >= 0.66 does), as a real fp16 overflow would. Elsewhere it is the identity. The step
comes from the engine's unit-call context (`executor.rng.current_unit_call`), or, in the plain
reference loop, from `reference_step` which that loop sets."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from executor.precision import PrecisionConfig
from executor.rng import current_unit_call
from executor.sampler import GlobalBatchSampler
from executor.trainer import TrainSpec, _to_device
from executor.units import UnitModel

reference_step = -1  # the step the plain reference loop is running (no engine context there)


class _Blowup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return (g.to(torch.float16) * 1e5).to(g.dtype)  # beyond fp16's 65504: inf


class OverflowAt(nn.Module):
    """`inner`, whose backward overflows fp16 at `steps` (module docstring)."""

    def __init__(self, inner: nn.Module, steps: Sequence[int]) -> None:
        super().__init__()
        self.inner, self.steps = inner, tuple(steps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        call = current_unit_call()
        step = call.step if call is not None else reference_step
        return _Blowup.apply(out) if step in self.steps and torch.is_grad_enabled() else out


def _wrapped_build(
    inner: Callable[[str], nn.Module], target: str, steps: tuple[int, ...], name: str
) -> nn.Module:
    unit = inner(name)
    return OverflowAt(unit, steps) if name == target and steps else unit


def with_precision(
    spec: TrainSpec,
    precision: str,
    overflow_unit: str | None = None,
    overflow_steps: tuple[int, ...] = (),
    reduce_dtype: str = "fp32",
) -> TrainSpec:
    """`spec` computing in `precision`, `overflow_unit` overflowing at `overflow_steps`; its dry
    run is redone (the boundary dtypes change with the precision)."""
    model = spec.model
    if overflow_unit is not None:
        build = functools.partial(_wrapped_build, model._build, overflow_unit, tuple(overflow_steps))
        model = UnitModel(model.names, build, model.init_seed)
    return dataclasses.replace(
        spec,
        model=model,
        precision=PrecisionConfig(precision, reduce_dtype),  # type: ignore[arg-type]
        probes=None,
    )


@dataclasses.dataclass
class TorchRun:
    losses: list[float]
    params: dict[str, torch.Tensor]  # unit -> flat fp32 parameters
    updates: int  # optimizer updates applied (skipped fp16 steps not counted)
    scale: float | None  # fp16: GradScaler's final scale


def torch_reference(
    spec: TrainSpec,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    batch: int,
    slots: int,
    steps: int,
    clip: float | None = None,
    dp: int = 1,
    wire: torch.dtype = torch.float32,
    device: str = "cpu",
) -> TorchRun:
    """The plain-PyTorch loop: fp32 modules (master weights), forward and per-sample loss under
    torch.autocast in the spec's precision, loss summed in fp32 / batch, fp32 gradients,
    torch.optim (and GradScaler in fp16, stepping the LR schedule only on applied updates).

    `dp` > 1 is what data parallelism computes (DDP, or ElasWave's DP ranks): every micro-batch
    is cut into `dp` contiguous row chunks, each run forward and backward on its own, so each
    chunk's weight gradients come out of autocast's 16-bit matmuls rounded on their own before
    they are added in fp32 (the sum of roundings is not the rounding of the sum). `wire`: the
    dtype the summed gradient is rounded to once before the update (a one-rank reduce-scatter
    in that `reduce_dtype`). `device`: where the loop runs (make gpu-check runs it on CUDA)."""
    global reference_step
    cfg = spec.precision
    dev = torch.device(device)
    model = nn.ModuleList([spec.model.build(i, dev) for i in range(len(spec.model))])
    opt = make_optimizer(model)
    sched = (
        torch.optim.lr_scheduler.LambdaLR(opt, spec.optimizer.schedule) if spec.optimizer.schedule else None
    )
    scaler = torch.amp.GradScaler(dev.type, init_scale=cfg.init_scale) if cfg.scales_loss else None
    sampler = GlobalBatchSampler(spec.dataset, batch)
    losses, updates = [], 0
    for step in range(steps):
        reference_step = step
        opt.zero_grad()
        total = 0.0
        for slot, k in itertools.product(range(slots), range(dp)):
            lo, hi = slot * batch // slots, (slot + 1) * batch // slots
            rows = sampler.rows(step, lo + k * (hi - lo) // dp, lo + (k + 1) * (hi - lo) // dp)
            x = _to_device(rows.inputs, dev)
            with cfg.autocast(dev):
                for unit in model:
                    x = unit(*x) if isinstance(x, tuple) else unit(x)
                per_sample = spec.loss_fn(x, _to_device(rows.targets, dev))
            loss = per_sample.float().sum() / batch
            (loss if scaler is None else scaler.scale(loss)).backward()
            total += float(loss.detach())
        losses.append(total)
        if wire != torch.float32:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad = p.grad.to(wire).float()
        if scaler is not None:
            scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler is None:
            opt.step()
            applied = True
        else:
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            applied = scaler.get_scale() >= before
        if applied:
            updates += 1
            if sched is not None:
                sched.step()
    reference_step = -1
    params = {
        name: torch.cat([p.detach().reshape(-1) for p in unit.parameters()]).cpu()
        for name, unit in zip(spec.model.names, model, strict=True)
    }
    return TorchRun(losses, params, updates, None if scaler is None else scaler.get_scale())
