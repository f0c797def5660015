"""Eq. (1) mini-step cost model and the ZeRO-1 memory model (ElasWave §4.2)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from planners import make_uniform_layout
from planners.costmodel import CostModel, LayerProfile, LinkModel, MemoryProfile, ministep_time
from planners.dataflow import resize_after_loss


def _profile() -> LayerProfile:
    # Two layers profiled at micro-batch 1, 2 and 4: forward 1, 3, 7 ms; backward twice that.
    return LayerProfile(
        (1, 2, 4),
        ((1e-3, 3e-3, 7e-3), (2e-3, 6e-3, 14e-3)),
        ((2e-3, 6e-3, 14e-3), (4e-3, 12e-3, 28e-3)),
        ref_mhz=1000,
    )


def test_interpolation_and_extrapolation() -> None:
    p = _profile()
    np.testing.assert_allclose(p.layer_times(2)[0], [3e-3, 6e-3])
    np.testing.assert_allclose(p.layer_times(3)[0], [5e-3, 10e-3])  # midpoint of 2 and 4
    np.testing.assert_allclose(p.layer_times(6)[0], [11e-3, 22e-3])  # line through 2 and 4
    np.testing.assert_allclose(p.layer_times(2, freq_scale=2.0)[1], [3e-3, 6e-3])  # 2x clock, half time
    single = LayerProfile((4,), ((8.0,),), ((16.0,),))
    assert single.layer_times(2)[0][0] == 4.0


def test_profile_rejects_bad_tables() -> None:
    with pytest.raises(ValueError, match="increasing positive ints"):
        LayerProfile((2, 1), ((1.0, 1.0),), ((1.0, 1.0),))
    with pytest.raises(ValueError, match="one non-negative time per micro-batch size"):
        LayerProfile((1, 2), ((1.0,),), ((1.0, 1.0),))


def test_eq1_overlap_hides_communication_but_never_below_zero() -> None:
    assert ministep_time(1.0, 2.0, 0.5, 0.5, 0.0, 0.0) == 4.0
    assert ministep_time(1.0, 2.0, 0.5, 0.5, 0.25, 0.25) == pytest.approx(3.0 + 0.25 + 0.0)
    assert ministep_time(1.0, 2.0, 0.5, 0.5, 1.0, 1.0) == 3.0  # fully hidden, clamped at zero


def test_stage_times_follow_micro_batch_resizing_and_links() -> None:
    link = LinkModel(boundary_bytes_per_sample=1e6, bandwidth_bytes_per_s=1e9, latency_s=1e-4)
    cost = CostModel(_profile(), MemoryProfile(act_bytes_per_sample=(0.0, 0.0)), link)
    lay = make_uniform_layout(2, 2, 2, global_batch=8, num_micro_batches=2)  # micro-batch 2 everywhere
    t0, t1 = cost.stage_times(lay)
    p2p = 1e-4 + 2 * 1e6 / 1e9
    assert t0 == pytest.approx(3e-3 + 6e-3 + p2p) and t1 == pytest.approx(6e-3 + 12e-3 + p2p)
    shrunk = resize_after_loss(lay, [1]).layout  # stage 0 now runs micro-batch 4
    p2p4 = 1e-4 + 4 * 1e6 / 1e9  # the link carries the larger side's samples
    assert cost.stage_times(shrunk) == pytest.approx((7e-3 + 14e-3 + p2p4, 6e-3 + 12e-3 + p2p4))
    times = cost.stage_times(shrunk)
    assert cost.step_time(shrunk) == pytest.approx(sum(times) + 1 * max(times))
    slow = replace(lay, frequencies_mhz=((2, 500),))  # one rank of stage 1 at half clock
    assert cost.stage_times(slow)[1] == pytest.approx(2 * (6e-3 + 12e-3) + p2p)


def test_memory_model_zero1_and_in_flight_activations() -> None:
    mem = MemoryProfile(
        act_bytes_per_sample=(10.0, 10.0),
        weight_bytes_per_param=2,
        grad_bytes_per_param=2,
        optim_bytes_per_param=12,
        stage_base_bytes=5.0,
    )
    cost = CostModel(_profile(), mem, LinkModel(1.0, 1.0))
    lay = make_uniform_layout(2, 2, 2, global_batch=16, num_micro_batches=4, layer_numel=(100, 100))
    # stage 0: 100 params * (2 + 2 + 12/2) + 2 in flight (P - 0) * micro 2 * 10 bytes + base
    assert cost.stage_memory_bytes(lay, 0) == pytest.approx(100 * 10 + 2 * 2 * 10 + 5)
    assert cost.stage_memory_bytes(lay, 1) == pytest.approx(100 * 10 + 1 * 2 * 10 + 5)
    shrunk = resize_after_loss(lay, [0]).layout  # DP 1: whole optimizer state, micro-batch 4
    assert cost.stage_memory_bytes(shrunk, 0) == pytest.approx(100 * 16 + 2 * 4 * 10 + 5)
    assert math.isfinite(cost.stage_memory_bytes(shrunk, 1))


def test_the_dp_exchange_is_priced_per_stage_and_free_by_default() -> None:
    mem = MemoryProfile(act_bytes_per_sample=(0.0, 0.0), weight_bytes_per_param=2)
    lay = make_uniform_layout(2, 2, 2, global_batch=8, num_micro_batches=2, layer_numel=(100, 300))
    free = CostModel(_profile(), mem, LinkModel(1e6, 1e9))
    priced = CostModel(_profile(), mem, LinkModel(1e6, 1e9, dp_bytes_per_s=1e3))
    assert free.sync_time(lay) == 0.0
    # The slowest stage's ring: 2 (D-1)/D of its 300 elements x 2 bytes, at 1e3 bytes/s.
    assert priced.sync_time(lay) == pytest.approx(2 * (1 / 2) * 300 * 2 / 1e3)
    assert priced.step_time(lay) == pytest.approx(free.step_time(lay) + priced.sync_time(lay))
    wide = make_uniform_layout(2, 1, 4, global_batch=8, num_micro_batches=2, layer_numel=(100, 300))
    assert priced.sync_time(wide) == pytest.approx(2 * (3 / 4) * 400 * 2 / 1e3)  # one stage, DP 4
    alone = make_uniform_layout(2, 2, 1, global_batch=8, num_micro_batches=2, layer_numel=(100, 300))
    assert priced.sync_time(alone) == 0.0  # DP 1: nothing to exchange
    with pytest.raises(ValueError, match="dp_bytes_per_s must be > 0"):
        LinkModel(1.0, 1.0, dp_bytes_per_s=0.0)
