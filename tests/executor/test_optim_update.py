"""The engine's optimizer update (`OptimizerConfig.update_slice`) against torch.optim's own.

The engine applies the update to ZeRO-1 slices that start anywhere in a unit's flat vector, on the
live shard and on every snapshot copy of it, so its bits must not depend on where the slices
fall. Adam and AdamW run torch's fused kernel over lengths padded to `FUSED_PAD`: on a model
whose every tensor is a multiple of that length (where torch's own fused optimizer takes no
scalar tail either) the result is torch.optim's fused AdamW bit for bit, and on uneven slices it
is the whole vector's update bit for bit. SGD keeps torch.optim's single-tensor arithmetic.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from executor.optim import FUSED_PAD, OptimizerConfig, trainable_runs

STEPS = 6


def _no_decay(name: str, param: nn.Parameter) -> bool:
    return param.dim() < 2


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.LayerNorm(12), nn.Linear(12, 4, bias=False))


def _padded_model() -> nn.Module:
    """Every tensor a multiple of FUSED_PAD elements."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FUSED_PAD, 2 * FUSED_PAD), nn.LayerNorm(2 * FUSED_PAD), nn.Linear(2 * FUSED_PAD, 3)
    )


def _torch_optimizer(cfg: OptimizerConfig, model: nn.Module, fused: bool) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if not _no_decay(n, p)]
    plain = [p for n, p in model.named_parameters() if _no_decay(n, p)]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    if cfg.kind == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    kind = torch.optim.AdamW if cfg.kind == "adamw" else torch.optim.Adam
    return kind(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False, fused=fused)


def _gradients(numel: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(numel, generator=gen) for _ in range(STEPS)]


def _torch_run(cfg: OptimizerConfig, model: nn.Module, fused: bool) -> tuple[torch.Tensor, ...]:
    """torch.optim's steps on `model`; its flat parameters and moments afterwards."""
    params = list(model.parameters())
    optimizer = _torch_optimizer(cfg, model, fused)
    for g in _gradients(sum(p.numel() for p in params)):
        pos = 0
        for p in params:
            p.grad = g[pos : pos + p.numel()].view_as(p).clone()
            pos += p.numel()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    if cfg.kind == "sgd":
        return (flat,)
    moments = [optimizer.state[p] for p in params]
    return (
        flat,
        torch.cat([s["exp_avg"].reshape(-1) for s in moments]),
        torch.cat([s["exp_avg_sq"].reshape(-1) for s in moments]),
    )


def _engine_run(cfg: OptimizerConfig, model: nn.Module, cuts: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """`update_slice` over the slices `cuts` makes of the flat vector, each on its own storage
    (as a snapshot holder keeps a neighbour's shard)."""
    segments = cfg.decay_segments(model.named_parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert cuts[0] == 0 and cuts[-1] == flat.numel()
    state1, state2 = torch.zeros_like(flat), torch.zeros_like(flat)
    for step, g in enumerate(_gradients(flat.numel()), start=1):
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            p, m, v = flat[lo:hi].clone(), state1[lo:hi].clone(), state2[lo:hi].clone()
            grad = g[lo:hi].clone()
            cfg.update_slice(p, grad, m, v, step, segments, lo)
            assert torch.equal(grad, g[lo:hi]), "the update wrote into the gradient"
            flat[lo:hi], state1[lo:hi], state2[lo:hi] = p, m, v
    return (flat,) if cfg.kind == "sgd" else (flat, state1, state2)


ADAMS = [
    OptimizerConfig("adamw", lr=3e-2, weight_decay=0.1, no_decay=_no_decay),
    OptimizerConfig("adam", lr=3e-2, weight_decay=0.05, no_decay=_no_decay),
]
SGD = OptimizerConfig("sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, no_decay=_no_decay)


@pytest.mark.parametrize("cfg", [*ADAMS, SGD], ids=["adamw", "adam", "sgd-nesterov"])
def test_the_update_of_uneven_slices_is_the_whole_vectors_bit_for_bit(cfg: OptimizerConfig) -> None:
    numel = sum(p.numel() for p in _small_model().parameters())
    whole = _engine_run(cfg, _small_model(), (0, numel))
    for cuts in [(0, 5, 37, 38, 101, numel), (0, 1, 2, 63, 64, 65, 129, numel), (0, 70, numel)]:
        sliced = _engine_run(cfg, _small_model(), cuts)
        for a, b in zip(sliced, whole, strict=True):
            assert torch.equal(a, b), (cuts, (a - b).abs().max().item())


@pytest.mark.parametrize("cfg", ADAMS, ids=["adamw", "adam"])
def test_adam_equals_torchs_fused_optimizer_bit_for_bit_where_it_takes_no_scalar_tail(
    cfg: OptimizerConfig,
) -> None:
    numel = sum(p.numel() for p in _padded_model().parameters())
    assert numel % FUSED_PAD == 3 % FUSED_PAD, "the last bias (3 elements) is the one ragged run"
    expected = _torch_run(cfg, _padded_model(), fused=True)
    got = _engine_run(cfg, _padded_model(), (0, 100, 1000, numel))
    # the last 3 elements (the ragged bias) took torch's scalar tail, ours its vector loop
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a[:-3], b[:-3]), (a[:-3] - b[:-3]).abs().max().item()
        torch.testing.assert_close(a[-3:], b[-3:], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("cfg", ADAMS, ids=["adamw", "adam"])
def test_adam_follows_torchs_single_tensor_optimizer_to_fp32_round_off(cfg: OptimizerConfig) -> None:
    expected = _torch_run(cfg, _small_model(), fused=False)
    numel = expected[0].numel()
    got = _engine_run(cfg, _small_model(), (0, 5, 37, numel))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_sgd_is_torchs_single_tensor_arithmetic_bit_for_bit() -> None:
    expected = _torch_run(SGD, _small_model(), fused=False)
    numel = expected[0].numel()
    (got,) = _engine_run(SGD, _small_model(), (0, 5, 37, 38, 101, numel))
    assert torch.equal(got, expected[0]), (got - expected[0]).abs().max().item()


def test_a_double_precision_slice_takes_the_fused_kernel_too() -> None:
    cfg = ADAMS[0]
    segments = ((0, 70, 0.1),)
    p = torch.ones(70, dtype=torch.float64)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    cfg.update_slice(p, torch.full((70,), 0.5, dtype=torch.float64), m, v, 1, segments, 0)
    assert torch.all(p < 1.0) and torch.all(m > 0) and torch.all(v > 0)
    assert torch.equal(p[0:1].expand(70), p), "the padded tail took the same arithmetic as the body"


def _partly_frozen_model() -> nn.Module:
    """BitFit's shape: the matrices frozen, the biases and the norm train."""
    model = _small_model()
    for p in model.parameters():
        p.requires_grad_(p.dim() < 2)
    return model


@pytest.mark.parametrize("cfg", [*ADAMS, SGD], ids=["adamw", "adam", "sgd-nesterov"])
def test_a_gradient_of_the_trainable_runs_only_updates_as_the_full_one_bit_for_bit(
    cfg: OptimizerConfig,
) -> None:
    model = _partly_frozen_model()
    segments = cfg.decay_segments(model.named_parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    numel = flat.numel()
    for lo, hi in [(0, numel), (5, 101), (100, 117), (0, 1)]:
        runs = trainable_runs(segments, lo, hi)
        full = [flat[lo:hi].clone(), torch.zeros(hi - lo), torch.zeros(hi - lo)]
        compact = [t.clone() for t in full]
        for step, g in enumerate(_gradients(numel), start=1):
            cfg.update_slice(full[0], g[lo:hi], full[1], full[2], step, segments, lo)
            wire = torch.cat([g[a:b] for a, b in runs]) if runs else torch.empty(0)
            cfg.update_slice(compact[0], wire, compact[1], compact[2], step, segments, lo, carried=runs)
        for a, b in zip(compact, full, strict=True):
            assert torch.equal(a, b), (lo, hi)
        frozen = torch.ones(hi - lo, dtype=torch.bool)
        for run_lo, run_hi in runs:
            frozen[run_lo - lo : run_hi - lo] = False
        assert torch.equal(full[0][frozen], flat[lo:hi][frozen]), "a frozen element moved"
        assert not torch.equal(full[0], flat[lo:hi]) or not runs, "nothing trained"


def test_a_gradient_that_does_not_hold_its_runs_is_refused() -> None:
    model = _partly_frozen_model()
    segments = ADAMS[0].decay_segments(model.named_parameters())
    lo, n = 90, 20
    runs = trainable_runs(segments, lo, lo + n)
    assert runs == ((96, 110),)
    param = torch.ones(n)
    with pytest.raises(ValueError, match="does not hold the runs"):
        ADAMS[0].update_slice(
            param, torch.zeros(1), torch.zeros(n), torch.zeros(n), 1, segments, lo, carried=runs
        )
    assert torch.equal(param, torch.ones(n)), "a refused update changed the slice"
