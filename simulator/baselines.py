"""The baselines' plans as the simulator runs them, beyond `planners.chameleon.candidates`.

ReCycle (Gandhi et al., SOSP'24; ElasWave §2 and §7.2): a failed rank's micro-batches are rerouted
to its stage peers, and the weight-gradient pass (W) of the rerouted work is deferred into the
pipeline bubbles (decoupled backward). A deferred W keeps the inputs of its layer's matmuls
until it runs: dW = X^T dY needs X. We count X only (the QKV, output-projection, MLP up/gate
and down-projection inputs: `(3 h + ffn)` bf16 values per token per layer, / TP); the paper's
implementation also keeps dY, so this is a lower bound. A stage defers at most the W passes that
fit its P-1 bubble slots per step (`(P-1) / w` micro-batches, `w` the W pass's share of a
mini-step, half the backward), and no more than its rerouted micro-batches. ElasWave §7.2
reports ReCycle out of memory on Llama2-34B after three nodes are lost "due to deferred
weight-gradient memory"; `recycle` reproduces that case (tests/simulator/test_paper_results.py).
When rerouting cannot run (memory, or a stage lost every live peer) ReCycle restarts without the
damaged replicas, as TorchFT does.
"""

from __future__ import annotations

from dataclasses import replace

from planners.chameleon.candidates import _rerouting_shape, recycle, torchft
from planners.chameleon.state import Candidate, ClusterState, PipelinePlan
from simulator.jobs import JobSpec


def deferred_w_bytes(spec: JobSpec, state: ClusterState) -> tuple[float, ...]:
    """Per stage: bytes a peer device keeps for deferred W passes (0 where nothing is rerouted)."""
    shape, prof, m = state.shape, state.profile, spec.model
    replicas, failed = _rerouting_shape(state)
    d_live = len(replicas)
    if not d_live:
        return (0.0,) * shape.pp
    slots = -(-shape.global_batch // (d_live * shape.micro_batch))
    w_share = 0.5 * sum(prof.layer_bwd_s) / (sum(prof.layer_fwd_s) + sum(prof.layer_bwd_s))
    fits_bubbles = (shape.pp - 1) / w_share
    per_sample_layer = 2 * m.seq_len * (3 * m.hidden + m.ffn) / shape.tp
    layers = [len(r) for r in _stage_layers(state)]
    out = []
    for s, f in enumerate(failed):
        if f == 0 or f >= d_live:
            out.append(0.0)
            continue
        rerouted = slots * f / (d_live - f)
        deferred = min(rerouted, fits_bubbles)
        out.append(deferred * shape.micro_batch * layers[s] * per_sample_layer)
    return tuple(out)


def _stage_layers(state: ClusterState) -> list[range]:
    from planners.chameleon.candidates import current_boundaries, stage_edges  # noqa: PLC0415

    return [range(a, b) for a, b in stage_edges(current_boundaries(state), state.profile.num_layers)]


def recycle_with_deferred_w(spec: JobSpec, state: ClusterState) -> Candidate:
    """ReCycle's plan with its deferred-W memory counted; an out-of-memory plan says so."""
    cand = recycle(state)
    if not cand.feasible or not state.failed:
        return cand
    extra = deferred_w_bytes(spec, state)
    pipe = cand.pipelines[0]
    stages = tuple(replace(st, mem_bytes=st.mem_bytes + e) for st, e in zip(pipe.stages, extra, strict=True))
    cap = state.profile.mem_cap_bytes
    over = [i for i, st in enumerate(stages) if st.mem_bytes > cap]
    if over:
        worst = max(over, key=lambda i: stages[i].mem_bytes)
        return Candidate(
            "recycle",
            False,
            f"out of memory: stage {worst} needs {stages[worst].mem_bytes / 2**30:.1f} GiB > "
            f"{cap / 2**30:.0f} GiB with {extra[worst] / 2**30:.1f} GiB of deferred weight-gradient "
            "inputs (ReCycle's decoupled backward)",
        )
    return replace(cand, pipelines=(PipelinePlan(stages, pipe.num_slots),))


def recycle_or_restart(spec: JobSpec, state: ClusterState) -> tuple[Candidate, bool]:
    """ReCycle's plan, or its restart without the damaged replicas; True when it restarted."""
    cand = recycle_with_deferred_w(spec, state)
    if cand.feasible:
        return cand, False
    fallback = torchft(state)
    if not fallback.feasible:
        return cand, False
    return replace(
        fallback,
        policy="recycle",
        reason=f"{cand.reason}; restarted without damaged replicas: {fallback.reason}",
    ), True
