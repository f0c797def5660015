"""Resume first, re-protect after: which shard copies a new layout must re-seed, and the window in
which they are not there yet (issue 23, item 2; ElasWave §5.1-5.2).

A plan gives some shards new backup pairs (owner -> holder, `planners.backup`): the owner's shard
changed (its stage lost or gained a rank, a block moved in or out of it) or its copy now lives on
another rank. Every such copy needs a full seed (parameters and both Adam moments of the shard)
before it protects anything; a copy whose owner kept exactly its shard and whose holder kept it
is still up to date and is kept. The executors re-seed the moved copies in the background over
the first `until_step - from_step + 1` steps on the new layout instead of before the first one,
so training resumes as soon as every rank holds its own shards of the committed step.

Until the step whose commit closes the window (`ReprotectWindow.until_step`), the moved copies
protect nothing: a loss in that window whose only surviving copies are among them is a RESTORE
(`planners.applicability.judge(..., unprotected=...)`), which both the Core (from the window the
workers report) and the executors (which compute the same pairs) apply. Every function here is
pure: the Core and every executor derive the same pairs from the same layouts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from planners.backup import backup_holder_sets
from planners.layout import Layout
from planners.zero import stage_ownership

Pair = tuple[int, int]  # (owner rank, holder rank): one copy of the owner's shard
# rank -> its shard as (layer, start, stop) for every layer of its stage, empty ones included
ShardIntervals = dict[int, tuple[tuple[int, int, int], ...]]


def backup_pairs(layout: Layout) -> frozenset[Pair]:
    """Every copy the layout keeps: (owner, holder) for each holder of each shard."""
    return frozenset((o, h) for o, hs in backup_holder_sets(layout).items() for h in hs)


def shard_intervals(layout: Layout) -> ShardIntervals:
    """rank -> its ZeRO-1 shard: (layer, start, stop) for every layer of its stage, the engine's
    convention (`executor.zero.unit_ownership`: a layer it owns nothing of is (layer, 0, 0))."""
    out: ShardIntervals = {}
    for stage in layout.stages:
        owned = {(r, layer): (0, 0) for r in stage.ranks for layer in stage.layers}
        for iv in stage_ownership(layout, stage):
            owned[(iv.rank, iv.layer)] = (iv.start, iv.stop)
        for r in stage.ranks:
            out[r] = tuple((layer, *owned[(r, layer)]) for layer in stage.layers)
    return out


def reseed_pairs(old: Layout | None, new: Layout, unprotected: Iterable[Pair] = ()) -> frozenset[Pair]:
    """The copies of `new` that need a full seed after a plan from committed layout `old` (None:
    nothing in memory carries over, as after a RESTORE): every pair of `new` except those `old`
    kept up to date (same owner, same holder, the owner's shard unchanged) and not themselves
    still being re-seeded (`unprotected`, the window open at the committed step)."""
    wanted = backup_pairs(new)
    if old is None:
        return wanted
    before, after = shard_intervals(old), shard_intervals(new)
    still = frozenset(unprotected)
    kept = {
        (o, h) for o, h in wanted & backup_pairs(old) if before.get(o) == after.get(o) and (o, h) not in still
    }
    return wanted - kept


@dataclass(frozen=True)
class ReprotectWindow:
    """The copies a plan's layout re-seeds in the background, and the steps they do not protect:
    from `from_step` (the first step trained on the layout) until the commit of `until_step`,
    which waits for every seed. `closed_step` is that commit once it happened (None: open, or cut
    short by a newer plan before it; `superseded_by` then names the plan)."""

    epoch: int
    pairs: tuple[Pair, ...]
    from_step: int
    until_step: int
    closed_step: int | None = None
    superseded_by: int | None = None

    def __post_init__(self) -> None:
        if self.from_step < 0 or self.until_step < self.from_step:
            raise ValueError(
                f"a re-protection window runs from step {self.from_step} to step {self.until_step}: "
                "it must start at a step >= 0 and end at or after it"
            )
        if any(o == h or o < 0 or h < 0 for o, h in self.pairs):
            raise ValueError(
                f"backup pairs must be (owner, holder) of two ranks >= 0, got {list(self.pairs)}"
            )

    @property
    def owners(self) -> tuple[int, ...]:
        """The ranks whose shards have fewer copies than the layout keeps during the window."""
        return tuple(sorted({o for o, _ in self.pairs}))

    def open_at(self, committed_step: int) -> bool:
        """Whether the copies are still missing for a job whose last committed step is
        `committed_step` (a failure in the step after it finds them missing)."""
        return self.closed_step is None and self.superseded_by is None and committed_step < self.until_step

    def as_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "owners": list(self.owners),
            "pairs": [list(p) for p in self.pairs],
            "from_step": self.from_step,
            "until_step": self.until_step,
            "closed_step": self.closed_step,
            "superseded_by": self.superseded_by,
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ReprotectWindow:
        return ReprotectWindow(
            int(d["epoch"]),
            tuple(sorted((int(o), int(h)) for o, h in d["pairs"])),
            int(d["from_step"]),
            int(d["until_step"]),
            None if d.get("closed_step") is None else int(d["closed_step"]),
            None if d.get("superseded_by") is None else int(d["superseded_by"]),
        )
