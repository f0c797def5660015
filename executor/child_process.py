"""A process another one started for this one, and how a warm parent is asked to fork one.

A launcher's helpers (the rendezvous stores, the describe run) are either this process's
children (`subprocess.Popen`) or forked by the node's zygote, which has imported torch already
(`agent.zygote`, `agent.zygote_client.ZygoteChild`): the same face either way, so the code that
waits for, signals and stops them does not care which. Stdlib only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol


class ChildProcess(Protocol):
    """A `subprocess.Popen`, or a child a zygote forked (`agent.zygote_client.ZygoteChild`)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, signum: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


# Forks `argv` with this environment and these descriptors as its stdin, stdout and stderr (a
# warm parent: agent.zygote); None where it declines, and the caller starts the command itself.
Spawn = Callable[[Sequence[str], Mapping[str, str], tuple[int, int, int]], ChildProcess | None]
