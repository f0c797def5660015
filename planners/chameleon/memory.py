"""Chameleon's peak-memory estimator, eq. (14) of Chameleon §IV-C.

`M_peak,i = N_li (m_p + m_o + m_g) + (N_pp - i) N_li m_a`: static memory of the stage's layers
plus the activations of the micro-batches a 1F1B stage keeps in flight in the steady phase.
Stage indices are 0-based here, so stage i holds `N_pp - i` micro-batches (the first stage the
most). `m_a` is per micro-batch; pass a scaled value when a stage's micro-batch grows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerMemory:
    """Average per-layer memory in bytes, from profiling (eq. 14's m_p, m_o, m_g, m_a)."""

    param: float
    optimizer: float
    grad: float
    activation_per_micro_batch: float

    def __post_init__(self) -> None:
        for name in ("param", "optimizer", "grad", "activation_per_micro_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"LayerMemory.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory per stage, which stages exceed their cap, and why."""

    stage_peak_bytes: tuple[float, ...]
    fits: bool
    reason: str


def stage_peak_memory(
    n_layers: int, stage: int, n_pp: int, mem: LayerMemory, activation_scale: float = 1.0
) -> float:
    """Eq. (14) for one stage; `activation_scale` multiplies m_a (e.g. a larger micro-batch)."""
    if not 0 <= stage < n_pp:
        raise ValueError(f"stage {stage} out of range [0, {n_pp})")
    if n_layers < 0:
        raise ValueError(f"n_layers must be >= 0, got {n_layers}")
    static = n_layers * (mem.param + mem.optimizer + mem.grad)
    dynamic = (n_pp - stage) * n_layers * mem.activation_per_micro_batch * activation_scale
    return static + dynamic


def pipeline_peak_memory(
    layers_per_stage: Sequence[int],
    mem: LayerMemory,
    cap_bytes: float,
    activation_scale: Sequence[float] | None = None,
) -> MemoryEstimate:
    """Eq. (14) for every stage of a pipeline, checked against a per-device cap."""
    n_pp = len(layers_per_stage)
    scale = list(activation_scale) if activation_scale is not None else [1.0] * n_pp
    if len(scale) != n_pp:
        raise ValueError(f"activation_scale has {len(scale)} entries, expected {n_pp}")
    peaks = tuple(stage_peak_memory(n, i, n_pp, mem, scale[i]) for i, n in enumerate(layers_per_stage))
    over = [i for i, p in enumerate(peaks) if p > cap_bytes]
    if over:
        worst = max(over, key=lambda i: peaks[i])
        return MemoryEstimate(
            peaks,
            False,
            f"eq. 14: stage {worst} needs {peaks[worst] / 2**30:.2f} GiB "
            f"> cap {cap_bytes / 2**30:.2f} GiB (stages over cap: {over})",
        )
    return MemoryEstimate(
        peaks,
        True,
        f"eq. 14: peak {max(peaks, default=0.0) / 2**30:.2f} GiB <= cap {cap_bytes / 2**30:.2f} GiB",
    )
