"""Dynamic-parallelism candidates: Chameleon's plan search and Oobleck-style templates.

Chameleon (chameleon.txt §IV-A, its Algorithm 1): use every live rank; for each DP degree within
`dp_range` of the current one, split the live ranks into that many pipelines as evenly as
possible (asymmetric lengths allowed), distribute micro-batches in proportion to pipeline
length, split layers evenly with the remainder on the later stages (eq. 14: they keep fewer
micro-batches in flight), estimate the step with eq. (10)/(11) plus coloured all-reduce rounds,
and keep the fastest plan that fits memory. Surviving ranks are assigned to the new slots by
Kuhn-Munkres on the bytes each must receive (§IV-B).

Oobleck: pipeline templates with between max(p_min, ceil(P/2)) and P stages (p_min the fewest
stages that fit memory, P the job's depth: templates with fewer nodes than the original);
instantiate as many pipelines as use all live ranks; ranks keep their order (no matching), so
more weights move.
"""

from __future__ import annotations

import math
from dataclasses import replace

from planners.chameleon.candidates import current_boundaries, even_counts, stage_edges, torchft
from planners.chameleon.matching import match_weight_transfer
from planners.chameleon.state import Candidate, ClusterState, PipelinePlan, infeasible
from planners.chameleon.stepmodel import make_stage, over_cap, stage_memory, step_time


def reparallelise(state: ClusterState, dp_range: int = 2) -> Candidate:
    if not state.failed and not state.slowdown:
        return _configured(state, "reparallelise")
    d = state.shape.dp
    options = [k for k in range(max(1, d - dp_range), d + dp_range + 1)]
    return _best_plan(state, "reparallelise", options, None, matched=True,
                      restart_s=state.mttr.reparallel_restart_s)


def oobleck(state: ClusterState) -> Candidate:
    if not state.failed and not state.slowdown:
        return _configured(state, "oobleck")
    p_min = _fewest_stages_that_fit(state)
    if p_min is None:
        return infeasible("oobleck", "no pipeline depth fits the model in device memory")
    depth = state.shape.pp
    templates = range(max(p_min, -(-depth // 2)), max(p_min, depth) + 1)
    n = len(state.alive)
    options = list(range(max(1, math.ceil(n / templates[-1])), n // p_min + 1))
    return _best_plan(state, "oobleck", options, templates, matched=False,
                      restart_s=state.mttr.oobleck_restart_s)


def _configured(state: ClusterState, name: str) -> Candidate:
    """With nothing lost or slow, the job runs its configured layout (what every policy starts from)."""
    base = torchft(state)
    return replace(base, policy=name, reason="healthy: the configured DP x PP layout")


def _fewest_stages_that_fit(state: ClusterState) -> int | None:
    prof, b = state.profile, state.shape.micro_batch
    for p in range(1, prof.num_layers + 1):
        spans = _layer_spans(prof.num_layers, p)
        if all(stage_memory(prof, a, z, i, p, b, state.shape.dp) <= prof.mem_cap_bytes
               for i, (a, z) in enumerate(spans)):
            return p
    return None


def _layer_spans(num_layers: int, stages: int) -> list[tuple[int, int]]:
    counts = list(reversed(even_counts(num_layers, stages)))  # remainder on the later stages
    edges = [0]
    for c in counts:
        edges.append(edges[-1] + c)
    return [(edges[i], edges[i + 1]) for i in range(stages)]


def _best_plan(state: ClusterState, name: str, dp_options: list[int], templates: range | None,
               matched: bool, restart_s: float) -> Candidate:
    alive = list(state.alive)
    best: Candidate | None = None
    reason = f"no DP degree in {dp_options} is usable with {len(alive)} live ranks"
    for dp in dp_options:
        if dp > len(alive):
            continue
        lengths = sorted(even_counts(len(alive), dp), reverse=True)
        if lengths[0] > state.profile.num_layers or (templates is not None and any(n not in templates for n in lengths)):
            continue
        cand = _plan(state, name, lengths, alive, matched, restart_s)
        if not cand.feasible:
            reason = cand.reason
        elif best is None or cand.step_time_s < best.step_time_s:
            best = cand
    return best if best is not None else infeasible(name, reason)


def _plan(state: ClusterState, name: str, lengths: list[int], alive: list[int], matched: bool,
          restart_s: float) -> Candidate:
    shape, prof = state.shape, state.profile
    total_mb = shape.global_batch // shape.micro_batch
    micro = _distribute_batch(total_mb, lengths)
    slots_layers = [(j, i, span) for j, n in enumerate(lengths) for i, span in enumerate(_layer_spans(prof.num_layers, n))]
    new_sets = [frozenset(range(a, z)) for _, _, (a, z) in slots_layers]
    spans_old = stage_edges(current_boundaries(state), prof.num_layers)
    old_sets = [frozenset(range(*spans_old[shape.position(r)[1]])) for r in alive]
    layer_bytes = [p * (1 + prof.optimizer_bytes_per_param_byte) for p in prof.layer_param_bytes]
    if matched:
        m = match_weight_transfer(old_sets, new_sets, layer_bytes)
        rank_of_slot = {slot: alive[i] for i, slot in enumerate(m.slot_of_node) if slot >= 0}
        moved = m.total_cost
    else:
        rank_of_slot = dict(enumerate(alive))
        moved = sum(sum(layer_bytes[x] for x in new_sets[k] - old_sets[k]) for k in range(len(new_sets)))
    busiest = max(sum(layer_bytes[x] for x in new_sets[k] - old_sets[alive.index(rank_of_slot[k])])
                  for k in range(len(new_sets)))
    holders = [0] * prof.num_layers
    for s in new_sets:
        for x in s:
            holders[x] += 1
    pipes, k = [], 0
    for j, n in enumerate(lengths):
        stages = []
        for i, (a, z) in enumerate(_layer_spans(prof.num_layers, n)):
            stages.append(make_stage(state, a, z, [rank_of_slot[k]], [shape.micro_batch], i, n, holders[a]))
            k += 1
        pipes.append(PipelinePlan(tuple(stages), micro[j]))
    cap = over_cap(pipes, prof)
    if cap:
        return infeasible(name, f"DP={len(lengths)} pipelines {lengths}: {cap}")
    changed = set(state.failed) or len(lengths) != shape.dp
    return Candidate(name, True, f"DP={len(lengths)} pipelines of {lengths} stages, micro-batches {micro}; "
                     f"{'Kuhn-Munkres' if matched else 'in-order'} rank assignment moves {moved / 2**30:.1f} GiB",
                     tuple(pipes), step_time(pipes, prof), shape.global_batch,
                     restart_s + busiest / prof.migrate_bytes_per_s if changed else 0.0, moved,
                     len(alive) * shape.tp)


def _distribute_batch(micro_batches: int, lengths: list[int]) -> list[int]:
    """Chameleon's distribute_batch: proportional to pipeline length, remainder one by one,
    then make sure no pipeline is left without a micro-batch."""
    total = sum(lengths)
    share = [micro_batches * n // total for n in lengths]
    j = 0
    while sum(share) < micro_batches:
        share[j % len(share)] += 1
        j += 1
    while min(share) == 0:
        share[share.index(max(share))] -= 1
        share[share.index(0)] += 1
    return share
