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
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.logs import log_event
from wire.local_protocol import _MAX_DATAGRAM, BadMetrics, validate_step_metrics
from wire.v1 import agent_pb2


def parse_step_metrics(record: object) -> agent_pb2.StepMetrics:
    """Validate one decoded JSON record (wire.local_protocol's rules) and build its proto."""
    return agent_pb2.StepMetrics(**validate_step_metrics(record))  # type: ignore[arg-type]  # validated fields


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
