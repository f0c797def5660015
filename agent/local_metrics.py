"""Step metrics from the training process to its agent over a Unix datagram socket.

The executor calls ``StepMetricsClient.send`` once per step; the agent's ``MetricsReceiver``
validates each newline-delimited JSON record and hands it on as a ``StepMetrics`` proto.
Datagrams suit this path: a send never blocks the training loop, and when the agent is gone the
kernel refuses at once, which the client swallows (the agent's absence is the Core's business).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.logs import log_event
from elaswave.v1 import agent_pb2

SOCKET_ENV = "ELASWAVE_METRICS_SOCKET"
# A datagram on a Unix socket is delivered whole; 64 KiB is far above one record (~150 bytes).
_MAX_DATAGRAM = 65536

_INT_FIELDS = {"step": 0, "samples": 0, "stage": -1, "dp_rank": -1}  # name -> minimum value
_SECONDS_FIELDS = ("step_time_s", "compute_time_s")
FIELDS = frozenset({*_INT_FIELDS, *_SECONDS_FIELDS, "loss"})


class BadMetrics(ValueError):
    """A step-metrics record that does not follow the schema; the message says why."""


def parse_step_metrics(record: object) -> agent_pb2.StepMetrics:
    """Validate one decoded JSON record and build its proto; ``BadMetrics`` says what is wrong.

    Every field is required except ``loss`` (absent or null = NaN, "not known on this worker").
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
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise BadMetrics(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        values[name] = float(value)
    loss = record.get("loss")
    if loss is None:
        loss = math.nan
    elif isinstance(loss, bool) or not isinstance(loss, int | float):
        raise BadMetrics(f"loss must be a number or null, got {loss!r}")
    return agent_pb2.StepMetrics(loss=float(loss), **values)


def parse_line(line: bytes) -> agent_pb2.StepMetrics:
    try:
        record = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadMetrics(f"not JSON: {exc}") from exc
    return parse_step_metrics(record)


@dataclass
class ReceiverStats:
    accepted: int = 0
    rejected: int = 0
    last_reject_reason: str = ""


class MetricsReceiver:
    """Binds the agent's end of the socket and forwards every valid record to ``on_metrics``."""

    def __init__(self, path: Path, on_metrics: Callable[[agent_pb2.StepMetrics], None]) -> None:
        self.path = path
        self.stats = ReceiverStats()
        self._on_metrics = on_metrics
        self._sock: socket.socket | None = None

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _remove_stale_socket(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(self.path))
        sock.setblocking(False)
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._drain)
        log_event(logging.INFO, "metrics_socket_listening", path=self.path)

    def _drain(self) -> None:
        assert self._sock is not None
        while True:
            try:
                datagram = self._sock.recv(_MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            for line in datagram.splitlines():
                if line.strip():
                    self._handle_line(line)

    def _handle_line(self, line: bytes) -> None:
        try:
            metrics = parse_line(line)
        except BadMetrics as exc:
            self.stats.rejected += 1
            self.stats.last_reject_reason = str(exc)
            log_event(logging.WARNING, "step_metrics_rejected", reason=str(exc), rejected=self.stats.rejected)
            return
        self.stats.accepted += 1
        self._on_metrics(metrics)

    def close(self) -> None:
        if self._sock is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop may already be closed
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _remove_stale_socket(path: Path) -> None:
    """Unlink a socket file left by a dead agent; refuse when a live agent still owns it."""
    if not path.exists():
        return
    if not stat.S_ISSOCK(path.stat().st_mode):
        raise ValueError(f"--metrics-socket: {path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        path.unlink()
        return
    except OSError as exc:
        raise ValueError(f"--metrics-socket: {path} exists and is not a usable socket: {exc}") from exc
    finally:
        probe.close()
    raise ValueError(f"--metrics-socket: another agent is already listening on {path}")


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
    ) -> bool:
        """Send one step's metrics; True when the agent's socket took it."""
        record = {
            "step": step,
            "step_time_s": step_time_s,
            "compute_time_s": compute_time_s,
            "loss": None if loss is None or math.isnan(loss) else loss,
            "samples": samples,
            "stage": stage,
            "dp_rank": dp_rank,
        }
        parse_step_metrics(record)
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
