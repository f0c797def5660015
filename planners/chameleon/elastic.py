"""ElasWave's candidate: micro-batch resizing, minimax layer migration, DVFS (ElasWave §4.1-4.3).

Every stage keeps its surviving ranks; a slot's samples are split evenly among them (§4.1), so a
stage that lost ranks takes longer per slot. Resizing alone keeps the boundaries and the slot
count. With migration, the planner also re-chooses the slot count M (a slot whose size divides
evenly among every stage's survivors removes the ceil() straggler) and re-partitions layers with
Algorithm 1 under per-stage memory caps; a stage with no survivor is removed and its layers are
re-partitioned over the rest. With DVFS, stages still above the balanced target after the
(layer-granular) partition are up-clocked to the lowest frequency that meets it: Alg. 2
(`planners.dvfs.bisection_search`) observing the analytic model, in which compute time scales
with nominal/f and transfers do not.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from planners.chameleon.candidates import current_boundaries, even_counts, stage_edges
from planners.chameleon.state import (
    Candidate,
    ClusterState,
    JobProfile,
    JobShape,
    PipelinePlan,
    StagePlan,
    infeasible,
)
from planners.chameleon.stepmodel import make_stage, over_cap, step_time
from planners.dvfs import bisection_search, model_frequency_guess
from planners.partition import AdditiveCosts


def elaswave(state: ClusterState, migrate: bool = True, dvfs: bool = True) -> Candidate:
    name = "elaswave" if migrate and dvfs else ("elaswave-migrate" if migrate else "elaswave-resize")
    shape = state.shape
    groups = [state.stage_ranks(s) for s in range(shape.pp)]
    kept = [s for s in range(shape.pp) if groups[s]]
    if not kept:
        return infeasible(name, "no rank left")
    if not migrate and len(kept) < shape.pp:
        return infeasible(
            name,
            f"stage(s) {[s for s in range(shape.pp) if not groups[s]]} lost every rank; "
            "resizing alone cannot serve them",
        )
    ranks = [groups[s] for s in kept]
    floor = _linear_per_sample(state) * shape.num_ranks / state.num_alive if dvfs else 0.0
    best: Candidate | None = None
    last_reason = "no slot size to try"
    for slot_size in _slot_sizes(state, [len(g) for g in ranks], migrate):
        cand = _plan_for_slot_size(state, name, kept, ranks, slot_size, migrate, dvfs, floor)
        if not cand.feasible:
            last_reason = cand.reason
        elif best is None or cand.step_time_s < best.step_time_s:
            best = cand
    return best if best is not None else infeasible(name, last_reason)


def _slot_sizes(state: ClusterState, live: list[int], migrate: bool) -> list[int]:
    """Samples per micro-batch slot to try: the original (resizing keeps M), and with migration
    every size between half and twice the original that some damaged stage's survivor count
    divides (slots follow `planners.layout.slot_range`, so the global batch need not divide)."""
    shape = state.shape
    original = shape.micro_batch * shape.dp
    if not migrate:
        return [original]
    sizes = {original}
    lo, hi = max(1, original // 2), 2 * original
    for n in {n for n in live if n != shape.dp}:  # the multiples of each damaged stage's survivor count
        sizes.update(range(-(-lo // n) * n, hi + 1, n))
    return sorted(sizes)


def _plan_for_slot_size(
    state: ClusterState,
    name: str,
    kept: list[int],
    ranks: list[list[int]],
    slot_size: int,
    migrate: bool,
    dvfs: bool,
    floor_per_sample: float = 0.0,
) -> Candidate:
    shape, prof = state.shape, state.profile
    slots = math.ceil(shape.global_batch / slot_size)
    largest_slot = math.ceil(shape.global_batch / slots)
    samples = [even_counts(largest_slot, len(g)) for g in ranks]
    if migrate:
        bounds = _partition(state, ranks, samples, slots)
        if bounds is None:
            return infeasible(
                name, f"Algorithm 1 found no memory-feasible partition for slots of {slot_size}"
            )
    else:
        bounds = current_boundaries(state)
    spans = stage_edges(bounds, prof.num_layers)
    stages = [
        make_stage(state, a, b, g, n, i, len(spans), len(g))
        for i, ((a, b), g, n) in enumerate(zip(spans, ranks, samples, strict=True))
    ]
    if dvfs and (state.failed or state.slowdown):
        stages = _upclock_stragglers(state, stages, floor_per_sample * largest_slot)
    pipe = PipelinePlan(tuple(stages), slots)
    cap = over_cap((pipe,), prof)
    if cap:
        return infeasible(name, f"resized micro-batches exceed memory: {cap}")
    moved, per_rank = _migration_bytes(state, kept, pipe)
    transition = (state.mttr.elaswave_base_s + per_rank / prof.migrate_bytes_per_s) if state.failed else 0.0
    freqs = sorted({s.freq_mhz for s in stages} - {prof.freq_nominal_mhz})
    return Candidate(
        name,
        True,
        f"{len(kept)} stages, slots of {slot_size} samples x {slots}; boundaries "
        f"{list(bounds)}" + (f"; up-clocked to {freqs} MHz" if freqs else ""),
        (pipe,),
        step_time((pipe,), prof),
        shape.global_batch,
        transition,
        moved,
        sum(len(g) for g in ranks) * shape.tp,
    )


def _stage_weight(state: ClusterState, ranks: list[int], samples: list[int]) -> float:
    return state.worst_share(ranks, samples)


def _partition(
    state: ClusterState, ranks: list[list[int]], samples: list[list[int]], slots: int
) -> tuple[int, ...] | None:
    """Algorithm 1 (planners.partition) over the stages' per-layer mini-step costs and eq. (14)."""
    prof = state.profile
    p = len(ranks)
    per_layer = np.asarray(prof.layer_fwd_s) + np.asarray(prof.layer_bwd_s)
    params, acts = np.asarray(prof.layer_param_bytes), np.asarray(prof.layer_act_bytes)
    weight = np.array([_stage_weight(state, g, n) for g, n in zip(ranks, samples, strict=True)])
    peak = np.array([max(n) for n in samples], dtype=float)
    layer_cost = weight[:, None] * per_layer[None, :]
    overhead = 2 * peak * prof.p2p_s_per_sample
    in_flight = np.array([min(p - i, slots) for i in range(p)], dtype=float)
    opt_share = np.array([prof.optimizer_bytes_per_param_byte / len(g) for g in ranks])
    layer_mem = (2 + opt_share)[:, None] * params[None, :] + (in_flight * peak)[:, None] * acts[None, :]
    result = AdditiveCosts(
        layer_cost, overhead, layer_mem, np.zeros(p), np.full(p, prof.mem_cap_bytes)
    ).solve()
    return result.boundaries if result.feasible else None


def _linear_target(state: ClusterState, slot_samples: int) -> float:
    """Mini-step time that would give linear scaling: the fault-free worst mini-step per sample,
    times the lost fraction of ranks, times this plan's slot size. DVFS never aims below it."""
    return _linear_per_sample(state) * slot_samples * state.shape.num_ranks / state.num_alive


def _linear_per_sample(state: ClusterState) -> float:
    """The fault-free worst mini-step per sample of the configured layout (0 if it cannot run);
    cached per (job, profile, layout): every plan of one job shares it."""
    return _fault_free_per_sample(state.shape, state.profile, state.boundaries)


@lru_cache(maxsize=64)
def _fault_free_per_sample(shape: JobShape, prof: JobProfile, boundaries: tuple[int, ...]) -> float:
    fault_free = elaswave(ClusterState(shape, prof, boundaries=boundaries), migrate=False, dvfs=False)
    if not fault_free.feasible:
        return 0.0
    return max(s.ministep_s for s in fault_free.pipelines[0].stages) / (shape.micro_batch * shape.dp)


def _upclock_stragglers(state: ClusterState, stages: list[StagePlan], floor_s: float) -> list[StagePlan]:
    """Lowest frequency per straggler stage that meets the target T* (ElasWave Alg. 2).

    T* is the larger of the minimax time if layers were divisible (sum_s (T - o_s) / w_s = total
    layer work, w_s the stage's weight per layer-second, o_s its exposed transfer) and the
    linear-scaling mini-step `floor_s`: up-clocking only removes what the event created.
    """
    prof = state.profile
    compute = [s.fwd_s + s.bwd_s for s in stages]
    overhead = [2 * s.p2p_s for s in stages]
    work = [
        sum(prof.layer_fwd_s[s.layer_start : s.layer_stop])
        + sum(prof.layer_bwd_s[s.layer_start : s.layer_stop])
        for s in stages
    ]
    weight = [c / w if w > 0 else 0.0 for c, w in zip(compute, work, strict=True)]
    inv = sum(1 / w for w in weight if w > 0)
    if inv == 0:
        return stages
    target = (sum(work) + sum(o / w for o, w in zip(overhead, weight, strict=True) if w > 0)) / inv
    target = max(target, max(overhead), floor_s)
    out = []
    for s, c, o in zip(stages, compute, overhead, strict=True):
        if c + o <= target * (1 + 1e-9) or target <= o:
            out.append(s)
            continue
        freq = _lowest_frequency(prof, c, o, target)
        scale = prof.freq_nominal_mhz / freq
        out.append(
            StagePlan(
                s.layer_start,
                s.layer_stop,
                s.ranks,
                s.samples_per_slot,
                freq,
                s.fwd_s * scale,
                s.bwd_s * scale,
                s.p2p_s,
                s.mem_bytes,
            )
        )
    return out


def _lowest_frequency(prof: JobProfile, compute_s: float, other_s: float, target_s: float) -> int:
    """`planners.dvfs.bisection_search` (Alg. 2) observing the analytic stage time
    `compute * f_nominal / f + other` instead of a device."""
    f_nom = prof.freq_nominal_mhz
    search = bisection_search(
        f_nom,
        prof.freq_max_mhz,
        target_s,
        target_s * 1e-9,
        prof.freq_step_mhz,
        model_frequency_guess(compute_s, other_s, f_nom, target_s),
    )
    mhz = next(search)
    while True:
        try:
            mhz = search.send(compute_s * f_nom / mhz + other_s)
        except StopIteration as done:
            return int(done.value.mhz)


def _migration_bytes(state: ClusterState, kept: list[int], pipe: PipelinePlan) -> tuple[float, float]:
    """Bytes moved in total and into the busiest rank: layers that change stage (weights to every
    rank of the new stage, optimizer state once, interleaved ZeRO §6.3) plus the optimizer shards
    survivors of a shrunk stage take over from the snapshot pool (§5.2)."""
    prof, shape = state.profile, state.shape
    old_stage = {}
    for s, (a, b) in enumerate(stage_edges(current_boundaries(state), prof.num_layers)):
        for layer in range(a, b):
            old_stage[layer] = s
    total, busiest = 0.0, 0.0
    for orig, stage in zip(kept, pipe.stages, strict=True):
        n = len(stage.ranks)
        incoming = [layer for layer in stage.layers if old_stage[layer] != orig]
        weights = sum(prof.layer_param_bytes[layer] for layer in incoming)
        opt = weights * prof.optimizer_bytes_per_param_byte
        stayed = sum(prof.layer_param_bytes[layer] for layer in stage.layers if old_stage[layer] == orig)
        remap = stayed * prof.optimizer_bytes_per_param_byte * (1 / n - 1 / shape.dp) if n < shape.dp else 0.0
        total += n * weights + opt + n * remap
        busiest = max(busiest, weights + opt / n + remap)
    return total, busiest
