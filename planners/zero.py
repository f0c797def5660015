"""ZeRO-1 shard ownership as element intervals, and what moving it costs (ElasWave §6.3, Fig. 10).

Two ownership layouts over the optimizer state O_i of every layer i of a stage with D DP ranks:

* **interleaved**: every layer is split into D near-equal shards and DP rank j owns shard j of
  *every* layer. Moving layer i to another stage is D disjoint rank-to-rank sends: |O_i| in total.
* **contiguous**: the stage's layers are concatenated (in layer order) into one flat buffer, which
  is cut into D near-equal chunks; DP rank j owns chunk j. Removing or adding a layer shifts every
  cut point, so besides the |O_i| cross-stage transfer each stage reshuffles about
  (D-1)/2 |O_i| internally: (D+1)/2 |O_i| on each of the two (concurrently resharding) stages.

`migration_cost` counts the moved elements in closed form per pair of (old stage, new stage)
that share layers: O(P + L) Python steps, with numpy work proportional to the ranks of the stages
whose shard cut points actually change (a stage that keeps its ranks and its cuts costs O(1)). It
equals `migration_cost_from_transfers`, which enumerates every interval (`shard_transfers`, what
the executor moves); property tests check the two against each other and the §6.3 formula.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

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


def interleaved_ownership(
    layers: Sequence[int], layer_numel: Sequence[int], ranks: Sequence[int]
) -> tuple[OwnedInterval, ...]:
    """DP rank j owns shard j of every layer (shards differ in size by at most one element)."""
    out: list[OwnedInterval] = []
    for layer in layers:
        shards = split_evenly(SampleRange(0, layer_numel[layer]), len(ranks))
        out.extend(
            OwnedInterval(layer, s.start, s.stop, r)
            for s, r in zip(shards, ranks, strict=True)
            if s.stop > s.start
        )
    return tuple(out)


def contiguous_ownership(
    layers: Sequence[int], layer_numel: Sequence[int], ranks: Sequence[int]
) -> tuple[OwnedInterval, ...]:
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
                problems.append(
                    f"ZeRO: layer {layer} elements [{pos}, {iv.start}) have no owner"
                    if iv.start > pos
                    else f"ZeRO: layer {layer} elements [{iv.start}, {pos}) have two owners"
                )
            if iv.rank not in stage_ranks:
                problems.append(f"ZeRO: layer {layer} shard owned by rank {iv.rank} outside its stage")
            pos = max(pos, iv.stop)
        if pos != layout.layer_numel[layer]:
            problems.append(
                f"ZeRO: layer {layer} ownership ends at {pos}, layer has {layout.layer_numel[layer]} elements"
            )
    return tuple(problems)


def shard_transfers(old: Layout, new: Layout) -> tuple[ShardTransfer, ...]:
    """The overlap matrix of old and new ownership: every element interval whose owner changes.

    Both layouts must describe the same layers with the same sizes. Intervals whose owner stays the
    same are not listed, so this is exactly the data that has to move (ElasWave Fig. 7b).
    """
    if old.layer_numel != new.layer_numel:
        raise ValueError("layouts disagree on layer_numel; ZeRO state cannot be remapped between them")
    # Per layer, the common refinement of the old and new owners' cut points (numpy), skipping every
    # layer whose stage kept its ranks and its cuts: the work is proportional to what moves, not to
    # ranks x layers (a single failure among 100,000 ranks touches one stage's layers).
    prefix = np.concatenate(([0], np.cumsum(np.asarray(old.layer_numel, dtype=np.int64))))
    old_of, new_of = _stage_of_layers(old), _stage_of_layers(new)
    rank_arrays: dict[tuple[int, int], np.ndarray] = {}

    def ranks_of(which: int, stage: StageLayout) -> np.ndarray:
        key = (which, stage.stage)
        if key not in rank_arrays:
            rank_arrays[key] = np.fromiter(stage.ranks, dtype=np.int64, count=stage.dp_size)
        return rank_arrays[key]

    out: list[ShardTransfer] = []
    for layer in range(new.num_layers):
        a, b = old.stages[old_of[layer]], new.stages[new_of[layer]]
        same_cuts = old.zero_layout == new.zero_layout and (
            old.zero_layout == "interleaved" or (a.layer_start, a.layer_stop) == (b.layer_start, b.layer_stop)
        )
        total = int(prefix[layer + 1] - prefix[layer])
        if total == 0 or (same_cuts and a.ranks == b.ranks):
            continue
        lengths, i, j = _merge(
            _owner_cuts(old, a, layer, layer + 1, prefix),
            _owner_cuts(new, b, layer, layer + 1, prefix),
            total,
        )
        src, dst = ranks_of(0, a)[i], ranks_of(1, b)[j]
        moved = src != dst
        stops = np.cumsum(lengths)
        starts = stops - lengths
        out.extend(
            ShardTransfer(layer, lo, hi, s, d)
            for lo, hi, s, d in zip(
                starts[moved].tolist(),
                stops[moved].tolist(),
                src[moved].tolist(),
                dst[moved].tolist(),
                strict=True,
            )
        )
    return tuple(out)


def _stage_of_layers(layout: Layout) -> list[int]:
    out = [0] * layout.num_layers
    for s in layout.stages:
        out[s.layer_start : s.layer_stop] = [s.stage] * (s.layer_stop - s.layer_start)
    return out


def shard_transfers_by_intervals(old: Layout, new: Layout) -> tuple[ShardTransfer, ...]:
    """`shard_transfers` by listing every owned interval of both layouts and merging them (the
    O(ranks x layers) reference the fast version is tested against)."""
    if old.layer_numel != new.layer_numel:
        raise ValueError("layouts disagree on layer_numel; ZeRO state cannot be remapped between them")
    old_own, new_own = layout_ownership(old), layout_ownership(new)
    out: list[ShardTransfer] = []
    for layer in range(new.num_layers):
        out.extend(_overlap(layer, old_own.get(layer, ()), new_own.get(layer, ())))
    return tuple(out)


def _overlap(layer: int, src: Sequence[OwnedInterval], dst: Sequence[OwnedInterval]) -> list[ShardTransfer]:
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


def migration_cost_from_transfers(old: Layout, new: Layout) -> MigrationCost:
    """Element counts of `shard_transfers(old, new)`, split by where they travel (the reference
    that `migration_cost` computes in closed form; O(ranks x layers), for tests and small jobs)."""
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
    return MigrationCost(
        cross + intra,
        cross,
        intra,
        tuple(per_stage),
        f"{len(transfers)} interval transfers: {cross} elements across stages, "
        f"{intra} inside stages ({old.zero_layout} -> {new.zero_layout})",
    )


def migration_cost(old: Layout, new: Layout) -> MigrationCost:
    """Element counts of `shard_transfers(old, new)` without listing the intervals.

    An element moves when its old owner differs from its new owner; where it travels is decided,
    as in `migration_cost_from_transfers`, by the source rank's stage now (its new stage, or its old
    stage index when it left the job: the snapshot holder sends for it). For each pair of old
    stage p and new stage q sharing layers [s, t) the owners are piecewise constant, so the count is
    a merge of the two stages' cut points (`_moved_by_source`), skipped when the pair shares no rank
    (everything moves) or has the same ranks and cuts (nothing moves). Both layouts must pass
    `validate`'s structural checks (every layer held by exactly one stage).
    """
    if old.layer_numel != new.layer_numel:
        raise ValueError("layouts disagree on layer_numel; ZeRO state cannot be remapped between them")
    prefix = np.concatenate(([0], np.cumsum(np.asarray(old.layer_numel, dtype=np.int64))))
    sources: dict[int, _Sources] = {}
    per_stage = [0] * max(new.num_stages, old.num_stages)
    cross = intra = pairs = 0
    for p, q, s, t in _shared_blocks(old, new):
        src = sources.get(p) or sources.setdefault(p, _sources(old, new, p))
        pairs += 1
        for g, amount in _moved_by_source(old, new, p, q, s, t, src, prefix).items():
            per_stage[q] += amount
            if g == q:
                intra += amount
            else:
                cross += amount
                per_stage[g] += amount
    return MigrationCost(
        cross + intra,
        cross,
        intra,
        tuple(per_stage),
        f"closed form over {pairs} (old, new) stage pairs: {cross} elements across stages, "
        f"{intra} inside stages ({old.zero_layout} -> {new.zero_layout})",
    )


@dataclass(frozen=True)
class _Sources:
    """Where the ranks of one old stage are now: `uniform` when they all count toward one stage,
    else `stage_of_pos[j]` for DP position j; `shares` = new stages holding some of its ranks."""

    uniform: int | None
    stage_of_pos: np.ndarray | None
    shares: frozenset[int]


def _sources(old: Layout, new: Layout, p: int) -> _Sources:
    ranks = old.stages[p].ranks
    if p < new.num_stages and new.stages[p].ranks == ranks:
        return _Sources(p, None, frozenset({p}))
    remaining, where = set(ranks), {}
    for q in sorted(range(new.num_stages), key=lambda q: q != p):  # the same index first: the usual case
        if not remaining:
            break
        hit = remaining.intersection(new.stages[q].ranks)
        if hit:
            where[q] = hit
            remaining -= hit
    now = set(where) | ({p} if remaining else set())  # ranks that left count as their old stage
    if len(now) == 1:
        return _Sources(now.pop(), None, frozenset(where))
    pos = {r: j for j, r in enumerate(ranks)}
    stage_of_pos = np.full(len(ranks), p, dtype=np.int64)
    for q, hit in where.items():
        stage_of_pos[[pos[r] for r in hit]] = q
    return _Sources(None, stage_of_pos, frozenset(where))


def _shared_blocks(old: Layout, new: Layout) -> list[tuple[int, int, int, int]]:
    """(old stage, new stage, first layer, stop layer) for every pair whose layer blocks overlap."""
    out, i, j = [], 0, 0
    while i < old.num_stages and j < new.num_stages:
        a, b = old.stages[i], new.stages[j]
        lo, hi = max(a.layer_start, b.layer_start), min(a.layer_stop, b.layer_stop)
        if lo < hi:
            out.append((i, j, lo, hi))
        if a.layer_stop <= b.layer_stop:
            i += 1
        else:
            j += 1
    return out


def _moved_by_source(
    old: Layout, new: Layout, p: int, q: int, s: int, t: int, src: _Sources, prefix: np.ndarray
) -> dict[int, int]:
    """Elements of layers [s, t) whose owner changes from old stage p to new stage q, by the
    stage the source rank counts toward."""
    a, b = old.stages[p], new.stages[q]
    total = int(prefix[t] - prefix[s])
    if q not in src.shares:  # no rank in common: every element of the block moves
        if src.uniform is not None:
            return {src.uniform: total} if total else {}
        starts, pos = _owner_cuts(old, a, s, t, prefix)
        return _by_source(np.diff(np.append(starts, total)), pos, src)
    same_cuts = old.zero_layout == new.zero_layout and (
        old.zero_layout == "interleaved" or (a.layer_start, a.layer_stop) == (b.layer_start, b.layer_stop)
    )
    if a.ranks == b.ranks and same_cuts:
        return {}
    if a.ranks == b.ranks:  # same DP order: an element stays put iff its DP position does
        old_ranks = new_ranks = np.arange(a.dp_size)
    else:
        old_ranks = np.fromiter(a.ranks, dtype=np.int64, count=a.dp_size)
        new_ranks = np.fromiter(b.ranks, dtype=np.int64, count=b.dp_size)
    if old.zero_layout == new.zero_layout == "interleaved":
        # Every layer is cut on its own, so layers of equal size move the same way: merge once each.
        moved: dict[int, int] = {}
        for n, count in Counter(old.layer_numel[s:t]).items():
            merged = _merge(_even_starts(n, a.dp_size), _even_starts(n, b.dp_size), n)
            for g, x in _moved_segments(merged, old_ranks, new_ranks, src).items():
                moved[g] = moved.get(g, 0) + x * count
        return moved
    merged = _merge(_owner_cuts(old, a, s, t, prefix), _owner_cuts(new, b, s, t, prefix), total)
    return _moved_segments(merged, old_ranks, new_ranks, src)


Cuts = tuple[np.ndarray, np.ndarray]  # (segment starts, DP position owning each), from 0 upwards


def _even_starts(n: int, parts: int) -> Cuts:
    """Starts of `split_evenly(range(n), parts)` (DP position j owns the j-th)."""
    j = np.arange(parts, dtype=np.int64)
    base, extra = divmod(n, parts)
    return j * base + np.minimum(j, extra), j


def _owner_cuts(layout: Layout, stage: StageLayout, s: int, t: int, prefix: np.ndarray) -> Cuts:
    """Owners of layers [s, t) of `stage`, in coordinates where layer s starts at 0."""
    if layout.zero_layout == "interleaved":
        parts = [_even_starts(int(prefix[i + 1] - prefix[i]), stage.dp_size) for i in range(s, t)]
        starts = np.concatenate(
            [st + int(prefix[i] - prefix[s]) for i, (st, _) in zip(range(s, t), parts, strict=True)]
        )
        return starts, np.concatenate([pos for _, pos in parts])
    offset = int(prefix[s] - prefix[stage.layer_start])  # block start inside the stage's flat buffer
    starts, pos = _even_starts(int(prefix[stage.layer_stop] - prefix[stage.layer_start]), stage.dp_size)
    first = max(int(np.searchsorted(starts, offset, side="right")) - 1, 0)
    starts = np.clip(starts[first:] - offset, 0, int(prefix[t] - prefix[s]))
    return starts, pos[first:]


def _merge(old: Cuts, new: Cuts, total: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Common refinement of two partitions of [0, total): segment lengths and both owners.
    Empty shards share their start with the next shard, so `side='right'` picks the real owner."""
    cuts = np.concatenate((old[0], new[0]))
    cuts.sort(kind="stable")  # two sorted runs: timsort merges them in linear time
    cuts = cuts[(cuts < total) & np.concatenate(([True], cuts[1:] != cuts[:-1]))]
    lengths = np.diff(np.append(cuts, total))
    i = np.searchsorted(old[0], cuts, side="right") - 1
    j = np.searchsorted(new[0], cuts, side="right") - 1
    return lengths, old[1][i], new[1][j]


def _moved_segments(
    merged: tuple[np.ndarray, np.ndarray, np.ndarray],
    old_ranks: np.ndarray,
    new_ranks: np.ndarray,
    src: _Sources,
) -> dict[int, int]:
    lengths, i, j = merged
    moved = old_ranks[i] != new_ranks[j]
    return _by_source(lengths[moved], i[moved], src)


def _by_source(lengths: np.ndarray, pos: np.ndarray, src: _Sources) -> dict[int, int]:
    if src.uniform is not None:
        x = int(lengths.sum())
        return {src.uniform: x} if x else {}
    stages = src.stage_of_pos[pos] if src.stage_of_pos is not None else pos
    sums = np.bincount(stages, weights=lengths.astype(np.float64))  # exact below 2**53 elements
    return {g: int(round(x)) for g, x in enumerate(sums) if x}


def layer_move_cost(zero_layout: str, layers_per_stage: int, dp: int, layer_numel: int) -> MigrationCost:
    """Cost of moving the last layer of stage 0 to stage 1 of a 2-stage job with equal layers.

    Builds the two layouts and measures the intervals (Fig. 10's setting); the formula
    |O_i| (interleaved) vs (D+1)/2 |O_i| per stage (contiguous) is what tests compare this with.
    """
    num_layers = 2 * layers_per_stage
    old = make_uniform_layout(
        num_layers,
        2,
        dp,
        global_batch=dp,
        num_micro_batches=1,
        layer_numel=(layer_numel,) * num_layers,
        zero_layout=zero_layout,  # type: ignore[arg-type]
    )
    s0, s1 = old.stages
    moved = (
        StageLayout(0, 0, s0.layer_stop - 1, s0.ranks),
        StageLayout(1, s1.layer_start - 1, s1.layer_stop, s1.ranks),
    )
    return migration_cost(old, old.replace(stages=moved))


def joiner_bytes(old: Layout, new: Layout, bytes_per_element: int = 4) -> dict[int, int]:
    """What each rank that `new` adds to `old` receives when it joins in place (the growth issue:
    ElasWave §5.2's live remap read in the other direction), in bytes: the full parameters of its
    stage's layers (ZeRO-1 replicates them over the stage) and the two Adam moments of the
    intervals it owns (fp32: 4 bytes an element). The executor's measured figure is
    `executor.fabric.rebuild.RebuiltState.received_bytes`."""
    joined = set(new.ranks()) - set(old.ranks())
    out: dict[int, int] = {}
    for stage in new.stages:
        params = sum(new.layer_numel[layer] for layer in stage.layers)
        owned = {rank: 0 for rank in stage.ranks}
        for iv in stage_ownership(new, stage):
            owned[iv.rank] += iv.size
        for rank in stage.ranks:
            if rank in joined:
                out[rank] = bytes_per_element * (params + 2 * owned[rank])
    return out
