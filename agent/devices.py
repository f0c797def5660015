"""Accelerators beside the worker: discovered and probed through torch (ElasWave §3.2 Agent).

torch is imported only when an accelerator can be present (a ``torch_npu`` install, or the
NVIDIA driver's device nodes), so a CPU-only agent starts in a fraction of a second.
``torch_npu`` is imported only when ``importlib.util.find_spec`` finds it.

On a host without accelerators the device list is one ``Device(kind="cpu")`` whose memory is the
host memory: every worker then has at least one device, so the Core's per-device accounting
(``MemoryUsage.device_*_bytes`` one per Device) needs no special case for gloo runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import time
from dataclasses import dataclass
from types import ModuleType

import psutil

from agent.nvml import NvmlReader
from wire.v1 import agent_pb2, common_pb2

_NVIDIA_NODES = ("/dev/nvidiactl", "/proc/driver/nvidia/version")


@dataclass(frozen=True)
class DeviceReading:
    used_bytes: list[int]
    total_bytes: list[int]
    probe: agent_pb2.HealthProbe


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _accelerator_module() -> tuple[str, ModuleType] | None:
    """("npu"|"cuda", torch submodule) when such devices are usable, else None."""
    if importlib.util.find_spec("torch_npu") is not None:
        torch = importlib.import_module("torch")
        importlib.import_module("torch_npu")
        if torch.npu.is_available():
            return "npu", torch.npu
    if any(os.path.exists(node) for node in _NVIDIA_NODES) and importlib.util.find_spec("torch"):
        torch = importlib.import_module("torch")
        if torch.cuda.is_available():
            return "cuda", torch.cuda
    return None


class DeviceSet:
    """The worker's devices; ``discover`` blocks (torch import), so call it in a thread."""

    def __init__(self, kind: str, module: ModuleType | None, devices: list[common_pb2.Device]) -> None:
        self.kind = kind
        self._module = module
        self.devices = devices
        # NVML health (ECC, XID, throttling; agent.nvml) of the host's GPUs, where pynvml works
        self._nvml = NvmlReader.open() if kind == "cuda" else None

    @classmethod
    def discover(cls) -> DeviceSet:
        found = _accelerator_module()
        if found is None:
            total = psutil.virtual_memory().total
            return cls(
                "cpu", None, [common_pb2.Device(kind="cpu", index=0, name=_cpu_name(), memory_bytes=total)]
            )
        kind, module = found
        devices = []
        for index in range(module.device_count()):
            props = module.get_device_properties(index)
            devices.append(
                common_pb2.Device(kind=kind, index=index, name=props.name, memory_bytes=props.total_memory)
            )
        return cls(kind, module, devices)

    @property
    def has_accelerator(self) -> bool:
        return self._module is not None

    def read(self, worker_rss_bytes: int) -> DeviceReading:
        """Memory per device and a DEVICE probe; on CPU the one device is host memory."""
        if self._module is None:
            total = psutil.virtual_memory().total
            probe = agent_pb2.HealthProbe(
                kind=agent_pb2.PROBE_KIND_DEVICE, healthy=True, detail="no accelerator on this host (cpu)"
            )
            return DeviceReading([worker_rss_bytes], [total], probe)
        started = time.perf_counter()
        used, total, errors = [], [], []
        for device in self.devices:
            try:
                used_bytes, total_bytes = self._memory(device.index)
            except Exception as exc:  # a driver error is exactly what this probe reports
                errors.append(f"{self.kind}:{device.index} {type(exc).__name__}: {exc}")
                used_bytes, total_bytes = 0, device.memory_bytes
            used.append(used_bytes)
            total.append(total_bytes)
        detail = "; ".join(errors) or ", ".join(
            f"{self.kind}:{d.index} used {u / 2**30:.2f}/{t / 2**30:.2f} GiB"
            for d, u, t in zip(self.devices, used, total, strict=True)
        )
        nvml = self._nvml_problems()
        if nvml:
            errors += nvml
            detail = "; ".join([*nvml, detail])
        probe = agent_pb2.HealthProbe(
            kind=agent_pb2.PROBE_KIND_DEVICE,
            healthy=not errors,
            detail=detail,
            latency_ms=(time.perf_counter() - started) * 1000,
        )
        return DeviceReading(used, total, probe)

    def _nvml_problems(self) -> list[str]:
        """NVML's health findings (uncorrectable ECC, critical XIDs, hardware throttling)."""
        if self._nvml is None:
            return []
        try:
            return [f"gpu{r.index}: {p}" for r in self._nvml.read() for p in r.problems]
        except Exception as exc:  # a driver error is exactly what this probe reports
            return [f"NVML {type(exc).__name__}: {exc}"]

    def _memory(self, index: int) -> tuple[int, int]:
        """(used, total) bytes. CUDA prefers NVML (no CUDA context in the agent), else the runtime."""
        assert self._module is not None
        total = self.devices[index].memory_bytes
        if self.kind == "cuda":
            try:
                return int(self._module.device_memory_used(index)), total
            except ModuleNotFoundError:  # pynvml not installed
                pass
        free, total = self._module.mem_get_info(index)
        return int(total - free), int(total)
