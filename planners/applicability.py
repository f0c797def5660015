"""Can the executor reach a new layout in place? One rule for the Core and the executor.

The Core asks before it publishes a plan (`judge`), and publishes a RESTORE plan (reload the
latest durable checkpoint in place, `planners.layout.PlanMode`) when the answer is no; the
executor asks the same question before it edits anything (`executor.fabric.relayout`), so a plan
it refuses is one the Core could not have known better about, and it acknowledges FAILED with
this module's reason.

In place means from the committed in-memory state (ElasWave §5): under ZeRO-1 every rank of a
stage holds the stage's parameters, and every rank's shard (its parameter slice and Adam moments)
has `Layout.backup_copies` backups on other ranks (`planners.backup`: the first on the DP
predecessor of §5.1 on another node, else a rank of a neighbouring stage; further copies on
further failure domains). A lost rank is recovered from its first copy still alive; only a lost
rank whose every holder is lost too has no copy left, and only then is the plan a RESTORE. With
a copy of everything, the executors can reach any layout over the surviving ranks: fewer ranks,
fewer stages (a whole stage lost, its blocks taken by its neighbours from the backups), blocks
moved any distance (state that travels between stages that are not adjacent gets a two-rank
group for the transfer: `far_pairs`), and ranks added (a joining worker, `Plan.joiners`, holds no
state yet: it receives its blocks' parameters and its shard from their live owners, the same
rebuild read in the other direction, ElasWave §5.2). Ranks a plan drops while they are alive
(`Plan.standby`: a whole DP replica dropped) are not lost: they hand their live shards over to
the ranks that take their work (`handover_pairs`), then wait as spares for a plan that takes
them back (`joiners`).

Right after a plan the copies its layout moved are being re-seeded in the background
(`planners.reprotect`): until that window closes they protect nothing, so `judge` takes the
copies still missing (`unprotected`, (owner, holder) pairs) and counts a lost rank whose first
surviving copy is one of them as without a copy: a RESTORE. Conservative where a shard keeps
several copies: recovery reads the first surviving one (`recovery_sources`), so a later copy
that is up to date does not make such a loss in place.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from planners.backup import backup_holder_sets, first_surviving, recovery_sources
from planners.layout import Layout

UNSUPPORTED = "unsupported by the engine's in-place re-layout"


@dataclass(frozen=True)
class Verdict:
    """Whether `old -> new` applies in place, and if not, why (one sentence a user can act on)."""

    in_place: bool
    reason: str
    lost: frozenset[int]
    without_copy: tuple[int, ...] = ()  # lost ranks whose optimizer shard has no surviving copy


def lost_without_copy(
    layout: Layout, lost: frozenset[int], unprotected: Iterable[tuple[int, int]] = ()
) -> tuple[int, ...]:
    """Lost ranks of `layout` whose shard and every copy of it are gone (`planners.backup`), or
    whose first surviving copy is still being re-seeded (`unprotected`, module docstring)."""
    sets, missing = backup_holder_sets(layout), frozenset(unprotected)
    out = []
    for r in sorted(lost & frozenset(layout.ranks())):
        src = first_surviving(sets, r, lost)
        if src is None or (r, src) in missing:
            out.append(r)
    return tuple(out)


def unit_sources(old: Layout, lost: frozenset[int], layer: int) -> tuple[int, ...]:
    """The live ranks that hold block `layer`'s committed state after losing `lost`: every rank
    of its old stage, a lost one replaced by its first surviving backup holder (ranks without a
    copy left out)."""
    sets = backup_holder_sets(old)
    out = []
    for rank in old.stages[old.stage_of_layer(layer)].ranks:
        src = first_surviving(sets, rank, lost) if rank in lost else rank
        if src is not None and src not in lost:
            out.append(src)
    return tuple(dict.fromkeys(out))


def far_pairs(old: Layout, new: Layout, lost: frozenset[int]) -> tuple[tuple[int, int], ...]:
    """(source, destination) ranks whose state must travel between two stages of `new` that are
    not adjacent (a block moved by more than one stage): the executors add a two-rank group for
    each (`executor.comm.groups.transfer_groups`), since their stage and pipeline groups hold
    only one stage or two adjacent ones."""
    pairs: set[tuple[int, int]] = set()
    kept = frozenset(new.ranks())
    for layer in range(new.num_layers):
        dst_stage = new.stages[new.stage_of_layer(layer)]
        for src in unit_sources(old, lost, layer):
            if src in kept and abs(new.stage_of_rank(src) - dst_stage.stage) > 1:
                pairs.update((src, dst) for dst in dst_stage.ranks)
    return tuple(sorted(pairs))


def handover_pairs(
    old: Layout, new: Layout, standby: frozenset[int], lost: frozenset[int] = frozenset()
) -> tuple[tuple[int, int], ...]:
    """(standby rank, destination) pairs: a rank the plan drops while it is alive (`Plan.standby`,
    a DP replica dropped) hands its live shard over to the ranks of `new` that hold its old
    stage's blocks, and the copy it keeps of a `lost` rank (when recovery reads that one) to the
    ranks that hold the lost rank's blocks. It is in no group of `new`, so every such pair gets
    a two-rank group for the transfer (`executor.comm.groups.transfer_groups`), as `far_pairs` do."""
    serves = {rank: {rank} for rank in standby}
    for owner, src in recovery_sources(old, lost).items():
        if src in standby:
            serves[src].add(owner)
    pairs: set[tuple[int, int]] = set()
    for rank, owners in sorted(serves.items()):
        for stage in {old.stage_of_rank(o) for o in owners}:
            s = old.stages[stage]
            for layer in range(s.layer_start, s.layer_stop):
                pairs.update((rank, dst) for dst in new.stages[new.stage_of_layer(layer)].ranks)
    return tuple(sorted(pairs))


def standby_problem(old: Layout, new: Layout, standby: frozenset[int]) -> str | None:
    """Why `standby` is not a set of ranks `old -> new` drops (None: it is)."""
    wrong = sorted(standby - (frozenset(old.ranks()) - frozenset(new.ranks())))
    if wrong:
        return f"standby ranks {wrong} are not ranks the plan drops from its old layout"
    return None


def structural_problem(old: Layout, new: Layout) -> str | None:
    """The first change of `old -> new` the executor cannot make in place, or None. Ranks that
    `new` adds are not a problem: the plan names the workers that take them (`Plan.joiners`)."""
    if old.num_layers != new.num_layers or old.layer_numel != new.layer_numel:
        return f"{UNSUPPORTED}: a different model (layer count or sizes differ)"
    if old.global_batch != new.global_batch:
        return (
            f"{UNSUPPORTED}: changing the global batch ({old.global_batch} -> "
            f"{new.global_batch}); it is fixed for a job"
        )
    return None


def judge(
    old: Layout,
    new: Layout,
    standby: frozenset[int] = frozenset(),
    unprotected: Iterable[tuple[int, int]] = (),
) -> Verdict:
    """Whether the executors can go from committed layout `old` to `new` in place. `standby`:
    ranks `new` drops while they are alive (`Plan.standby`): they hand their live state over,
    so they are not lost and need no copy. `unprotected`: (owner, holder) copies of `old` still
    being re-seeded after the plan that made it (`planners.reprotect`): they hold nothing yet."""
    problem = standby_problem(old, new, standby)
    if problem is not None:
        return Verdict(False, problem, frozenset())
    lost = frozenset(old.ranks()) - frozenset(new.ranks()) - standby
    missing = frozenset(unprotected)
    gone = lost_without_copy(old, lost, missing)
    if gone:
        stages = sorted({old.stage_of_rank(r) for r in gone})
        sets = backup_holder_sets(old)
        reseeding = [r for r in gone if first_surviving(sets, r, lost) is not None]
        where = (
            "its ring snapshot was on a rank lost with it"
            if old.backup_copies == 1
            else f"every one of its {old.backup_copies} backup copies was on a rank lost with it"
        )
        if reseeding:
            where += (
                f" (for {reseeding}: the surviving copy is not seeded yet, inside the re-protection "
                "window of the last plan or of the job's first step)"
            )
        return Verdict(
            False,
            f"the optimizer state of lost ranks {list(gone)} (stages {stages}) has no surviving copy: {where}",
            lost,
            gone,
        )
    problem = structural_problem(old, new)
    if problem is not None:
        return Verdict(False, problem, lost)
    return Verdict(True, "", lost)
