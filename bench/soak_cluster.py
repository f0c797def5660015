"""The processes of the soak (`bench.soak`): one etcd, two Cores on it, and `elaswave run --core`
launchers, one per simulated node, all on loopback and each bounded by timeouts.

A Core that is killed comes back on the same ports (the launchers, agents and workers know every
Core's address from the start and follow whichever leads), so the job always has a standby Core.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
START_S = 60.0


class SoakError(RuntimeError):
    """A process of the soak did not start or answer in time; the message says which."""


def free_ports(count: int) -> list[int]:
    import socket  # noqa: PLC0415

    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def env() -> dict[str, str]:
    """This checkout first on the path of every child, wherever its working directory is."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path)


def wait(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError, KeyError, SoakError):
            if value := predicate():
                return value
        if time.monotonic() > deadline:
            raise SoakError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


class Etcd:
    """One etcd member (the Debian `etcd-server` binary) with fast Raft timings."""

    def __init__(self, root: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise SoakError(
                "the etcd server binary is not installed (Debian etcd-server): `make system-deps`"
            )
        client, peer = free_ports(2)
        self.url = f"etcd://127.0.0.1:{client}"
        log = (root / "etcd.log").open("wb")
        self.proc = subprocess.Popen(
            [
                binary,
                "--name=soak",
                f"--data-dir={root / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{client}",
                f"--advertise-client-urls=http://127.0.0.1:{client}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=soak=http://127.0.0.1:{peer}",
                "--heartbeat-interval=50",
                "--election-timeout=500",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        health = f"http://127.0.0.1:{client}/health"
        wait(
            lambda: json.loads(urllib.request.urlopen(health, timeout=2).read())["health"] == "true",
            30,
            "etcd",
        )

    def stop(self) -> None:
        _end(self.proc)


class Core:
    """`elaswave core` on etcd, on fixed ports (a restart takes the same ones)."""

    def __init__(self, root: Path, name: str, registry: str, token: str) -> None:
        self.root, self.name, self.registry, self.token = root, name, registry, token
        self.grpc_port, self.http_port = free_ports(2)
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        cmd = [sys.executable, "-m", "elaswave.cli", "core", "--registry", self.registry]
        cmd += ["--core-id", self.name, "--grpc-host", "127.0.0.1", "--http-host", "127.0.0.1"]
        cmd += ["--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port)]
        cmd += ["--advertise", "127.0.0.1", "--heartbeat-timeout", "8", "--lease-ttl", "8"]
        cmd += ["--leader-ttl", "2", "--log-level", "WARNING"]
        log = (self.root / f"{self.name}.log").open("ab")
        self.proc = subprocess.Popen(
            cmd, env=env() | {"ELASWAVE_SCHEDULER_TOKEN": self.token}, stdout=log, stderr=subprocess.STDOUT
        )
        wait(lambda: self.role() is not None, START_S, f"Core {self.name} to answer")

    def role(self) -> str | None:
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            return str(httpx.get(f"{self.http_url}/healthz", timeout=2).json()["role"])
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            _end(self.proc)


class Node:
    """One simulated node: `elaswave run --core A,B` in the background, its output kept."""

    def __init__(
        self, root: Path, name: str, cores: list[Core], args: list[str], script: Path, script_args: list[str]
    ) -> None:
        self.name, self.lines = name, list[str]()
        both = ",".join(f"127.0.0.1:{c.http_port}" for c in cores)
        cmd = [sys.executable, "-m", "elaswave.cli", "run", "--core", both, "--node-id", name, *args]
        self.proc = subprocess.Popen(
            [*cmd, str(script), *script_args],
            cwd=root,
            env=env() | {"ELASWAVE_SCHEDULER_TOKEN": cores[0].token},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def tree(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def workers(self, script: Path) -> dict[int, str]:
        """pid -> worker id of this node's training processes (not their agents)."""
        found: dict[int, str] = {}
        for proc in self.tree():
            with contextlib.suppress(psutil.Error):
                cmd, penv = proc.cmdline(), proc.environ()
                if cmd[1:2] == [str(script)] and penv.get("ELASWAVE_RANK"):
                    found[proc.pid] = penv.get("ELASWAVE_WORKER_ID", "?")
        return found

    def agents(self) -> list[psutil.Process]:
        return [p for p in self.tree() if _runs(p, "agent")]

    def stores(self) -> list[psutil.Process]:
        return [p for p in self.tree() if _runs(p, "executor.store_server")]

    def stop(self) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                for proc in [psutil.Process(self.proc.pid), *self.tree()]:
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
                self.proc.wait(10)
        self._reader.join(5)


def _runs(proc: psutil.Process, word: str) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE and word in proc.cmdline()
    except psutil.Error:
        return False


def _end(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def new_token() -> str:
    return secrets.token_urlsafe(24)
