"""Start a real single-member etcd (Debian's ``etcd-server``) on free loopback ports for tests.

Tests that claim etcd behaviour run against this server, never against a stand-in (docs/architecture.md ("Processes")).
Raft timings are shortened (50 ms heartbeat, 500 ms election) so the member elects itself in
well under a second; with those settings etcd's minimum lease TTL is 1 s.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Self

import psutil

HEALTH_TIMEOUT_S = 20.0
_START_ATTEMPTS = 3  # a free port can be taken by someone else between our probe and etcd's bind


class EtcdServerError(RuntimeError):
    """etcd is missing, did not start, or did not become healthy in time."""


def find_etcd() -> str:
    path = shutil.which("etcd")
    if path is None:
        raise EtcdServerError(
            "the etcd server binary is not installed (Debian package etcd-server); run `make system-deps`"
        )
    return path


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago (held together, so distinct)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class EtcdServer:
    """One etcd process; ``start()`` returns once it answers ``/health`` with ``true``."""

    def __init__(self, data_dir: Path | None = None, name: str = "elaswave-test") -> None:
        self._binary = find_etcd()
        self._own_dir = data_dir is None
        self.data_dir = Path(tempfile.mkdtemp(prefix="etcd-test-")) if data_dir is None else Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.client_port = 0
        self.peer_port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path = self.data_dir / "etcd.log"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        """Registry URL for ``open_registry``."""
        return f"etcd://{self.endpoint}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> Self:
        last_error = ""
        for _ in range(_START_ATTEMPTS):
            if not self.client_port:
                self.client_port, self.peer_port = free_ports(2)
            try:
                self._launch()
                return self
            except EtcdServerError as exc:
                last_error = str(exc)
                self.kill()
                self.client_port = self.peer_port = 0
        raise EtcdServerError(f"etcd did not start after {_START_ATTEMPTS} attempts: {last_error}")

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; data stays for ``restart``."""
        self._terminate(signal.SIGKILL)

    def stop(self) -> None:
        """Stop the server and remove its data if this object created the directory."""
        self._terminate(signal.SIGTERM)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing answers (a hung or partitioned node).

        Returns once every thread is stopped: kill() only queues the signal, and a thread that is
        running at that moment could still answer one more request.
        """
        if self._proc is None:
            return
        self._proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        while not self._all_threads_stopped():
            if time.monotonic() > deadline:
                raise EtcdServerError("etcd did not stop within 5 s of SIGSTOP")
            time.sleep(0.01)

    def resume(self) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def restart(self) -> EtcdServer:
        """Kill and start again on the same ports with the same data (keys and leases survive)."""
        self.kill()
        self._launch()
        return self

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _command(self) -> list[str]:
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            self._binary,
            f"--name={self.name}",
            f"--data-dir={self.data_dir / 'member-data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self.name}={peer}",
            "--initial-cluster-state=new",
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--logger=zap",
            "--log-level=warn",
        ]

    def _launch(self) -> None:
        log = self._log_path.open("ab")
        self._proc = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                raise EtcdServerError(f"etcd exited early; log tail:\n{self._log_tail()}")
            if self._healthy():
                return
            time.sleep(0.05)
        raise EtcdServerError(
            f"etcd not healthy within {HEALTH_TIMEOUT_S:.0f} s; log tail:\n{self._log_tail()}"
        )

    def _all_threads_stopped(self) -> bool:
        assert self._proc is not None
        try:
            threads = psutil.Process(self._proc.pid).threads()
            return all(psutil.Process(t.id).status() == psutil.STATUS_STOPPED for t in threads)
        except psutil.NoSuchProcess:
            return False

    def _listening_on_client_port(self) -> bool:
        """Is *our* process the one listening? Otherwise /health could be answered by a stranger."""
        assert self._proc is not None
        try:
            conns = psutil.Process(self._proc.pid).net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            return False
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.client_port for c in conns)

    def _healthy(self) -> bool:
        if not self._listening_on_client_port():
            return False
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1.0) as response:
                return json.loads(response.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def _terminate(self, sig: signal.Signals) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)  # a paused etcd would not act on SIGTERM
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
