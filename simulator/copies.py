"""Where the k copies of every shard live, and whether a loss leaves one (the executor's rule).

`planners.backup.backup_holders` places the first copy (ElasWave §5.1: the ring predecessor on
another node, else a neighbouring stage's rank on another node). Issue 25 keeps k copies on k
distinct failure domains; the further copies follow the same preference order, each on a node
that holds neither the shard nor an earlier copy: ring predecessors further back, then the
neighbouring stages' ranks. A lost rank is recovered in place when at least one of its copies'
holders is alive; only when every copy is lost is a RESTORE needed (what the executor's
applicability rule declares once it keeps k copies).
"""

from __future__ import annotations

from planners.applicability import structural_problem
from planners.backup import backup_holders
from planners.layout import Layout


def _node(nodes: dict[int, int], rank: int) -> int:
    return nodes.get(rank, -1 - rank)


def copy_holders(layout: Layout) -> dict[int, tuple[int, ...]]:
    """rank -> the ranks holding its `layout.backup_copies` copies, first copy first."""
    nodes = dict(layout.rank_nodes)
    first = backup_holders(layout)
    k = layout.backup_copies
    out: dict[int, tuple[int, ...]] = {}
    for stage in layout.stages:
        ring = stage.ranks
        neighbours = [
            r
            for s in (stage.stage + 1, stage.stage - 1)
            if 0 <= s < layout.num_stages
            for r in layout.stages[s].ranks
        ]
        for j, rank in enumerate(ring):
            if rank not in first:
                continue
            holders = [first[rank]]
            used = {_node(nodes, rank), _node(nodes, first[rank])}
            order = [ring[(j - i) % len(ring)] for i in range(1, len(ring))] + neighbours
            for cand in order:
                if len(holders) >= k:
                    break
                if _node(nodes, cand) not in used:
                    holders.append(cand)
                    used.add(_node(nodes, cand))
            out[rank] = tuple(holders)
    return out


def lost_without_copy(layout: Layout, lost: frozenset[int]) -> tuple[int, ...]:
    """Lost ranks of `layout` every one of whose copies was lost too."""
    holders = copy_holders(layout)
    return tuple(
        r
        for r in sorted(lost & frozenset(layout.ranks()))
        if not any(h not in lost for h in holders.get(r, ()))
    )


def in_place(old: Layout, new: Layout, lost: frozenset[int]) -> bool:
    """Whether `old -> new` applies in place when `lost` (ranks of `old` that died) are gone: a
    copy of every lost shard survives and the change is one the executor makes (ranks that
    leave alive, a dropped replica, keep their state and need no copy)."""
    return not lost_without_copy(old, lost) and structural_problem(old, new) is None
