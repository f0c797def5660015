"""FlexTrain's scale table and Poisson benefit test for scale-up offers (FlexTrain §4.4, §5.1).

Scale table (§4.4.4): for each GPU count, the fastest memory-feasible configuration by the
profiling-based prediction; then, in ascending GPU count, an entry is dropped when (1) the
profiled and modelled predictions move in different directions relative to their own previous
kept values, (2) they disagree by more than `max_discrepancy`, or (3) it is not at least
`min_gain` faster than the last kept entry. The modelled prediction is eq. (5), the VPP
iteration time; the profiled one is any estimator the caller trusts (here eq. 11).

Benefit test (§5.1): scale up only if `lambda * S / (S - 1) * T_overhead < ln(1 / P_th)`, eq.
(16): the probability, under Poisson arrivals of rate lambda, that the idle GPUs stay idle long
enough for the speedup S to repay the scaling overhead is at least P_th (eq. 15).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from planners.chameleon.candidates import torchft
from planners.chameleon.state import ClusterState, JobShape


@dataclass(frozen=True)
class ConfigPrediction:
    """One configuration for `gpus` devices with its predicted iteration times (seconds)."""

    gpus: int
    dp: int
    pp: int
    profiled_step_s: float
    modeled_step_s: float
    fits_memory: bool = True


@dataclass(frozen=True)
class ScaleEntry:
    gpus: int
    dp: int
    pp: int
    speedup: float  # profiled, relative to the smallest kept configuration
    modeled_speedup: float


@dataclass(frozen=True)
class ScaleTable:
    entries: tuple[ScaleEntry, ...]
    excluded: tuple[tuple[int, str], ...]  # (gpus, why)
    reason: str

    def best_within(self, gpus: int) -> ScaleEntry | None:
        fitting = [e for e in self.entries if e.gpus <= gpus]
        return max(fitting, key=lambda e: e.speedup, default=None)


def vpp_iteration_time(
    m: int, p: int, num_layers: int, t_layer_s: float, virtual: int | None = None
) -> float:
    """Eq. (5): (m v + p - 1) or (p v + m - 1) chunk-times, a chunk being L / (p v) layers.

    FlexTrain sets v = ceil(L / p) (one layer per chunk); `virtual=1` is plain 1F1B, where eq. (5)
    reduces to chameleon's eq. (9)."""
    if min(m, p, num_layers) < 1 or t_layer_s < 0:
        raise ValueError(f"need m, p, L >= 1 and t_layer >= 0, got m={m}, p={p}, L={num_layers}")
    v = virtual if virtual is not None else math.ceil(num_layers / p)
    if v < 1:
        raise ValueError(f"virtual must be >= 1, got {v}")
    slots = m * v + p - 1 if m >= p else p * v + m - 1
    return slots * t_layer_s * num_layers / (p * v)


def build_scale_table(
    predictions: Sequence[ConfigPrediction], max_discrepancy: float = 0.25, min_gain: float = 0.02
) -> ScaleTable:
    """Best configuration per GPU count, filtered as §4.4.4."""
    best: dict[int, ConfigPrediction] = {}
    for c in predictions:
        if c.profiled_step_s <= 0 or c.modeled_step_s <= 0:
            raise ValueError(f"predicted step times must be > 0 (gpus={c.gpus}, dp={c.dp}, pp={c.pp})")
        if c.fits_memory and (c.gpus not in best or c.profiled_step_s < best[c.gpus].profiled_step_s):
            best[c.gpus] = c
    oom = sorted({c.gpus for c in predictions} - set(best))
    excluded: list[tuple[int, str]] = [(g, "every configuration runs out of memory") for g in oom]
    counts = sorted(best)
    if not counts:
        return ScaleTable((), tuple(excluded), "no configuration fits in memory")
    base = best[counts[0]]
    entries = [ScaleEntry(base.gpus, base.dp, base.pp, 1.0, 1.0)]
    prev_prof, prev_model = 1.0, 1.0
    for g in counts[1:]:
        c = best[g]
        prof = base.profiled_step_s / c.profiled_step_s
        model = base.modeled_step_s / c.modeled_step_s
        if (prof > prev_prof) != (model > prev_model):
            excluded.append(
                (
                    g,
                    f"trends disagree: profiled {prev_prof:.3f}->{prof:.3f}, modelled "
                    f"{prev_model:.3f}->{model:.3f}",
                )
            )
        elif abs(prof - model) / model > max_discrepancy:
            excluded.append(
                (
                    g,
                    f"profiled speedup {prof:.3f} and modelled {model:.3f} differ by more than "
                    f"{max_discrepancy:.0%}",
                )
            )
        elif prof < entries[-1].speedup * (1 + min_gain):
            excluded.append(
                (
                    g,
                    f"speedup {prof:.3f} is not {min_gain:.0%} above {entries[-1].speedup:.3f} "
                    f"at {entries[-1].gpus} GPUs",
                )
            )
        else:
            entries.append(ScaleEntry(g, c.dp, c.pp, prof, model))
            prev_prof, prev_model = prof, model
            continue
        prev_prof, prev_model = prof, model
    return ScaleTable(
        tuple(entries),
        tuple(sorted(excluded)),
        f"kept {len(entries)} of {len(counts)} GPU counts; excluded {len(excluded)}",
    )


@dataclass(frozen=True)
class BenefitDecision:
    scale_up: bool
    probability: float  # eq. (15): P(T_avail > S / (S - 1) * T_overhead)
    reason: str


def poisson_benefit(
    speedup: float, overhead_s: float, arrival_rate_per_s: float, p_threshold: float = 0.6
) -> BenefitDecision:
    """Eq. (15)-(16): scale up when idle GPUs likely stay idle long enough to pay off."""
    if overhead_s < 0 or arrival_rate_per_s < 0 or not 0 < p_threshold < 1:
        raise ValueError("need overhead_s >= 0, arrival_rate_per_s >= 0 and 0 < p_threshold < 1")
    if speedup <= 1:
        return BenefitDecision(False, 0.0, f"speedup {speedup:.3f} <= 1: scaling up cannot pay off")
    needed = speedup / (speedup - 1) * overhead_s
    exponent = arrival_rate_per_s * needed
    probability = math.exp(-exponent)
    ok = exponent < math.log(1 / p_threshold)
    return BenefitDecision(
        ok,
        probability,
        f"eq. 16: lambda*S/(S-1)*T_o = {exponent:.4g} {'<' if ok else '>='} ln(1/P_th) = "
        f"{math.log(1 / p_threshold):.4g} (needs {needed:.0f} s idle, P = {probability:.3f})",
    )


def arrival_rate(submit_times_s: Sequence[float], now_s: float, window_s: float) -> float:
    """Jobs per second over the last `window_s` (FlexTrain uses an 8-hour window)."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    return sum(1 for t in submit_times_s if now_s - window_s < t <= now_s) / window_s


def choose_scale_up(
    table: ScaleTable,
    current_gpus: int,
    idle_gpus: int,
    max_gpus: int,
    overhead_s: float,
    arrival_rate_per_s: float,
    p_threshold: float = 0.6,
) -> tuple[ScaleEntry | None, BenefitDecision]:
    """Largest-throughput table entry within current + idle (and the admin cap), if it pays off."""
    current = table.best_within(current_gpus)
    target = table.best_within(min(current_gpus + idle_gpus, max_gpus))
    if current is None or target is None or target.gpus <= current.gpus:
        return None, BenefitDecision(False, 0.0, "no scale-table entry above the current allocation fits")
    decision = poisson_benefit(target.speedup / current.speedup, overhead_s, arrival_rate_per_s, p_threshold)
    return (target if decision.scale_up else None), decision


def predict_configs(state: ClusterState, max_ranks: int) -> list[ConfigPrediction]:
    """Every (DP, PP) from the job's rank count up to `max_ranks` with an even global batch:
    profiled = eq. (10)/(11) on a balanced Algorithm-1 layout, modelled = eq. (5) with v = 1."""
    shape, prof = state.shape, state.profile
    per_layer = (sum(prof.layer_fwd_s) + sum(prof.layer_bwd_s)) / prof.num_layers * shape.micro_batch
    out = []
    for ranks in range(shape.num_ranks, max_ranks + 1):
        for pp in range(1, min(ranks, prof.num_layers) + 1):
            dp = ranks // pp
            if dp * pp != ranks or shape.global_batch % (dp * shape.micro_batch):
                continue
            new = JobShape(pp, dp, shape.micro_batch, shape.global_batch, shape.tp)
            cand = torchft(replace(state, shape=new, failed=frozenset(), slowdown=(), boundaries=()))
            fits = all(s.mem_bytes <= prof.mem_cap_bytes for p in cand.pipelines for s in p.stages)
            modeled = vpp_iteration_time(new.num_micro_batches, pp, prof.num_layers, per_layer, virtual=1)
            out.append(ConfigPrediction(ranks * shape.tp, dp, pp, cand.step_time_s, modeled, fits))
    return out
