"""The worker's side of the local protocol with its agent: one neutral module (stdlib only).

Three channels link a training process and the agent that launched it, all on the same host:

1. **The control file** (agent -> worker): clock factor and drain notice; see "Control file" below.
2. **Step metrics** (worker -> agent): one JSON record per committed step, sent as a datagram on
   the Unix socket the agent exports in ``ELASWAVE_METRICS_SOCKET`` (``StepMetricsClient``). A send
   never blocks the training loop; when the agent is gone the kernel refuses at once and the
   record is dropped (the agent's absence is the Core's business).
3. **Exit status and the finished marker**: a worker that completed all its work creates the file
   named by ``ELASWAVE_FINISHED_FILE`` (``mark_finished``) and exits 0; the agent reports that as
   finished rather than as a departure. Exit codes with a meaning are listed below.

Nothing here imports the agent daemon, grpc, protobuf or torch: the engine (``executor``), the
Core and the agent all import this module, and none of them imports another's internals.

Control file
------------
The agent -> worker control file: clock factor and drain notice (the worker reads, never writes).

Contract (version 1). The agent launching a worker exports ``ELASWAVE_CONTROL_FILE`` with the
path (default ``<metrics socket dir>/<job>.<worker>.control.json``; ``--control-file``). The
agent replaces the file atomically (write to a temporary file, ``os.replace``), so a reader sees
either the old or the new JSON object, never a torn one::

    {"version": 1, "seq": 3, "agent_pid": 4242, "updated_unix": 1.7e9,
     "frequency": {"controller": "simulated", "mhz": 1200, "nominal_mhz": 1400,
                   "min_mhz": 800, "max_mhz": 1650, "factor": 0.857142857},
     "drain": {"reason": "scheduler", "deadline_unix": 1.7e9, "since_unix": 1.7e9},
     "checkpoint": {"after_step": 41, "stop": false, "since_unix": 1.7e9}}

- ``seq`` increases by one on every write.
- ``frequency`` is the clock the agent's controller applied (``null`` with no controller).
  ``factor = mhz / nominal_mhz``. For the simulated controller (CPU runs, docs/architecture.md ("The executor") "DVFS")
  the factor *is* the clock: a worker emulates it by dividing its injected per-layer compute
  delay by ``factor`` (0.5 = half speed, twice the delay), the same way straggler slowdowns
  are injected. For real controllers (NVML, npu-smi) the hardware is already clocked and the
  field is informational.
- ``drain`` is ``null`` until the Core drains this worker; once set it stays set. A worker that
  sees it stops at its next step boundary and exits 0. If it is still running ``--drain-grace``
  seconds later (or at the Drain deadline, whichever is first) the agent sends SIGTERM, and
  SIGKILL ``--grace`` seconds after that.
- ``checkpoint`` (absent or ``null`` until the Core relays an operator's request) asks every
  worker of the job to checkpoint the state committed by step ``after_step`` and, with
  ``stop``, to leave the job at that boundary. The Core picks a step every worker reaches only
  after the request is written, so all of them act at the same boundary.

Readers call ``ControlReader.poll()`` once per step: it re-reads only when the file's mtime or
size (or inode) changed, so the cost per step is one ``stat``. ``harness/dummy_worker.py`` is the reference
reader. ``executor.worker`` (Core-driven) reads ``checkpoint`` at every boundary and ``drain``
after a SIGTERM: set means the
agent reported the preemption, so the worker keeps training until the Core's plan lets it go.
The agent also sets ``drain`` (reason "preempted (SIGTERM)") when SIGTERM reaches it.
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from wire.worker_env import EXIT_NO_PLAN, EXIT_OK, EXIT_TERMINATED, EXIT_USAGE, TOKEN_ENV

# WorkerExit.exit_code when the status cannot be known: a foreign pid whose parent reaped it
# before we looked. Not a valid signal number (1..64) nor an exit code (0..255).
EXIT_CODE_UNKNOWN = -255

__all__ = ["EXIT_CODE_UNKNOWN", "EXIT_NO_PLAN", "EXIT_OK", "EXIT_TERMINATED", "EXIT_USAGE", "TOKEN_ENV"]


CONTROL_ENV = "ELASWAVE_CONTROL_FILE"
# The worker's word back, beside the control file: it creates this file once it has completed
# all of its work, so that its exit 0 reads as "finished" rather than "stopped early".
FINISHED_ENV = "ELASWAVE_FINISHED_FILE"


def finished_path(control: Path) -> Path:
    return control.with_name(control.name + ".finished")


def mark_finished(checkpoint: str = "") -> bool:
    """Worker side: say "my work is complete" to the agent, with the job's final checkpoint when
    this worker wrote its share of one (the agent reports it in `Leave.checkpoint`, the Core
    shows it on the COMPLETED job); False when no agent asked for it."""
    path = os.environ.get(FINISHED_ENV)
    if not path:
        return False
    Path(path).write_text(json.dumps({"finished_unix": time.time(), "checkpoint": checkpoint}) + "\n")
    return True


def finished_checkpoint(path: Path) -> str:
    """Agent side: the final checkpoint the worker named in its finished file ("" when none, or
    the file is from a worker that wrote only a time)."""
    try:
        said = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    checkpoint = said.get("checkpoint", "") if isinstance(said, dict) else ""
    return checkpoint if isinstance(checkpoint, str) else ""


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
class CheckpointRequest:
    """Checkpoint the state committed by step ``after_step``; with ``stop``, leave after it."""

    after_step: int
    stop: bool
    since_unix: float


@dataclass(frozen=True)
class ControlState:
    """What a worker reads: ``frequency``/``drain``/``checkpoint`` None when not set."""

    seq: int
    frequency: FrequencyState | None
    drain: DrainNotice | None
    checkpoint: CheckpointRequest | None = None


class ControlFile:
    """The agent's writer. Holds the current state; every change rewrites the whole file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seq = 0
        self.frequency: FrequencyState | None = None
        self.drain: DrainNotice | None = None
        self.checkpoint: CheckpointRequest | None = None

    def publish(self) -> None:
        self.seq += 1
        body = {
            "version": VERSION,
            "seq": self.seq,
            "agent_pid": os.getpid(),
            "updated_unix": time.time(),
            "frequency": None if self.frequency is None else self.frequency.to_dict(),
            "drain": None if self.drain is None else asdict(self.drain),
            "checkpoint": None if self.checkpoint is None else asdict(self.checkpoint),
        }
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

    def set_checkpoint(self, request: CheckpointRequest) -> None:
        self.checkpoint = request
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
    freq, drain, ckpt = body.get("frequency"), body.get("drain"), body.get("checkpoint")
    try:
        frequency = (
            None
            if freq is None
            else FrequencyState(
                str(freq["controller"]),
                int(freq["mhz"]),
                int(freq["nominal_mhz"]),
                int(freq["min_mhz"]),
                int(freq["max_mhz"]),
            )
        )
        notice = (
            None
            if drain is None
            else DrainNotice(str(drain["reason"]), float(drain["deadline_unix"]), float(drain["since_unix"]))
        )
        checkpoint = (
            None
            if ckpt is None
            else CheckpointRequest(int(ckpt["after_step"]), bool(ckpt["stop"]), float(ckpt["since_unix"]))
        )
        seq = int(body["seq"])
    except (KeyError, TypeError, ValueError) as exc:
        raise BadControlFile(f"missing or malformed field: {exc!r}") from exc
    if frequency is not None and not (frequency.nominal_mhz > 0 and math.isfinite(frequency.factor)):
        raise BadControlFile(f"nominal_mhz must be > 0, got {frequency.nominal_mhz}")
    return ControlState(seq, frequency, notice, checkpoint)


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

    @property
    def checkpoint(self) -> CheckpointRequest | None:
        state = self.poll()
        return None if state is None else state.checkpoint


# ------------------------------------------------------------------------------ step metrics

SOCKET_ENV = "ELASWAVE_METRICS_SOCKET"
# A datagram on a Unix socket is delivered whole; 64 KiB is far above one record (~150 bytes).
_MAX_DATAGRAM = 65536

_INT_FIELDS = {"step": 0, "samples": 0, "stage": -1, "dp_rank": -1}  # name -> minimum value
_SECONDS_FIELDS = ("step_time_s", "compute_time_s")
FIELDS = frozenset({*_INT_FIELDS, *_SECONDS_FIELDS, "loss", "checkpoint"})
MAX_CHECKPOINT_CHARS = 4096  # a checkpoint path in a record (AgentService limits: details)


class BadMetrics(ValueError):
    """A step-metrics record that does not follow the schema; the message says why."""


def validate_step_metrics(record: object) -> dict[str, float | int | str]:
    """Validate one decoded JSON record; the fields as numbers, ``loss`` NaN when unknown,
    ``checkpoint`` a path or "". ``BadMetrics`` says what is wrong.

    Every field is required except ``loss`` (absent or null = NaN, "not known on this worker")
    and ``checkpoint`` (absent = "": no checkpoint completed since the previous record).
    """
    if not isinstance(record, dict):
        raise BadMetrics(f"expected a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - FIELDS)
    if unknown:
        raise BadMetrics(f"unknown field(s) {unknown}")
    missing = sorted((set(_INT_FIELDS) | set(_SECONDS_FIELDS)) - set(record))
    if missing:
        raise BadMetrics(f"missing field(s) {missing}")
    values: dict[str, float | int] = {}
    for name, minimum in _INT_FIELDS.items():
        value = record[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadMetrics(f"{name} must be an integer, got {value!r}")
        if value < minimum:
            raise BadMetrics(f"{name} must be >= {minimum}, got {value}")
        values[name] = value
    for name in _SECONDS_FIELDS:
        value = record[name]
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise BadMetrics(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        values[name] = float(value)
    loss = record.get("loss")
    if loss is None:
        loss = math.nan
    elif isinstance(loss, bool) or not isinstance(loss, int | float):
        raise BadMetrics(f"loss must be a number or null, got {loss!r}")
    checkpoint = record.get("checkpoint", "")
    if not isinstance(checkpoint, str) or len(checkpoint) > MAX_CHECKPOINT_CHARS:
        raise BadMetrics(f"checkpoint must be a path of at most {MAX_CHECKPOINT_CHARS} characters")
    return {"loss": float(loss), **values, "checkpoint": checkpoint}


class StepMetricsClient:
    """The executor's end: ``send`` never blocks and never raises because the agent is gone.

    Arguments are validated with the same rules as the agent (a ValueError is a bug in the
    caller, not a transport problem). ``dropped`` counts records the kernel refused.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.sent = 0
        self.dropped = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    @classmethod
    def from_env(cls) -> StepMetricsClient | None:
        """A client for the socket the launching agent exported, or None outside an agent."""
        path = os.environ.get(SOCKET_ENV)
        return cls(path) if path else None

    def send(
        self,
        *,
        step: int,
        step_time_s: float,
        compute_time_s: float,
        loss: float | None,
        samples: int,
        stage: int,
        dp_rank: int,
        checkpoint: str = "",
    ) -> bool:
        """Send one step's metrics (with `checkpoint`: one this worker completed since the
        previous record); True when the agent's socket took it."""
        record: dict[str, object] = {
            "step": step,
            "step_time_s": step_time_s,
            "compute_time_s": compute_time_s,
            "loss": None if loss is None or math.isnan(loss) else loss,
            "samples": samples,
            "stage": stage,
            "dp_rank": dp_rank,
        }
        if checkpoint:
            record["checkpoint"] = checkpoint
        validate_step_metrics(record)
        data = (json.dumps(record) + "\n").encode()
        try:
            self._sock.sendto(data, self.path)
        except OSError:
            # Agent gone (ENOENT/ECONNREFUSED) or its queue full (EAGAIN): drop, never stall training.
            self.dropped += 1
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> StepMetricsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
