"""Device clock controllers behind the Core's SetFrequency command (docs/architecture.md ("The executor") "DVFS", ElasWave §4.3).

Algorithm 2 of the paper up-clocks only the residual straggler stage; the Core's DVFS planner
(``planners.dvfs``) picks the clock and the agent beside each worker applies it through one of:

- ``nvml``: NVIDIA GPU clocks through NVML (``pynvml``, from the ``nvidia-ml-py`` package;
  optional, used only when importable): application clocks (graphics = mhz at the current memory
  clock) on every GPU of the worker (``CUDA_VISIBLE_DEVICES`` order, else all), or locked clocks
  (min = max = mhz) where the GPU does not support application clocks; 0 resets. Range: the
  supported graphics clocks at the current memory clock. Where NVML says the application-clock
  API is restricted to root, the controller is unavailable and says "not permitted" (the agent
  then applies no clock, and the Core plans without DVFS on it); a set the driver refuses is
  refused as "not permitted", never reported as applied.
- ``npu-smi``: Ascend, used only when the ``npu-smi`` binary is on PATH. The current clock is read
  from ``npu-smi info -t common -i ID`` ("Aicore curFreq(MHZ)", rated "Aicore Freq(MHZ)"). npu-smi
  has no command to set the AI core clock common to all Ascend products, so setting it needs
  ``--npu-smi-set`` (a command template with ``{id}`` and ``{mhz}``); without it every request is
  refused with that reason. The range comes from ``--clock-range``.
- ``simulated``: CPU runs. The "clock" is a number in ``--clock-range`` (default 800:1400:1650
  MHz, the 910B figures of ElasWave §5: 1,400 MHz initial, 1,650 MHz maximum); the agent
  publishes ``factor = mhz / nominal`` in the worker's control file (``wire.local_protocol``) and the
  worker scales its injected compute delay by it.

Every controller refuses a clock outside its range with the reason and changes nothing
(``FrequencyRefused``); a driver that fails raises ``FrequencyFailed``. ``mhz = 0`` restores the
default (nominal) clock, as in ``SetFrequency``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

from agent.nvml import application_clocks_permitted
from wire.local_protocol import FrequencyState

CHOICES = ("auto", "nvml", "npu-smi", "simulated", "none")
DEFAULT_CLOCK_RANGE = "800:1400:1650"
_NPU_SMI_TIMEOUT_S = 10.0


class FrequencyRefused(ValueError):
    """The request cannot be applied as asked (out of range, no way to set); nothing changed."""


class FrequencyFailed(RuntimeError):
    """The driver or tool failed while applying a valid request."""


class ControllerUnavailable(RuntimeError):
    """This controller cannot run on this host; the message says why."""


@dataclass(frozen=True)
class ClockRange:
    """Allowed clocks in MHz; ``nominal_mhz`` is the default that ``mhz = 0`` restores."""

    min_mhz: int
    nominal_mhz: int
    max_mhz: int

    def __post_init__(self) -> None:
        if not 0 < self.min_mhz <= self.nominal_mhz <= self.max_mhz:
            raise ValueError(
                f"clock range needs 0 < min <= nominal <= max MHz, got "
                f"{self.min_mhz}:{self.nominal_mhz}:{self.max_mhz}"
            )

    def resolve(self, mhz: int, controller: str) -> int:
        """The clock to apply for a request (0 -> nominal); FrequencyRefused when out of range."""
        if mhz == 0:
            return self.nominal_mhz
        if not self.min_mhz <= mhz <= self.max_mhz:
            raise FrequencyRefused(
                f"{mhz} MHz is outside the {controller} range {self.min_mhz}..{self.max_mhz} MHz"
            )
        return mhz

    def __str__(self) -> str:
        return f"{self.min_mhz}..{self.max_mhz} MHz, nominal {self.nominal_mhz}"


def parse_clock_range(text: str, flag: str = "--clock-range") -> ClockRange:
    """``MIN:NOMINAL:MAX`` in MHz -> ClockRange; ValueError naming ``flag`` otherwise."""
    parts = text.split(":")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"{flag}: expected MIN:NOMINAL:MAX in whole MHz, got {text!r}")
    try:
        return ClockRange(*(int(p) for p in parts))
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


class FrequencyController(Protocol):
    """What the agent needs of a clock controller; calls may block (run them in a thread)."""

    name: str

    def clock_range(self) -> ClockRange: ...

    def current_mhz(self) -> int:
        """The clock the device runs at now (for the simulated controller: the one applied)."""
        ...

    def apply(self, mhz: int) -> FrequencyState:
        """Apply ``mhz`` (0 = nominal); FrequencyRefused (nothing changed) or FrequencyFailed."""
        ...


class SimulatedController:
    """A clock that is only a number; the agent publishes its factor to the worker."""

    name = "simulated"

    def __init__(self, clock: ClockRange) -> None:
        self._clock = clock
        self._mhz = clock.nominal_mhz

    def clock_range(self) -> ClockRange:
        return self._clock

    def current_mhz(self) -> int:
        return self._mhz

    def apply(self, mhz: int) -> FrequencyState:
        self._mhz = self._clock.resolve(mhz, self.name)
        return self.state()

    def state(self) -> FrequencyState:
        c = self._clock
        return FrequencyState(self.name, self._mhz, c.nominal_mhz, c.min_mhz, c.max_mhz)


class NvmlController:
    """NVIDIA locked graphics clocks on the worker's GPUs."""

    name = "nvml"

    def __init__(self, nvml: ModuleType, handles: list[object], clock: ClockRange) -> None:
        self._nvml = nvml
        self._handles = handles
        self._clock = clock

    @classmethod
    def open(cls) -> NvmlController:
        if importlib.util.find_spec("pynvml") is None:
            raise ControllerUnavailable("pynvml is not installed (pip install nvidia-ml-py)")
        nvml = importlib.import_module("pynvml")
        try:
            nvml.nvmlInit()
            handles = [_nvml_handle(nvml, ref) for ref in _visible_gpus(nvml.nvmlDeviceGetCount())]
            if not handles:
                raise ControllerUnavailable("NVML sees no GPU")
            for handle in handles:
                permitted, why = application_clocks_permitted(nvml, handle)
                if not permitted:
                    raise ControllerUnavailable(why)
            return cls(nvml, handles, _nvml_range(nvml, handles))
        except nvml.NVMLError as exc:
            raise ControllerUnavailable(f"NVML: {exc}") from exc

    def clock_range(self) -> ClockRange:
        return self._clock

    def current_mhz(self) -> int:
        return min(
            int(self._nvml.nvmlDeviceGetClockInfo(h, self._nvml.NVML_CLOCK_GRAPHICS)) for h in self._handles
        )

    def apply(self, mhz: int) -> FrequencyState:
        target = self._clock.resolve(mhz, self.name)
        nvml = self._nvml
        try:
            for handle in self._handles:
                self._set_one(handle, mhz, target)
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_NO_PERMISSION", object()):
                raise FrequencyRefused(f"not permitted: NVML refused to set the GPU clock ({exc})") from exc
            raise FrequencyFailed(
                f"NVML could not {'reset' if mhz == 0 else 'set'} the GPU clock: {exc}"
            ) from exc
        c = self._clock
        return FrequencyState(self.name, target, c.nominal_mhz, c.min_mhz, c.max_mhz)

    def _set_one(self, handle: object, mhz: int, target: int) -> None:
        """Application clocks; locked clocks on a GPU that does not support them."""
        nvml = self._nvml
        try:
            if mhz == 0:
                nvml.nvmlDeviceResetApplicationsClocks(handle)
            else:
                memory = nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)
                nvml.nvmlDeviceSetApplicationsClocks(handle, memory, target)
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) != getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", object()):
                raise
            if mhz == 0:
                nvml.nvmlDeviceResetGpuLockedClocks(handle)
            else:
                nvml.nvmlDeviceSetGpuLockedClocks(handle, target, target)


def _visible_gpus(count: int) -> list[int | str]:
    """NVML indices (or UUIDs) of the worker's GPUs: CUDA_VISIBLE_DEVICES when set, else all.

    NVML ignores CUDA_VISIBLE_DEVICES, so the agent maps it itself.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    refs: list[int | str] = []
    for item in (v.strip() for v in visible.split(",")):
        if not item:
            continue
        refs.append(int(item) if item.isdigit() else item)
    return refs


def _nvml_handle(nvml: ModuleType, ref: int | str) -> object:
    return (
        nvml.nvmlDeviceGetHandleByIndex(ref) if isinstance(ref, int) else nvml.nvmlDeviceGetHandleByUUID(ref)
    )


def _nvml_range(nvml: ModuleType, handles: list[object]) -> ClockRange:
    """Clocks every GPU supports at its current memory clock; nominal = default application clock."""
    lows, highs, nominals = [], [], []
    for handle in handles:
        memory_clock = nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)
        supported = [int(c) for c in nvml.nvmlDeviceGetSupportedGraphicsClocks(handle, memory_clock)]
        lows.append(min(supported))
        highs.append(max(supported))
        nominals.append(int(nvml.nvmlDeviceGetDefaultApplicationsClock(handle, nvml.NVML_CLOCK_GRAPHICS)))
    low, high = max(lows), min(highs)
    return ClockRange(low, min(max(min(nominals), low), high), high)


_NPU_RATED = re.compile(r"Aicore\s+Freq\(MHZ\)\s*:\s*(\d+)", re.IGNORECASE)
_NPU_CURRENT = re.compile(r"Aicore\s+curFreq\(MHZ\)\s*:\s*(\d+)", re.IGNORECASE)


def parse_npu_smi_common(text: str) -> tuple[int, int]:
    """(rated, current) AI core MHz from ``npu-smi info -t common`` output; ValueError if absent."""
    rated, current = _NPU_RATED.search(text), _NPU_CURRENT.search(text)
    if rated is None or current is None:
        raise ValueError("no 'Aicore Freq(MHZ)' / 'Aicore curFreq(MHZ)' lines in npu-smi output")
    return int(rated.group(1)), int(current.group(1))


class NpuSmiController:
    """Ascend AI core clock through the ``npu-smi`` tool."""

    name = "npu-smi"

    def __init__(self, binary: str, ids: list[int], clock: ClockRange, set_template: str | None) -> None:
        self._binary = binary
        self._ids = ids
        self._clock = clock
        self._set_template = set_template

    @classmethod
    def open(cls, ids: list[int], clock: ClockRange, set_template: str | None) -> NpuSmiController:
        binary = shutil.which("npu-smi")
        if binary is None:
            raise ControllerUnavailable("npu-smi is not on PATH")
        controller = cls(binary, ids or [0], clock, set_template)
        try:
            controller.current_mhz()
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            raise ControllerUnavailable(f"npu-smi does not answer: {exc}") from exc
        return controller

    def clock_range(self) -> ClockRange:
        return self._clock

    def _run(self, args: list[str]) -> str:
        done = subprocess.run(args, capture_output=True, text=True, timeout=_NPU_SMI_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise ValueError(
                f"{shlex.join(args)} exited {done.returncode}: {(done.stderr or done.stdout).strip()[:200]}"
            )
        return done.stdout

    def current_mhz(self) -> int:
        return min(
            parse_npu_smi_common(self._run([self._binary, "info", "-t", "common", "-i", str(i)]))[1]
            for i in self._ids
        )

    def apply(self, mhz: int) -> FrequencyState:
        target = self._clock.resolve(mhz, self.name)
        if self._set_template is None:
            raise FrequencyRefused(
                "npu-smi has no portable command to set the AI core clock; start the agent "
                "with --npu-smi-set 'COMMAND with {id} and {mhz}' for this product"
            )
        for device in self._ids:
            args = [part.format(id=device, mhz=target) for part in shlex.split(self._set_template)]
            try:
                self._run(args)
            except (OSError, subprocess.SubprocessError, ValueError) as exc:
                raise FrequencyFailed(
                    f"npu-smi could not set device {device} to {target} MHz: {exc}"
                ) from exc
        c = self._clock
        return FrequencyState(self.name, target, c.nominal_mhz, c.min_mhz, c.max_mhz)


def select_controller(
    choice: str, device_kind: str, clock: ClockRange, npu_ids: list[int], npu_smi_set: str | None
) -> tuple[FrequencyController | None, str]:
    """(controller, why) for ``--frequency-controller``; ValueError when an explicit one cannot run.

    ``auto``: NVML on CUDA hosts, npu-smi on Ascend hosts, simulated on CPU-only hosts; an
    accelerator host whose tool is missing gets no controller (simulating a clock on a real GPU
    would report a speed-up that never happens).
    """
    if choice not in CHOICES:
        raise ValueError(f"--frequency-controller: expected one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "none":
        return None, "disabled by --frequency-controller none"
    if choice == "auto":
        choice = {"cuda": "nvml", "npu": "npu-smi"}.get(device_kind, "simulated")
        explicit = False
    else:
        explicit = True
    try:
        if choice == "nvml":
            return NvmlController.open(), "NVIDIA application (or locked) clocks through NVML"
        if choice == "npu-smi":
            return NpuSmiController.open(npu_ids, clock, npu_smi_set), "Ascend AI core clock through npu-smi"
    except ControllerUnavailable as exc:
        if explicit:
            raise ValueError(f"--frequency-controller {choice}: {exc}") from None
        return None, f"{device_kind} host but {choice} is unavailable: {exc}"
    return SimulatedController(clock), "simulated clock for a CPU run (factor published in the control file)"
