"""Express a single-pipeline candidate (ElasWave, TorchFT) as a `planners.layout.Layout`, the form
the executor applies and `planners.validation` checks."""

from __future__ import annotations

from planners.chameleon.state import Candidate, ClusterState
from planners.layout import Layout, StageLayout


def candidate_layout(candidate: Candidate, state: ClusterState) -> Layout:
    """The candidate's stages, ranks, slot count and frequencies as a Layout (even sample splits)."""
    if not candidate.feasible or len(candidate.pipelines) != 1:
        raise ValueError(
            f"{candidate.policy}: only a feasible single-pipeline candidate maps to a Layout "
            f"({len(candidate.pipelines)} pipelines, feasible={candidate.feasible})"
        )
    pipe = candidate.pipelines[0]
    prof = state.profile
    stages = tuple(StageLayout(i, s.layer_start, s.layer_stop, s.ranks) for i, s in enumerate(pipe.stages))
    freqs = tuple(
        sorted((r, s.freq_mhz) for s in pipe.stages for r in s.ranks if s.freq_mhz != prof.freq_nominal_mhz)
    )
    numel = tuple(max(1, int(b // 2)) for b in prof.layer_param_bytes)  # bf16: 2 bytes per parameter
    return Layout(
        prof.num_layers, state.shape.global_batch, pipe.num_slots, stages, numel, frequencies_mhz=freqs
    )
