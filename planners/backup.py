"""Where each rank's ZeRO shard is backed up, and what the backups cost (ElasWave §5.1).

Every rank keeps, in host memory, an up-to-date copy of another rank's shard (parameters and
Adam moments of its interval), refreshed every step from that rank's gradient shard. §5.1 puts
the copy on the rank's DP predecessor (the ring of Fig. 6a). That copy dies with the shard when
both ranks sit on one node, and does not exist at all when the stage has one rank, so a node
loss, or any loss of a DP = 1 stage, would leave the stage's state nowhere but on disk.

The rule here keeps one copy per shard and puts it, in this order of preference:

1. on the ring predecessor when it runs on another node (the placement interleaves nodes so that
   this is the common case: `planners.placement`), else on the nearest rank before it in the
   ring that does;
2. on a rank of a neighbouring stage (the next one, else the previous one) that runs on another
   node, spread over that stage's ranks by DP index, so no single node's loss takes a shard and
   its copy, and a whole stage lost keeps its state in its neighbours;
3. on the ring predecessor on the same node (a process loss is still covered);
4. on a rank of a neighbouring stage on the same node (a one-node job with DP = 1 stages).

A job of one rank has no backup. Node identity comes from `Layout.rank_nodes`; without it every
rank counts as a node of its own, so rule 1 always applies where DP >= 2.

The same function is used by the Core (`planners.applicability`, before publishing) and by the
executors (`executor.fabric.snapshot`, to form the backup pairs), so both agree on where every
copy is without a message.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from planners.layout import Layout
from planners.zero import layout_ownership

BACKUP_ROWS = 3  # parameters, exp_avg, exp_avg_sq of every backed-up element
FLOAT_BYTES = 4


def _node(nodes: dict[int, int], rank: int) -> int:
    # A rank the layout does not place gets a node of its own (a negative id no real node has).
    return nodes.get(rank, -1 - rank)


def backup_holders(layout: Layout) -> dict[int, int]:
    """rank -> the rank whose host memory keeps its shard's backup (see the module docstring);
    ranks without one (a job of a single rank) are left out."""
    nodes = dict(layout.rank_nodes)
    holders: dict[int, int] = {}
    for stage in layout.stages:
        # Adjacent stages only: the pair must share a group (each stage, each adjacent pair).
        neighbours = [
            layout.stages[s].ranks for s in (stage.stage + 1, stage.stage - 1) if 0 <= s < layout.num_stages
        ]
        for j, rank in enumerate(stage.ranks):
            holder = _choose(nodes, rank, stage.ranks, j, neighbours)
            if holder is not None:
                holders[rank] = holder
    return holders


def _choose(
    nodes: dict[int, int],
    rank: int,
    ring: tuple[int, ...],
    j: int,
    neighbours: list[tuple[int, ...]],
) -> int | None:
    mine = _node(nodes, rank)
    pred = ring[(j - 1) % len(ring)] if len(ring) >= 2 else None
    for k in range(1, len(ring)):  # the ring predecessor, else the nearest one before it
        if _node(nodes, ring[(j - k) % len(ring)]) != mine:
            return ring[(j - k) % len(ring)]
    for ranks in neighbours:
        elsewhere = [r for r in ranks if _node(nodes, r) != mine]
        if elsewhere:
            return elsewhere[j % len(elsewhere)]
    if pred is not None:
        return pred
    if neighbours:
        return neighbours[0][j % len(neighbours[0])]
    return None


def protected_by(holders: dict[int, int], holder: int) -> tuple[int, ...]:
    """The ranks whose backups `holder` keeps, in rank order."""
    return tuple(sorted(r for r, h in holders.items() if h == holder))


@dataclass(frozen=True)
class BackupCost:
    """Host memory the backups take: per holder rank, and the largest (bytes)."""

    per_rank_bytes: dict[int, int]
    reason: str

    @property
    def max_bytes(self) -> int:
        return max(self.per_rank_bytes.values(), default=0)

    def stage_max_bytes(self, layout: Layout, stage: int) -> int:
        """The most backup bytes any rank of `stage` keeps (what its memory check adds)."""
        return max((self.per_rank_bytes.get(r, 0) for r in layout.stages[stage].ranks), default=0)


def shard_elements(layout: Layout) -> dict[int, int]:
    """rank -> the elements its ZeRO-1 shard owns (`planners.zero.layout_ownership`)."""
    out: dict[int, int] = defaultdict(int)
    for ivs in layout_ownership(layout).values():
        for iv in ivs:
            out[iv.rank] += iv.stop - iv.start
    return dict(out)


def backup_cost(layout: Layout) -> BackupCost:
    """What every holder keeps: 3 fp32 rows per element of each shard it backs up."""
    elements = shard_elements(layout)
    held: dict[int, int] = defaultdict(int)
    cross = 0
    for rank, holder in backup_holders(layout).items():
        held[holder] += BACKUP_ROWS * FLOAT_BYTES * elements.get(rank, 0)
        cross += layout.stage_of_rank(rank) != layout.stage_of_rank(holder)
    per_rank = {r: held.get(r, 0) for r in layout.ranks()}
    top = max(per_rank.values(), default=0)
    reason = (
        f"shard backups take up to {top / 2**20:.1f} MiB of host memory per rank; "
        f"{cross} of {len(per_rank)} shards are backed up in a neighbouring stage"
    )
    return BackupCost(per_rank, reason)
