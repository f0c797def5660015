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
plan has nothing to remap. A plan outside these two steps (the stage count changes because a
whole stage was lost, a live rank changes stage, a block moves by more than one stage, a lost shard's backup lives in
another stage, ranks added by joining workers) is one rebuild from live shards and backups
(`executor.fabric.rebuild`). Refused up front (`RelayoutError`, before any group is edited):
changing the model or the global batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from executor.migration import moved_layers
from planners.applicability import UNSUPPORTED, structural_problem
from planners.backup import recovery_sources
from planners.layout import Layout


class RelayoutError(ValueError):
    """The plan asks for a change the engine cannot apply in place; nothing was changed.

    Unsupported in place: changing the model or the global batch."""


@dataclass(frozen=True)
class Relayout:
    lost: frozenset[int]
    remap_to: Layout | None  # the new ranks with the old stage boundaries; None: nothing to remap
    moves: tuple[tuple[int, int, int], ...]  # (layer, from stage, to stage) of the migration step
    rebuild: bool = False  # neither step fits: one rebuild from live shards and backups

    @property
    def is_empty(self) -> bool:
        return self.remap_to is None and not self.moves and not self.rebuild


def with_boundaries(layout: Layout, bounds_from: Layout) -> Layout:
    """`layout` with the stage boundaries (layer ranges) of `bounds_from`, everything else kept."""
    stages = tuple(
        replace(s, layer_start=b.layer_start, layer_stop=b.layer_stop)
        for s, b in zip(layout.stages, bounds_from.stages, strict=True)
    )
    return replace(layout, stages=stages)


def plan_relayout(old: Layout, new: Layout, standby: frozenset[int] = frozenset()) -> Relayout:
    """Diff `old -> new` into a remap and a migration; raises RelayoutError (a ValueError) for a
    plan the engine cannot apply in place (see `RelayoutError`). `standby`: ranks dropped while
    alive (`Plan.standby`); they are not lost, and their live shards are handed over in one
    rebuild, where they are read like any live owner's."""
    check_supported(old, new)
    lost = frozenset(old.ranks()) - frozenset(new.ranks()) - standby
    if standby or needs_rebuild(old, new, lost):
        return Relayout(lost, None, (), rebuild=True)
    mid = with_boundaries(new, old)
    try:
        moves = moved_layers(mid, new)
    except ValueError as exc:  # only the checks above should reject a plan; keep the reason if not
        raise RelayoutError(f"{UNSUPPORTED}: the plan's layer moves cannot be migrated: {exc}") from None
    return Relayout(lost, None if mid == old else mid, moves)


def needs_rebuild(old: Layout, new: Layout, lost: frozenset[int]) -> bool:
    """Whether `old -> new` falls outside remap-then-migrate: the stage count changes, a live
    rank changes stage, a block moves by more than one stage, a lost shard's backup lives in
    another stage, or ranks join (a joiner holds nothing yet: everything it needs is read from
    live owners)."""
    if old.num_stages != new.num_stages or set(new.ranks()) - set(old.ranks()):
        return True
    # A live rank in another stage (stages regrouped at an unchanged count, `planners.elaswave_replicas`)
    # holds none of its new stage's parameters: the remap keeps every rank in its stage.
    if any(old.stage_of_rank(r) != new.stage_of_rank(r) for r in new.ranks()):
        return True
    if any(abs(old.stage_of_layer(k) - new.stage_of_layer(k)) > 1 for k in range(old.num_layers)):
        return True
    sources = recovery_sources(old, lost)  # the copy each lost shard is read from: its first alive
    return any(old.stage_of_rank(src) != old.stage_of_rank(r) for r, src in sources.items())


def check_supported(old: Layout, new: Layout) -> None:
    """Raise RelayoutError naming the first change of `old -> new` the engine cannot make in place
    (the rule the Core applies before publishing: `planners.applicability`)."""
    problem = structural_problem(old, new)
    if problem is not None:
        raise RelayoutError(problem)
