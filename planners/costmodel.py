"""Mini-step cost model and memory model of ElasWave §4.2, eq. (1).

For stage i holding layers l_i with local micro-batch size m_i:

    T_i = Tf_i + Tb_i + max(0, P2Pf_i - sigma_f * Tf_i) + max(0, P2Pb_i - sigma_b * Tb_i)

Tf/Tb are the profiled forward/backward times of the stage's layers at micro-batch size m_i
(piecewise-linear interpolation between profiled sizes, linear extrapolation beyond), scaled by
f_ref / f for the stage's slowest locked frequency (compute time ~ 1/f, used by DVFS §4.3).
P2Pf is the activation send to stage i+1, P2Pb the gradient send to stage i-1; with r_i ranks
sending to r_{i+1} ranks by sample range, a link carries at most max(m_i, m_{i+1}) samples.
The paper writes the exposed communication without the clamp; we clamp at zero because overlap
can hide communication but never make it negative.

The step adds the gradient synchronisation after the last backward, as Chameleon's eq. (10)
prices it and `planners.chameleon.stepmodel.sync_time` does for every policy's candidate: each
stage's DP group exchanges 2 (D-1)/D of its weights' bytes per device (a ring all-reduce, or
ZeRO-1's reduce-scatter of the gradients plus all-gather of the updated weights), stages in
parallel on their own devices, charged in full. Without it a plan that regroups ranks into fewer,
wider stages (PP=1: no pipeline bubble) looked free of the exchange that grows with it.

Memory of a stage (ZeRO-1): weights + gradients of its layers, its 1/D share of optimizer state,
and activations of the micro-batches in flight under 1F1B (min(P - i, M) for 0-based stage i).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from planners.dataflow import micro_batch_sizes, stage_micro_batch_size
from planners.layout import Layout


@dataclass(frozen=True)
class LayerProfile:
    """Profiled compute times (seconds) of every layer at a few micro-batch sizes, at `ref_mhz`."""

    micro_batch_sizes: tuple[int, ...]
    fwd_s: tuple[tuple[float, ...], ...]  # [layer][size index]
    bwd_s: tuple[tuple[float, ...], ...]
    ref_mhz: int = 1000

    def __post_init__(self) -> None:
        sizes = self.micro_batch_sizes
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"micro_batch_sizes must be increasing positive ints, got {sizes}")
        for name, table in (("fwd_s", self.fwd_s), ("bwd_s", self.bwd_s)):
            if any(len(row) != len(sizes) or min(row) < 0 for row in table):
                raise ValueError(f"{name} needs one non-negative time per micro-batch size per layer")
        if len(self.fwd_s) != len(self.bwd_s):
            raise ValueError(f"fwd_s has {len(self.fwd_s)} layers, bwd_s {len(self.bwd_s)}")

    @property
    def num_layers(self) -> int:
        return len(self.fwd_s)

    def layer_times(self, micro_batch: int, freq_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer (fwd, bwd) seconds at `micro_batch` samples; `freq_scale` = f / f_ref."""
        if micro_batch <= 0:
            zero = np.zeros(self.num_layers)
            return zero, zero
        w = _interp_weights(self.micro_batch_sizes, micro_batch)
        return self._fwd_table @ w / freq_scale, self._bwd_table @ w / freq_scale

    @cached_property
    def _fwd_table(self) -> np.ndarray:
        return np.asarray(self.fwd_s, dtype=float)

    @cached_property
    def _bwd_table(self) -> np.ndarray:
        return np.asarray(self.bwd_s, dtype=float)


def _interp_weights(sizes: tuple[int, ...], m: int) -> np.ndarray:
    """Weights over profiled sizes giving piecewise-linear interpolation (linear extrapolation
    outside; a single profiled size scales proportionally)."""
    w = np.zeros(len(sizes))
    if len(sizes) == 1:
        w[0] = m / sizes[0]
        return w
    k = min(max(bisect.bisect_left(sizes, m), 1), len(sizes) - 1)
    lo, hi = sizes[k - 1], sizes[k]
    t = (m - lo) / (hi - lo)
    w[k - 1], w[k] = 1 - t, t
    return w


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes per parameter and activation bytes per sample per layer (stored for backward)."""

    act_bytes_per_sample: tuple[float, ...]
    weight_bytes_per_param: float = 2.0
    grad_bytes_per_param: float = 2.0
    optim_bytes_per_param: float = 12.0  # fp32 master + Adam m, v; sharded over DP by ZeRO-1
    stage_base_bytes: float = 0.0


@dataclass(frozen=True)
class LinkModel:
    """P2P between stages and the compute/communication overlap factors sigma of eq. (1)."""

    boundary_bytes_per_sample: float
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    sigma_f: float = 0.0
    sigma_b: float = 0.0
    dp_bytes_per_s: float = math.inf  # bytes/s per device of the DP exchange; inf: not priced

    def __post_init__(self) -> None:
        if not self.dp_bytes_per_s > 0:
            raise ValueError(f"LinkModel.dp_bytes_per_s must be > 0 (inf: free), got {self.dp_bytes_per_s}")

    def transfer_s(self, samples: int) -> float:
        return self.latency_s + samples * self.boundary_bytes_per_sample / self.bandwidth_bytes_per_s


def ministep_time(
    tf: np.ndarray | float,
    tb: np.ndarray | float,
    p2p_f: np.ndarray | float,
    p2p_b: np.ndarray | float,
    sigma_f: float,
    sigma_b: float,
) -> np.ndarray | float:
    """Eq. (1); works elementwise (with broadcasting) on arrays of segment compute times."""
    return tf + tb + np.maximum(0.0, p2p_f - sigma_f * tf) + np.maximum(0.0, p2p_b - sigma_b * tb)


@dataclass(frozen=True)
class StageConditions:
    """What stage i's cost depends on besides its layers: its micro-batch size, frequency scale
    and the P2P times to its neighbours."""

    micro_batch: int
    freq_scale: float
    p2p_f_s: float
    p2p_b_s: float


@dataclass(frozen=True)
class CostModel:
    profile: LayerProfile
    memory: MemoryProfile
    link: LinkModel
    # Seconds every mini-step costs beyond eq. (1), whatever its blocks and samples: hop latency,
    # kernel launches, the schedule's waits. A profiled model has none; the uniform model charges
    # here what the measured wall step has beyond the blocks' compute (planners.elaswave_model),
    # so a shape with more mini-steps (stages or slots) pays for each.
    ministep_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ministep_overhead_s) and self.ministep_overhead_s >= 0):
            raise ValueError(
                f"CostModel.ministep_overhead_s must be finite and >= 0, got {self.ministep_overhead_s}"
            )

    def ministep(
        self,
        tf: np.ndarray | float,
        tb: np.ndarray | float,
        p2p_f: np.ndarray | float,
        p2p_b: np.ndarray | float,
    ) -> np.ndarray | float:
        """Eq. (1) with this model's overlap factors, plus its fixed mini-step overhead."""
        link = self.link
        return ministep_time(tf, tb, p2p_f, p2p_b, link.sigma_f, link.sigma_b) + self.ministep_overhead_s

    def conditions(self, layout: Layout) -> tuple[StageConditions, ...]:
        sizes = micro_batch_sizes(layout)
        clocks = self.stage_clocks_mhz(layout)
        out = []
        for p in range(layout.num_stages):
            nxt = sizes[p + 1] if p + 1 < len(sizes) else 0
            prv = sizes[p - 1] if p > 0 else 0
            p2p_f = self.link.transfer_s(max(sizes[p], nxt)) if nxt else 0.0
            p2p_b = self.link.transfer_s(max(sizes[p], prv)) if prv else 0.0
            out.append(StageConditions(sizes[p], clocks[p] / self.profile.ref_mhz, p2p_f, p2p_b))
        return tuple(out)

    def stage_clocks_mhz(self, layout: Layout) -> list[float]:
        """Slowest clock of each stage (DP peers wait for it); unlocked ranks run at `ref_mhz`."""
        default = float(self.profile.ref_mhz)
        if not layout.frequencies_mhz:
            return [default] * layout.num_stages  # the common case costs nothing per rank
        freqs = dict(layout.frequencies_mhz)
        if len(freqs) < len(layout.frequencies_mhz):  # a rank listed twice: its slowest clock counts
            freqs = {}
            for rank, mhz in layout.frequencies_mhz:
                freqs[rank] = min(mhz, freqs.get(rank, mhz))
        out = []
        for s in layout.stages:
            locked = freqs.keys() & s.ranks  # membership tested in C: no Python step per rank
            slowest = float(min(map(freqs.__getitem__, locked), default=math.inf))
            unlocked = len(locked) < s.dp_size and len(locked) < len(set(s.ranks))
            out.append(min(slowest, default) if unlocked else slowest)
        return out

    def stage_compute(self, cond: StageConditions) -> tuple[np.ndarray, np.ndarray]:
        return self.profile.layer_times(cond.micro_batch, cond.freq_scale)

    def stage_time(self, cond: StageConditions, layer_start: int, layer_stop: int) -> float:
        fwd, bwd = self.stage_compute(cond)
        tf, tb = float(fwd[layer_start:layer_stop].sum()), float(bwd[layer_start:layer_stop].sum())
        return float(self.ministep(tf, tb, cond.p2p_f_s, cond.p2p_b_s))

    def stage_times(self, layout: Layout) -> tuple[float, ...]:
        return tuple(
            self.stage_time(c, s.layer_start, s.layer_stop)
            for c, s in zip(self.conditions(layout), layout.stages, strict=True)
        )

    def step_time(self, layout: Layout) -> float:
        """1F1B step estimate: warm-up and cool-down pass through every stage once, the steady
        phase repeats the slowest mini-step M-1 times; then the DP exchange (`sync_time`)."""
        times = self.stage_times(layout)
        return sum(times) + (layout.num_micro_batches - 1) * max(times) + self.sync_time(layout)

    def sync_time(self, layout: Layout) -> float:
        """Seconds of the slowest stage's DP exchange: 2 (D-1)/D of its weights' bytes per device
        at `LinkModel.dp_bytes_per_s` (0 when that is inf, or every stage has DP size 1)."""
        if math.isinf(self.link.dp_bytes_per_s):
            return 0.0
        numel = layout.layer_numel
        ring = max(
            2 * (s.dp_size - 1) / s.dp_size * sum(numel[s.layer_start : s.layer_stop]) for s in layout.stages
        )
        return ring * self.memory.weight_bytes_per_param / self.link.dp_bytes_per_s

    def layer_mem_bytes(self, layout: Layout, stage: int, micro_batch: int | None = None) -> np.ndarray:
        """Per-layer bytes if `stage` held that layer (params, grads, optimizer share, activations)."""
        s, mem = layout.stages[stage], self.memory
        per_param = (
            mem.weight_bytes_per_param + mem.grad_bytes_per_param + mem.optim_bytes_per_param / s.dp_size
        )
        in_flight = min(layout.num_stages - stage, layout.num_micro_batches)
        micro = stage_micro_batch_size(layout, stage) if micro_batch is None else micro_batch
        return np.asarray(layout.layer_numel, dtype=float) * per_param + in_flight * micro * np.asarray(
            mem.act_bytes_per_sample, dtype=float
        )

    def stage_memory_bytes(self, layout: Layout, stage: int) -> float:
        """MemoryModel protocol (planners.validation)."""
        s = layout.stages[stage]
        return self.memory.stage_base_bytes + float(
            self.layer_mem_bytes(layout, stage)[s.layer_start : s.layer_stop].sum()
        )
