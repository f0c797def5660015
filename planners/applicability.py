"""Can the executor reach a new layout in place? One rule for the Core and the executor.

The Core asks before it publishes a plan (`judge`), and publishes a RESTORE plan (reload the
latest durable checkpoint in place, `planners.layout.PlanMode`) when the answer is no; the
executor asks the same question before it edits anything (`executor.fabric.relayout`), so a plan
it refuses is one the Core could not have known better about, and it acknowledges FAILED with
this module's reason.

In place means from the committed in-memory state (ElasWave §5): under ZeRO-1 every rank of a
stage holds the stage's parameters, so only the optimizer shards of lost ranks must be rebuilt,
from the ring snapshot their DP predecessor keeps (§5.1, Fig. 6a). A lost rank whose holder is
lost too (two ring neighbours on one node, or a whole stage) has no copy left; neither has the
shard of a lost rank alone in its stage (DP = 1). The executor's structural limits (a plan may
remove ranks and move blocks between adjacent stages, nothing else) are checked first.
"""

from __future__ import annotations

from dataclasses import dataclass

from planners.layout import Layout

UNSUPPORTED = "unsupported by the engine's in-place re-layout"


@dataclass(frozen=True)
class Verdict:
    """Whether `old -> new` applies in place, and if not, why (one sentence a user can act on)."""

    in_place: bool
    reason: str
    lost: frozenset[int]
    without_copy: tuple[int, ...] = ()  # lost ranks whose optimizer shard has no surviving copy


def snapshot_holder(layout: Layout, rank: int) -> int | None:
    """The rank whose host memory keeps `rank`'s shard snapshot: its DP predecessor in the ring
    (executor.fabric.snapshot.ring_holder); None when the stage has one rank (no ring)."""
    ranks = layout.stage_layout_of_rank(rank).ranks
    if len(ranks) < 2:
        return None
    return ranks[(ranks.index(rank) - 1) % len(ranks)]


def lost_without_copy(layout: Layout, lost: frozenset[int]) -> tuple[int, ...]:
    """Lost ranks of `layout` whose shard and snapshot are both gone."""
    gone = []
    for rank in sorted(lost & frozenset(layout.ranks())):
        holder = snapshot_holder(layout, rank)
        if holder is None or holder in lost:
            gone.append(rank)
    return tuple(gone)


def structural_problem(old: Layout, new: Layout) -> str | None:
    """The first change of `old -> new` the executor cannot make in place, or None."""
    joined = set(new.ranks()) - set(old.ranks())
    if joined:
        return (
            f"{UNSUPPORTED}: adding ranks (ranks {sorted(joined)} join in this plan). Only "
            "ranks already in the job have a process and state here, so a plan may remove "
            "ranks and move layers but not add ranks"
        )
    if old.num_layers != new.num_layers or old.layer_numel != new.layer_numel:
        return f"{UNSUPPORTED}: a different model (layer count or sizes differ)"
    if old.global_batch != new.global_batch:
        return (
            f"{UNSUPPORTED}: changing the global batch ({old.global_batch} -> "
            f"{new.global_batch}); it is fixed for a job"
        )
    if old.num_stages != new.num_stages:
        return (
            f"{UNSUPPORTED}: changing the number of stages ({old.num_stages} -> "
            f"{new.num_stages}). Stages are re-laid out one by one; none can be added or dropped"
        )
    jumps = [
        (layer, old.stage_of_layer(layer), new.stage_of_layer(layer))
        for layer in range(old.num_layers)
        if abs(old.stage_of_layer(layer) - new.stage_of_layer(layer)) > 1
    ]
    if jumps:
        desc = ", ".join(f"block {lay}: stage {a} -> {b}" for lay, a, b in jumps)
        return (
            f"{UNSUPPORTED}: moving a block by more than one stage in one plan ({desc}). "
            "Migration moves blocks between adjacent stages only (§6.2)"
        )
    return None


def judge(old: Layout, new: Layout) -> Verdict:
    """Whether the executors can go from committed layout `old` to `new` in place."""
    lost = frozenset(old.ranks()) - frozenset(new.ranks())
    gone = lost_without_copy(old, lost)
    if gone:
        stages = sorted({old.stage_of_rank(r) for r in gone})
        return Verdict(
            False,
            f"the optimizer state of lost ranks {list(gone)} (stages {stages}) has no surviving copy: "
            "its ring snapshot was on a rank lost with it",
            lost,
            gone,
        )
    problem = structural_problem(old, new)
    if problem is not None:
        return Verdict(False, problem, lost)
    return Verdict(True, "", lost)
