"""Growth: spares join the layout where they are needed most (ElasWave §4.1 in reverse).

`plan_elaswave` calls `add_spares` after the going ranks left and before Algorithm 1, so one
plan answers a loss and a join together (a join during a recovery, a failure during a join:
both re-plan from the cumulative state). In order:

1. a stage that lost all its ranks (dropped, its layers handed to a neighbour) is re-created
   from spares with the layers it held in the fault-free layout, so the stage count returns;
2. every stage smaller than in the fault-free layout takes spares, the largest deficit first,
   each new rank in a lost rank's place in the DP order; a stage back at its fault-free size
   gets its fault-free sample split back, so the layout returns to the fault-free one (same
   stage sizes and micro-batch split, fresh rank ids in the lost ones' places);
3. beyond the fault-free size, a spare joins the stage whose extra DP rank lowers the predicted
   step time most, and only when that gain is at least `min_gain` (micro-batches re-split
   among more ranks, §4.1 in reverse); otherwise it waits.

Never more ranks than `max_ranks`. New ranks get fresh ids from `next_rank` upwards (the Core
passes the largest rank the job ever used + 1): a lost rank's id is never reused, so no peer can
mistake a newcomer for the rank it lost. Layers then move where it pays by Algorithm 1 (§4.2,
`planners.elaswave_graph.repartition`, run by the caller on the grown layout).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from planners.dataflow import micro_batch_sizes, resize_after_join
from planners.elaswave_graph import repartition
from planners.elaswave_model import JobModel, costing
from planners.elaswave_reasons import Outcome, Reason, Step
from planners.layout import Layout, StageLayout


@dataclass(frozen=True)
class Spare:
    """A spare worker: its id, and the node (a `Layout.rank_nodes` index) of its host, None when
    the layout does not place ranks on nodes."""

    worker_id: str
    node: int | None = None


@dataclass(frozen=True)
class Joins:
    """What growth is planned from: the spares in order, the fault-free layout (None: unknown),
    the first fresh rank id and the most ranks a plan may have."""

    spares: tuple[Spare, ...]
    original: Layout | None
    next_rank: int
    max_ranks: int


@dataclass(frozen=True)
class Grown:
    layout: Layout
    joiners: tuple[tuple[int, str], ...]  # (rank, worker_id), sorted by rank
    reasons: tuple[Reason, ...]


class _Ids:
    """Fresh rank ids, consecutive from the first unused one, and the spares still waiting."""

    def __init__(self, first: int, spares: list[Spare]) -> None:
        self.next = first
        self.waiting = list(spares)
        self.given: dict[int, Spare] = {}  # new rank -> the spare that takes it

    def take(self) -> int:
        rank, self.next = self.next, self.next + 1
        self.given[rank] = self.waiting.pop(0)
        return rank


def add_spares(
    layout: Layout, joins: Joins, model: JobModel, factors: dict[int, float], min_gain: float
) -> Grown:
    """`layout` with as many spares as fit and help, placed as the module docstring says."""
    room = joins.max_ranks - len(layout.ranks())
    if not joins.spares:
        return Grown(layout, (), ())
    if room <= 0:
        why = (
            f"{len(joins.spares)} spare(s) wait: the layout has {len(layout.ranks())} ranks, "
            f"the job's maximum is {joins.max_ranks}"
        )
        return Grown(layout, (), (Reason(Step.RESIZE, Outcome.DECLINED, why),))
    ids = _Ids(joins.next_rank, list(joins.spares[:room]))
    reasons: list[Reason] = []
    grown, original = layout, joins.original
    if original is not None:
        grown = _restore_original(grown, original, ids, reasons) or grown
    if original is not None and grown.num_stages < original.num_stages:
        grown = _recreate_stages(grown, original, ids, reasons)
    if original is not None and grown.num_stages == original.num_stages and ids.waiting:
        grown = _fill_deficits(grown, original, ids, reasons)
    if ids.waiting:
        grown = _grow(grown, ids, model, factors, min_gain, reasons)
    if not ids.given:
        return Grown(layout, (), tuple(reasons))
    grown = _place_on_nodes(grown, ids.given)
    joiners = tuple(sorted((rank, spare.worker_id) for rank, spare in ids.given.items()))
    headline = f"joined {', '.join(f'{w} as rank {r}' for r, w in joiners)}"
    text = f"{headline}: DP sizes {list(layout.dp_sizes)} -> {list(grown.dp_sizes)}"
    reasons.append(Reason(Step.RESIZE, Outcome.CHANGED, text, headline))
    reasons.append(
        Reason(Step.RESIZE, Outcome.INFO, f"micro-batch sizes per stage {list(micro_batch_sizes(grown))}")
    )
    return Grown(grown, joiners, tuple(reasons))


def _reshaped(layout: Layout, original: Layout) -> bool:
    """The DP shape step (`planners.elaswave_replicas`) changed the layout's structure: another
    stage count or slot count, or a stage larger than in the fault-free layout."""
    if layout.num_stages != original.num_stages or layout.num_micro_batches != original.num_micro_batches:
        return True
    return any(a > b for a, b in zip(layout.dp_sizes, original.dp_sizes, strict=True))


def _restore_original(layout: Layout, original: Layout, ids: _Ids, reasons: list[Reason]) -> Layout | None:
    """A reshaped layout goes back to the fault-free one once its ranks and the spares fill it
    (a dropped replica re-created, regrouped stages restored, the fault-free slots): every
    fault-free rank still live keeps its place, the other live ranks fill the lost ones' places,
    then spares with fresh ids. None when it is not reshaped or cannot be filled."""
    live = layout.ranks()
    need = len(original.ranks())
    if not _reshaped(layout, original) or not len(live) <= need <= len(live) + len(ids.waiting):
        return None
    present, kept = set(live), set(original.ranks())
    others = [r for r in live if r not in kept]
    stages = []
    for st in original.stages:
        ranks = [r if r in present else (others.pop(0) if others else ids.take()) for r in st.ranks]
        stages.append(replace(st, ranks=tuple(ranks)))
    text = (
        f"back to the fault-free shape: {original.num_stages} stages of DP sizes "
        f"{list(original.dp_sizes)}, {original.num_micro_batches} slots (from {layout.num_stages} stages of "
        f"{list(layout.dp_sizes)}, {layout.num_micro_batches} slots)"
    )
    reasons.append(Reason(Step.REPLICA, Outcome.CHANGED, text, "fault-free shape restored"))
    return replace(
        original,
        stages=tuple(stages),
        frequencies_mhz=(),
        rank_nodes=layout.rank_nodes,
        backup_copies=layout.backup_copies,
    )


def _recreate_stages(layout: Layout, original: Layout, ids: _Ids, reasons: list[Reason]) -> Layout:
    """Fault-free stages none of whose ranks is left come back, from as many spares as they had
    ranks (at least one), with their fault-free layers taken from the stage that holds them now;
    a stage whose layers are not at one end of a current stage stays dropped."""
    present = set(layout.ranks())
    stages = list(layout.stages)
    caps = list(layout.stage_mem_cap_bytes) if layout.stage_mem_cap_bytes is not None else None
    for gone in original.stages:
        if present.intersection(gone.ranks) or not ids.waiting:
            continue
        span = (gone.layer_start, gone.layer_stop)
        host = next((s for s in stages if s.layer_start <= span[0] and span[1] <= s.layer_stop), None)
        if host is None or (host.layer_start, host.layer_stop) == span:
            continue
        at = stages.index(host)
        if span[0] == host.layer_start:
            stages[at] = replace(host, layer_start=span[1])
        elif span[1] == host.layer_stop:
            stages[at], at = replace(host, layer_stop=span[0]), at + 1
        else:
            continue
        ranks = tuple(ids.take() for _ in range(min(gone.dp_size, len(ids.waiting))))
        weights = gone.sample_weights if len(ranks) == gone.dp_size else ()
        stages.insert(at, StageLayout(0, span[0], span[1], ranks, weights))
        if caps is not None and original.stage_mem_cap_bytes is not None:
            caps.insert(at, original.stage_mem_cap_bytes[gone.stage])
        text = (
            f"the stage of layers {span[0]}..{span[1] - 1} is re-created from spares as ranks "
            f"{list(ranks)}: back toward the fault-free {original.num_stages} stages"
        )
        reasons.append(Reason(Step.RESIZE, Outcome.CHANGED, text, text))
    stages = [replace(s, stage=p) for p, s in enumerate(stages)]
    capped = None if caps is None or len(caps) != len(stages) else tuple(caps)
    return replace(layout, stages=tuple(stages), stage_mem_cap_bytes=capped)


def _fill_deficits(layout: Layout, original: Layout, ids: _Ids, reasons: list[Reason]) -> Layout:
    """Stages smaller than in the fault-free layout take spares, the largest deficit first."""
    deficit = {p: original.stages[p].dp_size - s.dp_size for p, s in enumerate(layout.stages)}
    count: Counter[int] = Counter()
    for _ in ids.waiting:
        stage = max(deficit, key=lambda p: (deficit[p] - count[p], -p))
        if deficit[stage] - count[stage] <= 0:
            break
        count[stage] += 1
    if not count:
        return layout
    stages = list(layout.stages)
    for p, n in sorted(count.items()):
        stages[p] = _into_holes(stages[p], original.stages[p], [ids.take() for _ in range(n)])
    text = f"spares replace lost ranks in stage(s) {sorted(count)} (fault-free DP sizes {list(original.dp_sizes)})"
    reasons.append(Reason(Step.RESIZE, Outcome.INFO, text))
    return replace(layout, stages=tuple(stages))


def _into_holes(stage: StageLayout, fault_free: StageLayout, new: list[int]) -> StageLayout:
    """`new` ranks in the DP positions the fault-free stage had ranks that are gone now, so the
    DP order (and with it the ZeRO shard order and each rank's samples) is the fault-free one;
    back at the fault-free size the stage gets the fault-free sample split too."""
    current, known = list(stage.ranks), set(fault_free.ranks)
    joined = [r for r in current if r not in known]  # earlier newcomers, in their places already
    queue = list(new)
    out: list[int] = []
    for rank in fault_free.ranks:
        if rank in stage.ranks:
            out.append(rank)
        elif joined:
            out.append(joined.pop(0))
        elif queue:
            out.append(queue.pop(0))
    out += joined + queue
    kept = set(current)
    if [r for r in out if r in kept] != current:  # the survivors' order would change: append
        out = current + list(new)
    if len(out) == fault_free.dp_size:
        return replace(stage, ranks=tuple(out), sample_weights=fault_free.sample_weights)
    weights = stage.sample_weights
    if weights:
        by_rank = dict(zip(stage.ranks, weights, strict=True))
        mean = max(1, round(sum(weights) / len(weights)))
        weights = tuple(by_rank.get(r, mean) for r in out)
    return replace(stage, ranks=tuple(out), sample_weights=weights)


def _grow(
    layout: Layout,
    ids: _Ids,
    model: JobModel,
    factors: dict[int, float],
    min_gain: float,
    reasons: list[Reason],
) -> Layout:
    """Beyond the fault-free size: each spare to the stage where it lowers the predicted step
    time most, if by at least `min_gain`; the rest wait. A stage that grows is priced with the
    layers Algorithm 1 would then move to it (one more DP rank in one stage of a balanced
    pipeline only pays once that stage takes more layers)."""

    def step_time(candidate: Layout, moved: bool = False) -> float:
        if moved:
            candidate = repartition(candidate, factors, model, min_gain)[0]
        return model.cost.step_time(costing(candidate, factors, model.nominal_mhz, current_clocks=True))

    while ids.waiting:
        t0 = step_time(layout)
        options = [resize_after_join(layout, {p: [ids.next]}).layout for p in range(layout.num_stages)]
        t1, best = min(
            ((step_time(c, moved=True), p) for p, c in enumerate(options)), key=lambda x: (x[0], x[1])
        )
        if t1 >= t0 * (1 - min_gain):
            why = (
                f"{len(ids.waiting)} spare(s) wait: one more rank in any stage would change the "
                f"predicted step only {t0:.4g} -> {t1:.4g} {model.unit} (needs > {min_gain:.0%} gain)"
            )
            reasons.append(Reason(Step.RESIZE, Outcome.DECLINED, why))
            break
        rank = ids.take()
        layout = options[best]
        text = (
            f"rank {rank} joins stage {best} where it pays: predicted step {t0:.4g} -> {t1:.4g} {model.unit}"
        )
        reasons.append(Reason(Step.RESIZE, Outcome.INFO, text))
    return layout


def _place_on_nodes(layout: Layout, given: dict[int, Spare]) -> Layout:
    """New ranks' nodes (`planners.backup` places shard backups off a rank's node): a spare's
    own node when known, else a node of its own. Only for layouts that place ranks on nodes."""
    if not layout.rank_nodes:
        return layout
    pairs = dict(layout.rank_nodes)
    spare_node = max(pairs.values(), default=-1) + 1
    for rank, spare in sorted(given.items()):
        if spare.node is not None:
            pairs[rank] = spare.node
        else:
            pairs[rank], spare_node = spare_node, spare_node + 1
    return replace(layout, rank_nodes=tuple(sorted(pairs.items())))
