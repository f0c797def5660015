"""Dataflow planner: micro-batch resizing (ElasWave §4.1, Fig. 3 step 1).

When a stage loses ranks, the samples those ranks processed in every micro-batch slot are spread
over the stage's survivors, so `ranks x micro-batch size` per slot, the number of slots M and the
global batch B stay constant (DP=3, size 2 -> DP=2, size 3). On scale-out the reverse happens:
new ranks join a stage and every rank's share shrinks. The pipeline schedule is unchanged; only
each micro-batch's service time changes (which the graph planner, §4.2, then rebalances).

Gradient scale: the training loss is the *sum* of per-sample losses divided by the fixed global
batch B (not a mean over a rank's micro-batch), so a rank's gradient contribution is exactly the
sum over the samples it processed / B whatever its share. Uneven splits therefore never change the
gradient scale, and the summed gradient of a step is the fault-free one (up to fp32 addition
order, §4.4).

Splits stay exact: a slot of s samples over D ranks gives `s % D` ranks one extra sample. A stage
that loses *all* of its ranks cannot be fixed by resizing; `drop_stage` hands its layers to a
neighbour so the graph planner can re-partition.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import chain

from planners.layout import Layout, SampleRange, StageLayout


@dataclass(frozen=True)
class DataflowResult:
    layout: Layout
    stage_micro_batch_sizes: tuple[int, ...]
    reason: str


class StageEmptied(ValueError):
    """Every rank of a stage was lost: resizing alone cannot keep the job running."""

    def __init__(self, stages: Sequence[int]) -> None:
        self.stages = tuple(stages)
        super().__init__(
            f"stage(s) {list(stages)} lost every rank; micro-batch resizing cannot serve "
            "their layers (use drop_stage and re-partition)"
        )


def stage_micro_batch_size(layout: Layout, stage: int) -> int:
    """The largest number of samples any rank of `stage` processes in one slot: the micro-batch
    size that sets the stage's mini-step time (DP peers wait for the slowest)."""
    s = layout.stages[stage]
    # Slot sizes are floor or ceil of B/M and the last slot always has the ceiling size.
    slot = layout.slot_range(layout.num_micro_batches - 1)
    if not s.sample_weights:
        return -(-len(slot) // len(s.ranks))
    # Largest-remainder splits can give a rank less of a bigger slot (Alabama paradox): check
    # both slot sizes that occur.
    sizes = {len(layout.slot_range(0)), len(slot)}
    return max(len(r) for n in sizes for r in s.split_slot(SampleRange(0, n)))


def micro_batch_sizes(layout: Layout) -> tuple[int, ...]:
    return tuple(stage_micro_batch_size(layout, p) for p in range(layout.num_stages))


def resize_after_loss(layout: Layout, lost_ranks: Iterable[int]) -> DataflowResult:
    """Remove `lost_ranks` from their stages; survivors take their samples (§4.1).

    Raises ValueError for a rank not in the layout and StageEmptied when a stage has no survivor.
    Frequencies of lost ranks are dropped; layer boundaries are untouched.
    """
    lost = set(lost_ranks)
    # set.intersection walks each rank tuple in C: O(ranks) without a Python loop over them.
    lost_by_stage = {s.stage: sorted(lost.intersection(s.ranks)) for s in layout.stages}
    unknown = lost - {r for rs in lost_by_stage.values() for r in rs}
    if unknown:
        raise ValueError(f"lost ranks {sorted(unknown)} are not in the layout")
    emptied = [s.stage for s in layout.stages if lost and len(lost_by_stage[s.stage]) == s.dp_size]
    if emptied:
        raise StageEmptied(emptied)
    stages = tuple(
        _without(s, lost_by_stage[s.stage]) if lost_by_stage[s.stage] else s for s in layout.stages
    )
    freqs = tuple((r, f) for r, f in layout.frequencies_mhz if r not in lost)
    new = replace(layout, stages=stages, frequencies_mhz=freqs)
    return _result(layout, new, f"lost ranks {sorted(lost)}")


def resize_after_join(layout: Layout, joins: Mapping[int, Sequence[int]]) -> DataflowResult:
    """Add ranks to stages (`{stage: [new ranks]}`), appended to the DP order; every rank of a
    joined stage takes a smaller share of each slot. A weighted stage gives newcomers the mean
    weight of its current ranks (rounded, at least 1)."""
    present = set(layout.ranks())
    for stage, ranks in joins.items():
        if not 0 <= stage < layout.num_stages:
            raise ValueError(f"cannot join stage {stage}: layout has stages 0..{layout.num_stages - 1}")
        clash = present.intersection(ranks)
        if clash or len(set(ranks)) != len(ranks):
            raise ValueError(
                f"joining ranks {sorted(ranks)} to stage {stage}: ranks "
                f"{sorted(clash) or 'listed twice'} already present"
            )
        present.update(ranks)
    stages = tuple(_with(s, tuple(joins.get(s.stage, ()))) for s in layout.stages)
    new = replace(layout, stages=stages)
    return _result(layout, new, f"joined {dict((k, list(v)) for k, v in sorted(joins.items()))}")


def drop_stage(layout: Layout, stage: int) -> Layout:
    """Remove a stage that has no ranks left; its layers go to the previous stage (the next one for
    stage 0). The result is a valid but unbalanced layout for the graph planner to re-partition."""
    if layout.num_stages < 2:
        raise ValueError("cannot drop the only stage of a layout")
    if not 0 <= stage < layout.num_stages:
        raise ValueError(f"stage {stage} out of range [0, {layout.num_stages})")
    gone = layout.stages[stage]
    kept: list[StageLayout] = []
    for s in layout.stages:
        if s.stage == stage:
            continue
        if s.stage == stage - 1:
            s = replace(s, layer_stop=gone.layer_stop)
        elif stage == 0 and s.stage == 1:
            s = replace(s, layer_start=gone.layer_start)
        kept.append(replace(s, stage=len(kept)))
    caps = layout.stage_mem_cap_bytes
    if caps is not None:
        caps = tuple(c for p, c in enumerate(caps) if p != stage)
    lost = set(gone.ranks)
    freqs = tuple((r, f) for r, f in layout.frequencies_mhz if r not in lost)
    return replace(layout, stages=tuple(kept), stage_mem_cap_bytes=caps, frequencies_mhz=freqs)


def _without(stage: StageLayout, lost: list[int]) -> StageLayout:
    # Slice around the lost positions so the survivors' tuple is copied in C, not rank by rank.
    gone = sorted(stage.ranks.index(r) for r in set(lost))
    keep = [slice(a + 1, b) for a, b in zip([-1, *gone], [*gone, len(stage.ranks)], strict=True)]
    ranks = tuple(chain.from_iterable(stage.ranks[sl] for sl in keep))
    weights = stage.sample_weights
    if weights:
        weights = tuple(chain.from_iterable(weights[sl] for sl in keep))
        if sum(weights) == 0:
            weights = ()  # only zero-weight ranks survived: fall back to equal shares
    return replace(stage, ranks=ranks, sample_weights=weights)


def _with(stage: StageLayout, joined: tuple[int, ...]) -> StageLayout:
    if not joined:
        return stage
    weights = stage.sample_weights
    if weights:
        mean = max(1, round(sum(weights) / len(weights)))
        weights = weights + (mean,) * len(joined)
    return replace(stage, ranks=stage.ranks + joined, sample_weights=weights)


def _result(old: Layout, new: Layout, what: str) -> DataflowResult:
    before, after = micro_batch_sizes(old), micro_batch_sizes(new)
    changed = [
        f"stage {p}: DP {old.stages[p].dp_size}->{new.stages[p].dp_size}, micro-batch {before[p]}->{after[p]}"
        for p in range(new.num_stages)
        if old.stages[p].ranks != new.stages[p].ranks
    ]
    reason = (
        f"{what}: resized micro-batches ({'; '.join(changed) or 'no stage changed'}); "
        f"global batch {new.global_batch} and {new.num_micro_batches} slots unchanged"
    )
    return DataflowResult(new, after, reason)
