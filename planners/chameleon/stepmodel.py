"""Step time and memory of a candidate plan, from the per-layer profile.

A stage's per-slot forward (backward) time is its slowest rank's: samples x the stage's
per-sample layer times x the rank's slowdown / (frequency / nominal). A pipeline's makespan is
the event-driven recurrence of eq. (11); several pipelines update together, so the step is the
slowest pipeline (eq. 10) plus the gradient synchronisation, serialised into the all-reduce
rounds of the layer-conflict colouring (chameleon §IV-B). Memory per device is eq. (14) with
the optimizer state sharded ZeRO-1 style over the devices that hold each layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from planners.chameleon.coloring import colour_all_reduce_rounds, rounds_time
from planners.chameleon.estimators import asymmetric_pipeline_time
from planners.chameleon.memory import LayerMemory, stage_peak_memory
from planners.chameleon.state import ClusterState, JobProfile, PipelinePlan, StagePlan


def make_stage(
    state: ClusterState,
    layer_start: int,
    layer_stop: int,
    ranks: Sequence[int],
    samples_per_slot: Sequence[int],
    stage_index: int,
    num_stages: int,
    zero_shards: int,
    freq_mhz: int | None = None,
) -> StagePlan:
    """Build one stage's plan: compute times of its slowest rank and its eq. (14) memory."""
    prof = state.profile
    freq = freq_mhz if freq_mhz is not None else prof.freq_nominal_mhz
    fwd = sum(prof.layer_fwd_s[layer_start:layer_stop])
    bwd = sum(prof.layer_bwd_s[layer_start:layer_stop])
    speed = freq / prof.freq_nominal_mhz
    if len(ranks) != len(samples_per_slot):
        raise ValueError(f"{len(ranks)} ranks but {len(samples_per_slot)} sample counts")
    worst = state.worst_share(ranks, samples_per_slot)
    max_samples = max(samples_per_slot, default=0)
    mem = stage_memory(prof, layer_start, layer_stop, stage_index, num_stages, max_samples, zero_shards)
    return StagePlan(
        layer_start,
        layer_stop,
        tuple(ranks),
        tuple(samples_per_slot),
        freq,
        worst * fwd / speed,
        worst * bwd / speed,
        max_samples * prof.p2p_s_per_sample,
        mem,
    )


def stage_memory(
    prof: JobProfile,
    layer_start: int,
    layer_stop: int,
    stage_index: int,
    num_stages: int,
    samples: float,
    zero_shards: int,
) -> float:
    """Eq. (14): static (weights, grads, 1/zero_shards of optimizer) + in-flight activations."""
    n = layer_stop - layer_start
    if n <= 0:
        return 0.0
    param = sum(prof.layer_param_bytes[layer_start:layer_stop]) / n
    act = sum(prof.layer_act_bytes[layer_start:layer_stop]) / n
    mem = LayerMemory(
        param=param,
        optimizer=param * prof.optimizer_bytes_per_param_byte / max(zero_shards, 1),
        grad=param,
        activation_per_micro_batch=act,
    )
    return stage_peak_memory(n, stage_index, num_stages, mem, activation_scale=samples)


def pipeline_time(pipe: PipelinePlan) -> float:
    """Eq. (11) makespan of one pipeline (memoised: the pipelines of a plan mostly share shapes)."""
    p2p = max((s.p2p_s for s in pipe.stages), default=0.0)
    return _pipeline_time(
        tuple(s.fwd_s for s in pipe.stages), tuple(s.bwd_s for s in pipe.stages), pipe.num_slots, p2p
    )


@lru_cache(maxsize=4096)
def _pipeline_time(fwd: tuple[float, ...], bwd: tuple[float, ...], num_slots: int, p2p: float) -> float:
    return asymmetric_pipeline_time(fwd, bwd, num_slots, p2p)


def sync_time(pipes: Sequence[PipelinePlan], prof: JobProfile) -> float:
    """Gradient all-reduce after the last backward, serialised into coloured rounds."""
    ranks_of_span: dict[tuple[int, int], int] = {}  # distinct layer spans: O(stages), not O(layers)
    for pipe in pipes:
        for stage in pipe.stages:
            span = (stage.layer_start, stage.layer_stop)
            ranks_of_span[span] = ranks_of_span.get(span, 0) + len(stage.ranks)
    holders: dict[int, int] = {}
    for (a, z), n in ranks_of_span.items():
        for layer in range(a, z):
            holders[layer] = holders.get(layer, 0) + n
    # Devices holding the same layers add no edge the first of them does not: colour distinct sets.
    rounds = colour_all_reduce_rounds([frozenset(range(a, z)) for a, z in ranks_of_span])
    per_layer = {
        layer: 2 * (n - 1) / n * prof.layer_param_bytes[layer] / prof.allreduce_bytes_per_s
        for layer, n in holders.items()
    }
    return rounds_time(rounds, per_layer)


def step_time(pipes: Sequence[PipelinePlan], prof: JobProfile) -> float:
    """Eq. (10): slowest pipeline, then the synchronous gradient update."""
    if not pipes:
        return float("inf")
    return max(pipeline_time(p) for p in pipes) + sync_time(pipes, prof)


def over_cap(pipes: Sequence[PipelinePlan], prof: JobProfile) -> str:
    """Empty when every stage fits its device memory, else which stage does not and by how much."""
    for j, pipe in enumerate(pipes):
        for i, stage in enumerate(pipe.stages):
            if stage.mem_bytes > prof.mem_cap_bytes:
                return (
                    f"pipeline {j} stage {i} needs {stage.mem_bytes / 2**30:.1f} GiB > cap "
                    f"{prof.mem_cap_bytes / 2**30:.1f} GiB"
                )
    return ""
