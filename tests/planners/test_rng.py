"""RNG resharding: dropout masks do not depend on placement (ElasWave §4.4)."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners import Layout, make_uniform_layout, validate
from planners.dataflow import resize_after_loss
from planners.partition import apply_boundaries
from planners.rng import StreamId, per_rank_rng_plan, rng_key, rng_keys, rng_plan, stream_uses
from tests.planners.strategies import layouts

WIDTH = 3


def test_rng_key_is_deterministic_distinct_and_in_range() -> None:
    keys = {rng_key(7, t, layer, i) for t in range(4) for layer in range(6) for i in range(64)}
    assert len(keys) == 4 * 6 * 64
    assert all(0 <= k < 2**63 for k in keys)
    assert rng_key(7, 1, 2, 3) == rng_key(7, 1, 2, 3) != rng_key(8, 1, 2, 3)
    assert rng_keys(7, 1, 2, make_uniform_layout(1, 1, 1, 4, 1).slot_range(0)) == tuple(
        rng_key(7, 1, 2, i) for i in range(4)
    )
    with pytest.raises(ValueError, match="rng_key sample must be >= 0"):
        rng_key(1, 1, 1, -1)


def _counter_masks(layout: Layout, seed: int, step: int) -> dict[tuple[int, int], np.ndarray]:
    """Dropout masks as each rank would draw them, keyed by (layer, global sample)."""
    out = {}
    for s in layout.stages:
        for r in s.ranks:
            for m in range(layout.num_micro_batches):
                samples = layout.samples_of(r, m)
                for layer in s.layers:
                    for i, key in zip(
                        range(samples.start, samples.stop), rng_keys(seed, step, layer, samples), strict=True
                    ):
                        assert (layer, i) not in out  # each (layer, sample) drawn by exactly one rank
                        out[(layer, i)] = np.random.default_rng(key).random(WIDTH)
    return out


@st.composite
def relayouts(draw: st.DrawFn) -> tuple[Layout, Layout]:
    """A fault-free layout and one after losses and a new layer partition."""
    ref = draw(layouts(max_layers=6, max_stages=3, max_dp=3))
    lost = [r for s in ref.stages for r in s.ranks[1:] if draw(st.booleans())]
    new = resize_after_loss(ref, lost).layout
    if new.num_stages > 1:
        cuts = sorted(
            draw(
                st.sets(
                    st.integers(1, new.num_layers - 1),
                    min_size=new.num_stages - 1,
                    max_size=new.num_stages - 1,
                )
            )
        )
        new = apply_boundaries(new, cuts)
    return ref, new


@settings(max_examples=60)
@given(relayouts(), st.integers(0, 2**32), st.integers(0, 100))
def test_counter_mode_masks_are_placement_invariant(
    case: tuple[Layout, Layout], seed: int, step: int
) -> None:
    ref, new = case
    assert validate(new, exhaustive=True).ok
    before, after = _counter_masks(ref, seed, step), _counter_masks(new, seed, step)
    assert (
        before.keys()
        == after.keys()
        == {(layer, i) for layer in range(ref.num_layers) for i in range(ref.global_batch)}
    )
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert rng_plan(ref, ref, new).handoffs == ()


def _reference_stream_masks(ref: Layout, seed: int) -> dict[tuple[int, int], np.ndarray]:
    """Fault-free per-rank streams: stream (stage, j) draws one mask per layer for its micro-batch."""
    out = {}
    for s in ref.stages:
        for j in range(s.dp_size):
            gen = np.random.default_rng([seed, s.stage, j])
            for m in range(ref.num_micro_batches):
                samples = s.split_slot(ref.slot_range(m))[j]
                for layer in s.layers:
                    mask = gen.random((len(samples), WIDTH))
                    for row, i in enumerate(range(samples.start, samples.stop)):
                        out[(layer, i)] = mask[row]
    return out


def _replay_per_rank_plan(ref: Layout, new: Layout, seed: int) -> dict[tuple[int, int], np.ndarray]:
    """Execute `new` using only what the plan says: initial copies, handoffs, stream uses."""
    plan = per_rank_rng_plan(ref, ref, new)
    state: dict[tuple[StreamId, int], np.random.Generator] = {}
    ref_uses = stream_uses(ref, ref)
    first = {
        stream: min((u.slot, u.layer_start) for u in ref_uses if u.stream == stream)
        for stream in {u.stream for u in ref_uses}
    }
    for u in ref_uses:  # at the step boundary each stream sits with its first (non-empty) users
        if (u.slot, u.layer_start) == first[u.stream]:
            state[(u.stream, u.rank)] = np.random.default_rng([seed, u.stream.stage, u.stream.dp_index])
    for stream, _src, dst in plan.initial_copies:  # copied from a holder or the stage backup
        state[(stream, dst)] = np.random.default_rng([seed, stream.stage, stream.dp_index])
    handoffs = {(h.slot, h.stream, h.before_layer, h.dst_rank): h.src_rank for h in plan.handoffs}
    segments: dict[tuple[StreamId, int, int], list] = {}
    for u in plan.uses:
        segments.setdefault((u.stream, u.slot, u.layer_start), []).append(u)
    out = {}
    for (stream, slot, layer_start), uses in sorted(segments.items()):
        received = {
            u.rank: copy.deepcopy(state[(stream, handoffs[(slot, stream, layer_start, u.rank)])])
            for u in uses
            if (slot, stream, layer_start, u.rank) in handoffs
        }
        for u in uses:
            gen = received.get(u.rank, state.get((stream, u.rank)))
            assert gen is not None, f"rank {u.rank} has no state of {stream}"
            state[(stream, u.rank)] = gen
            for layer in range(u.layer_start, u.layer_stop):
                mask = gen.random((len(u.stream_samples), WIDTH))
                for i in range(u.samples.start, u.samples.stop):
                    out[(layer, i)] = mask[i - u.stream_samples.start]
    return out


@settings(max_examples=60)
@given(relayouts(), st.integers(0, 2**32))
def test_per_rank_plan_reproduces_fault_free_masks(case: tuple[Layout, Layout], seed: int) -> None:
    ref, new = case
    ref = replace(ref, rng_mode="per_rank")
    new = replace(new, rng_mode="per_rank")
    expected, got = _reference_stream_masks(ref, seed), _replay_per_rank_plan(ref, new, seed)
    assert expected.keys() == got.keys()
    assert all(np.array_equal(expected[k], got[k]) for k in expected)


def test_per_rank_plan_example_layer_and_sample_moves() -> None:
    ref = replace(make_uniform_layout(4, 2, 2, 8, 2), rng_mode="per_rank")
    new = apply_boundaries(resize_after_loss(ref, [1]).layout, (1,))  # rank 1 lost, layer 1 -> stage 1
    plan = per_rank_rng_plan(ref, ref, new)
    # Rank 0 now also serves rank 1's samples, so it needs stream (0, 1): from the backup (rank 1 died).
    assert plan.initial_copies == ((StreamId(0, 1), None, 0),)
    # Layer 1 now runs on stage 1: stage-0 streams are handed from rank 0 to ranks 2/3 mid-forward.
    assert any(
        h.src_rank == 0 and h.dst_rank == 2 and h.before_layer == 1 and not h.across_slots
        for h in plan.handoffs
    )
    assert "1 state copies" in plan.reason
    with pytest.raises(ValueError, match="RNG streams can only be remapped"):
        stream_uses(ref, make_uniform_layout(4, 2, 2, 16, 2))
