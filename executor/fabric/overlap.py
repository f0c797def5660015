"""The remap transfer plan: the overlap matrix of old and new ownership, with lost sources
redirected to their ring snapshots (ElasWave §5.2, Fig. 7).

Ownership is per *unit* (a transformer block, the embedding, the head): unit -> the
(worker, lo, hi) element intervals of its flat vector. For blocks this is exactly
`planners.zero.layout_ownership` and the plan equals `planners.zero.shard_transfers` (the tests
check it); the engine also shards its embedding and head, which the planners do not model, so the
overlap is computed here over any ownership map. Only intervals whose owner changes are listed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from planners.backup import backup_holder_sets, first_surviving
from planners.layout import Layout
from planners.zero import layout_ownership

# unit -> (worker, lo, hi) intervals, disjoint, sorted by lo
Ownership = Mapping[str, Sequence[tuple[int, int, int]]]


class UnrecoverableLoss(RuntimeError):
    """A lost shard has no surviving copy (its ring neighbour is lost too, or it was alone)."""


@dataclass(frozen=True, order=True)
class RemapTransfer:
    """Elements [lo, hi) of `unit`, owned by `owner` before, go from `src` to `dst`;
    `from_snapshot` says `src` reads them from its host snapshot of `owner`."""

    unit: str
    lo: int
    hi: int
    owner: int
    src: int
    dst: int
    from_snapshot: bool

    @property
    def size(self) -> int:
        return self.hi - self.lo


def block_ownership(
    layout: Layout, unit_of_layer: Mapping[int, str] | None = None
) -> dict[str, list[tuple[int, int, int]]]:
    """The planners' ZeRO ownership of every block, keyed by unit name (default `block_<layer>`)."""
    name = (lambda k: unit_of_layer[k]) if unit_of_layer else (lambda k: f"block_{k}")
    return {
        name(layer): [(iv.rank, iv.start, iv.stop) for iv in ivs]
        for layer, ivs in layout_ownership(layout).items()
    }


def snapshot_holders(old: Layout, lost: Collection[int]) -> dict[int, int]:
    """Integrity check (Fig. 7a): lost worker -> the surviving worker of its stage whose backup
    covers it: its first copy still alive (`planners.backup`). A backup kept in another stage is
    the rebuild's to read (`executor.fabric.rebuild`), not the remap's."""
    every = backup_holder_sets(old)
    holders: dict[int, int] = {}
    for w in sorted(lost):
        stage = old.stage_layout_of_rank(w)
        if not every.get(w):
            raise UnrecoverableLoss(f"worker {w} was the only rank of the job: no snapshot of it exists")
        holder = first_surviving(every, w, lost)
        if holder is None:
            raise UnrecoverableLoss(f"worker {w} and every snapshot holder of it {list(every[w])} were lost")
        if holder not in stage.ranks:
            raise UnrecoverableLoss(
                f"worker {w} is backed up on worker {holder} of another stage: the remap reads only "
                "its own stage (this plan needs the rebuild)"
            )
        holders[w] = holder
    return holders


def overlap_transfers(old_own: Ownership, new_own: Ownership) -> list[tuple[str, int, int, int, int]]:
    """(unit, lo, hi, old_owner, new_owner) for every interval whose owner changes: M_overlap."""
    if set(old_own) != set(new_own):
        raise ValueError(f"ownership maps cover different units: {sorted(set(old_own) ^ set(new_own))}")
    out = []
    for unit in sorted(new_own):
        src, dst, i, j = list(old_own[unit]), list(new_own[unit]), 0, 0
        while i < len(src) and j < len(dst):
            (a_rank, a_lo, a_hi), (b_rank, b_lo, b_hi) = src[i], dst[j]
            lo, hi = max(a_lo, b_lo), min(a_hi, b_hi)
            if lo < hi and a_rank != b_rank:
                out.append((unit, lo, hi, a_rank, b_rank))
            if a_hi <= b_hi:
                i += 1
            else:
                j += 1
    return out


def remap_plan(
    old: Layout,
    new: Layout,
    lost: Collection[int],
    old_own: Ownership | None = None,
    new_own: Ownership | None = None,
) -> tuple[RemapTransfer, ...]:
    """Every owner-changing interval, lost owners replaced by their snapshot holders.

    Ownership defaults to the planners' block ownership of the two layouts."""
    unknown = set(lost) - set(old.ranks())
    if unknown:
        raise ValueError(f"lost workers {sorted(unknown)} are not in the old layout")
    still_there = set(lost) & set(new.ranks())
    if still_there:
        raise ValueError(f"lost workers {sorted(still_there)} still appear in the new layout")
    holders = snapshot_holders(old, lost)
    old_own = block_ownership(old) if old_own is None else old_own
    new_own = block_ownership(new) if new_own is None else new_own
    out = [
        RemapTransfer(unit, lo, hi, owner, holders.get(owner, owner), dst, owner in holders)
        for unit, lo, hi, owner, dst in overlap_transfers(old_own, new_own)
    ]
    return tuple(sorted(out))


def owned_by(own: Ownership, worker: int) -> list[tuple[str, int, int]]:
    return [
        (unit, lo, hi) for unit, ivs in sorted(own.items()) for w, lo, hi in ivs if w == worker and hi > lo
    ]
