"""Clock controllers, the worker's control file and their settings (no processes)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agent.config import Address, AgentConfig
from agent.frequency import (
    ClockRange,
    FrequencyRefused,
    NpuSmiController,
    SimulatedController,
    parse_clock_range,
    parse_npu_smi_common,
    select_controller,
)
from wire.local_protocol import (
    BadControlFile,
    ControlFile,
    ControlReader,
    DrainNotice,
    FrequencyState,
    parse_control,
)

CLOCK = ClockRange(800, 1400, 1650)


def test_simulated_controller_applies_in_range_restores_nominal_and_refuses_outside_unchanged():
    controller = SimulatedController(CLOCK)
    assert controller.current_mhz() == 1400
    state = controller.apply(1050)
    assert (state.mhz, state.nominal_mhz, state.factor, controller.current_mhz()) == (1050, 1400, 0.75, 1050)
    for mhz in (799, 1651, 5000):
        with pytest.raises(FrequencyRefused, match=f"{mhz} MHz is outside the simulated range 800..1650 MHz"):
            controller.apply(mhz)
        assert controller.current_mhz() == 1050  # nothing changed
    assert controller.apply(0).mhz == 1400 and controller.current_mhz() == 1400
    assert (controller.apply(800).factor, controller.apply(1650).mhz) == (
        800 / 1400,
        1650,
    )  # bounds inclusive


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("800:1400", "expected MIN:NOMINAL:MAX"),
        ("a:b:c", "expected MIN:NOMINAL:MAX"),
        ("800:1400:-1", "expected MIN:NOMINAL:MAX"),
        ("1500:1400:1650", "0 < min <= nominal <= max"),
        ("0:1400:1650", "0 < min <= nominal <= max"),
    ],
)
def test_bad_clock_ranges_are_refused_with_the_flag_named(text: str, message: str):
    with pytest.raises(ValueError, match=message) as err:
        parse_clock_range(text)
    assert str(err.value).startswith("--clock-range: ")
    assert parse_clock_range("800:1400:1650") == CLOCK


def test_control_file_round_trip_and_reader_sees_every_write(tmp_path: Path):
    path = tmp_path / "sub" / "w.control.json"
    reader = ControlReader(path)
    assert (reader.poll(), reader.factor, reader.draining) == (None, 1.0, None)  # no file yet
    writer = ControlFile(path)
    writer.set_frequency(FrequencyState("simulated", 700, 1000, 500, 1650))
    assert reader.factor == 0.7
    # Two writes within one mtime tick, (nearly always) the same size: the reader sees the second.
    writer.set_frequency(FrequencyState("simulated", 900, 1000, 500, 1650))
    assert reader.factor == 0.9
    writer.set_frequency(FrequencyState("simulated", 1400, 1400, 500, 1650))
    assert reader.factor == 1.0
    writer.set_drain(DrainNotice("maintenance", 1.9e9, 1.8e9))
    state = reader.poll()
    assert state is not None and state.seq == 4
    assert state.drain == DrainNotice("maintenance", 1.9e9, 1.8e9)
    assert state.frequency == FrequencyState("simulated", 1400, 1400, 500, 1650)
    body = json.loads(path.read_text())
    assert (body["version"], body["agent_pid"], body["frequency"]["factor"]) == (1, os.getpid(), 1.0)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files left behind
    writer.remove()
    assert not path.exists()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("{", "not JSON"),
        ('{"version": 2}', "version 1"),
        ('{"version": 1, "seq": 1, "frequency": {"mhz": 1}}', "missing or malformed field"),
        (
            '{"version": 1, "seq": 1, "frequency": {"controller": "s", "mhz": 1, "nominal_mhz": 0, "min_mhz": 1, '
            '"max_mhz": 1}}',
            "nominal_mhz must be > 0",
        ),
    ],
)
def test_bad_control_files_are_refused_with_the_reason(raw: str, message: str):
    with pytest.raises(BadControlFile, match=message):
        parse_control(raw)


def test_npu_smi_common_output_parsing():
    sample = (
        "        NPU ID                         : 0\n"
        "        Aicore Usage Rate(%)           : 0\n"
        "        Aicore Freq(MHZ)               : 1800\n"
        "        Aicore curFreq(MHZ)            : 1400\n"
        "        Temperature(C)                 : 37\n"
    )
    assert parse_npu_smi_common(sample) == (1800, 1400)
    with pytest.raises(ValueError, match="no 'Aicore Freq"):
        parse_npu_smi_common("Temperature(C) : 37\n")


def test_npu_smi_without_a_set_command_refuses_before_running_anything():
    # The binary does not exist: a refusal that ran npu-smi would raise FrequencyFailed instead.
    controller = NpuSmiController("/nonexistent/npu-smi", [0], CLOCK, None)
    with pytest.raises(FrequencyRefused, match="--npu-smi-set"):
        controller.apply(1500)
    with pytest.raises(FrequencyRefused, match="outside the npu-smi range"):
        controller.apply(2000)


def test_auto_selection_and_explicit_choices_on_a_cpu_host(monkeypatch: pytest.MonkeyPatch):
    controller, why = select_controller("auto", "cpu", CLOCK, [], None)
    assert isinstance(controller, SimulatedController) and "CPU run" in why
    assert select_controller("none", "cpu", CLOCK, [], None) == (
        None,
        "disabled by --frequency-controller none",
    )
    monkeypatch.setenv("PATH", "/nonexistent")  # npu-smi cannot be found
    controller, why = select_controller("auto", "npu", CLOCK, [0], None)
    assert controller is None and why == "npu host but npu-smi is unavailable: npu-smi is not on PATH"
    with pytest.raises(ValueError, match="--frequency-controller npu-smi: npu-smi is not on PATH"):
        select_controller("npu-smi", "cpu", CLOCK, [0], None)
    with pytest.raises(ValueError, match="expected one of auto, nvml, npu-smi, simulated, none"):
        select_controller("fast", "cpu", CLOCK, [], None)


def _config(**changes: object) -> AgentConfig:
    base: dict[str, object] = dict(job="j", worker_id="w", cores=(Address("h", 1),), worker_pid=1)
    return AgentConfig(**{**base, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"drain_grace_s": -1.0}, "--drain-grace: must be >= 0"),
        ({"frequency_controller": "turbo"}, "--frequency-controller: expected one of"),
        ({"npu_smi_set": "npu-smi set -i {id}"}, "--npu-smi-set: the command must contain {mhz}"),
    ],
)
def test_bad_clock_and_drain_settings_are_refused(changes: dict[str, object], message: str):
    with pytest.raises(ValueError, match=message):
        _config(**changes)


def test_control_file_defaults_beside_the_metrics_socket(tmp_path: Path):
    assert _config(metrics_socket=tmp_path / "w0.sock").control_path == tmp_path / "w0.control.json"
    default = _config()
    assert default.control_path.parent == default.socket_path.parent
    assert default.control_path.name == "j.w.control.json"
    assert _config(control_file=tmp_path / "c.json").control_path == tmp_path / "c.json"
