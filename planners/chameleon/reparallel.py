"""Dynamic-parallelism candidates: Chameleon's plan search and Oobleck-style templates.

Chameleon (Chameleon §IV-A, its Algorithm 1): use every live rank; for each DP degree within
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
from collections import Counter
from dataclasses import replace

import numpy as np

from planners.chameleon.candidates import current_boundaries, even_counts, stage_edges, torchft
from planners.chameleon.matching import class_cost_matrix, match_classes
from planners.chameleon.state import Candidate, ClusterState, PipelinePlan, StagePlan, infeasible
from planners.chameleon.stepmodel import make_stage, over_cap, stage_memory, step_time


def reparallelise(state: ClusterState, dp_range: int = 2, current_dp: int | None = None) -> Candidate:
    """`current_dp`: the DP degree of the plan in force (default: the configured one); the
    search looks within `dp_range` of it (Chameleon §IV-A plans from the running plan)."""
    if not state.failed and not state.slowdown:
        return _configured(state, "reparallelise")
    d = current_dp or state.shape.dp
    options = [k for k in range(max(1, d - dp_range), d + dp_range + 1)]
    return _best_plan(
        state, "reparallelise", options, None, matched=True, restart_s=state.mttr.reparallel_restart_s
    )


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
    return _best_plan(
        state, "oobleck", options, templates, matched=False, restart_s=state.mttr.oobleck_restart_s
    )


def _configured(state: ClusterState, name: str) -> Candidate:
    """With nothing lost or slow, the job runs its configured layout (what every policy starts from)."""
    base = torchft(state)
    return replace(base, policy=name, reason="healthy: the configured DP x PP layout")


def _fewest_stages_that_fit(state: ClusterState) -> int | None:
    prof, b = state.profile, state.shape.micro_batch
    for p in range(1, prof.num_layers + 1):
        spans = _layer_spans(prof.num_layers, p)
        if all(
            stage_memory(prof, a, z, i, p, b, state.shape.dp) <= prof.mem_cap_bytes
            for i, (a, z) in enumerate(spans)
        ):
            return p
    return None


def _layer_spans(num_layers: int, stages: int) -> list[tuple[int, int]]:
    counts = list(reversed(even_counts(num_layers, stages)))  # remainder on the later stages
    edges = [0]
    for c in counts:
        edges.append(edges[-1] + c)
    return [(edges[i], edges[i + 1]) for i in range(stages)]


def _best_plan(
    state: ClusterState,
    name: str,
    dp_options: list[int],
    templates: range | None,
    matched: bool,
    restart_s: float,
) -> Candidate:
    """The fastest feasible DP degree. Without slowed ranks every pipeline of one (length,
    micro-batch count) times the same whichever ranks serve it, so each degree is scored on its
    distinct pipeline shapes (`_shape_step_time`, exact) and only the winner is built rank by
    rank with its Kuhn-Munkres assignment: O(stages) per degree instead of O(ranks)."""
    alive = list(state.alive)
    best: Candidate | None = None
    best_shape: tuple[float, list[int]] | None = None
    reason = f"no DP degree in {dp_options} is usable with {len(alive)} live ranks"
    for dp in dp_options:
        if dp > len(alive):
            continue
        lengths = sorted(even_counts(len(alive), dp), reverse=True)
        if lengths[0] > state.profile.num_layers or (
            templates is not None and any(n not in templates for n in lengths)
        ):
            continue
        t = None if state.slowdown else _shape_step_time(state, lengths)
        if t is not None:
            if best_shape is None or t < best_shape[0]:
                best_shape = (t, lengths)
            continue
        cand = _plan(state, name, lengths, alive, matched, restart_s)
        if not cand.feasible:
            reason = cand.reason
        elif best is None or cand.step_time_s < best.step_time_s:
            best = cand
    if best_shape is not None:
        best = _plan(state, name, best_shape[1], alive, matched, restart_s)
    return best if best is not None else infeasible(name, reason)


def _shapes(
    state: ClusterState, lengths: list[int]
) -> tuple[list[int], dict[int, list[tuple[int, int]]], list[int], dict[tuple[int, int], StagePlan]]:
    """Micro-batches per pipeline, the layer spans of each pipeline length, how many ranks hold each
    layer, and one stage plan per (length, stage index) for an unslowed rank (eq. 14 memory with
    the optimizer sharded over every holder)."""
    shape, prof = state.shape, state.profile
    micro = _distribute_batch(shape.global_batch // shape.micro_batch, lengths)
    spans_of_length = {n: _layer_spans(prof.num_layers, n) for n in set(lengths)}
    holders = [0] * prof.num_layers
    for n, count in Counter(lengths).items():  # pipelines of one length share their spans
        for a, z in spans_of_length[n]:
            for x in range(a, z):
                holders[x] += count
    templates = {
        (n, i): make_stage(state, a, z, [-1], [shape.micro_batch], i, n, holders[a])
        for n in spans_of_length
        for i, (a, z) in enumerate(spans_of_length[n])
    }
    return micro, spans_of_length, holders, templates


def _shape_step_time(state: ClusterState, lengths: list[int]) -> float | None:
    """Step time of the plan with these pipeline lengths when no rank is slowed, from one pipeline
    per distinct (length, micro-batches) whose stages carry the multiplicity as their rank count
    (what the all-reduce model reads); None when a stage is over memory."""
    micro, spans_of_length, _, templates = _shapes(state, lengths)
    groups = Counter(zip(lengths, micro, strict=True))
    pipes = [
        PipelinePlan(tuple(_with_ranks(templates[n, i], (-1,) * count) for i in range(n)), m)
        for (n, m), count in groups.items()
    ]
    if over_cap(pipes, state.profile):
        return None
    return step_time(pipes, state.profile)


def _with_ranks(t: StagePlan, ranks: tuple[int, ...]) -> StagePlan:
    """`t` served by `ranks`. A re-parallelised plan has one stage object per rank, so this is
    the per-rank cost of the policy: copy the template's fields instead of running the frozen
    dataclass's `__init__` (5x cheaper; `dataclasses.replace` is 20x)."""
    out = object.__new__(StagePlan)
    out.__dict__.update(t.__dict__, ranks=ranks, samples_per_slot=t.samples_per_slot * len(ranks))
    return out


def _plan(
    state: ClusterState, name: str, lengths: list[int], alive: list[int], matched: bool, restart_s: float
) -> Candidate:
    shape, prof = state.shape, state.profile
    micro, spans_of_length, holders, templates = _shapes(state, lengths)
    # Classes instead of per-rank sets: a node holds its old stage's layers (class = old stage),
    # a slot needs the layers of its (length, stage) span (class = distinct span). O(ranks) numpy.
    spans = list(dict.fromkeys(span for n in lengths for span in spans_of_length[n]))
    span_id = {span: k for k, span in enumerate(spans)}
    ids_of_length = {
        n: np.array([span_id[span] for span in spans_of_length[n]], dtype=np.int64) for n in spans_of_length
    }
    new_ids = np.concatenate([ids_of_length[n] for n in lengths])
    old_spans, old_ids = _held_classes(state, alive)
    layer_bytes = [p * (1 + prof.optimizer_bytes_per_param_byte) for p in prof.layer_param_bytes]
    cost = class_cost_matrix(
        [frozenset(range(a, z)) for a, z in old_spans],
        [frozenset(range(a, z)) for a, z in spans],
        layer_bytes,
    )
    node_of_slot = np.arange(len(new_ids))
    if matched:
        m = match_classes(cost, old_ids, new_ids)
        slot_of_node = np.asarray(m.slot_of_node, dtype=np.int64)
        served = np.flatnonzero(slot_of_node >= 0)
        node_of_slot[slot_of_node[served]] = served
        moved = m.total_cost
    else:
        moved = float(cost[old_ids[: len(new_ids)], new_ids].sum())
    # Busiest receiver: the costliest (held, needed) class pair that occurs.
    busiest = float(cost[old_ids[node_of_slot], new_ids].max())
    rank_of_slot = np.asarray(alive, dtype=np.int64)[node_of_slot].tolist()
    # A stage's plan depends on its rank only through the rank's slowdown: stamp the rank into the
    # (length, stage) template; slowed ranks get their own make_stage.
    slowed = state.slowdown_map
    pipes, k = [], 0
    for j, n in enumerate(lengths):
        stages = []
        for i in range(n):
            rank = rank_of_slot[k]
            if rank in slowed:
                a, z = spans_of_length[n][i]
                stages.append(make_stage(state, a, z, [rank], [shape.micro_batch], i, n, holders[a]))
            else:
                stages.append(_with_ranks(templates[n, i], (rank,)))
            k += 1
        pipes.append(PipelinePlan(tuple(stages), micro[j]))
    cap = over_cap(pipes, prof)
    if cap:
        return infeasible(name, f"DP={len(lengths)} pipelines {lengths}: {cap}")
    changed = set(state.failed) or len(lengths) != shape.dp
    return Candidate(
        name,
        True,
        f"DP={len(lengths)} pipelines of {lengths} stages, micro-batches {micro}; "
        f"{'Kuhn-Munkres' if matched else 'in-order'} rank assignment moves {moved / 2**30:.1f} GiB",
        tuple(pipes),
        step_time(pipes, prof),
        shape.global_batch,
        restart_s + busiest / prof.migrate_bytes_per_s if changed else 0.0,
        moved,
        len(alive) * shape.tp,
    )


def _held_classes(state: ClusterState, alive: list[int]) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The layer spans the live ranks hold (classes) and each live rank's class: the plan in
    force (`ClusterState.held_layers`, a rank it does not name holds nothing), else the
    configured stages."""
    if not state.held_layers:
        edges = stage_edges(current_boundaries(state), state.profile.num_layers)
        return list(edges), np.asarray(alive, dtype=np.int64) % state.shape.pp
    span_of = {r: (a, z) for r, a, z in state.held_layers}
    spans = list(dict.fromkeys(span_of.get(r, (0, 0)) for r in alive))
    index = {span: k for k, span in enumerate(spans)}
    return spans, np.array([index[span_of.get(r, (0, 0))] for r in alive], dtype=np.int64)


def _distribute_batch(micro_batches: int, lengths: list[int]) -> list[int]:
    """Chameleon's distribute_batch: proportional to pipeline length, remainder one by one,
    then make sure no pipeline is left without a micro-batch."""
    total = sum(lengths)
    share = [micro_batches * n // total for n in lengths]
    remainder = micro_batches - sum(share)  # < len(share): one each to the first pipelines, cyclically
    for j in range(remainder):
        share[j % len(share)] += 1
    while min(share) == 0:
        share[share.index(max(share))] -= 1
        share[share.index(0)] += 1
    return share
