"""The fused update in few calls (`executor.fused_update`, `OptimizerConfig.update_slices`).

Reference: each decay run of a slice updated alone by torch's fused kernel in a zero-padded copy
of a multiple of FUSED_PAD elements (every element in the kernel's vector loop, the rule
docs/engine.md states). The planned update, a slice at a time or a stage's units in one batch,
must give those bits on every cut of the flat vectors, for float32 and float64, and leave
frozen elements alone.
"""

from __future__ import annotations

import pytest
import torch

from executor.fused_update import FUSED_PAD, MAX_GATHERED, MAX_GATHERED_SHARE, plan_slice
from executor.optim import FROZEN, OptimizerConfig, Segments, UnitSlice, trainable_runs

CFG = OptimizerConfig(kind="adamw", lr=1e-2, weight_decay=0.1)
# Two units' flat vectors: a block with decayed matrices between small undecayed runs (biases,
# norms) and one with a frozen run in the middle.
SEGMENTS: dict[str, Segments] = {
    "block": ((0, 700, 0.1), (700, 712, 0.0), (712, 1500, 0.1), (1500, 1531, 0.0), (1531, 2000, 0.1)),
    "part": ((0, 300, 0.1), (300, 650, FROZEN), (650, 700, 0.0), (700, 1001, 0.1)),
}


def _reference(u: UnitSlice, segments: Segments, step: int) -> None:
    """Each trainable run alone through the kernel, zero-padded to a multiple of FUSED_PAD."""
    hi = u.lo + u.param.numel()
    for a, b in trainable_runs(segments, u.lo, hi):
        for start, stop, wd in segments:
            s, e = max(a, start), min(b, stop)
            if s >= e:
                continue
            k = e - s
            padded = -(-k // FUSED_PAD) * FUSED_PAD
            at = s - u.lo
            rows = [torch.zeros(padded, dtype=u.param.dtype) for _ in range(4)]
            for row, t in zip(rows, (u.param, u.grad, u.exp_avg, u.exp_avg_sq), strict=True):
                row[:k] = t[at : at + k]
            torch._fused_adamw_(
                [rows[0]], [rows[1]], [rows[2]], [rows[3]], [],
                [torch.tensor(float(step), dtype=u.param.dtype)],
                lr=CFG.lr_at(step), beta1=CFG.betas[0], beta2=CFG.betas[1], weight_decay=wd,
                eps=CFG.eps, amsgrad=False, maximize=False,
            )  # fmt: skip
            for t, row in ((u.param, rows[0]), (u.exp_avg, rows[2]), (u.exp_avg_sq, rows[3])):
                t[at : at + k] = row[:k]


def _slices(cuts: dict[str, tuple[int, int]], dtype: torch.dtype, seed: int) -> list[UnitSlice]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for unit, (lo, hi) in cuts.items():
        p, g = (torch.randn(hi - lo, generator=gen, dtype=dtype) for _ in range(2))
        m = torch.randn(hi - lo, generator=gen, dtype=dtype) * 0.1
        v = torch.rand(hi - lo, generator=gen, dtype=dtype) * 0.01
        out.append(UnitSlice(unit, lo, p, g, m, v))
    return out


def _clone(slices: list[UnitSlice]) -> list[UnitSlice]:
    return [
        UnitSlice(s.unit, s.lo, s.param.clone(), s.grad.clone(), s.exp_avg.clone(), s.exp_avg_sq.clone())
        for s in slices
    ]


def _bits(slices: list[UnitSlice]) -> list[torch.Tensor]:
    return [t for s in slices for t in (s.param, s.exp_avg, s.exp_avg_sq)]


CUTS = [
    {"block": (0, 2000), "part": (0, 1001)},  # whole units
    {"block": (333, 1999), "part": (7, 999)},  # slices starting and ending mid-run
    {"block": (700, 712), "part": (640, 660)},  # inside a small run, across frozen into trained
    {"block": (1, 65), "part": (650, 714)},  # exactly one quantum
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cuts", CUTS)
def test_a_batch_and_each_slice_alone_give_the_run_by_run_bits(
    cuts: dict[str, tuple[int, int]], dtype: torch.dtype
) -> None:
    base = _slices(cuts, dtype, seed=3)
    frozen_before = base[1].param[max(0, 300 - base[1].lo) : max(0, 650 - base[1].lo)].clone()
    ref, alone, batch = _clone(base), _clone(base), _clone(base)
    for step in (1, 2, 3):
        for s in ref:
            _reference(s, SEGMENTS[s.unit], step)
        for s in alone:
            CFG.update_slice(s.param, s.grad, s.exp_avg, s.exp_avg_sq, step, SEGMENTS[s.unit], s.lo)
        CFG.update_slices(batch, SEGMENTS, step)
    for want, got_alone, got_batch in zip(_bits(ref), _bits(alone), _bits(batch), strict=True):
        assert torch.equal(want, got_alone)
        assert torch.equal(want, got_batch)
    part = batch[1]
    assert torch.equal(part.param[max(0, 300 - part.lo) : max(0, 650 - part.lo)], frozen_before)


def test_a_slice_that_trains_whole_is_one_in_place_call_and_its_small_runs_gathered() -> None:
    pieces = tuple((a, b, wd, a) for a, b, wd in SEGMENTS["block"])
    plan = plan_slice(pieces, 2000)
    assert [(p.start, p.length, p.wd) for p in plan.in_place] == [(0, 1984, 0.1)]
    gathered = {g.wd: g for g in plan.gathered}
    # The undecayed runs (12 + 31 elements) and the decayed ragged end (16), in 64-slots.
    assert sorted(gathered[0.0].dest.tolist()) == [*range(700, 712), *range(1500, 1531)]
    assert gathered[0.0].src.numel() == 2 * FUSED_PAD
    assert gathered[0.1].dest.tolist() == list(range(1984, 2000))
    assert all(g.src.numel() % FUSED_PAD == 0 for g in plan.gathered)


def test_frozen_runs_a_carried_gradient_or_a_large_minority_keep_the_run_by_run_plan() -> None:
    frozen = ((0, 300, 0.1, 0), (650, 700, 0.0, 650), (700, 1001, 0.1, 700))
    carried = ((0, 300, 0.1, 0), (300, 1001, 0.0, 250))  # the gradient is not aligned with the slice
    minority = int(MAX_GATHERED_SHARE * 1024) + 64
    large = ((0, 1024 - minority, 0.1, 0), (1024 - minority, 1024, 0.0, 1024 - minority))
    many = MAX_GATHERED + 1  # a small share of a large slice, but more than a plan indexes
    big = ((0, 64 * many, 0.1, 0), (64 * many, 65 * many, 0.0, 64 * many))
    for pieces, numel in ((frozen, 1001), (carried, 1001), (large, 1024), (big, 65 * many)):
        plan = plan_slice(pieces, numel)
        assert len(plan.in_place) == sum(1 for a, b, _, _ in pieces if b - a >= FUSED_PAD), pieces
        assert all(p.length % FUSED_PAD == 0 for p in plan.in_place)


def test_sgd_and_a_batch_of_no_slices_change_nothing_they_should_not() -> None:
    sgd = OptimizerConfig(kind="sgd", lr=0.1, momentum=0.9)
    slices = _slices({"block": (10, 90)}, torch.float32, seed=5)
    alone = _clone(slices)
    sgd.update_slices(slices, SEGMENTS, 1)
    s = alone[0]
    sgd.update_slice(s.param, s.grad, s.exp_avg, s.exp_avg_sq, 1, SEGMENTS["block"], s.lo)
    assert all(torch.equal(a, b) for a, b in zip(_bits(slices), _bits(alone), strict=True))
    CFG.update_slices([], SEGMENTS, 1)
