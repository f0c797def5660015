"""The worker process the agent watches: launched by the agent, or an existing pid.

Exit is detected the moment it happens, never by slow polling (docs/architecture.md ("The Core's decisions"), "the agent sees the
process exit"): a launched child through asyncio's child watcher (waitpid in a thread or a
pidfd), a foreign pid through ``pidfd_open`` readable on exit, with a 50 ms psutil poll only
where pidfds are unavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from agent.zygote_client import fork_by_zygote
from wire.local_protocol import EXIT_CODE_UNKNOWN

log = logging.getLogger("elaswave.agent.worker")
_FOREIGN_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@dataclass(frozen=True)
class ExitStatus:
    """How the worker ended; ``exit_code`` < 0 is the signal that killed it."""

    exit_code: int
    detail: str


def describe_exit(code: int) -> str:
    if code == EXIT_CODE_UNKNOWN:
        return "exit status unknown (the process was not started by this agent and was already reaped)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-code} ({name})"
    return f"exited with code {code}"


def _decode_wait_status(status: int) -> int:
    """waitpid status -> exit code, negative for a signal (as subprocess does)."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _read_proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat from field 3 (state) on, or None when the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read().decode(errors="replace")
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


class Worker(ABC):
    """Common interface of both kinds of worker."""

    pid: int
    launched: bool

    @abstractmethod
    async def wait(self) -> ExitStatus:
        """Return once the process has exited, with how it ended."""

    def is_alive(self) -> bool:
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def rss_bytes(self) -> int:
        try:
            return int(psutil.Process(self.pid).memory_info().rss)
        except psutil.Error:
            return 0

    def send_signal(self, signum: int) -> bool:
        """True when the signal was delivered (False: the process is already gone)."""
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            return False
        return True


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    """Runs in the forked child before exec: SIGKILL the worker if the agent dies.

    A worker that outlives its agent would keep training while the Core, having seen the stream
    close without a Leave, plans without it; dying with the agent keeps the two views the same.
    """
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: nothing to import in the child

    def set_parent_death_signal() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the agent died before prctl took effect
            os._exit(1)

    return set_parent_death_signal


class LaunchedWorker(Worker):
    """A child the agent started; its exit status is exact."""

    launched = True

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process
        self.pid = process.pid

    @classmethod
    async def start(cls, command: Sequence[str], env: Mapping[str, str]) -> LaunchedWorker:
        try:
            process = await asyncio.create_subprocess_exec(
                *command, env=dict(env), preexec_fn=_die_with_parent(os.getpid())
            )
        except OSError as exc:
            raise ValueError(f"cannot start worker command {list(command)!r}: {exc}") from exc
        return cls(process)

    async def wait(self) -> ExitStatus:
        code = await self._process.wait()
        return ExitStatus(code, describe_exit(code))

    def send_signal(self, signum: int) -> bool:
        if self._process.returncode is not None:
            return False
        return super().send_signal(signum)


class ForkedWorker(Worker):
    """A worker the node's zygote forked for this agent (`agent.zygote`): torch already imported.

    Its exit status comes over the agent's connection to the zygote, which is also its lifeline:
    if this agent dies, the connection closes and the zygote kills the worker."""

    launched = True

    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid = pid
        self._conn = conn
        self._status: ExitStatus | None = None

    @classmethod
    async def start(cls, zygote: Path, command: Sequence[str], env: Mapping[str, str]) -> ForkedWorker | None:
        """The forked worker, or None when the zygote cannot run `command` (it says why, logged)
        or cannot be reached: the caller starts the worker as its own child instead."""
        forked = await asyncio.to_thread(fork_by_zygote, zygote, command, env)
        if forked is None:
            return None
        pid, conn = forked
        conn.setblocking(False)
        return cls(pid, conn)

    async def wait(self) -> ExitStatus:
        if self._status is None:
            loop = asyncio.get_running_loop()
            received = b""
            while not received.endswith(b"\n"):
                chunk = await loop.sock_recv(self._conn, 64)
                if not chunk:
                    break
                received += chunk
            self._conn.close()
            text = received.decode(errors="replace").strip()
            if text.startswith("EXIT "):
                code = int(text.split()[1])
            else:  # the zygote died; its workers die with it (parent-death signal)
                await _gone(self)
                code = EXIT_CODE_UNKNOWN
            self._status = ExitStatus(code, describe_exit(code))
        return self._status

    def send_signal(self, signum: int) -> bool:
        if self._status is not None:
            return False
        return super().send_signal(signum)


async def _gone(worker: Worker) -> None:
    while worker.is_alive():
        await asyncio.sleep(_FOREIGN_POLL_S)


class ForeignWorker(Worker):
    """A process the agent did not start (``--pid``)."""

    launched = False

    def __init__(self, pid: int) -> None:
        fields = _read_proc_stat(pid)
        if fields is None or fields[0] == "Z":
            raise ValueError(f"--pid: no running process with pid {pid}")
        self.pid = pid
        self._start_ticks = fields[19]  # field 22 starttime: tells a reused pid apart

    async def wait(self) -> ExitStatus:
        try:
            pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            await _gone(self)
        else:
            try:
                await self._wait_readable(pidfd)
            finally:
                os.close(pidfd)
        code = self._zombie_exit_code()
        return ExitStatus(code, describe_exit(code))

    @staticmethod
    async def _wait_readable(fd: int) -> None:
        loop = asyncio.get_running_loop()
        exited = loop.create_future()

        def readable() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await exited
        finally:
            loop.remove_reader(fd)

    def _zombie_exit_code(self) -> int:
        """Exit status of our pid while it waits as a zombie for its parent (Linux >= 3.5)."""
        fields = _read_proc_stat(self.pid)
        if fields is None or fields[0] != "Z" or fields[19] != self._start_ticks or len(fields) < 50:
            return EXIT_CODE_UNKNOWN
        with contextlib.suppress(ValueError):
            return _decode_wait_status(int(fields[49]))  # field 52 exit_code
        return EXIT_CODE_UNKNOWN
