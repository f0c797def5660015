"""Real device readings for the agent: NVML on NVIDIA GPUs, `npu-smi` on Ascend (ElasWave §3.2 Agent).

NVML (the `nvidia-ml-py` package, module `pynvml`, used only when importable) gives per GPU:
memory used/total, GPU and memory utilisation, temperature, SM clock, and health: volatile
uncorrectable ECC errors (where ECC is on), XID events seen since the reader opened (a critical
XID means the GPU needs a reset) and the clock-throttle reasons NVML reports. One reading is
first a plain dict of NVML's raw values (`read_nvml_raw`), then parsed (`parse_nvml`): the same
parser serves a live GPU and a recorded reading, which is what CI tests (no GPU there).

`parse_npu_smi` reads the table `npu-smi info` prints (per NPU: name, health, power, temperature;
per chip: AI core utilisation, HBM used/total).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

# nvmlClocksThrottleReason* bit -> name (NVML's nvml.h); "idle" and "applications clocks
# setting" are not trouble, the others say the GPU runs slower than asked.
THROTTLE_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
BENIGN_THROTTLE = {"gpu_idle", "applications_clocks_setting", "sync_boost"}
# XIDs after which the GPU must be reset or the job restarted (NVIDIA's XID catalogue):
# 48 double-bit ECC, 62/64/74/79 internal errors, NVLink errors, GPU fallen off the bus, 92-95
# ECC/contained errors.
CRITICAL_XIDS = frozenset({48, 62, 64, 74, 79, 92, 94, 95})


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one instant, parsed (module docstring)."""

    index: int
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    gpu_util_pct: int
    memory_util_pct: int
    temperature_c: int
    sm_clock_mhz: int
    ecc_uncorrected: int | None  # None: ECC off or not supported
    xids: tuple[int, ...] = ()
    throttle: tuple[str, ...] = ()
    problems: tuple[str, ...] = field(default=())

    @property
    def healthy(self) -> bool:
        return not self.problems


def parse_nvml(raw: Mapping[str, Any]) -> GpuReading:
    """A `GpuReading` from NVML's raw values (keys as `read_nvml_raw` writes them)."""
    mask = int(raw.get("throttle_mask", 0))
    throttle = tuple(name for bit, name in sorted(THROTTLE_REASONS.items()) if mask & bit)
    ecc = raw.get("ecc_uncorrected")
    xids = tuple(int(x) for x in raw.get("xids", ()))
    problems = []
    if ecc:
        problems.append(f"{int(ecc)} uncorrectable ECC error(s)")
    critical = sorted(set(xids) & CRITICAL_XIDS)
    if critical:
        problems.append(f"critical XID {', '.join(map(str, critical))}")
    slow = [t for t in throttle if t not in BENIGN_THROTTLE]
    if any(t.startswith("hw_") for t in slow):
        problems.append(f"hardware throttling: {', '.join(slow)}")
    return GpuReading(
        index=int(raw["index"]),
        name=str(raw["name"]),
        memory_used_bytes=int(raw["memory"]["used"]),
        memory_total_bytes=int(raw["memory"]["total"]),
        gpu_util_pct=int(raw["utilization"]["gpu"]),
        memory_util_pct=int(raw["utilization"]["memory"]),
        temperature_c=int(raw["temperature_c"]),
        sm_clock_mhz=int(raw["sm_clock_mhz"]),
        ecc_uncorrected=None if ecc is None else int(ecc),
        xids=xids,
        throttle=throttle,
        problems=tuple(problems),
    )


class NvmlReader:
    """Live NVML readings of the given GPUs (NVML indices), with an XID event set."""

    def __init__(self, nvml: ModuleType, indices: Sequence[int]) -> None:
        self.nvml = nvml
        self.handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        self._events: Any = None
        try:  # XID events are not supported everywhere (e.g. some virtualised GPUs)
            self._events = nvml.nvmlEventSetCreate()
            for handle in self.handles.values():
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._events)
        except nvml.NVMLError:
            self._events = None

    @staticmethod
    def open(indices: Sequence[int] | None = None) -> NvmlReader | None:
        """A reader, or None when pynvml is not installed or NVML cannot start (no driver)."""
        if importlib.util.find_spec("pynvml") is None:
            return None
        nvml = importlib.import_module("pynvml")
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError:
            return None
        return NvmlReader(nvml, list(range(count)) if indices is None else indices)

    def _xids(self) -> dict[int, list[int]]:
        seen: dict[int, list[int]] = {}
        if self._events is None:
            return seen
        by_handle = {id(h): i for i, h in self.handles.items()}
        while True:
            try:
                event = self.nvml.nvmlEventSetWait(self._events, 0)
            except self.nvml.NVMLError:  # NVML_ERROR_TIMEOUT: nothing pending
                return seen
            index = by_handle.get(id(event.device), -1)
            seen.setdefault(index, []).append(int(event.eventData))

    def read_raw(self) -> list[dict[str, Any]]:
        """NVML's raw values for every GPU (what `parse_nvml` reads, and what a recording keeps)."""
        nvml, xids, out = self.nvml, self._xids(), []
        for index, h in self.handles.items():
            mem, util = nvml.nvmlDeviceGetMemoryInfo(h), nvml.nvmlDeviceGetUtilizationRates(h)
            try:
                ecc: int | None = int(
                    nvml.nvmlDeviceGetTotalEccErrors(
                        h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                    )
                )
            except nvml.NVMLError:  # ECC off or not supported
                ecc = None
            name = nvml.nvmlDeviceGetName(h)
            out.append(
                {
                    "index": index,
                    "name": name.decode() if isinstance(name, bytes) else str(name),
                    "memory": {"used": int(mem.used), "total": int(mem.total)},
                    "utilization": {"gpu": int(util.gpu), "memory": int(util.memory)},
                    "temperature_c": int(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
                    "sm_clock_mhz": int(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
                    "ecc_uncorrected": ecc,
                    "xids": xids.get(index, []),
                    "throttle_mask": int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)),
                }
            )
        return out

    def read(self) -> list[GpuReading]:
        return [parse_nvml(raw) for raw in self.read_raw()]


def application_clocks_permitted(nvml: ModuleType, handle: object) -> tuple[bool, str]:
    """Whether this process may set application clocks on the GPU, and why not: NVML reports
    the restriction itself (`nvmlDeviceGetAPIRestriction`); unknown counts as not permitted."""
    try:
        restricted = nvml.nvmlDeviceGetAPIRestriction(handle, nvml.NVML_RESTRICTED_API_SET_APPLICATION_CLOCKS)
    except nvml.NVMLError as exc:
        return False, f"not permitted: NVML cannot say ({exc})"
    if restricted:
        return False, "not permitted: application clocks are restricted to root on this GPU"
    return True, "permitted"


@dataclass(frozen=True)
class NpuReading:
    npu: int
    chip: int
    name: str
    health: str
    power_w: float | None
    temperature_c: int
    aicore_pct: int
    hbm_used_mb: int
    hbm_total_mb: int

    @property
    def healthy(self) -> bool:
        return self.health == "OK"


_NPU_ROW = re.compile(r"^\|\s*(\d+)\s+(\S+)\s*\|\s*(\S+)\s*\|\s*([\d.]+|NA)\s+(\d+)\s")
_CHIP_ROW = re.compile(
    r"^\|\s*(\d+)\s*\|\s*([0-9A-Fa-f:.]+)\s*\|\s*(\d+)\s+(\d+)\s*/\s*(\d+)\s+(\d+)\s*/\s*(\d+)\s*\|"
)


def parse_npu_smi(text: str) -> list[NpuReading]:
    """Readings from `npu-smi info`: each NPU row is followed by its chip row (module docstring)."""
    out: list[NpuReading] = []
    npu_row: re.Match[str] | None = None
    for line in text.splitlines():
        chip = _CHIP_ROW.match(line)
        if chip and npu_row is not None:
            npu, name, health, power, temp = npu_row.groups()
            out.append(
                NpuReading(
                    npu=int(npu),
                    chip=int(chip[1]),
                    name=name,
                    health=health,
                    power_w=None if power == "NA" else float(power),
                    temperature_c=int(temp),
                    aicore_pct=int(chip[3]),
                    hbm_used_mb=int(chip[6]),
                    hbm_total_mb=int(chip[7]),
                )
            )
            npu_row = None
            continue
        npu_row = _NPU_ROW.match(line) or npu_row
    return out
