"""The agent's device readers (agent.nvml). In CI (no GPU, no NPU) only the parsing of readings is
tested, on readings transcribed by hand and one captured on an H200 (tests/agent/recorded/README.md); the
live NVML test runs where pynvml and a driver are present and is skipped, saying so, elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.nvml import NvmlReader, parse_npu_smi, parse_nvml

RECORDED = Path(__file__).parent / "recorded"


def test_parses_transcribed_nvml_readings_healthy_and_failing() -> None:
    idle, failing, capped = (parse_nvml(r) for r in json.loads((RECORDED / "nvml_h100.json").read_text()))
    assert idle.healthy and idle.throttle == ("gpu_idle",) and idle.ecc_uncorrected == 0
    assert (idle.memory_used_bytes, idle.memory_total_bytes, idle.sm_clock_mhz) == (
        567279616,
        85520809984,
        345,
    )
    assert not failing.healthy
    assert failing.problems == (
        "2 uncorrectable ECC error(s)",
        "critical XID 79",
        "hardware throttling: hw_slowdown, hw_thermal_slowdown",
    )
    assert (failing.gpu_util_pct, failing.memory_util_pct, failing.temperature_c) == (97, 61, 84)
    # a software power cap slows the GPU but is no fault; ECC off reads as unknown, not as zero
    assert capped.healthy and capped.throttle == ("sw_power_cap",) and capped.ecc_uncorrected is None


def test_parses_transcribed_npu_smi_table() -> None:
    ok, hot = parse_npu_smi((RECORDED / "npu_smi_910b.txt").read_text())
    assert (ok.npu, ok.chip, ok.name, ok.health, ok.power_w, ok.temperature_c) == (
        0,
        0,
        "910B3",
        "OK",
        93.5,
        36,
    )
    assert (ok.aicore_pct, ok.hbm_used_mb, ok.hbm_total_mb) == (0, 3161, 65536) and ok.healthy
    assert (hot.npu, hot.aicore_pct, hot.hbm_used_mb, hot.health) == (1, 98, 61230, "Warning")
    assert not hot.healthy
    assert parse_npu_smi("npu-smi: command not found") == []


def test_live_nvml_reading_where_a_driver_is_present() -> None:
    reader = NvmlReader.open()
    if reader is None:
        pytest.skip("no live NVML here (pynvml not installed or no NVIDIA driver): parsing is tested above")
    readings = reader.read()
    assert readings and all(r.memory_total_bytes > 0 and r.sm_clock_mhz >= 0 for r in readings)


def test_parses_an_nvml_reading_captured_on_an_h200() -> None:
    """Captured by `make gpu-check` on an idle H200 (2026-11-30), not transcribed: the reader's
    raw shape and the parser agree on a real driver's values."""
    (idle,) = (parse_nvml(r) for r in json.loads((RECORDED / "nvml_h200_captured.json").read_text()))
    assert idle.name == "NVIDIA H200" and idle.healthy and idle.throttle == ("gpu_idle",)
    assert (idle.memory_used_bytes, idle.memory_total_bytes, idle.sm_clock_mhz) == (
        648347648,
        150754820096,
        345,
    )
    assert idle.ecc_uncorrected == 0 and idle.problems == ()
