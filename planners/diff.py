"""What changes between two layouts: the work an executor derives from a Plan (docs/architecture.md ("The central idea")).

`diff_layouts(old, new)` lists ranks added and removed, stages whose rank set changed, layers
that move between stages, frequency changes, and the ZeRO overlap matrix — for each layer, every
element interval whose owner changes (`ShardTransfer`), so the executor moves only what must move
(ElasWave Fig. 7b).
"""

from __future__ import annotations

from dataclasses import dataclass

from planners.layout import Layout
from planners.zero import ShardTransfer, shard_transfers


@dataclass(frozen=True, order=True)
class LayerMove:
    layer: int
    from_stage: int
    to_stage: int


@dataclass(frozen=True)
class LayoutDiff:
    ranks_added: tuple[int, ...]
    ranks_removed: tuple[int, ...]
    stages_changed: tuple[int, ...]
    layer_moves: tuple[LayerMove, ...]
    zero_transfers: tuple[ShardTransfer, ...]
    frequency_changes: tuple[tuple[int, int | None, int | None], ...]
    samples_changed: bool
    reason: str

    @property
    def is_empty(self) -> bool:
        return not (
            self.ranks_added
            or self.ranks_removed
            or self.stages_changed
            or self.layer_moves
            or self.zero_transfers
            or self.frequency_changes
            or self.samples_changed
        )

    @property
    def moved_elements(self) -> int:
        return sum(t.size for t in self.zero_transfers)


def diff_layouts(old: Layout, new: Layout, *, include_zero: bool = True) -> LayoutDiff:
    """Compare two layouts of the same model (same `num_layers` and `layer_numel`).

    `stages_changed` holds the new stage indices whose rank tuple (set or DP order) differs from the
    old stage of the same index; a stage that did not exist before counts as changed. Set
    `include_zero=False` to skip the overlap matrix (it is O(layers x ranks) for interleaved ZeRO).
    """
    if old.num_layers != new.num_layers:
        raise ValueError(f"layouts have different num_layers ({old.num_layers} vs {new.num_layers})")
    old_ranks, new_ranks = set(old.ranks()), set(new.ranks())
    added, removed = tuple(sorted(new_ranks - old_ranks)), tuple(sorted(old_ranks - new_ranks))
    stages_changed = tuple(
        s.stage for s in new.stages if s.stage >= old.num_stages or old.stages[s.stage].ranks != s.ranks
    )
    moves = tuple(
        LayerMove(layer, old.stage_of_layer(layer), new.stage_of_layer(layer))
        for layer in range(new.num_layers)
        if old.stage_of_layer(layer) != new.stage_of_layer(layer)
    )
    transfers = shard_transfers(old, new) if include_zero else ()
    old_f, new_f = dict(old.frequencies_mhz), dict(new.frequencies_mhz)
    freq = tuple(
        (r, old_f.get(r), new_f.get(r))
        for r in sorted(old_f.keys() | new_f.keys())
        if old_f.get(r) != new_f.get(r) and r in new_ranks
    )
    samples_changed = (
        (old.global_batch, old.num_micro_batches) != (new.global_batch, new.num_micro_batches)
        or any(
            o.ranks != n.ranks or o.sample_weights != n.sample_weights
            for o, n in zip(old.stages, new.stages, strict=False)
        )
        or old.num_stages != new.num_stages
    )
    reason = (
        f"+{len(added)}/-{len(removed)} ranks, {len(stages_changed)} stages changed, "
        f"{len(moves)} layers move, {len(transfers)} ZeRO intervals "
        f"({sum(t.size for t in transfers)} elements) move, {len(freq)} frequency changes"
    )
    return LayoutDiff(added, removed, stages_changed, moves, transfers, freq, samples_changed, reason)
