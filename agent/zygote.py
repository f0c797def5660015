"""A warm parent for Python workers: torch imported once per node, each worker forked from it.

A worker started as `python script.py` spends about a second of CPU importing torch before it
does anything (docs/engine.md, "Warm starts"). Every agent on a node starting its own worker
pays it again, and a join or replacement pays it while the survivors wait. The zygote imports
the preloaded modules once, then forks one child per request; the child becomes the worker
exactly as `python script.py args` (or `python -m module args`) would run it: same argv,
environment, working directory, stdin/stdout/stderr (the agent's own descriptors, passed over
the socket), `__main__`, interpreter shutdown and exit status.

Run it as

    python -m agent.zygote --socket PATH [--preload torch,elaswave.api,executor.warm_runtime]

It prints ``READY`` on one line once it listens. Protocol, one connection per worker (the agent's
side is `agent.worker.ForkedWorker`): the agent sends a 4-byte big-endian length and that many
bytes of JSON ({"argv", "env", "cwd"}), with its descriptors 0, 1, 2 attached to the first
bytes (SCM_RIGHTS). The zygote answers ``PID <pid>`` or ``NO <reason>`` (a command it cannot run
as its own child: the agent then starts the worker the usual way), and ``EXIT <code>`` when the
worker ends (negative: the signal that killed it). The connection is the agent's lifeline: when
it closes first (the agent died), the worker is killed, as an agent's own child is by its
parent-death signal. The worker dies with the zygote too (whose starter arms its own parent-death
signal: `elaswave.launcher_procs.WarmWorkers`), so nothing outlives the node's launcher.

A command is forked only when nothing that the interpreter or torch read at import differs
between the zygote and the worker (`IMPORT_TIME_ENV`): otherwise the answer is NO.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
HEADER = struct.Struct("!I")
MAX_REQUEST_BYTES = 16 << 20
REQUEST_TIMEOUT_S = 10.0
# A preloaded module's function, called once after every preload: what the module's workers
# would build lazily (imports inside torch, the garbage collector's freeze), built once per node.
PREPARE_HOOK = "prepare_zygote"
# Environment read when the interpreter starts or a library loads (OpenMP's pool size, the
# allocator, torch's import-time switches): a worker whose values differ is not forked.
IMPORT_TIME_ENV = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "LD_", "MALLOC_", "TORCH_")


@dataclass(frozen=True)
class WorkerRequest:
    """What one worker is to run: `argv` as given to exec, its full environment and directory."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str

    @classmethod
    def from_json(cls, raw: bytes) -> WorkerRequest:
        body = json.loads(raw)
        argv, env, cwd = body["argv"], body["env"], body["cwd"]
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
        if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
            raise ValueError("env must map names to strings")
        if not isinstance(cwd, str):
            raise ValueError(f"cwd must be a string, got {cwd!r}")
        return cls(tuple(argv), dict(env), cwd)

    def to_json(self) -> bytes:
        return json.dumps({"argv": list(self.argv), "env": self.env, "cwd": self.cwd}).encode()


def why_not_forked(request: WorkerRequest, own_env: dict[str, str]) -> str:
    """Why this zygote cannot run `request` as its child ("" when it can)."""
    command = request.argv[0]
    if os.sep in command:  # a path: relative to the worker's directory, not the zygote's
        command = os.path.join(request.cwd, command)
    exe = shutil.which(command, path=request.env.get("PATH"))
    # The same file in the same directory: a virtual environment's python is a link to the
    # base interpreter, and another environment's link to it has other packages.
    ours = os.path.abspath(sys.executable)
    if (
        exe is None
        or os.path.dirname(os.path.abspath(exe)) != os.path.dirname(ours)
        or not os.path.samefile(exe, ours)
    ):
        return f"{request.argv[0]!r} is not this zygote's interpreter {sys.executable}"
    rest = request.argv[1:]
    if not rest or (rest[0].startswith("-") and not (rest[0] == "-m" and len(rest) > 1)):
        return "only `python SCRIPT ...` and `python -m MODULE ...` are forked (no interpreter options)"
    for key in sorted(set(own_env) | set(request.env)):
        if key.startswith(IMPORT_TIME_ENV) and own_env.get(key) != request.env.get(key):
            return f"${key} differs from the zygote's (read at import)"
    return ""


def run_as_main(request: WorkerRequest) -> None:
    """In the forked child: become `python SCRIPT args` / `python -m MODULE args` and run it.

    Returns or raises as the script does: the caller lets the interpreter end the process, so
    atexit handlers, non-daemon threads and the exit status are those of a fresh interpreter."""
    import runpy

    _show_as(request.argv)  # first: it measures the space it may use from the environment block
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    args = request.argv[1:]
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]  # runpy sets argv[0] to the module's file
        sys.path[0] = request.cwd
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(args[0])
        if not os.path.exists(script):
            print(f"{request.argv[0]}: can't open file {script!r}: no such file", file=sys.stderr)
            sys.exit(2)
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


def _show_as(argv: tuple[str, ...]) -> None:
    """`ps`, `top` and /proc/PID/cmdline show the worker's own command, not the zygote's (the
    title takes the space of the zygote's argv and environment block, so /proc/PID/environ no
    longer reads as an environment: the worker's is in its os.environ)."""
    try:
        import setproctitle
    except ImportError:  # a dependency; without it the worker still runs, under the zygote's title
        return
    setproctitle.setproctitle(" ".join(argv))


def run_worker(request: WorkerRequest) -> None:
    """`run_as_main`, with an uncaught error reported as the interpreter would: through
    sys.excepthook, without the zygote's own frames, exit status 1."""
    try:
        run_as_main(request)
    except (SystemExit, KeyboardInterrupt):
        raise  # the interpreter's own handling: the exit status, or death by SIGINT
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        sys.exit(1)


class Zygote:
    """The listening loop. Single-threaded, so that a fork copies a process in a known state."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.own_env = dict(os.environ)
        self.selector = selectors.DefaultSelector()
        self.workers: dict[int, socket.socket] = {}  # pid -> its agent's connection
        self.stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def serve(self) -> WorkerRequest | None:
        """Serves until SIGTERM/SIGINT (returns None) or, in a forked child, returns its request."""
        signal.set_wakeup_fd(self._wake_w)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self._wake_r, selectors.EVENT_READ, "signal")
        while not self.stopping:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    request = self._accept()
                    if request is not None:
                        return request  # the child
                elif key.data == "signal":
                    os.read(self._wake_r, 512)
                    self._reap()
                else:
                    self._agent_readable(key.data)
        for pid in list(self.workers):
            _kill(pid)
        return None

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if signum != signal.SIGCHLD:
            self.stopping = True

    def _accept(self) -> WorkerRequest | None:
        conn, _ = self.listener.accept()
        try:
            conn.settimeout(REQUEST_TIMEOUT_S)
            request, fds = _read_request(conn)
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
            _answer(conn, f"NO bad request: {exc}")
            conn.close()
            return None
        try:
            why = why_not_forked(request, self.own_env)
            if why:
                _answer(conn, f"NO {why}")
                conn.close()
                return None
            sys.stdout.flush()
            sys.stderr.flush()
            zygote = os.getpid()
            pid = os.fork()
            if pid == 0:
                self._become_child(fds, conn, zygote)
                return request
            self.workers[pid] = conn
            _answer(conn, f"PID {pid}")
            conn.setblocking(False)
            self.selector.register(conn, selectors.EVENT_READ, pid)
        finally:
            for fd in fds:
                if fd > 2:
                    os.close(fd)
        return None

    def _become_child(self, fds: list[int], conn: socket.socket, zygote: int) -> None:
        """The child drops everything of the zygote's and takes the agent's descriptors."""
        for signum in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.set_wakeup_fd(-1)
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != zygote:  # the zygote died before the signal was armed
            os._exit(128 + signal.SIGKILL)
        self.selector.close()
        for sock in (self.listener, conn, *self.workers.values()):
            sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        _fresh_stdio()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.workers.pop(pid, None)
            if conn is None:
                continue
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            with contextlib.suppress(KeyError):
                self.selector.unregister(conn)
            conn.setblocking(True)
            _answer(conn, f"EXIT {code}")
            conn.close()

    def _agent_readable(self, pid: int) -> None:
        """The agent's side of a live worker's connection: anything but data means it died."""
        conn = self.workers[pid]
        try:
            data = conn.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(conn)
            _kill(pid)  # reaped, and its connection closed, on SIGCHLD


def _fresh_stdio() -> None:
    """Text streams on the new descriptors 0, 1, 2, buffered as a fresh interpreter buffers them
    (stdout line-buffered only on a terminal, stderr always; PYTHONUNBUFFERED is the zygote's own)."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        mode = "r" if fd == 0 else "w"
        line = fd == 2 or (fd == 1 and os.isatty(fd))
        stream = open(  # noqa: SIM115 - the process's own stdio, open until it exits
            fd, mode, buffering=1 if line else -1, encoding=old.encoding, errors=old.errors, closefd=False
        )
        assert isinstance(stream, io.TextIOWrapper)
        if unbuffered and fd > 0:
            stream.reconfigure(write_through=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    chunks: list[bytes] = []
    while size:
        chunk = conn.recv(min(size, 1 << 20))
        if not chunk:
            raise ValueError("connection closed mid-request")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _read_request(conn: socket.socket) -> tuple[WorkerRequest, list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected 3 descriptors (stdin, stdout, stderr), got {len(fds)}")
    try:
        if len(head) < HEADER.size:
            head += _recv_exactly(conn, HEADER.size - len(head))
        (size,) = HEADER.unpack(head)
        if size > MAX_REQUEST_BYTES:
            raise ValueError(f"request of {size} bytes is over {MAX_REQUEST_BYTES}")
        return WorkerRequest.from_json(_recv_exactly(conn, size)), list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _answer(conn: socket.socket, line: str) -> None:
    with contextlib.suppress(OSError):  # the agent is gone: its live worker is killed on the next read
        conn.sendall(line.encode() + b"\n")


def _preload(modules: list[str]) -> None:
    """Import `modules`, then call `prepare_zygote()` of each that defines one (what its workers
    would otherwise build lazily, built once here: `executor.warm_runtime`)."""
    import importlib

    loaded = []
    for name in modules:
        try:
            loaded.append(importlib.import_module(name))
        except Exception as exc:  # noqa: BLE001 - a warm start is an optimisation, never a failure
            print(
                f"zygote: preloading {name} failed ({exc}); its workers import it themselves", file=sys.stderr
            )
    for module in loaded:
        hook = getattr(module, PREPARE_HOOK, None)
        if not callable(hook):
            continue
        try:
            hook()
        except Exception as exc:  # noqa: BLE001 - as above: the workers then do it themselves
            print(f"zygote: {module.__name__}.{PREPARE_HOOK}() failed ({exc})", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m agent.zygote", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", type=Path, required=True, help="Unix socket path to listen on")
    parser.add_argument("--preload", default="torch", help="comma-separated modules to import once")
    args = parser.parse_args(argv)
    _preload([m for m in args.preload.split(",") if m])
    args.socket.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    binding = args.socket.with_name(args.socket.name + ".tmp")
    binding.unlink(missing_ok=True)
    listener.bind(str(binding))
    os.chmod(binding, 0o600)  # only this user's agents may have workers forked
    listener.listen(64)
    binding.rename(args.socket)  # the path appears only once connections are accepted
    print("READY", flush=True)
    zygote = Zygote(listener)
    request = zygote.serve()
    if request is None:
        listener.close()
        args.socket.unlink(missing_ok=True)
        return
    run_worker(request)


if __name__ == "__main__":
    main()
