"""The shape of the data-parallel side after a change: thin every stage, re-slot, or drop a replica.

ElasWave §4.1 keeps the slot count M and lets a stage's survivors take the going ranks' samples.
Two things make that costly, and this step weighs them with the cost model (eq. 1) before
Algorithm 1 and DVFS run:

- rounding: a slot of s samples over D ranks gives some ranks ceil(s / D); after a loss that can
  be 6 samples where 4 were (8 ranks -> 6: 32 / 6), a 1.5x longer mini-step for the whole stage,
  while M' = ceil(B / (D x 4)) slots keep every rank at 4 samples (the global batch B is kept);
- memory: a larger share per rank keeps more activation bytes in flight (eq. 14); more slots of
  fewer samples bring a stage back under its cap where thinning alone runs out of memory.

Candidates, each a `Layout` with the global batch kept: the thinned layout as resized (M kept);
re-slotted so that no rank takes more samples per slot than a share some stage ran before the
change (smaller shares only where nothing else fits memory: in a model where compute is linear in the
micro-batch, smaller shares would buy a shorter bubble the configured job never had); and with a
whole replica dropped (every stage cut to the smallest stage's DP size, the surplus ranks leave
the layout, idle until a join takes them back), re-slotted likewise; and the live ranks regrouped
into 1..2P stages of equal DP size, the same count P included (a stage thinned by earlier losses
takes ranks from the others; a shorter pipeline where fewer stages fit memory, a longer one where
the stages in force are few for the ranks left: the executor reaches any layout over the
surviving ranks in place, `planners.applicability`, rebuilding where a live rank changes stage),
re-slotted likewise; only P where the cost model prices no DP exchange or explains too little of
the measured step, unless nothing else fits memory (`_stage_counts`). A regrouped stage's memory
cap is the tightest of its ranks' old stages'. Each candidate is priced after Algorithm 1
(`planners.elaswave_graph.repartition`: thinning's benefit comes with the re-partition); one
over its stages' memory caps is only taken when every candidate is. The fastest wins; a change
must buy `min_gain` unless it is the only one that fits memory. On a join the same step runs on
the grown layout, so a dropped replica comes back when its ranks are offered again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planners.dataflow import micro_batch_sizes, resize_after_loss
from planners.elaswave_graph import repartition
from planners.elaswave_model import JobModel, costing
from planners.elaswave_reasons import Outcome, Reason, Step
from planners.layout import Layout, SampleRange, StageLayout, split_evenly
from planners.validation import validate

# The least share of the measured wall step a model must predict to price another stage count.
TRUSTED_SHARE = 0.75


@dataclass(frozen=True)
class Shaped:
    """A candidate: the layout before Algorithm 1, its step after it, and whether it fits."""

    name: str
    layout: Layout
    step: float
    fits: bool


def slot_counts(layout: Layout, share: int) -> list[int]:
    """M' = ceil(B / (D x share)) for every stage DP size D: the slot counts that put some stage
    at exactly `share` samples per rank, and no stage above it."""
    b = layout.global_batch
    counts = {math.ceil(b / (d * share)) for d in {s.dp_size for s in layout.stages}}
    return sorted(m for m in counts if 1 <= m <= b and m != layout.num_micro_batches)


def drop_replica(layout: Layout) -> tuple[Layout, tuple[int, ...]] | None:
    """Every stage cut to the smallest stage's DP size (its last ranks in DP order leave); None
    when the stages are already equal."""
    smallest = min(s.dp_size for s in layout.stages)
    surplus = tuple(r for s in layout.stages for r in s.ranks[smallest:])
    if not surplus:
        return None
    return resize_after_loss(layout, surplus).layout, surplus


def restage(layout: Layout, stages: int) -> Layout | None:
    """The layout's ranks, in stage then DP order, regrouped into `stages` stages of as equal DP
    sizes as possible (layers split evenly; Algorithm 1 then balances them); None when that is
    not a new layout. Every rank keeps its neighbours, so few ranks change stage."""
    ranks = [r for s in layout.stages for r in s.ranks]
    if not 1 <= stages <= min(layout.num_layers, len(ranks)):
        return None
    groups = split_evenly(SampleRange(0, len(ranks)), stages)
    blocks = split_evenly(SampleRange(0, layout.num_layers), stages)
    new = tuple(
        StageLayout(p, b.start, b.stop, tuple(ranks[g.start : g.stop]))
        for p, (b, g) in enumerate(zip(blocks, groups, strict=True))
    )
    if [s.ranks for s in new] == [s.ranks for s in layout.stages]:
        return None
    caps = layout.stage_mem_cap_bytes
    # A regrouped stage's cap: the tightest of its ranks' old stages' (a cap is its devices').
    capped = None
    if caps is not None:
        capped = tuple(min(caps[layout.stage_of_rank(r)] for r in s.ranks) for s in new)
    return replace(layout, stages=new, stage_mem_cap_bytes=capped, frequencies_mhz=())


def _fits(layout: Layout, model: JobModel) -> bool:
    caps = layout.stage_mem_cap_bytes
    if caps is None:
        return True
    return all(model.cost.stage_memory_bytes(layout, p) <= caps[p] for p in range(layout.num_stages))


def _price(name: str, layout: Layout, factors: dict[int, float], model: JobModel) -> Shaped | None:
    if not validate(layout).ok:
        return None
    graph, _ = repartition(layout, factors, model, 0.0)
    priced = costing(graph, factors, model.nominal_mhz, current_clocks=False)
    return Shaped(name, layout, model.cost.step_time(priced), _fits(graph, model))


def _reslotted(
    name: str, layout: Layout, factors: dict[int, float], model: JobModel, share: int
) -> list[Shaped]:
    """`layout` re-slotted so that no rank takes more than `share` samples per slot."""
    out = []
    for m in slot_counts(layout, share):
        cand = replace(layout, num_micro_batches=m)
        if max(micro_batch_sizes(cand)) <= share:
            priced = _price(f"{name}, {m} slots of at most {share} samples per rank", cand, factors, model)
            if priced is not None:
                out.append(priced)
    return out


def _stage_counts(layout: Layout, model: JobModel) -> tuple[list[int], list[int]]:
    """(the stage counts a regroup may take, those it may take only when nothing else fits
    memory): 1..2P where the model prices the DP exchange and explains at least
    `TRUSTED_SHARE` of the measured step, else only P.

    Another stage count changes every rank's share of the DP exchange (P -> 1: each rank
    exchanges all the weights), the pipeline's hops, and how long ranks wait for each other. The
    uniform model (no profile registered) prices no exchange, and a profile of compute alone
    (a describe run's) prices no more than the ranks' compute, which was 15 % of a step on 2 CPU
    cores. With the rest charged per mini-step, a loss at PP=2 x DP=4 there was regrouped into
    PP=1 x DP=7 (the fewest mini-steps) and the job stepped 1.8x slower."""
    p = layout.num_stages
    every = list(range(1, 2 * p + 1))
    share = model.explained_share
    if math.isfinite(model.cost.link.dp_bytes_per_s) and (share is None or share >= TRUSTED_SHARE):
        return every, []
    return [p], [n for n in every if n != p]


def _regroups(layout: Layout, counts: list[int]) -> list[tuple[str, Layout]]:
    shapes = []
    for stages in counts:
        regrouped = restage(layout, stages)
        if regrouped is not None:
            shapes.append((f"{stages} stages of equal DP size", regrouped))
    return shapes


def _priced(shapes: list[tuple[str, Layout]], factors: dict[int, float], model: JobModel) -> list[Shaped]:
    priced = (_price(name, shaped, factors, model) for name, shaped in shapes)
    return [p for p in priced if p is not None]


def shape_replicas(
    layout: Layout,
    factors: dict[int, float],
    model: JobModel,
    min_gain: float,
    shares: tuple[int, int],
    drop: bool = True,
) -> tuple[Layout, tuple[Reason, ...]]:
    """The resized `layout`, re-slotted, regrouped or with a replica dropped where the cost model
    predicts a faster step (module docstring), and the reason. `shares`: the smallest and largest
    per-rank micro-batch before the change; re-slotting keeps ranks within them, smaller only
    where nothing else fits memory (a share no stage ran would buy a bubble the job never had).
    `drop`: whether dropping a replica (its ranks leave the layout alive) is a candidate."""
    as_is = _price("thin every stage", layout, factors, model)
    if as_is is None:
        return layout, ()
    dropped = drop_replica(layout) if drop else None
    shapes = [("thin every stage", layout)]
    if dropped is not None:
        shapes.append((f"drop ranks {list(dropped[1])} (a replica)", dropped[0]))
    # Fewer stages, or as many regrouped to equal DP sizes (a stage thinned by earlier losses
    # takes ranks from the others): the executor rebuilds any layout in which a live rank changes
    # stage from live shards and backups (`executor.fabric.relayout.needs_rebuild`).
    counts, unpriced = _stage_counts(layout, model)
    shapes += _regroups(layout, counts)
    options = _priced(shapes[1:], factors, model)
    if unpriced and not (as_is.fits or any(o.fits for o in options)):
        extra = _regroups(layout, unpriced)  # memory: any stage count that fits
        shapes += extra
        options += _priced(extra, factors, model)
    low, high = shares
    for m in range(high, 0, -1):
        if m < low and (as_is.fits or any(o.fits for o in options)):
            break
        for name, shaped in shapes:
            options += _reslotted(name, shaped, factors, model, m)
    options.insert(0, as_is)
    fitting = [o for o in options if o.fits] or options
    best = min(fitting, key=lambda o: o.step)
    worth = not as_is.fits or best.step < as_is.step * (1 - min_gain)
    if best.layout == layout or not worth:
        text = (
            f"DP shape kept: thin every stage at {layout.num_micro_batches} slots "
            f"(predicted {as_is.step:.4g} {model.unit}; best alternative {best.name} {best.step:.4g})"
        )
        return layout, (Reason(Step.REPLICA, Outcome.KEPT, text),)
    text = (
        f"DP shape: {best.name} (predicted step {best.step:.4g} {model.unit} vs {as_is.step:.4g} "
        f"thinning every stage at {layout.num_micro_batches} slots"
        + ("" if as_is.fits else ", which is over memory")
        + "; global batch kept)"
    )
    return best.layout, (Reason(Step.REPLICA, Outcome.CHANGED, text, best.name),)
