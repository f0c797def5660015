"""ZeRO-1 shard ownership as element intervals, and what moving it costs (ElasWave §6.3, Fig. 10).

Two ownership layouts over the optimizer state O_i of every layer i of a stage with D DP ranks:

* **interleaved**: every layer is split into D near-equal shards and DP rank j owns shard j of
  *every* layer. Moving layer i to another stage is D disjoint rank-to-rank sends: |O_i| in total.
* **contiguous**: the stage's layers are concatenated (in layer order) into one flat buffer, which
  is cut into D near-equal chunks; DP rank j owns chunk j. Removing or adding a layer shifts every
  cut point, so besides the |O_i| cross-stage transfer each stage reshuffles about
  (D-1)/2 |O_i| internally: (D+1)/2 |O_i| on each of the two (concurrently resharding) stages.

Costs are computed from the actual interval overlaps (`shard_transfers`), never from the formula;
the formula is what the tests check the intervals against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planners.layout import Layout, SampleRange, StageLayout, make_uniform_layout, split_evenly


@dataclass(frozen=True, order=True)
class OwnedInterval:
    """Elements `[start, stop)` of layer `layer`'s flat optimizer state are owned by `rank`."""

    layer: int
    start: int
    stop: int
    rank: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, order=True)
class ShardTransfer:
    """Elements `[start, stop)` of layer `layer` move from `src_rank` to `dst_rank`.

    When `src_rank` is no longer in the new layout (it failed), the executor reads those elements
    from the holder of that rank's snapshot instead (parameter fabric, ElasWave §5).
    """

    layer: int
    start: int
    stop: int
    src_rank: int
    dst_rank: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def interleaved_ownership(layers: Sequence[int], layer_numel: Sequence[int],
                          ranks: Sequence[int]) -> tuple[OwnedInterval, ...]:
    """DP rank j owns shard j of every layer (shards differ in size by at most one element)."""
    out: list[OwnedInterval] = []
    for layer in layers:
        shards = split_evenly(SampleRange(0, layer_numel[layer]), len(ranks))
        out.extend(OwnedInterval(layer, s.start, s.stop, r) for s, r in zip(shards, ranks, strict=True)
                   if s.stop > s.start)
    return tuple(out)


def contiguous_ownership(layers: Sequence[int], layer_numel: Sequence[int],
                         ranks: Sequence[int]) -> tuple[OwnedInterval, ...]:
    """The stage's flat buffer (its layers in order) is cut into D near-equal chunks; rank j owns
    chunk j. Returned in layer-local element coordinates."""
    offsets = [0]
    for layer in layers:
        offsets.append(offsets[-1] + layer_numel[layer])
    chunks = split_evenly(SampleRange(0, offsets[-1]), len(ranks))
    out: list[OwnedInterval] = []
    for k, layer in enumerate(layers):
        base, end = offsets[k], offsets[k + 1]
        for chunk, rank in zip(chunks, ranks, strict=True):
            lo, hi = max(chunk.start, base), min(chunk.stop, end)
            if lo < hi:
                out.append(OwnedInterval(layer, lo - base, hi - base, rank))
    return tuple(out)


def stage_ownership(layout: Layout, stage: StageLayout) -> tuple[OwnedInterval, ...]:
    """Ownership of one stage's layers under `layout.zero_layout`, sorted by (layer, start)."""
    owner = interleaved_ownership if layout.zero_layout == "interleaved" else contiguous_ownership
    return owner(stage.layers, layout.layer_numel, stage.ranks)


def layout_ownership(layout: Layout) -> dict[int, tuple[OwnedInterval, ...]]:
    """layer -> its owned intervals in element order."""
    by_layer: dict[int, list[OwnedInterval]] = {}
    for stage in layout.stages:
        for iv in stage_ownership(layout, stage):
            by_layer.setdefault(iv.layer, []).append(iv)
    return {layer: tuple(ivs) for layer, ivs in sorted(by_layer.items())}


def ownership_problems(layout: Layout) -> tuple[str, ...]:
    """Every element of every layer owned by exactly one rank of the layer's stage (explicit check)."""
    problems: list[str] = []
    owned = layout_ownership(layout)
    for layer in range(layout.num_layers):
        stage_ranks = set(layout.stages[layout.stage_of_layer(layer)].ranks)
        pos = 0
        for iv in owned.get(layer, ()):
            if iv.start != pos:
                problems.append(f"ZeRO: layer {layer} elements [{pos}, {iv.start}) have no owner"
                                if iv.start > pos else
                                f"ZeRO: layer {layer} elements [{iv.start}, {pos}) have two owners")
            if iv.rank not in stage_ranks:
                problems.append(f"ZeRO: layer {layer} shard owned by rank {iv.rank} outside its stage")
            pos = max(pos, iv.stop)
        if pos != layout.layer_numel[layer]:
            problems.append(f"ZeRO: layer {layer} ownership ends at {pos}, layer has "
                            f"{layout.layer_numel[layer]} elements")
    return tuple(problems)


def shard_transfers(old: Layout, new: Layout) -> tuple[ShardTransfer, ...]:
    """The overlap matrix of old and new ownership: every element interval whose owner changes.

    Both layouts must describe the same layers with the same sizes. Intervals whose owner stays the
    same are not listed, so this is exactly the data that has to move (ElasWave Fig. 7b).
    """
    if old.layer_numel != new.layer_numel:
        raise ValueError("layouts disagree on layer_numel; ZeRO state cannot be remapped between them")
    old_own, new_own = layout_ownership(old), layout_ownership(new)
    out: list[ShardTransfer] = []
    for layer in range(new.num_layers):
        out.extend(_overlap(layer, old_own.get(layer, ()), new_own.get(layer, ())))
    return tuple(out)


def _overlap(layer: int, src: Sequence[OwnedInterval],
             dst: Sequence[OwnedInterval]) -> list[ShardTransfer]:
    """Two-pointer merge of two sorted, disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(src) and j < len(dst):
        a, b = src[i], dst[j]
        lo, hi = max(a.start, b.start), min(a.stop, b.stop)
        if lo < hi and a.rank != b.rank:
            out.append(ShardTransfer(layer, lo, hi, a.rank, b.rank))
        if a.stop <= b.stop:
            i += 1
        else:
            j += 1
    return out


@dataclass(frozen=True)
class MigrationCost:
    """Elements moved by a re-layout: in total, across stages, inside stages, and per stage.

    `per_stage_elements[p]` counts elements sent or received by ranks of new stage p over any link
    whose other end is a different rank; with the stages resharding concurrently, the busiest
    stage's count is the critical-path volume that ElasWave §6.3 compares.
    """

    total_elements: int
    cross_stage_elements: int
    intra_stage_elements: int
    per_stage_elements: tuple[int, ...]
    reason: str

    @property
    def critical_stage_elements(self) -> int:
        return max(self.per_stage_elements, default=0)


def migration_cost(old: Layout, new: Layout) -> MigrationCost:
    """Element counts of `shard_transfers(old, new)`, split by where they travel."""
    transfers = shard_transfers(old, new)
    stage_now = {r: s.stage for s in old.stages for r in s.ranks}
    stage_now.update({r: s.stage for s in new.stages for r in s.ranks})  # the new stage wins
    per_stage = [0] * max(new.num_stages, old.num_stages)
    cross = intra = 0
    for t in transfers:
        src, dst = stage_now[t.src_rank], stage_now[t.dst_rank]
        per_stage[dst] += t.size
        if src == dst:
            intra += t.size
        else:
            cross += t.size
            per_stage[src] += t.size
    return MigrationCost(cross + intra, cross, intra, tuple(per_stage),
                         f"{len(transfers)} interval transfers: {cross} elements across stages, "
                         f"{intra} inside stages ({old.zero_layout} -> {new.zero_layout})")


def layer_move_cost(zero_layout: str, layers_per_stage: int, dp: int,
                    layer_numel: int) -> MigrationCost:
    """Cost of moving the last layer of stage 0 to stage 1 of a 2-stage job with equal layers.

    Builds the two layouts and measures the intervals (Fig. 10's setting); the formula
    |O_i| (interleaved) vs (D+1)/2 |O_i| per stage (contiguous) is what tests compare this with.
    """
    num_layers = 2 * layers_per_stage
    old = make_uniform_layout(num_layers, 2, dp, global_batch=dp, num_micro_batches=1,
                              layer_numel=(layer_numel,) * num_layers,
                              zero_layout=zero_layout)  # type: ignore[arg-type]
    s0, s1 = old.stages
    moved = (StageLayout(0, 0, s0.layer_stop - 1, s0.ranks), StageLayout(1, s1.layer_start - 1,
                                                                         s1.layer_stop, s1.ranks))
    return migration_cost(old, old.replace(stages=moved))
