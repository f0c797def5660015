"""Test harness for the agent: a real grpc.aio AgentService that records what agents send, and
helpers that run the agent as a real process (``python -m agent``)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio

from wire.v1 import agent_pb2, agent_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


@dataclass
class Received:
    at: float  # time.monotonic() when the server read it
    stream: int  # 1-based index of the stream it came on
    request: agent_pb2.ConnectRequest

    @property
    def kind(self) -> str:
        return self.request.WhichOneof("body")


@dataclass
class StreamInfo:
    metadata: dict[str, str]
    auth: dict[str, list[bytes]]  # the peer's TLS identity (x509_common_name, ...) when TLS is on
    commands: asyncio.Queue[agent_pb2.ConnectResponse] = field(default_factory=asyncio.Queue)


class RecordingCore(agent_pb2_grpc.AgentServiceServicer):
    """A real gRPC AgentService on 127.0.0.1 (own thread and loop) standing in for the Core.

    As leader it acknowledges Register and forwards queued commands; as standby it reads the
    Register and aborts the stream with ``refuse_code``/``refuse_message``. With ``tls`` it
    serves TLS only; with ``close_on_leave`` it ends a stream once it has read Leave.
    """

    def __init__(
        self,
        refuse_code: grpc.StatusCode | None = None,
        refuse_message: str = "",
        close_on_leave: bool = False,
        tls: grpc.ServerCredentials | None = None,
    ) -> None:
        self.refuse_code = refuse_code
        self.tls = tls
        self.refuse_message = refuse_message
        self.close_on_leave = close_on_leave  # end the stream once Leave is read, as the Core does
        self.port = 0
        self.received: list[Received] = []
        self.streams: list[StreamInfo] = []
        self._cond = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def start(self) -> RecordingCore:
        async def start() -> int:
            self._server = grpc.aio.server()
            agent_pb2_grpc.add_AgentServiceServicer_to_server(self, self._server)
            address = f"127.0.0.1:{self.port}"
            port = (
                self._server.add_secure_port(address, self.tls)
                if self.tls
                else self._server.add_insecure_port(address)
            )
            await self._server.start()
            return port

        self.port = self._call(start())
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._call(self._server.stop(grace=0))
            self._server = None

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def Connect(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        info = StreamInfo(metadata=dict(context.invocation_metadata()), auth=dict(context.auth_context()))
        with self._cond:
            self.streams.append(info)
            stream_index = len(self.streams)
        first = await context.read()
        self._record(stream_index, first)
        if self.refuse_code is not None:
            await context.abort(self.refuse_code, self.refuse_message)
        await context.write(
            agent_pb2.ConnectResponse(
                ack=agent_pb2.RegisterAck(
                    session=stream_index, heartbeat_timeout_ms=3000, core_id=f"test-{self.port}"
                )
            )
        )
        reader = asyncio.ensure_future(self._read_all(context, stream_index))
        command = None
        try:
            while not reader.done():
                command = asyncio.ensure_future(info.commands.get())
                await asyncio.wait({reader, command}, return_when=asyncio.FIRST_COMPLETED)
                if command.done():
                    await context.write(command.result())
        finally:
            for task in (reader, command):
                if task is not None:
                    task.cancel()

    async def _read_all(self, context: grpc.aio.ServicerContext, stream_index: int) -> None:
        while True:
            request = await context.read()
            if request is grpc.aio.EOF:
                return
            self._record(stream_index, request)
            if self.close_on_leave and request.WhichOneof("body") == "leave":
                return

    def _record(self, stream_index: int, request: agent_pb2.ConnectRequest) -> None:
        with self._cond:
            self.received.append(Received(time.monotonic(), stream_index, request))
            self._cond.notify_all()

    def send_command(self, response: agent_pb2.ConnectResponse) -> None:
        """Send a command on the newest stream."""
        info = self.streams[-1]
        self._loop.call_soon_threadsafe(info.commands.put_nowait, response)

    def of_kind(self, kind: str) -> list[Received]:
        with self._cond:
            return [r for r in self.received if r.kind == kind]

    def wait_for(self, predicate: Callable[[list[Received]], bool], timeout: float = 10.0) -> list[Received]:
        """Block until ``predicate(received)`` holds; AssertionError with what came otherwise."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.received):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    kinds = [r.kind for r in self.received]
                    raise AssertionError(f"condition not met within {timeout} s; received {kinds}")
                self._cond.wait(remaining)
            return list(self.received)

    def wait_kind(self, kind: str, count: int = 1, timeout: float = 10.0) -> list[Received]:
        self.wait_for(lambda rs: sum(r.kind == kind for r in rs) >= count, timeout)
        return self.of_kind(kind)


class AgentProcess:
    """``python -m agent`` as a real child process, logs in ``log_path``."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        full_env = dict(os.environ)
        full_env.pop("ELASWAVE_JOB_TOKEN", None)  # only what the test passes
        full_env.update(PYTHONPATH=str(REPO_ROOT), **(env or {}))
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent", *args],
            cwd=REPO_ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
        )

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str, timeout: float = 10.0) -> str:
        """The log once it contains ``text``; AssertionError with the log tail otherwise."""
        deadline = time.monotonic() + timeout
        while text not in (log := self.log):
            assert time.monotonic() < deadline, f"{text!r} not logged within {timeout} s:\n{log[-2000:]}"
            time.sleep(0.02)
        return log

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 10.0) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)
        self._log.close()


def base_args(tmp_path: Path, cores: str, worker_id: str = "w0", *extra: str) -> list[str]:
    """Flags every test agent uses: fast heartbeats and backoff-friendly timeouts."""
    return [
        "--job",
        "testjob",
        "--worker-id",
        worker_id,
        "--core",
        cores,
        "--metrics-socket",
        str(tmp_path / f"{worker_id}.sock"),
        "--heartbeat-interval",
        "0.1",
        "--register-timeout",
        "2",
        "--leave-timeout",
        "2",
        "--probe-interval",
        "60",
        *extra,
    ]


def sleeper_command(tmp_path: Path, ignore_sigterm: bool = False) -> list[str]:
    """A worker that sleeps; on SIGTERM it copies its control file (if any) to
    control_at_term.json, writes 'SIGTERM' to term.txt and exits 0 (or, with ``ignore_sigterm``,
    ignores it). It touches ready.txt once its handler is installed (see ``wait_worker_ready``)."""
    script = tmp_path / "worker.py"
    handler = "signal.SIG_IGN" if ignore_sigterm else "on_term"
    script.write_text(
        "import os, pathlib, signal, sys, time\n"
        "def on_term(*_):\n"
        "    control = pathlib.Path(os.environ.get('ELASWAVE_CONTROL_FILE', '/nonexistent'))\n"
        "    if control.exists():\n"
        f"        pathlib.Path({str(tmp_path / 'control_at_term.json')!r}).write_text(control.read_text())\n"
        f"    pathlib.Path({str(tmp_path / 'term.txt')!r}).write_text('SIGTERM')\n"
        "    sys.exit(0)\n"
        f"signal.signal(signal.SIGTERM, {handler})\n"
        f"pathlib.Path({str(tmp_path / 'ready.txt')!r}).write_text('ready')\n"
        "time.sleep(120)\n"
    )
    return ["--", sys.executable, str(script)]


def wait_worker_ready(tmp_path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not (tmp_path / "ready.txt").exists():
        assert time.monotonic() < deadline, "worker did not start"
        time.sleep(0.01)
