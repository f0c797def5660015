"""The client's side of the node's zygote (`agent.zygote`): ask it to fork a command.

Two kinds of client: an agent's worker (`agent.worker.ForkedWorker`, asynchronous), and a
launcher's helper processes, such as a job's rendezvous stores (`ZygoteChild`, with the face of
a `subprocess.Popen`). A store forked this way starts in milliseconds instead of importing torch
for a second or more of CPU, so a lost standby store is replaced before the next loss can come
(docs/engine.md, "Warm starts").

The connection that carried the request stays open for the child's life: the zygote writes the
child's exit status on it, and kills the child when it closes first (its owner died), so a forked
child never outlives the process that asked for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from agent.zygote import HEADER, WorkerRequest
from wire.local_protocol import EXIT_CODE_UNKNOWN

log = logging.getLogger("elaswave.agent.zygote_client")
ZYGOTE_ANSWER_S = 10.0  # a fork takes milliseconds; a zygote this slow is treated as absent
STANDARD_STREAMS = (0, 1, 2)


def ask_zygote(
    zygote: Path, request: WorkerRequest, stdio: Sequence[int] = STANDARD_STREAMS
) -> tuple[socket.socket, str]:
    """Send `request` with `stdio` (this process's descriptors that become the child's 0, 1, 2);
    return the open connection and the zygote's one-line answer (`PID n` or `NO reason`).
    Blocks at most ZYGOTE_ANSWER_S; raises OSError when the zygote cannot be reached or closes
    without answering."""
    if len(stdio) != 3:
        raise ValueError(f"stdio must be three descriptors (stdin, stdout, stderr), got {list(stdio)}")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(ZYGOTE_ANSWER_S)
        conn.connect(str(zygote))
        payload = request.to_json()
        socket.send_fds(conn, [HEADER.pack(len(payload))], list(stdio))
        conn.sendall(payload)
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = conn.recv(256)
            if not chunk:
                raise ConnectionError("the zygote closed the connection without answering")
            answer += chunk
    except BaseException:
        conn.close()
        raise
    return conn, answer.decode(errors="replace").strip()


def fork_by_zygote(
    zygote: Path,
    argv: Sequence[str],
    env: Mapping[str, str],
    stdio: Sequence[int] = STANDARD_STREAMS,
    cwd: str | None = None,
) -> tuple[int, socket.socket] | None:
    """Ask the zygote at `zygote` to fork `argv` with `env`, `stdio` and `cwd` (default this
    process's): the child's pid and the connection that will carry its exit status, or None,
    with the reason logged, when the zygote cannot be reached or declines (the caller then starts
    the command itself). Blocks at most ZYGOTE_ANSWER_S."""
    request = WorkerRequest(tuple(argv), dict(env), cwd or os.getcwd())
    try:
        conn, answer = ask_zygote(zygote, request, stdio)
    except OSError as exc:
        log.warning("zygote %s unreachable (%s): starting %s cold", zygote, exc, list(argv[:3]))
        return None
    if not answer.startswith("PID "):
        conn.close()
        log.info("zygote %s: %s; starting %s cold", zygote, answer, list(argv[:3]))
        return None
    return int(answer.split()[1]), conn


class ZygoteChild:
    """A process the zygote forked for this one, used as a `subprocess.Popen` is: `pid`,
    `returncode`, `poll`, `wait`, `send_signal`, `terminate`, `kill`.

    Not this process's child, so its status comes over the connection (`EXIT n`). If the zygote
    dies first, the child dies with it (its parent-death signal); the status is then unknown
    (`wire.local_protocol.EXIT_CODE_UNKNOWN`) and reported once the pid is gone."""

    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._received = b""

    @classmethod
    def fork(
        cls,
        zygote: Path,
        argv: Sequence[str],
        env: Mapping[str, str],
        stdio: Sequence[int] = STANDARD_STREAMS,
        cwd: str | None = None,
    ) -> ZygoteChild | None:
        """`argv` forked by the zygote (`fork_by_zygote`), or None where it is not."""
        forked = fork_by_zygote(zygote, argv, env, stdio, cwd)
        return None if forked is None else cls(*forked)

    def poll(self) -> int | None:
        """The exit code once the child has ended (negative: the signal), else None. Non-blocking."""
        return self._settle(0.0)

    def wait(self, timeout: float | None = None) -> int:
        """Block until the child ends, at most `timeout` seconds (None: no limit); raises
        subprocess.TimeoutExpired as Popen.wait does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            code = self._settle(0.1 if left is None else min(left, 0.1))
            if code is not None:
                return code
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout or 0.0)

    def send_signal(self, signum: int) -> None:
        """As Popen's: nothing once the child is known to have ended."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _settle(self, wait_s: float) -> int | None:
        """Read what the zygote sent within `wait_s`; the exit code once it is known."""
        if self.returncode is not None:
            return self.returncode
        if self._conn.fileno() < 0:
            time.sleep(wait_s)  # the zygote is gone: only the pid is left to watch
        elif select.select([self._conn], [], [], wait_s)[0]:
            try:
                chunk = self._conn.recv(64)
            except OSError:
                chunk = b""
            self._received += chunk
            if self._received.endswith(b"\n") and self._received.startswith(b"EXIT "):
                self.returncode = int(self._received.split()[1])
            elif not chunk:  # the zygote died: the child dies with it
                self._conn.close()
        if self.returncode is None and self._conn.fileno() < 0 and not _alive(self.pid):
            self.returncode = EXIT_CODE_UNKNOWN
        if self.returncode is not None and self._conn.fileno() >= 0:
            self._conn.close()
        return self.returncode


def _alive(pid: int) -> bool:
    """The pid runs and is not a zombie (a zombie of a dead zygote is reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] != b"Z"
