"""Eq. (14) peak memory per stage."""

from __future__ import annotations

import pytest

from planners.chameleon.memory import LayerMemory, pipeline_peak_memory, stage_peak_memory

MEM = LayerMemory(param=2.0, optimizer=12.0, grad=2.0, activation_per_micro_batch=3.0)


def test_eq14_by_hand() -> None:
    # 4 layers on stage 1 of 4: static 4*(2+12+2) = 64, dynamic (4-1)*4*3 = 36.
    assert stage_peak_memory(4, 1, 4, MEM) == 100.0
    assert stage_peak_memory(4, 1, 4, MEM, activation_scale=2.0) == 136.0


def test_first_stage_holds_the_most_activations_and_caps_are_checked() -> None:
    est = pipeline_peak_memory([3, 3, 3], MEM, cap_bytes=80.0)
    assert est.stage_peak_bytes == (48 + 27, 48 + 18, 48 + 9)
    assert est.fits
    tight = pipeline_peak_memory([3, 3, 3], MEM, cap_bytes=70.0)
    assert not tight.fits and "stage 0" in tight.reason


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="param must be >= 0"):
        LayerMemory(-1.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="stage 4 out of range"):
        stage_peak_memory(1, 4, 4, MEM)
