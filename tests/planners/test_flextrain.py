"""FlexTrain scale table (§4.4.4) and Poisson benefit test (eq. 14-16)."""

from __future__ import annotations

import math

import pytest

from planners.chameleon.state import ClusterState, JobProfile, JobShape
from planners.flextrain import (
    ConfigPrediction,
    arrival_rate,
    build_scale_table,
    choose_scale_up,
    poisson_benefit,
    predict_configs,
    vpp_iteration_time,
)


def test_eq5_both_regimes_and_plain_1f1b() -> None:
    # L=8, p=4 -> v=2, one layer per chunk; m >= p: (m v + p - 1), m < p: (p v + m - 1) chunk-times.
    assert vpp_iteration_time(8, 4, 8, 1.0) == 8 * 2 + 3
    assert vpp_iteration_time(2, 4, 8, 1.0) == 4 * 2 + 1
    # v = 1 is eq. (9): (m + p - 1) stage-times of L/p layers each.
    assert vpp_iteration_time(8, 4, 8, 1.0, virtual=1) == (8 + 4 - 1) * 2
    with pytest.raises(ValueError):
        vpp_iteration_time(0, 4, 8, 1.0)


def test_scale_table_of_a_job_grows_with_devices() -> None:
    shape = JobShape(pp=2, dp=2, micro_batch=1, global_batch=32)
    profile = JobProfile(
        layer_fwd_s=(0.01,) * 8,
        layer_bwd_s=(0.02,) * 8,
        layer_param_bytes=(1e6,) * 8,
        layer_act_bytes=(1e6,) * 8,
        mem_cap_bytes=1e12,
    )
    preds = predict_configs(ClusterState(shape, profile), max_ranks=8)
    assert {(p.dp, p.pp) for p in preds if p.gpus == 8} == {(8, 1), (4, 2), (2, 4), (1, 8)}
    for p in preds:  # balanced layers and no transfer cost: eq. 11 is eq. 5 with v=1 plus the all-reduce
        assert p.profiled_step_s >= p.modeled_step_s * (1 - 1e-9)
    table = build_scale_table(preds, max_discrepancy=0.5)
    assert table.entries[0].gpus == 4 and table.entries[-1].gpus == 8
    assert all(b.speedup > a.speedup for a, b in zip(table.entries, table.entries[1:], strict=False))


def cp(gpus: int, prof: float, model: float, fits: bool = True, pp: int = 1) -> ConfigPrediction:
    return ConfigPrediction(gpus, 1, pp, prof, model, fits)


def test_table_keeps_best_config_per_gpu_count_and_filters_as_444() -> None:
    table = build_scale_table(
        [
            cp(8, 100.0, 100.0),
            cp(16, 60.0, 55.0),
            cp(16, 52.0, 52.0, pp=2),  # best of two for 16 GPUs
            cp(24, 40.0, 40.0, fits=False),  # OOM
            cp(32, 45.0, 30.0),  # profiled 2.22 vs modelled 3.33: too far apart
            cp(40, 51.0, 50.0),  # no gain over 16 GPUs (1.96 vs 1.92)
            cp(48, 36.0, 36.0),  # kept
            cp(56, 37.0, 35.0),  # profiled down, modelled up: trends disagree
        ],
        max_discrepancy=0.25,
        min_gain=0.05,
    )
    assert [(e.gpus, e.pp) for e in table.entries] == [(8, 1), (16, 2), (48, 1)]
    why = dict(table.excluded)
    assert "out of memory" in why[24]
    assert "differ by more than" in why[32]
    assert "not 5% above" in why[40]
    assert "trends disagree" in why[56]
    assert table.entries[-1].speedup == pytest.approx(100 / 36)
    best = table.best_within(47)
    assert best is not None and best.gpus == 16


def test_poisson_benefit_threshold_is_eq16() -> None:
    lam, overhead, s, p_th = 1 / 3600, 120.0, 1.5, 0.6
    needed = s / (s - 1) * overhead  # 360 s
    d = poisson_benefit(s, overhead, lam, p_th)
    assert d.probability == pytest.approx(math.exp(-lam * needed))
    assert d.scale_up == (lam * needed < math.log(1 / p_th))
    assert d.scale_up
    # Just above the threshold rate the offer is declined.
    edge = math.log(1 / p_th) / needed
    assert poisson_benefit(s, overhead, edge * 1.01, p_th).scale_up is False
    assert poisson_benefit(s, overhead, edge * 0.99, p_th).scale_up is True
    assert not poisson_benefit(1.0, overhead, lam).scale_up
    with pytest.raises(ValueError):
        poisson_benefit(2.0, overhead, lam, p_threshold=1.5)


def test_arrival_rate_and_scale_up_choice() -> None:
    assert arrival_rate([10, 20, 30, 5000], now_s=60, window_s=50) == pytest.approx(2 / 50)
    table = build_scale_table([cp(8, 100.0, 100.0), cp(16, 55.0, 55.0), cp(32, 30.0, 30.0)])
    entry, decision = choose_scale_up(
        table, current_gpus=8, idle_gpus=30, max_gpus=32, overhead_s=60.0, arrival_rate_per_s=1 / 7200
    )
    assert entry is not None and entry.gpus == 32 and decision.scale_up
    entry, decision = choose_scale_up(table, 8, 30, 32, overhead_s=60.0, arrival_rate_per_s=1 / 10)
    assert entry is None and not decision.scale_up
    entry, _ = choose_scale_up(table, 8, 4, 32, 60.0, 1 / 7200)
    assert entry is None  # no table entry fits in 12 GPUs above the current 8
