"""Starting a rendezvous store process (`executor.store_server`) and reading the port it bound.

Torch-free, so that a launcher can start stores without importing torch itself. A store is
either this process's child (`python -m executor.store_server`, which imports torch: a second or
more of CPU, 10-15 s on a loaded machine) or forked by the node's zygote, which has imported
torch already (`agent.zygote`; the caller passes its `Spawn`): then it is up in milliseconds, and
a lost standby is replaced long before the next loss can come (docs/engine.md, "Warm starts").
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from executor.child_process import ChildProcess, Spawn


def launch(
    args: Sequence[str],
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    stderr: int | None = None,
    spawn: Spawn | None = None,
    new_session: bool = False,
) -> tuple[ChildProcess, int]:
    """Start `python -m executor.store_server --port 0 ARGS` and wait (at most `timeout_s`) for
    the port it bound: forked by `spawn` where given and it accepts (milliseconds), else as this
    process's child, which imports torch itself (a second or more of CPU) and gets `--parent`
    (it ends with this process, as a forked one does through its zygote's lifeline). `stderr`:
    a descriptor for the store's log (default this process's). Raises RuntimeError, with the
    store stopped, when no port is announced in time."""
    argv = [sys.executable, "-m", "executor.store_server", "--port", "0", *args]
    environ = dict(os.environ if env is None else env)
    read_end, write_end = os.pipe()
    proc: ChildProcess | None = None
    try:
        with open(os.devnull, "rb") as null:
            stdio = (null.fileno(), write_end, 2 if stderr is None else stderr)
            proc = spawn(argv, environ, stdio) if spawn is not None else None
            if proc is None:
                proc = subprocess.Popen(
                    [*argv, "--parent", str(os.getpid())],
                    env=environ,
                    stdin=null,
                    stdout=write_end,
                    stderr=stderr,
                    start_new_session=new_session,
                )
    finally:
        os.close(write_end)  # the store holds its own copy: its exit ends the read below
        if proc is None:
            os.close(read_end)
    try:
        line = _read_line(read_end, timeout_s)
    finally:
        os.close(read_end)
    if not line.startswith("PORT "):
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
        why = "timed out" if not line else f"said {line!r}"
        raise RuntimeError(f"the store server did not announce its port within {timeout_s:g} s ({why})")
    return proc, int(line.split()[1])


def accepts_connections(address: str, timeout_s: float) -> bool:
    """Whether "host:port" accepts a TCP connection within `timeout_s` (closed at once)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def announce_args(peers: tuple[str, ...]) -> list[str]:
    """The command-line arguments that make a new store announce itself to `peers`."""
    return ["--announce-to", ",".join(peers)] if peers else []


def _read_line(fd: int, timeout_s: float) -> str:
    """The first line written to `fd` within `timeout_s` ("" if none: timed out or closed)."""
    deadline = time.monotonic() + timeout_s
    received = b""
    while b"\n" not in received:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return ""
        chunk = os.read(fd, 256)
        if not chunk:
            break
        received += chunk
    return received.split(b"\n", 1)[0].decode(errors="replace").strip()
