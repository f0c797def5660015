"""The agent -> worker control file: clock factor and drain notice (the worker reads, never writes).

Contract (version 1). The agent launching a worker exports ``ELASWAVE_CONTROL_FILE`` with the
path (default ``<metrics socket dir>/<job>.<worker>.control.json``; ``--control-file``). The
agent replaces the file atomically (write to a temporary file, ``os.replace``), so a reader sees
either the old or the new JSON object, never a torn one::

    {"version": 1, "seq": 3, "agent_pid": 4242, "updated_unix": 1.7e9,
     "frequency": {"controller": "simulated", "mhz": 1200, "nominal_mhz": 1400,
                   "min_mhz": 800, "max_mhz": 1650, "factor": 0.857142857},
     "drain": {"reason": "scheduler", "deadline_unix": 1.7e9, "since_unix": 1.7e9}}

- ``seq`` increases by one on every write.
- ``frequency`` is the clock the agent's controller applied (``null`` with no controller).
  ``factor = mhz / nominal_mhz``. For the simulated controller (CPU runs, DESIGN.md §4 "DVFS")
  the factor *is* the clock: a worker emulates it by dividing its injected per-layer compute
  delay by ``factor`` (0.5 = half speed, twice the delay), the same way straggler slowdowns
  are injected. For real controllers (NVML, npu-smi) the hardware is already clocked and the
  field is informational.
- ``drain`` is ``null`` until the Core drains this worker; once set it stays set. A worker that
  sees it stops at its next step boundary and exits 0. If it is still running ``--drain-grace``
  seconds later (or at the Drain deadline, whichever is first) the agent sends SIGTERM, and
  SIGKILL ``--grace`` seconds after that.

Readers call ``ControlReader.poll()`` once per step: it re-reads only when the file's mtime or
size (or inode) changed, so the cost per step is one ``stat``. ``elaswave/dummy_worker.py`` is the reference
reader. ``executor.worker`` (Core-driven) reads only ``drain``, after a SIGTERM: set means the
agent reported the preemption, so the worker keeps training until the Core's plan lets it go.
The agent also sets ``drain`` (reason "preempted (SIGTERM)") when SIGTERM reaches it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

CONTROL_ENV = "ELASWAVE_CONTROL_FILE"
# The worker's word back, beside the control file: it creates this file once it has completed
# all of its work, so that its exit 0 reads as "finished" rather than "stopped early".
FINISHED_ENV = "ELASWAVE_FINISHED_FILE"


def finished_path(control: Path) -> Path:
    return control.with_name(control.name + ".finished")


def mark_finished() -> bool:
    """Worker side: say "my work is complete" to the agent; False when no agent asked for it."""
    path = os.environ.get(FINISHED_ENV)
    if not path:
        return False
    Path(path).write_text(f"{time.time():.6f}\n")
    return True
VERSION = 1


@dataclass(frozen=True)
class FrequencyState:
    """The clock a controller applied; MHz."""

    controller: str
    mhz: int
    nominal_mhz: int
    min_mhz: int
    max_mhz: int

    @property
    def factor(self) -> float:
        return self.mhz / self.nominal_mhz

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "factor": self.factor}


@dataclass(frozen=True)
class DrainNotice:
    reason: str
    deadline_unix: float  # 0 = no deadline given
    since_unix: float


@dataclass(frozen=True)
class ControlState:
    """What a worker reads: ``frequency``/``drain`` None when not set."""

    seq: int
    frequency: FrequencyState | None
    drain: DrainNotice | None


class ControlFile:
    """The agent's writer. Holds the current state; every change rewrites the whole file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seq = 0
        self.frequency: FrequencyState | None = None
        self.drain: DrainNotice | None = None

    def publish(self) -> None:
        self.seq += 1
        body = {"version": VERSION, "seq": self.seq, "agent_pid": os.getpid(), "updated_unix": time.time(),
                "frequency": None if self.frequency is None else self.frequency.to_dict(),
                "drain": None if self.drain is None else asdict(self.drain)}
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(body, handle, sort_keys=True)
            os.replace(tmp, self.path)  # atomic: readers never see a half-written file
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def set_frequency(self, state: FrequencyState) -> None:
        self.frequency = state
        self.publish()

    def set_drain(self, notice: DrainNotice) -> None:
        self.drain = notice
        self.publish()

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


class BadControlFile(ValueError):
    """The control file does not follow the contract above; the message says what is wrong."""


def parse_control(raw: str) -> ControlState:
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadControlFile(f"not JSON: {exc}") from exc
    if not isinstance(body, dict) or body.get("version") != VERSION:
        raise BadControlFile(f"expected a JSON object with version {VERSION}")
    freq, drain = body.get("frequency"), body.get("drain")
    try:
        frequency = None if freq is None else FrequencyState(
            str(freq["controller"]), int(freq["mhz"]), int(freq["nominal_mhz"]), int(freq["min_mhz"]),
            int(freq["max_mhz"]))
        notice = None if drain is None else DrainNotice(
            str(drain["reason"]), float(drain["deadline_unix"]), float(drain["since_unix"]))
        seq = int(body["seq"])
    except (KeyError, TypeError, ValueError) as exc:
        raise BadControlFile(f"missing or malformed field: {exc!r}") from exc
    if frequency is not None and not (frequency.nominal_mhz > 0 and math.isfinite(frequency.factor)):
        raise BadControlFile(f"nominal_mhz must be > 0, got {frequency.nominal_mhz}")
    return ControlState(seq, frequency, notice)


class ControlReader:
    """The worker's reader: ``poll`` returns the latest state (None while there is no file)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.state: ControlState | None = None
        self._stamp: tuple[int, int, int] | None = None

    @classmethod
    def from_env(cls) -> ControlReader | None:
        path = os.environ.get(CONTROL_ENV)
        return cls(path) if path else None

    def poll(self) -> ControlState | None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return self.state
        # os.replace gives every write a new inode; mtime alone is too coarse (one jiffy).
        stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            self.state = parse_control(self.path.read_text())
            self._stamp = stamp
        return self.state

    @property
    def factor(self) -> float:
        """Clock factor to apply (1.0 when no frequency was published)."""
        state = self.poll()
        return 1.0 if state is None or state.frequency is None else state.frequency.factor

    @property
    def draining(self) -> DrainNotice | None:
        state = self.poll()
        return None if state is None else state.drain
