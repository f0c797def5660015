"""Where each rank's ZeRO shard is backed up, and what the backups cost (ElasWave §5.1).

Every rank keeps, in host memory, an up-to-date copy of another rank's shard (parameters and
Adam moments of its interval), refreshed every step from that rank's gradient shard. §5.1 puts
the copy on the rank's DP predecessor (the ring of Fig. 6a). That copy dies with the shard when
both ranks sit on one node, and does not exist at all when the stage has one rank, so a node
loss, or any loss of a DP = 1 stage, would leave the stage's state nowhere but on disk.

The first copy of every shard goes, in this order of preference:

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

k copies (`Layout.backup_copies`, issue 25: bursts that take a shard and its first holder in the
same step). The first copy goes where the rule above puts it (k = 1 is exactly §5.1's single
copy). Every further copy is taken from the same candidates (the ring before the rank, nearest
first, then the neighbouring stages, each rotated by the rank's DP index so the load spreads):

a. the first candidate on a node that holds neither the shard nor any of its earlier copies (a
   failure domain of its own: one node lost takes at most one of the k + 1 places);
b. else the first on another node than the shard (two copies share a node);
c. else the first candidate at all (a process loss is still covered).

Where fewer than k other ranks share a group with the shard, it keeps fewer copies. Both
fall-backs are counted and said in `BackupPlacement.notes` (and in `backup_cost`'s reason), so a
policy that asks for more copies than the job has failure domains learns why it got less.

The same functions are used by the Core (`planners.applicability`, before publishing) and by the
executors (`executor.fabric.snapshot`, to form the backup pairs), so both agree on where every
copy is without a message.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from functools import partial

from planners.layout import Layout
from planners.zero import layout_ownership

BACKUP_ROWS = 3  # parameters, exp_avg, exp_avg_sq of every backed-up element
FLOAT_BYTES = 4


# Committed steps between two checks of every backup against its live shard (ElasWave §5.1). A
# check costs about a quarter of a step at hidden 256 on the CPU (docs/benchmarks.md, "Per-step
# snapshot overhead"): every 50 steps that is ~0.5 % of the step time, on the critical path.
DEFAULT_VERIFY_EVERY = 50


def _node(nodes: dict[int, int], rank: int) -> int:
    # A rank the layout does not place gets a node of its own (a negative id no real node has).
    return nodes.get(rank, -1 - rank)


@dataclass(frozen=True)
class BackupPlacement:
    """Where every shard's copies go: rank -> its holders, first copy first (ranks without any
    copy left out), and why some shard got fewer or less independent copies than asked."""

    holders: dict[int, tuple[int, ...]]
    notes: tuple[str, ...]


def backup_placement(layout: Layout) -> BackupPlacement:
    """The holders of every shard's `layout.backup_copies` copies (see the module docstring)."""
    nodes = dict(layout.rank_nodes)
    k = max(1, layout.backup_copies)
    holders: dict[int, tuple[int, ...]] = {}
    shared = fewer = 0
    for stage in layout.stages:
        # Adjacent stages only: the pair must share a group (each stage, each adjacent pair).
        neighbours = [
            layout.stages[s].ranks for s in (stage.stage + 1, stage.stage - 1) if 0 <= s < layout.num_stages
        ]
        for j, rank in enumerate(stage.ranks):
            first = _choose(nodes, rank, stage.ranks, j, neighbours)
            if first is None:
                continue
            chosen = [first]
            if k > 1:
                candidates = partial(_candidates, rank, stage.ranks, j, neighbours)
                while len(chosen) < k:
                    extra, independent = _extra_copy(nodes, rank, candidates, chosen)
                    if extra is None:
                        break
                    chosen.append(extra)
                    shared += not independent
                fewer += len(chosen) < k
            holders[rank] = tuple(chosen)
    return BackupPlacement(holders, _notes(layout, k, shared, fewer))


def backup_holder_sets(layout: Layout) -> dict[int, tuple[int, ...]]:
    """rank -> the ranks that keep copies of its shard, first copy first (`backup_placement`)."""
    return backup_placement(layout).holders


def backup_holders(layout: Layout) -> dict[int, int]:
    """rank -> the rank whose host memory keeps its shard's first backup (see the module
    docstring); ranks without one (a job of a single rank) are left out."""
    return {r: hs[0] for r, hs in backup_holder_sets(layout).items()}


def first_surviving(
    holder_sets: Mapping[int, tuple[int, ...]], rank: int, lost: Collection[int]
) -> int | None:
    """The first holder of `rank`'s shard that is not in `lost` (None: every copy is gone)."""
    return next((h for h in holder_sets.get(rank, ()) if h not in lost), None)


def recovery_sources(layout: Layout, lost: Collection[int]) -> dict[int, int]:
    """Lost rank -> the surviving rank whose copy of its shard recovery reads (the first copy
    still alive); lost ranks with no copy left are left out."""
    sets = backup_holder_sets(layout)
    out = {}
    for rank in sorted(set(lost)):
        src = first_surviving(sets, rank, lost)
        if src is not None:
            out[rank] = src
    return out


def _candidates(rank: int, ring: tuple[int, ...], j: int, neighbours: list[tuple[int, ...]]) -> Iterator[int]:
    """Every rank that shares a group with `rank`, in the order further copies prefer them
    (lazily: a copy is usually placed after a few, whatever the stage's DP size)."""
    yield from (ring[(j - d) % len(ring)] for d in range(1, len(ring)))
    for ranks in neighbours:
        yield from (r for r in (ranks[(j + i) % len(ranks)] for i in range(len(ranks))) if r != rank)


def _extra_copy(
    nodes: dict[int, int], rank: int, candidates: Callable[[], Iterator[int]], chosen: list[int]
) -> tuple[int | None, bool]:
    """The next copy's holder (rules a-c) and whether it sits on a failure domain of its own:
    the first candidate of rule a, else the first one rule b or c found on the way."""
    mine = _node(nodes, rank)
    used = {mine} | {_node(nodes, h) for h in chosen}
    other_node = any_rank = None
    for r in candidates():
        if r in chosen:
            continue
        node = _node(nodes, r)
        if node not in used:
            return r, True
        if other_node is None and node != mine:
            other_node = r
        any_rank = r if any_rank is None else any_rank
    return (other_node if other_node is not None else any_rank), False


def _notes(layout: Layout, k: int, shared: int, fewer: int) -> tuple[str, ...]:
    out = []
    if shared:
        domains = len({_node(dict(layout.rank_nodes), r) for r in layout.ranks()})
        out.append(
            f"{shared} extra shard copies share a node with the shard or another of its copies "
            f"(backup_copies={k}, the layout spans {domains} nodes)"
        )
    if fewer:
        out.append(
            f"{fewer} shards keep fewer than backup_copies={k} copies: too few other ranks share "
            "a group with them (their stage and its neighbours)"
        )
    return tuple(out)


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


def protected_by(holders: Mapping[int, int] | Mapping[int, tuple[int, ...]], holder: int) -> tuple[int, ...]:
    """The ranks whose backups `holder` keeps (any copy), in rank order."""
    return tuple(
        sorted(r for r, h in holders.items() if (holder in h if isinstance(h, tuple) else h == holder))
    )


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
    """What every holder keeps: 3 fp32 rows per element of each shard copy it holds (all
    `layout.backup_copies` copies of every shard are counted)."""
    elements = shard_elements(layout)
    placed = backup_placement(layout)
    held: dict[int, int] = defaultdict(int)
    cross = 0
    for rank, holders in placed.holders.items():
        for holder in holders:
            held[holder] += BACKUP_ROWS * FLOAT_BYTES * elements.get(rank, 0)
        cross += layout.stage_of_rank(rank) != layout.stage_of_rank(holders[0])
    per_rank = {r: held.get(r, 0) for r in layout.ranks()}
    top = max(per_rank.values(), default=0)
    reason = (
        f"shard backups take up to {top / 2**20:.1f} MiB of host memory per rank; "
        f"{cross} of {len(per_rank)} shards are backed up in a neighbouring stage"
    )
    if layout.backup_copies > 1:
        reason += f"; {layout.backup_copies} copies of every shard, all counted"
    reason += "".join(f"; {note}" for note in placed.notes)
    return BackupCost(per_rank, reason)


def extra_copy_bytes(layout: Layout) -> dict[int, int]:
    """Holder rank -> host bytes of the copies beyond each shard's first that it keeps (what
    `backup_copies` > 1 adds to ElasWave §5.1's single copy); ranks keeping none left out."""
    elements = shard_elements(layout)
    out: dict[int, int] = defaultdict(int)
    for rank, holders in backup_holder_sets(layout).items():
        for holder in holders[1:]:
            out[holder] += BACKUP_ROWS * FLOAT_BYTES * elements.get(rank, 0)
    return dict(out)


GRAD_BYTES = 4  # the executor's gradient shards are fp32


def snapshot_rank_bytes(
    layout: Layout, from_copy: int = 0, grad_bytes: float = GRAD_BYTES
) -> dict[int, tuple[float, float]]:
    """Rank -> (bytes out, bytes in) per step of the gradient exchange that keeps the copies up to
    date (`executor.fabric.snapshot`: every owner sends its gradient shard to each holder, every
    step), counting each shard's copies from index `from_copy` on (0: all k; 1: those beyond
    ElasWave §5.1's single copy) and only copies on another node than their shard (a copy on the
    same node is a host-memory copy), at `grad_bytes` per element of the shard."""
    nodes = dict(layout.rank_nodes)
    elements = shard_elements(layout)
    out: dict[int, float] = defaultdict(float)
    inn: dict[int, float] = defaultdict(float)
    for rank, holders in backup_holder_sets(layout).items():
        for holder in holders[from_copy:]:
            if _node(nodes, holder) != _node(nodes, rank):
                nbytes = grad_bytes * elements.get(rank, 0)
                out[rank] += nbytes
                inn[holder] += nbytes
    return {r: (out.get(r, 0.0), inn.get(r, 0.0)) for r in set(out) | set(inn)}
