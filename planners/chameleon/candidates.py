"""Candidate plans of the recovery policies for one cluster state.

- TorchFT: drop every DP replica that lost a rank; survivors keep their layout and take the
  dropped replicas' micro-batches (global batch kept).
- ReCycle: drop only replicas that lost every rank; reroute the rest of the failed ranks'
  micro-batches to DP peers of the same stage (chameleon eq. 13, bottleneck form); the
  weight-gradient half of the rerouted backward may fill the P-1 bubble slots, as ReCycle's
  decoupled backward does, the rest lengthens the step.
ElasWave's candidate lives in `planners.chameleon.elastic`, the dynamic-parallelism ones
(Chameleon, Oobleck) in `planners.chameleon.reparallel`; this module also holds the layout
helpers they share.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

import numpy as np

from planners.chameleon.estimators import StepEstimate, rerouting_step_time
from planners.chameleon.state import Candidate, ClusterState, JobProfile, PipelinePlan, infeasible
from planners.chameleon.stepmodel import make_stage, over_cap, stage_memory, step_time
from planners.partition import AdditiveCosts


def even_counts(total: int, parts: int) -> list[int]:
    """`total` split into `parts` integers differing by at most one (earlier parts larger)."""
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def even_boundaries(num_layers: int, num_stages: int) -> tuple[int, ...]:
    edges = np.cumsum(even_counts(num_layers, num_stages))
    return tuple(int(e) for e in edges[:-1])


def current_boundaries(state: ClusterState) -> tuple[int, ...]:
    """The layout in force: the state's boundaries, or Algorithm 1 on the fault-free job (the
    balanced AdaPipe-like initial layout ElasWave §7.1 compares against)."""
    if state.boundaries:
        return state.boundaries
    return _balanced_boundaries(state.profile, state.shape.pp, state.shape.micro_batch)


@lru_cache(maxsize=64)
def _balanced_boundaries(prof: JobProfile, p: int, micro_batch: int) -> tuple[int, ...]:
    """Algorithm 1 on the fault-free job, computed once per (profile, depth, micro-batch)."""
    costs = np.asarray(prof.layer_fwd_s) + np.asarray(prof.layer_bwd_s)
    layer_cost = np.tile(costs * micro_batch, (p, 1))
    result = AdditiveCosts(
        layer_cost, np.zeros(p), np.zeros((p, prof.num_layers)), np.zeros(p), np.full(p, np.inf)
    ).solve()
    return result.boundaries if result.feasible else even_boundaries(prof.num_layers, p)


def stage_edges(boundaries: tuple[int, ...], num_layers: int) -> list[tuple[int, int]]:
    edges = [0, *boundaries, num_layers]
    return [(edges[i], edges[i + 1]) for i in range(len(edges) - 1)]


def _fixed_layout_pipe(
    state: ClusterState,
    replicas: list[int],
    samples: int,
    num_slots: int,
    activation_scale: list[float] | None = None,
) -> PipelinePlan:
    """The current stage boundaries served by `replicas`, each rank taking `samples` per slot."""
    shape = state.shape
    spans = stage_edges(current_boundaries(state), state.profile.num_layers)
    stages = []
    base = np.asarray(replicas, dtype=np.int64) * shape.pp
    for s, (a, b) in enumerate(spans):
        ranks = _without_failed((base + s).tolist(), state.failed)
        stage = make_stage(state, a, b, ranks, [samples] * len(ranks), s, len(spans), max(len(ranks), 1))
        if activation_scale is not None:
            mem = stage_memory(state.profile, a, b, s, len(spans), samples * activation_scale[s], len(ranks))
            stage = replace(stage, mem_bytes=mem)
        stages.append(stage)
    return PipelinePlan(tuple(stages), num_slots)


def _without_failed(ranks: list[int], failed: frozenset[int]) -> list[int]:
    """`ranks` (in order) minus the failed ones: a C-level `list.remove` per failed rank while
    there are few, one filtering pass when there are many."""
    present = failed.intersection(ranks)
    if len(present) > 64:
        return [r for r in ranks if r not in present]
    for r in present:
        ranks.remove(r)
    return ranks


def _damaged_replicas(state: ClusterState) -> dict[int, int]:
    """Replica -> number of its ranks that failed (only replicas that lost one)."""
    out: dict[int, int] = {}
    for r in state.failed:
        d = r // state.shape.pp
        out[d] = out.get(d, 0) + 1
    return out


def torchft(state: ClusterState) -> Candidate:
    shape = state.shape
    damaged = _damaged_replicas(state)
    whole = [d for d in range(shape.dp) if d not in damaged]
    if not whole:
        return infeasible("torchft", "every DP replica lost a rank; TorchFT has no whole replica left")
    slots = math.ceil(shape.global_batch / (len(whole) * shape.micro_batch))
    pipe = _fixed_layout_pipe(state, whole, shape.micro_batch, slots)
    cap = over_cap((pipe,), state.profile)
    if cap:  # fewer replicas shard the ZeRO-1 optimizer state over fewer ranks (eq. 14)
        return infeasible("torchft", f"{len(whole)} whole replicas do not fit memory: {cap}")
    dropped = shape.dp - len(whole)
    return Candidate(
        "torchft",
        True,
        f"dropped {dropped} of {shape.dp} replicas; {len(whole)} replicas run {slots} micro-batches each",
        (pipe,),
        step_time((pipe,), state.profile),
        shape.global_batch,
        state.mttr.torchft_restart_s if dropped else 0.0,
        0.0,
        len(whole) * shape.pp * shape.tp,
    )


def _rerouting_shape(state: ClusterState) -> tuple[list[int], list[int]]:
    """Replicas that keep at least one rank, and per stage how many of their ranks are lost."""
    shape = state.shape
    damaged = _damaged_replicas(state)
    replicas = [d for d in range(shape.dp) if damaged.get(d, 0) < shape.pp]
    failed = [0] * shape.pp
    for r in state.failed:
        if damaged[r // shape.pp] < shape.pp:
            failed[r % shape.pp] += 1
    return replicas, failed


def rerouting_estimate(state: ClusterState) -> StepEstimate:
    """Chameleon's eq. (13) estimate of rerouting, summed over stages as the paper writes it."""
    shape = state.shape
    replicas, failed = _rerouting_shape(state)
    if not replicas:
        return StepEstimate(float("inf"), False, "no replica left")
    pipe = _fixed_layout_pipe(state, replicas, shape.micro_batch, 1)
    worst = max(pipe.stages, key=lambda st: st.ministep_s)
    slots = math.ceil(shape.global_batch / (len(replicas) * shape.micro_batch))
    return rerouting_step_time(
        shape.pp, slots, len(replicas), failed, worst.fwd_s + worst.p2p_s, worst.bwd_s + worst.p2p_s
    )


def recycle(state: ClusterState) -> Candidate:
    shape, prof = state.shape, state.profile
    replicas, failed = _rerouting_shape(state)
    if not replicas:
        return infeasible("recycle", "no replica left")
    dead = shape.dp - len(replicas)
    d_live = len(replicas)
    if max(failed) >= d_live:
        s = failed.index(max(failed))
        return infeasible(
            "recycle", f"eq. 13: stage {s} lost all {d_live} live DP ranks; rerouting cannot recover"
        )
    slots = math.ceil(shape.global_batch / (d_live * shape.micro_batch))
    scale = [d_live / (d_live - f) for f in failed]  # peers hold the rerouted micro-batches' activations
    pipe = _fixed_layout_pipe(state, replicas, shape.micro_batch, slots, scale)
    ministep = max(st.ministep_s for st in pipe.stages)
    extra = max(slots * f / (d_live - f) for f in failed)
    # Decoupled backward: the weight-gradient part of rerouted work (half the backward) is
    # deferred into the P-1 bubble slots; forward and input-gradient stay on the critical path.
    w_frac = 0.5 * sum(prof.layer_bwd_s) / (sum(prof.layer_fwd_s) + sum(prof.layer_bwd_s))
    hidden = min(extra * w_frac, shape.pp - 1)
    t = step_time((pipe,), prof) + (extra - hidden) * ministep
    cap = over_cap((pipe,), prof)
    if cap:
        return infeasible("recycle", f"rerouted activations exceed memory: {cap}")
    return Candidate(
        "recycle",
        True,
        f"rerouted {sum(failed)} failed ranks' micro-batches to their stage peers "
        f"(+{extra:.3g} mini-steps, {hidden:.3g} hidden in bubbles); dropped {dead} whole replicas",
        (pipe,),
        t,
        shape.global_batch,
        state.mttr.recycle_s if state.failed else 0.0,
        0.0,
        (d_live * shape.pp - sum(failed)) * shape.tp,
    )
