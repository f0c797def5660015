"""RNG resharding: dropout randomness that does not depend on placement (ElasWave §4.4, Fig. 5).

Two modes (`Layout.rng_mode`):

* ``placement_invariant`` (default): every random draw for layer l on global sample i of step t is
  generated from the counter-based key `rng_key(seed, t, l, i)`. The key names *what* is computed,
  not *where*, so no RNG state ever moves and a re-layout cannot change a single mask.
* ``per_rank``: the paper's scheme. Each (stage, DP index) of the fault-free *reference* layout
  owns a stateful stream, consumed in forward order: slot by slot, layer by layer, one mask for the
  stream's whole micro-batch. After a re-layout a (layer, sample) must still be drawn from its
  reference stream: `per_rank_rng_plan` says which rank uses which stream for which layers and
  samples (a rank holding part of a stream's micro-batch draws the stream's full mask and keeps its
  rows), where the state is handed on inside a forward pass when the stream's layers now span
  stages, and which states must be copied when the plan is applied. A rank whose share of a slot
  is empty draws nothing from its stream in that slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from planners.layout import Layout, SampleRange, StageLayout

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def rng_key(seed: int, step: int, layer: int, sample: int) -> int:
    """Counter-based key of the draws for `layer` on global sample `sample` of step `step`.

    `sample` is the index in the whole run's sample sequence (step * global_batch + index in the
    batch) or the index within the step; either way it must not depend on the rank. Each field is
    folded in with SplitMix64, so nearby counters give unrelated keys; the result is a 63-bit
    non-negative int, usable directly as `torch.Generator().manual_seed(key)` or a Philox key.
    """
    for part, name in ((seed, "seed"), (step, "step"), (layer, "layer"), (sample, "sample")):
        if part < 0:
            raise ValueError(f"rng_key {name} must be >= 0, got {part}")
    h = _splitmix64(seed & _MASK64)
    for part in (step, layer, sample):
        h = _splitmix64(h ^ (part & _MASK64))
    return h >> 1


def rng_keys(seed: int, step: int, layer: int, samples: SampleRange) -> tuple[int, ...]:
    """`rng_key` for every sample of a range, in sample order (one micro-batch's dropout keys)."""
    return tuple(rng_key(seed, step, layer, i) for i in range(samples.start, samples.stop))


@dataclass(frozen=True, order=True)
class StreamId:
    """Stream of DP index `dp_index` of stage `stage` in the reference (fault-free) layout."""

    stage: int
    dp_index: int


@dataclass(frozen=True, order=True)
class StreamUse:
    """`rank` draws from `stream` for layers [layer_start, layer_stop) in slot `slot`: it draws the
    mask of the stream's whole micro-batch `stream_samples` and keeps the rows of `samples`."""

    slot: int
    stream: StreamId
    layer_start: int
    layer_stop: int
    rank: int
    stream_samples: SampleRange
    samples: SampleRange


@dataclass(frozen=True, order=True)
class StateHandoff:
    """In every step, before running layer `before_layer` in slot `slot`, `dst_rank` needs
    `stream`'s state from `src_rank`, which used the stream just before (in the same slot, or in
    the previous slot when `across_slots`).

    Cross-slot handoffs make a stream's forward draws sequential across micro-batches, which a 1F1B
    pipeline would otherwise overlap; that is the price of exact per-rank streams once a stream's
    layers span stages. The placement-invariant mode needs no handoff at all.
    """

    slot: int
    stream: StreamId
    before_layer: int
    across_slots: bool
    src_rank: int
    dst_rank: int


@dataclass(frozen=True)
class RngPlan:
    mode: str
    uses: tuple[StreamUse, ...]
    handoffs: tuple[StateHandoff, ...]
    initial_copies: tuple[tuple[StreamId, int | None, int], ...]  # (stream, src or None=backup, dst)
    reason: str


def _overlaps(
    a: tuple[SampleRange, ...], b: tuple[SampleRange, ...]
) -> Iterator[tuple[int, int, SampleRange]]:
    """(i, j, a[i] & b[j]) for every non-empty overlap of two sorted exact splits of one range."""
    i = j = 0
    while i < len(a) and j < len(b):
        common = a[i].intersect(b[j])
        if len(common):
            yield i, j, common
        if a[i].stop <= b[j].stop:
            i += 1
        else:
            j += 1


def stream_uses(reference: Layout, layout: Layout) -> tuple[StreamUse, ...]:
    """Which reference stream serves every (layer, sample) of `layout`, grouped per rank."""
    _check_compatible(reference, layout)
    uses: list[StreamUse] = []
    for new in layout.stages:
        for ref in reference.stages:
            lo, hi = max(new.layer_start, ref.layer_start), min(new.layer_stop, ref.layer_stop)
            if lo >= hi:
                continue
            uses.extend(_uses_in(reference, layout, ref, new, lo, hi))
    return tuple(sorted(uses))


def _uses_in(
    reference: Layout, layout: Layout, ref: StageLayout, new: StageLayout, lo: int, hi: int
) -> Iterator[StreamUse]:
    for m in range(layout.num_micro_batches):
        slot = layout.slot_range(m)
        ref_split, new_split = ref.split_slot(slot), new.split_slot(slot)
        for j_new, j_ref, common in _overlaps(new_split, ref_split):
            yield StreamUse(m, StreamId(ref.stage, j_ref), lo, hi, new.ranks[j_new], ref_split[j_ref], common)


def _handoffs(uses: tuple[StreamUse, ...]) -> tuple[StateHandoff, ...]:
    """Chain each stream through its layer segments in forward order, slot after slot."""
    segments: dict[StreamId, dict[tuple[int, int], list[int]]] = {}
    for u in uses:
        segments.setdefault(u.stream, {}).setdefault((u.slot, u.layer_start), []).append(u.rank)
    out: list[StateHandoff] = []
    for stream, by_pos in segments.items():
        order = sorted(by_pos)
        for prev_pos, (slot, layer) in zip(order, order[1:], strict=False):
            src = by_pos[prev_pos][0]  # every rank of a segment holds the same state
            out.extend(
                StateHandoff(slot, stream, layer, slot != prev_pos[0], src, dst)
                for dst in by_pos[(slot, layer)]
                if dst != src
            )
    return tuple(sorted(out))


def _first_holders(uses: tuple[StreamUse, ...]) -> dict[StreamId, set[int]]:
    first: dict[StreamId, tuple[tuple[int, int], set[int]]] = {}
    for u in uses:
        pos = (u.slot, u.layer_start)
        if u.stream not in first or pos < first[u.stream][0]:
            first[u.stream] = (pos, {u.rank})
        elif pos == first[u.stream][0]:
            first[u.stream][1].add(u.rank)
    return {s: ranks for s, (_, ranks) in first.items()}


def per_rank_rng_plan(reference: Layout, old: Layout, new: Layout) -> RngPlan:
    """Stream uses and handoffs under `new`, plus the state copies needed when switching from
    `old`: at a step boundary a stream's state sits with the ranks that use it first; ranks that
    newly need it get it from a surviving holder, or from the stage backup (src None) if all died."""
    new_uses, old_uses = stream_uses(reference, new), stream_uses(reference, old)
    alive = set(new.ranks())
    old_first, new_first = _first_holders(old_uses), _first_holders(new_uses)
    copies: list[tuple[StreamId, int | None, int]] = []
    for stream, holders in sorted(new_first.items()):
        had = old_first.get(stream, set())
        sources = sorted(had & alive)
        copies.extend((stream, sources[0] if sources else None, dst) for dst in sorted(holders - had))
    handoffs = _handoffs(new_uses)
    return RngPlan(
        "per_rank",
        new_uses,
        handoffs,
        tuple(copies),
        f"{len(new_uses)} stream uses, {len(handoffs)} in-step state handoffs, "
        f"{len(copies)} state copies at apply time",
    )


def rng_plan(reference: Layout, old: Layout, new: Layout) -> RngPlan:
    """The RNG part of a plan for `new.rng_mode`."""
    if new.rng_mode == "placement_invariant":
        return RngPlan(
            "placement_invariant",
            (),
            (),
            (),
            "counter-based keys (seed, step, layer, sample): no RNG state moves",
        )
    return per_rank_rng_plan(reference, old, new)


def _check_compatible(reference: Layout, layout: Layout) -> None:
    ref_shape = (reference.num_layers, reference.global_batch, reference.num_micro_batches)
    shape = (layout.num_layers, layout.global_batch, layout.num_micro_batches)
    if ref_shape != shape:
        raise ValueError(
            f"reference layout (L, B, M)={ref_shape} differs from layout {shape}; "
            "RNG streams can only be remapped between layouts of the same job"
        )
