"""The engine's optimizer update (`OptimizerConfig.update_slice`) against torch.optim's own.

The engine applies the update to ZeRO-1 slices that start anywhere in a unit's flat vector, on the
live shard and on every snapshot copy of it; the claim in executor.optim is that this is
torch.optim's single-tensor arithmetic in the same order, so the bits do not depend on where the
slices fall. Each case runs the same steps through torch.optim (foreach off, fused off: its CPU
default) and through `update_slice` over uneven slices, and compares every bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from executor.optim import OptimizerConfig

STEPS = 6
CUTS = (0, 5, 37, 38, 101, 180)  # uneven slices of the flat vector, one of a single element


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.LayerNorm(12), nn.Linear(12, 4, bias=False))


def _no_decay(name: str, param: nn.Parameter) -> bool:
    return param.dim() < 2


def _torch_optimizer(cfg: OptimizerConfig, model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if not _no_decay(n, p)]
    plain = [p for n, p in model.named_parameters() if _no_decay(n, p)]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    if cfg.kind == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    kind = torch.optim.AdamW if cfg.kind == "adamw" else torch.optim.Adam
    return kind(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False, fused=False)


def _gradients(numel: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(numel, generator=gen) for _ in range(STEPS)]


@pytest.mark.parametrize(
    "cfg",
    [
        OptimizerConfig("adamw", lr=3e-2, weight_decay=0.1, no_decay=_no_decay),
        OptimizerConfig("adam", lr=3e-2, weight_decay=0.05, no_decay=_no_decay),
        OptimizerConfig("sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, no_decay=_no_decay),
    ],
    ids=["adamw", "adam", "sgd-nesterov"],
)
def test_the_update_of_uneven_slices_equals_torch_optim_bit_for_bit(cfg: OptimizerConfig) -> None:
    reference = _model()
    params = list(reference.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    assert flat.numel() == CUTS[-1]
    grads = _gradients(flat.numel())
    optimizer = _torch_optimizer(cfg, reference)
    for g in grads:
        pos = 0
        for p in params:
            p.grad = g[pos : pos + p.numel()].view_as(p).clone()
            pos += p.numel()
        optimizer.step()

    segments = cfg.decay_segments(_model().named_parameters())
    state1, state2 = torch.zeros_like(flat), torch.zeros_like(flat)
    for step, g in enumerate(grads, start=1):
        for lo, hi in zip(CUTS, CUTS[1:], strict=False):
            # each slice on its own storage, as a snapshot holder keeps a neighbour's shard
            p, m, v = flat[lo:hi].clone(), state1[lo:hi].clone(), state2[lo:hi].clone()
            cfg.update_slice(p, g[lo:hi].clone(), m, v, step, segments, lo)
            flat[lo:hi], state1[lo:hi], state2[lo:hi] = p, m, v

    expected = torch.cat([p.detach().reshape(-1) for p in params])
    assert torch.equal(flat, expected), (flat - expected).abs().max().item()
    if cfg.kind != "sgd":
        moments = [optimizer.state[p] for p in params]
        assert torch.equal(state1, torch.cat([s["exp_avg"].reshape(-1) for s in moments]))
        assert torch.equal(state2, torch.cat([s["exp_avg_sq"].reshape(-1) for s in moments]))
