"""One diff of a plan into the two state movements the engine knows (ElasWave §4.2, §5.2, §6.2).

A plan from the Core may change which ranks serve each stage (a loss: the dataflow planner drops
the lost rank and resizes micro-batches, §4.1) *and* where the stage boundaries are (the graph
planner moves layers out of the damaged stage to rebalance the pipeline, §4.2). The executor
applies such a plan in two steps, each with its own, already exact, transfer plan:

1. live remap (§5.2) of the committed ZeRO-1 shards onto the new ranks with the *old* stage
   boundaries (`remap_to`): every unit stays in its stage, lost shards come from snapshots;
2. blocking layer migration (§6.2) from `remap_to` to the new layout: a pipeline-only change
   (every stage keeps its new ranks), whose moved blocks are `moves`.

Either step is skipped when it has nothing to do: a pure loss has no moves, a pipeline-only
plan has nothing to remap.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from executor.migration import moved_layers
from planners.layout import Layout


class RelayoutError(ValueError):
    """The plan asks for a change the engine cannot apply in place; nothing was changed."""


@dataclass(frozen=True)
class Relayout:
    lost: frozenset[int]
    remap_to: Layout | None  # the new ranks with the old stage boundaries; None: nothing to remap
    moves: tuple[tuple[int, int, int], ...]  # (layer, from stage, to stage) of the migration step

    @property
    def is_empty(self) -> bool:
        return self.remap_to is None and not self.moves


def with_boundaries(layout: Layout, bounds_from: Layout) -> Layout:
    """`layout` with the stage boundaries (layer ranges) of `bounds_from`, everything else kept."""
    stages = tuple(replace(s, layer_start=b.layer_start, layer_stop=b.layer_stop)
                   for s, b in zip(layout.stages, bounds_from.stages, strict=True))
    return replace(layout, stages=stages)


def plan_relayout(old: Layout, new: Layout) -> Relayout:
    """Diff `old -> new` into a remap and a migration; raises RelayoutError (a ValueError) for a
    plan the engine cannot apply in place: a rank that joins (it has no process and no state
    here), a different number of stages, or a block that would move more than one stage."""
    joined = set(new.ranks()) - set(old.ranks())
    if joined:
        raise RelayoutError(f"ranks {sorted(joined)} join in this plan; the engine's in-place re-layout "
                            "only removes ranks and moves layers")
    if old.num_stages != new.num_stages:
        raise RelayoutError(f"the plan changes the number of stages ({old.num_stages} -> {new.num_stages}); "
                            "the engine re-lays out stage by stage and cannot add or drop one")
    if old.num_layers != new.num_layers or old.layer_numel != new.layer_numel:
        raise RelayoutError("the plan describes a different model (layer count or sizes differ)")
    if old.global_batch != new.global_batch:
        raise RelayoutError(f"the global batch is fixed for a job ({old.global_batch}), plan says {new.global_batch}")
    mid = with_boundaries(new, old)
    try:
        moves = moved_layers(mid, new)
    except ValueError as exc:
        raise RelayoutError(f"the plan's layer moves cannot be migrated: {exc}") from None
    lost = frozenset(old.ranks()) - frozenset(new.ranks())
    return Relayout(lost, None if mid == old else mid, moves)
