"""The processes `elaswave run` starts on one machine: a Core, the rendezvous store, one agent per rank.

Every child runs in its own session, so a Ctrl-C at the terminal reaches only the launcher, which
then stops the job at a step boundary (`launcher_monitor`) instead of every process dying at once.
Each child also gets a parent-death signal (Linux), so a launcher killed with SIGKILL does not
leave a Core, a store or training processes behind. Every wait here is bounded.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from agent.zygote_client import ZygoteChild
from executor.child_process import ChildProcess
from executor.store_process import announce_args, launch

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LOOPBACK = "127.0.0.1"
# What the zygote imports once per node; `executor.warm_runtime`'s hook then runs torch's lazy
# imports and freezes the result for every forked worker (agent.zygote, PREPARE_HOOK).
ZYGOTE_PRELOAD = "torch,elaswave.api,executor.warm_runtime"
# A zygote still importing is waited for this long: a cold start would import the same modules on
# the same cores, so giving up early only adds a second import (10 s was exceeded on a loaded CI
# machine, and the describe run started cold). A zygote that exits is not waited for at all.
ZYGOTE_READY_TIMEOUT_S = 60.0


class LaunchError(RuntimeError):
    """A part of the job could not be started; the message says which and why."""


def _die_with_parent(signum: int) -> Callable[[], None] | None:
    """preexec_fn: `signum` to the child when the launcher dies (None where prctl is missing)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: nothing to import in the child
    parent = os.getpid()

    def arm() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)

    return arm


def spawn(
    cmd: list[str], env: Mapping[str, str], log: Path | None, death_signal: int
) -> subprocess.Popen[bytes]:
    """Start `cmd` in its own session; stdout and stderr to `log` (None: the launcher's terminal)."""
    out: BinaryIO | None = log.open("ab") if log is not None else None
    try:
        return subprocess.Popen(
            cmd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            preexec_fn=_die_with_parent(death_signal),
        )
    except OSError as exc:
        raise LaunchError(f"cannot start {cmd[:4]}: {exc}") from exc
    finally:
        if out is not None:
            out.close()  # the child holds its own copy


def stop_process(proc: ChildProcess, signum: int, timeout_s: float) -> None:
    """`signum`, then SIGKILL after `timeout_s`; blocks at most about 2 x timeout_s."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout_s)


@dataclass
class LocalCore:
    """An embedded Core that leads: in-memory membership, loopback, random ports and scheduler
    token (`CoreStart` starts it)."""

    process: subprocess.Popen[bytes]
    grpc_port: int
    http: httpx.Client
    scheduler_token: str

    def create_job(
        self, name: str, expected_workers: int, layout_json: str, model: dict[str, Any] | None = None
    ) -> str:
        """POST /api/v1/jobs with the layout and the model (planners.described_model); returns the
        job token."""
        body = {"name": name, "expected_workers": expected_workers, "layout": json.loads(layout_json)}
        if model is not None:
            body["model"] = model
        response = self.http.post(
            "/api/v1/jobs", json=body, headers={"Authorization": f"Bearer {self.scheduler_token}"}
        )
        if response.status_code != 201:
            raise LaunchError(
                f"the Core refused job {name!r}: HTTP {response.status_code} {response.text[:500]}"
            )
        return str(response.json()["token"])

    def stop(self) -> None:
        self.http.close()
        stop_process(self.process, signal.SIGINT, 10.0)


@dataclass
class CoreStart:
    """An embedded Core's process, started and not yet waited for: the launcher describes the
    model meanwhile (both import for about a second), then `ready` waits for it to lead."""

    process: subprocess.Popen[bytes]
    run_dir: Path
    token: str
    core: LocalCore | None = None

    @classmethod
    def begin(cls, run_dir: Path, env: Mapping[str, str]) -> CoreStart:
        """Spawn the Core (in-memory registry, loopback, ports from the kernel); returns at once."""
        ready = run_dir / "core.json"
        ready.unlink(missing_ok=True)
        token = secrets.token_urlsafe(24)
        cmd = [
            sys.executable,
            "-m",
            "elaswave.cli",
            "core",
            "--grpc-host",
            LOOPBACK,
            "--grpc-port",
            "0",
            "--http-host",
            LOOPBACK,
            "--http-port",
            "0",
            "--registry",
            "memory://",
            "--ready-file",
            str(ready),
            "--log-level",
            "WARNING",
        ]
        proc = spawn(cmd, dict(env, ELASWAVE_SCHEDULER_TOKEN=token), run_dir / "core.log", signal.SIGTERM)
        return cls(proc, run_dir, token)

    def ready(self, timeout_s: float = 30.0) -> LocalCore:
        """Block until the Core leads (at most `timeout_s`); raises LaunchError, with the Core
        stopped, if it exits or does not lead in time."""
        if self.core is not None:
            return self.core
        ready = self.run_dir / "core.json"
        deadline = time.monotonic() + timeout_s
        try:
            while not ready.exists():
                if self.process.poll() is not None:
                    raise LaunchError(
                        f"the embedded Core exited with status {self.process.returncode} before it was "
                        f"ready; see {self.run_dir / 'core.log'}"
                    )
                _check(deadline, "the embedded Core to start", timeout_s)
                time.sleep(0.05)
            info = json.loads(ready.read_text())
            http = httpx.Client(base_url=f"http://{LOOPBACK}:{info['http_port']}", timeout=5.0)
            while http.get("/healthz").json().get("role") != "leader":
                _check(deadline, "the embedded Core to lead", timeout_s)
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        self.core = LocalCore(self.process, int(info["grpc_port"]), http, self.token)
        return self.core

    def stop(self) -> None:
        """Stop the Core, led or not; safe to call again."""
        if self.core is not None:
            self.core.stop()
        else:
            stop_process(self.process, signal.SIGTERM, 5.0)


@dataclass
class LocalStore:
    """The executors' rendezvous store (`executor.store_server`) in its own process: forked from
    this node's zygote where there is one (milliseconds), else a child importing torch."""

    process: ChildProcess
    port: int
    host: str = LOOPBACK

    @classmethod
    def start(
        cls,
        env: Mapping[str, str],
        log: Path,
        timeout_s: float = 60.0,
        peers: tuple[str, ...] = (),
        host: str = LOOPBACK,
        zygote: WarmWorkers | None = None,
    ) -> LocalStore:
        """Start it and wait (at most `timeout_s`: a cold store imports torch) for the port it
        bound; `peers`: the job's live stores, which learn the new store list from it; `host`:
        where the workers reach it (this node's address for the other nodes of a job)."""
        # A cold one arms its own parent-death signal (`--parent`, executor.store_server.launch):
        # no preexec_fn, since a replacement is started from the store keeper's thread while
        # other threads run.
        args = ["--host", host, *announce_args(peers)]
        spawn = zygote.fork if zygote is not None else None
        try:
            with log.open("ab") as err:  # the child keeps its own copy
                proc, port = launch(args, timeout_s, env, err.fileno(), spawn, new_session=True)
        except (OSError, RuntimeError) as exc:
            raise LaunchError(f"the rendezvous store did not start ({exc}); see {log}") from exc
        return cls(proc, port, host)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    def stop(self) -> None:
        stop_process(self.process, signal.SIGTERM, 10.0)


@dataclass
class WarmWorkers:
    """This node's worker zygote (`agent.zygote`): torch imported once, each worker forked from
    it, so a worker's start costs milliseconds of CPU instead of a second. Optional: an agent
    whose worker it cannot fork, or that finds it gone, starts its worker cold."""

    process: subprocess.Popen[bytes]
    socket: Path
    gave_up: bool = False  # `ready` timed out once: said so, and never says it again

    @classmethod
    def begin(cls, socket_dir: Path, env: Mapping[str, str], log: Path) -> WarmWorkers:
        """Spawn it; returns at once (`ready` waits). `env`: the import-time environment its
        workers share (the zygote refuses a worker whose differs)."""
        sock = socket_dir / "zygote.sock"
        cmd = [sys.executable, "-m", "agent.zygote", "--socket", str(sock), "--preload", ZYGOTE_PRELOAD]
        return cls(spawn(cmd, env, log, signal.SIGTERM), sock)

    def ready(self, timeout_s: float = ZYGOTE_READY_TIMEOUT_S) -> Path | None:
        """Its socket once it accepts workers, else None: workers start cold. Blocks while the
        zygote is alive and still importing, at most `timeout_s`; returns None at once when it
        has exited. Once it has given up on a zygote that is still alive (said on stderr), later
        calls do not wait again: they take the socket if it has appeared since."""
        deadline = time.monotonic() + (0.0 if self.gave_up else timeout_s)
        while not self.socket.exists():
            if self.process.poll() is not None:
                return None
            if time.monotonic() >= deadline:
                if not self.gave_up:
                    self.gave_up = True
                    print(
                        f"[elaswave] the worker zygote was not ready within {timeout_s:g} s: "
                        "processes start cold",
                        file=sys.stderr,
                        flush=True,
                    )
                return None
            time.sleep(0.02)
        return self.socket

    def fork(
        self, argv: Sequence[str], env: Mapping[str, str], stdio: tuple[int, int, int]
    ) -> ZygoteChild | None:
        """`argv` forked from the zygote (a helper such as a rendezvous store: `LocalStore`),
        or None when it is not up within `ready`'s wait or declines: start it cold then. The
        child dies with this process (the zygote's lifeline) or with the zygote."""
        socket = self.ready()
        return ZygoteChild.fork(socket, argv, env, stdio) if socket is not None else None

    def stop(self) -> None:
        """After the agents: it kills any worker still running, then exits."""
        stop_process(self.process, signal.SIGTERM, 5.0)


@dataclass(frozen=True)
class RankSpec:
    rank: int  # < 0 for a spare: its rank comes with the plan that takes it in
    stage: int
    dp_rank: int
    node: int
    worker_id: str = ""  # default rank-R; a spare's is the Core's (its node's id and an index)

    @property
    def name(self) -> str:
        return self.worker_id or f"rank-{self.rank}"


@dataclass
class Agents:
    """One `elaswave agent` per rank, each launching `python script.py args`."""

    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    specs: dict[int, RankSpec] = field(default_factory=dict)

    def start(
        self,
        spec: RankSpec,
        job: str,
        core: str,
        socket_dir: Path,
        worker_cmd: list[str],
        env: Mapping[str, str],
        log: Path | None,
        zygote: Path | None = None,
    ) -> None:
        cmd = [
            sys.executable,
            "-m",
            "elaswave.cli",
            "agent",
            "--job",
            job,
            "--worker-id",
            spec.name,
            # a spare registers without a rank: the Core takes it in by a plan
            *(() if spec.rank < 0 else ("--rank", str(spec.rank))),
            *(() if spec.rank < 0 else ("--stage", str(spec.stage), "--dp-rank", str(spec.dp_rank))),
            "--core",
            core,
            "--metrics-socket",
            str(socket_dir / f"{spec.name}.sock"),
            "--log-level",
            "WARNING",
            *(() if zygote is None else ("--zygote", str(zygote))),
            "--",
            *worker_cmd,
        ]
        # SIGINT on the launcher's death: the agent's clean shutdown stops its worker and leaves.
        self.procs[spec.rank] = spawn(cmd, env, log, signal.SIGINT)
        self.specs[spec.rank] = spec

    def running(self) -> list[int]:
        return [r for r, p in self.procs.items() if p.poll() is None]

    def exit_codes(self) -> dict[int, int | None]:
        return {r: p.poll() for r, p in self.procs.items()}

    def wait_all(self, timeout_s: float) -> bool:
        """Block until every agent exited, at most `timeout_s`; True if they all did."""
        deadline = time.monotonic() + timeout_s
        while self.running():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGINT every agent still running (it stops its worker and says Leave), then SIGKILL."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGINT)
        if not self.wait_all(timeout_s):
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.kill()
            self.wait_all(5.0)


def _check(deadline: float, what: str, timeout_s: float) -> None:
    if time.monotonic() > deadline:
        raise LaunchError(f"timed out after {timeout_s:g} s waiting for {what}")
