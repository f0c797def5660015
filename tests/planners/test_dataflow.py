"""Dataflow planner: micro-batch resizing keeps the global batch and the gradient (ElasWave §4.1)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners import Layout, make_uniform_layout, validate
from planners.dataflow import (
    StageEmptied,
    drop_stage,
    micro_batch_sizes,
    resize_after_join,
    resize_after_loss,
)
from tests.planners.strategies import layouts


def test_paper_example_dp3_size2_becomes_dp2_size3() -> None:
    lay = make_uniform_layout(4, 2, 3, global_batch=24, num_micro_batches=4)
    assert micro_batch_sizes(lay) == (2, 2)
    out = resize_after_loss(lay, [1])
    assert out.layout.stages[0].ranks == (0, 2) and out.stage_micro_batch_sizes == (3, 2)
    assert out.layout.global_batch == 24 and out.layout.num_micro_batches == 4
    assert "DP 3->2, micro-batch 2->3" in out.reason


def test_non_divisible_split_is_uneven_but_exact() -> None:
    lay = make_uniform_layout(2, 1, 4, global_batch=8, num_micro_batches=1)
    out = resize_after_loss(lay, [3]).layout
    assert [len(r) for r in out.micro_batch_ranges(0)[0]] == [3, 3, 2]
    assert out.samples_of(0, 0).start == 0 and out.samples_of(2, 0).stop == 8


def _samples_per_rank(layout: Layout, stage: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for m in range(layout.num_micro_batches):
        for r in layout.stages[stage].ranks:
            samples = layout.samples_of(r, m)
            out.setdefault(r, []).extend(range(samples.start, samples.stop))
    return out


@st.composite
def layout_and_losses(draw: st.DrawFn) -> tuple[Layout, list[int]]:
    layout = draw(layouts())
    lost: list[int] = []
    for s in layout.stages:  # lose any subset that leaves each stage a survivor
        keep = draw(st.sampled_from(s.ranks))
        lost += [r for r in s.ranks if r != keep and draw(st.booleans())]
    return layout, lost


@settings(max_examples=100)
@given(layout_and_losses())
def test_resize_keeps_batch_and_covers_every_sample_once(case: tuple[Layout, list[int]]) -> None:
    layout, lost = case
    out = resize_after_loss(layout, lost).layout
    assert validate(out, exhaustive=True).ok
    assert (out.global_batch, out.num_micro_batches, out.boundaries) == (
        layout.global_batch,
        layout.num_micro_batches,
        layout.boundaries,
    )
    assert set(out.ranks()) == set(layout.ranks()) - set(lost)
    for p in range(out.num_stages):
        per_rank = _samples_per_rank(out, p)
        assert sorted(i for samples in per_rank.values() for i in samples) == list(range(out.global_batch))


@settings(max_examples=60)
@given(layout_and_losses(), st.integers(0, 2**31 - 1))
def test_gradient_scale_is_unchanged(case: tuple[Layout, list[int]], seed: int) -> None:
    """Each rank sums per-sample gradients of its samples and divides by the *global* batch: the
    DP-reduced gradient equals the fault-free full-batch mean for any loss pattern."""
    layout, lost = case
    grads = np.random.default_rng(seed).normal(size=(layout.global_batch, 3))
    reference = grads.mean(axis=0)
    out = resize_after_loss(layout, lost).layout
    for p in range(out.num_stages):
        reduced = sum(
            grads[samples].sum(axis=0) / out.global_batch for samples in _samples_per_rank(out, p).values()
        )
        np.testing.assert_allclose(reduced, reference, rtol=1e-12, atol=1e-12)


def test_losing_a_whole_stage_is_refused_and_drop_stage_recovers() -> None:
    lay = make_uniform_layout(6, 3, 2, 8, 2, stage_mem_cap_bytes=(1.0, 2.0, 3.0))
    with pytest.raises(StageEmptied, match=r"stage\(s\) \[1\] lost every rank") as err:
        resize_after_loss(lay, [2, 3])
    assert err.value.stages == (1,)
    dropped = drop_stage(lay, 1)
    assert validate(dropped).ok
    assert [(s.layer_start, s.layer_stop, s.ranks) for s in dropped.stages] == [
        (0, 4, (0, 1)),
        (4, 6, (4, 5)),
    ]
    assert dropped.stage_mem_cap_bytes == (1.0, 3.0)
    first = drop_stage(lay, 0)
    assert [(s.layer_start, s.layer_stop) for s in first.stages] == [(0, 4), (4, 6)] and validate(first).ok


def test_unknown_lost_rank_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"lost ranks \[99\] are not in the layout"):
        resize_after_loss(make_uniform_layout(2, 1, 2, 4, 1), [99])


def test_lost_ranks_lose_their_frequency() -> None:
    lay = replace(make_uniform_layout(2, 1, 3, 6, 1), frequencies_mhz=((0, 1200), (1, 1300)))
    assert resize_after_loss(lay, [1]).layout.frequencies_mhz == ((0, 1200),)


@settings(max_examples=60)
@given(layout_and_losses())
def test_join_reverses_loss(case: tuple[Layout, list[int]]) -> None:
    layout, lost = case
    even = replace(layout, stages=tuple(replace(s, sample_weights=()) for s in layout.stages))
    shrunk = resize_after_loss(even, lost).layout
    joins = {s.stage: [r for r in s.ranks if r in lost] for s in even.stages}
    grown = resize_after_join(shrunk, {p: rs for p, rs in joins.items() if rs})
    assert validate(grown.layout, exhaustive=True).ok
    assert grown.stage_micro_batch_sizes == micro_batch_sizes(even)
    assert set(grown.layout.ranks()) == set(even.ranks())


def test_join_rejects_present_or_bad_stage() -> None:
    lay = make_uniform_layout(2, 2, 2, 4, 1)
    with pytest.raises(ValueError, match=r"ranks \[1\] already present"):
        resize_after_join(lay, {0: [1]})
    with pytest.raises(ValueError, match="cannot join stage 5"):
        resize_after_join(lay, {5: [9]})


def test_weighted_stage_keeps_exact_split_after_loss() -> None:
    lay = make_uniform_layout(2, 1, 3, 12, 2)
    lay = replace(lay, stages=(replace(lay.stages[0], sample_weights=(2, 1, 1)),))
    out = resize_after_loss(lay, [2]).layout
    assert out.stages[0].sample_weights == (2, 1)
    assert [len(r) for r in out.micro_batch_ranges(0)[0]] == [4, 2]
    assert micro_batch_sizes(out) == (4,)
