"""The agent daemon: one asyncio process beside one training worker (docs/architecture.md ("Processes", "The Core's decisions", "Promises and rules")).

It watches the worker (exit reported the moment it happens), probes host, process, devices and
interconnect, forwards the executor's step metrics, relays preemption (SIGTERM, notice file) and
holds its etcd liveness lease, all over one stream to the leading Core (``agent.core_link``).

Shutdown, whatever the cause, ends with a Leave report: SIGINT stops a launched worker (SIGTERM,
then SIGKILL after the grace) and leaves; SIGTERM first reports a PreemptionNotice, forwards
SIGTERM to a launched worker (with a drain notice in its control file first, so a worker can
tell a reported preemption from a plain stop), waits for it up to the grace, then leaves; a
worker that fails on its own (non-zero status or a signal) is reported as WorkerExit, one that exits 0 only leaves
(also after a preemption: the Core-driven worker exits 0 once the Core's plan has let it go at a
step boundary, a planned departure the Core records as LEFT, not a failure), and the agent exits
with the worker's exit status.

Core commands:

- SetFrequency: applied by the clock controller chosen at start (``agent.frequency``); the
  outcome (applied, or refused/failed with the reason, clock unchanged) goes into a device probe
  sent at once, and every device probe names the controller and the clock, so the Core always
  shows the applied frequency. The clock is also published in the worker's control file.
- Drain: the drain notice goes into the worker's control file (``wire.local_protocol``) so the worker
  stops at its next step boundary; a worker still running after ``--drain-grace`` (or at the
  Drain deadline, if sooner) gets SIGTERM, and SIGKILL ``--grace`` later. The agent reports
  "draining" at once and, once the worker is gone, leaves with a Leave that says how it ended:
  a drained worker that exits 0 or by the agent's signal is a planned departure, not a
  WorkerExit (which the Core takes as a failure). The agent never launches a worker again while
  draining. A second Drain only repeats the report.
- ReportNow: a heartbeat ahead of the queue, every probe, memory, and the last step metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Coroutine
from typing import Any

from agent import probes
from agent.config import TOKEN_ENV, AgentConfig, load_job_token
from agent.core_link import CommandHandlers, CoreLink
from agent.devices import DeviceSet
from agent.frequency import FrequencyController, FrequencyFailed, FrequencyRefused, select_controller
from agent.lease import AliveLease
from agent.local_metrics import MetricsReceiver
from agent.logs import log_event
from agent.preemption import notice, watch_notice_file
from agent.worker import ExitStatus, ForeignWorker, ForkedWorker, LaunchedWorker, Worker
from wire.local_protocol import (
    CONTROL_ENV,
    EXIT_CODE_UNKNOWN,
    FINISHED_ENV,
    SOCKET_ENV,
    CheckpointRequest,
    ControlFile,
    DrainNotice,
    FrequencyState,
    finished_checkpoint,
    finished_path,
)
from wire.v1 import agent_pb2
from wire.worker_env import WORKER_TOKEN_FILE_ENV


def agent_exit_code(status: ExitStatus | None) -> int:
    """The agent's own exit status: the worker's, shell-style (128 + signal) when it was killed."""
    if status is None:
        return 0
    if status.exit_code == EXIT_CODE_UNKNOWN:
        return 1
    return 128 - status.exit_code if status.exit_code < 0 else status.exit_code


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.started_unix = time.time()
        self.host = socket.gethostname()
        self.draining: agent_pb2.Drain | None = None
        self._signalled_worker = False  # the agent itself sent the worker SIGTERM/SIGKILL
        self.frequency: FrequencyController | None = None
        self._frequency_why = "not selected yet"
        self._last_set_frequency = ""  # outcome of the latest SetFrequency, for the device probe
        self.control = ControlFile(config.control_path)
        self._last_step: agent_pb2.StepMetrics | None = None
        self._worker: Worker | None = None
        self._worker_status: ExitStatus | None = None
        self._worker_done = asyncio.Event()
        self._devices: DeviceSet | None = None
        self._stage, self._dp_rank = config.stage, config.dp_rank
        self._shutdown_reason: str | None = None
        self._shutdown = asyncio.Event()
        self._preempted = False
        self._worker_finished = False  # the worker said its work is complete, then exited 0
        self._tasks: list[asyncio.Task[None]] = []
        self.link = CoreLink(
            config,
            self._register_message,
            CommandHandlers(self._on_report_now, self._on_drain, self._on_set_frequency, self._on_checkpoint),
            on_worker_token=self._store_worker_token,
        )
        self.worker_token_file = config.control_path.with_name(config.control_path.name + ".worker-token")
        self.metrics = MetricsReceiver(config.socket_path, self._on_step_metrics)
        self.lease = (
            AliveLease(
                config.etcd, config.alive_key, self._lease_value, config.lease_ttl_s, config.rpc_timeout_s
            )
            if config.etcd
            else None
        )

    async def run(self) -> int:
        """Run until shutdown; returns the agent's exit status (see ``agent_exit_code``)."""
        if load_job_token(self.config.job_token_file) is None:  # a bad token file raises here, at start
            log_event(
                logging.WARNING,
                "no_job_token",
                why=f"neither --job-token-file nor ${TOKEN_ENV} is set; "
                "a Core with authentication will refuse this agent",
            )
        probes.prime_cpu_percent()
        self._install_signal_handlers()
        await self.metrics.start()
        try:
            self._devices = await asyncio.to_thread(DeviceSet.discover)
            await asyncio.to_thread(self._select_frequency_controller)  # before the worker reads the file
            self._worker = await self._start_worker()
            log_event(
                logging.INFO,
                "agent_started",
                job=self.config.job,
                worker_id=self.config.worker_id,
                worker_pid=self._worker.pid,
                launched=self._worker.launched,
                devices=",".join(f"{d.kind}:{d.index}" for d in self._devices.devices),
                cores=",".join(map(str, self.config.cores)),
                etcd=self.config.etcd or "",
            )
            self._spawn(self.link.run(), self._watch_worker(), self._probe_loop())
            if self.lease is not None:
                self._spawn(self.lease.run())
            if self.config.notice_file is not None:
                self._spawn(
                    watch_notice_file(
                        self.config.notice_file,
                        self.config.notice_poll_s,
                        self.config.grace_s,
                        time.time,
                        self._on_notice_file,
                    )
                )
            await self._shutdown.wait()
            await self._leave()
        finally:
            await self._cancel_tasks()
            self.metrics.close()
            self.control.remove()
            self.worker_token_file.unlink(missing_ok=True)
        return agent_exit_code(self._worker_status)

    def _store_worker_token(self, token: str) -> None:
        """The worker's own credential from the Core, for its executor's acks and failure reports
        (wire.worker_env.WORKER_TOKEN_FILE_ENV): written atomically, readable by this user only."""
        tmp = self.worker_token_file.with_name(self.worker_token_file.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(token)
        tmp.replace(self.worker_token_file)

    def _select_frequency_controller(self) -> None:
        """Pick the clock controller (ValueError when an explicit one cannot run) and say which."""
        assert self._devices is not None
        npu_ids = [d.index for d in self._devices.devices if d.kind == "npu"]
        self.frequency, self._frequency_why = select_controller(
            self.config.frequency_controller,
            self._devices.kind,
            self.config.clock_range,
            npu_ids,
            self.config.npu_smi_set,
        )
        if self.frequency is None:
            log_event(logging.WARNING, "frequency_controller", controller="none", why=self._frequency_why)
            self.control.publish()
            return
        clock = self.frequency.clock_range()
        log_event(
            logging.INFO,
            "frequency_controller",
            controller=self.frequency.name,
            range=str(clock),
            current_mhz=self.frequency.current_mhz(),
            why=self._frequency_why,
            control_file=self.control.path,
        )
        # The worker starts at the current clock (the nominal one for the simulated controller).
        self.control.set_frequency(
            FrequencyState(
                self.frequency.name,
                self.frequency.current_mhz(),
                clock.nominal_mhz,
                clock.min_mhz,
                clock.max_mhz,
            )
        )

    # ---- worker -----------------------------------------------------------------------------

    async def _start_worker(self) -> Worker:
        if self.draining is not None:  # a drained agent never (re)launches its worker
            raise ValueError("draining: not launching the worker")
        if self.config.worker_pid is not None:
            return ForeignWorker(self.config.worker_pid)
        finished = finished_path(self.control.path)
        finished.unlink(missing_ok=True)  # a previous run's word is not this worker's
        env = dict(
            os.environ,
            **{
                SOCKET_ENV: str(self.config.socket_path),
                CONTROL_ENV: str(self.control.path),
                FINISHED_ENV: str(finished),
                "ELASWAVE_JOB": self.config.job,
                "ELASWAVE_WORKER_ID": self.config.worker_id,
                WORKER_TOKEN_FILE_ENV: str(self.worker_token_file),
            },
        )
        if self.config.worker_zygote is not None:
            forked = await ForkedWorker.start(self.config.worker_zygote, self.config.worker_command, env)
            if forked is not None:
                return forked
        return await LaunchedWorker.start(self.config.worker_command, env)

    def _drained_exit(self, status: ExitStatus) -> bool:
        """A worker that ended because of a Drain: exit 0, or the signal the agent sent it."""
        if self.draining is None:
            return False
        by_agent = self._signalled_worker and status.exit_code in (-signal.SIGTERM, -signal.SIGKILL)
        # A --pid worker reaped by its own parent leaves no status; it ended after the notice.
        return status.exit_code in (0, EXIT_CODE_UNKNOWN) or by_agent

    async def _watch_worker(self) -> None:
        assert self._worker is not None
        status = await self._worker.wait()
        self._worker_status = status
        if self._drained_exit(status):
            # A planned departure: the Leave carries the exit; a WorkerExit would read as a failure.
            assert self.draining is not None
            log_event(
                logging.INFO,
                "worker_exit",
                pid=self._worker.pid,
                exit_code=status.exit_code,
                detail=status.detail,
                drained=True,
            )
            self._worker_done.set()
            self._request_shutdown(
                f"drained ({self.draining.reason}): worker {self._worker.pid} {status.detail}"
            )
            return
        if status.exit_code == 0:
            # A clean departure, not a fail-stop, so the Core records LEFT, not LOST: the worker
            # completed its work (it created the finished file: nothing to re-plan for), stopped
            # after a preemption notice, or left a layout that no longer holds it.
            self._worker_finished = not self._preempted and finished_path(self.control.path).exists()
            log_event(
                logging.INFO,
                "worker_exit",
                pid=self._worker.pid,
                exit_code=0,
                detail=status.detail,
                preempted=self._preempted,
                finished=self._worker_finished,
            )
            self._worker_done.set()
            if self._preempted:
                how = f"preempted (SIGTERM): worker {self._worker.pid} {status.detail}"
            elif self._worker_finished:
                how = f"worker {self._worker.pid} finished its work ({status.detail})"
            else:
                how = f"worker {self._worker.pid} left ({status.detail})"
            self._request_shutdown(how)
            return
        self.link.send_critical(
            agent_pb2.ConnectRequest(
                worker_exit=agent_pb2.WorkerExit(exit_code=status.exit_code, detail=status.detail)
            )
        )
        log_event(
            logging.WARNING,
            "worker_exit",
            pid=self._worker.pid,
            exit_code=status.exit_code,
            detail=status.detail,
        )
        self._worker_done.set()
        cause = "preempted (SIGTERM); " if self._preempted else ""
        self._request_shutdown(f"{cause}worker {self._worker.pid} {status.detail}")

    async def _wait_worker(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._worker_done.wait(), max(timeout_s, 0.0))
        return self._worker_done.is_set()

    async def _stop_launched_worker(self, deadline_unix: float) -> None:
        """SIGTERM a launched worker (if not done already), SIGKILL it at the deadline."""
        worker = self._worker
        if worker is None or not worker.launched or self._worker_done.is_set():
            return
        await self._terminate(worker, deadline_unix)

    async def _terminate(self, worker: Worker, kill_at_unix: float) -> None:
        self._signalled_worker = True
        worker.send_signal(signal.SIGTERM)
        if not await self._wait_worker(kill_at_unix - time.time()):
            log_event(logging.WARNING, "worker_kill_after_grace", pid=worker.pid)
            worker.send_signal(signal.SIGKILL)
            await self._wait_worker(self.config.rpc_timeout_s)

    # ---- signals and shutdown ---------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        loop.add_signal_handler(signal.SIGINT, self._request_shutdown, "SIGINT")

    def _on_sigterm(self) -> None:
        if self._preempted:
            return
        self._preempted = True
        now = time.time()
        deadline = now + self.config.grace_s
        log_event(logging.WARNING, "preemption_notice", source="sigterm", deadline_unix=deadline)
        self.link.send_critical(notice("sigterm", deadline))
        self._spawn(self._finish_preemption(deadline))
        # Written now, before that task forwards SIGTERM: the notice tells a worker that can wait
        # for the Core's plan (executor.worker) that its departure was reported (a plain stop has none).
        try:
            self.control.set_drain(DrainNotice("preempted (SIGTERM)", deadline, now))
        except OSError as exc:  # the worker then stops as on a plain SIGTERM; the report is sent anyway
            log_event(logging.WARNING, "control_file_unwritable", path=self.control.path, error=str(exc))

    async def _finish_preemption(self, deadline_unix: float) -> None:
        if self._worker is not None and self._worker.launched:
            await self._stop_launched_worker(deadline_unix)
        else:
            await self._wait_worker(deadline_unix - time.time())
        self._request_shutdown("preempted (SIGTERM)")

    def _on_notice_file(self, deadline_unix: float) -> None:
        self.link.send_critical(notice("notice-file", deadline_unix))

    def _request_shutdown(self, reason: str) -> None:
        if self._shutdown_reason is None:
            self._shutdown_reason = reason
            log_event(logging.INFO, "agent_shutdown", reason=reason)
        self._shutdown.set()

    async def _leave(self) -> None:
        reason = self._shutdown_reason or "shutdown"
        # SIGINT or an internal error: the launched worker goes first, gracefully (no-op once it exited).
        await self._stop_launched_worker(time.time() + self.config.grace_s)
        self.metrics.close()
        checkpoint = finished_checkpoint(finished_path(self.control.path)) if self._worker_finished else ""
        await self.link.leave(reason, finished=self._worker_finished, checkpoint=checkpoint)
        if self.lease is not None:
            await self.lease.revoke()

    def _spawn(self, *coroutines: Coroutine[Any, Any, None]) -> None:
        for coroutine in coroutines:
            task = asyncio.create_task(coroutine)
            task.add_done_callback(self._on_task_done)
            self._tasks.append(task)

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        # A part of the agent that dies must not leave a half-working agent behind: stop loudly.
        if not task.cancelled() and task.exception() is not None:
            log_event(
                logging.ERROR,
                "agent_task_failed",
                task=getattr(task.get_coro(), "__qualname__", repr(task.get_coro())),
                error=repr(task.exception()),
            )
            self._request_shutdown(f"internal error: {task.exception()!r}")

    async def _cancel_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- reports ----------------------------------------------------------------------------

    def _register_message(self) -> agent_pb2.Register:
        assert self._devices is not None and self._worker is not None
        return agent_pb2.Register(
            job=self.config.job,
            worker_id=self.config.worker_id,
            host=self.host,
            pid=self._worker.pid,
            devices=self._devices.devices,
            stage=self._stage,
            dp_rank=self._dp_rank,
            rank=self.config.rank,
            heartbeat_interval_ms=round(self.config.heartbeat_interval_s * 1000),
            holds_own_lease=self.lease is not None,
        )

    def _lease_value(self) -> dict[str, object]:
        worker_pid = self._worker.pid if self._worker is not None else 0
        return {
            "host": self.host,
            "pid": worker_pid,
            "agent_pid": os.getpid(),
            "agent_start_unix": self.started_unix,
            "worker_id": self.config.worker_id,
        }

    def _on_step_metrics(self, metrics: agent_pb2.StepMetrics) -> None:
        # The latest placement goes into the next Register (after a reconnect).
        self._stage, self._dp_rank = metrics.stage, metrics.dp_rank
        self._last_step = metrics
        self.link.send(agent_pb2.ConnectRequest(step=metrics))

    async def _probe_loop(self) -> None:
        while True:
            try:
                await self._report()
            except Exception as exc:  # a probe that breaks is logged; the next round tries again
                log_event(logging.ERROR, "report_failed", error=repr(exc))
            await asyncio.sleep(self.config.probe_interval_s)

    async def _report(self) -> None:
        """Every probe and the memory report, queued at once."""
        assert self._devices is not None
        usage, device_probe = await asyncio.to_thread(probes.memory_usage, self._worker, self._devices)
        device_probe.detail += f"; {await asyncio.to_thread(self._clock_detail)}"
        process_probe = probes.process_probe(self._worker)
        if self.draining is not None:
            process_probe.detail += f"; {self._draining_detail()}"
        found = [probes.host_probe(), process_probe, device_probe]
        found += await asyncio.gather(
            *(probes.interconnect_probe(peer, self.config.peer_timeout_s) for peer in self.config.peers)
        )
        self.link.send(agent_pb2.ConnectRequest(memory=usage))
        for probe in found:
            self.link.send(agent_pb2.ConnectRequest(probe=probe))

    def _clock_detail(self) -> str:
        """Which clock controller runs and at what clock; appended to every device probe."""
        if self.frequency is None:
            text = f"clock controller none ({self._frequency_why})"
        else:
            try:
                current = f"{self.frequency.current_mhz()} MHz"
            except Exception as exc:  # a clock that cannot be read is reported, not raised
                current = f"unreadable ({exc})"
            text = (
                f"clock controller {self.frequency.name} at {current} (range {self.frequency.clock_range()})"
            )
        return f"{text}; {self._last_set_frequency}" if self._last_set_frequency else text

    def _draining_detail(self) -> str:
        assert self.draining is not None
        return f"draining: {self.draining.reason} (deadline {self.draining.deadline_unix:.3f})"

    async def _on_report_now(self) -> None:
        """ReportNow: heartbeat ahead of the queue, then probes, memory and the last step."""
        self.link.heartbeat_now()
        await self._report()
        if self._last_step is not None:
            self.link.send(agent_pb2.ConnectRequest(step=self._last_step))

    async def _on_drain(self, drain: agent_pb2.Drain) -> None:
        if self.draining is not None:  # idempotent: report again, change nothing
            log_event(logging.INFO, "drain_repeated", reason=drain.reason, first_reason=self.draining.reason)
            await self._report()
            return
        self.draining = drain
        now = time.time()
        log_event(
            logging.WARNING,
            "drain",
            reason=drain.reason,
            deadline_unix=drain.deadline_unix,
            drain_grace_s=self.config.drain_grace_s,
        )
        await asyncio.to_thread(self.control.set_drain, DrainNotice(drain.reason, drain.deadline_unix, now))
        await self._report()
        self._spawn(self._finish_drain(now))

    async def _finish_drain(self, started_unix: float) -> None:
        """Give the worker --drain-grace to stop at a step boundary, then SIGTERM, then SIGKILL."""
        assert self.draining is not None and self._worker is not None
        term_at = started_unix + self.config.drain_grace_s
        if self.draining.deadline_unix > started_unix:
            term_at = min(term_at, self.draining.deadline_unix)
        if not await self._wait_worker(term_at - time.time()):
            log_event(logging.WARNING, "drain_sigterm", pid=self._worker.pid, why="worker still running")
            await self._terminate(self._worker, time.time() + self.config.grace_s)

    async def _on_checkpoint(self, request: agent_pb2.Checkpoint) -> None:
        """Relay the Core's checkpoint request to the worker through the control file."""
        log_event(logging.INFO, "checkpoint_request", after_step=request.after_step, stop=request.stop)
        notice = CheckpointRequest(int(request.after_step), bool(request.stop), time.time())
        await asyncio.to_thread(self.control.set_checkpoint, notice)

    async def _on_set_frequency(self, request: agent_pb2.SetFrequency) -> None:
        """Apply the clock, or say why not; the outcome goes to the Core in a report at once."""
        outcome = await asyncio.to_thread(self._apply_frequency, request.mhz)
        self._last_set_frequency = outcome
        await self._report()

    def _apply_frequency(self, mhz: int) -> str:
        asked = f"SetFrequency {mhz} MHz" + (" (restore default)" if mhz == 0 else "")
        if self.frequency is None:
            outcome = f"{asked} not applied: no clock controller ({self._frequency_why})"
        else:
            try:
                state = self.frequency.apply(mhz)
            except FrequencyRefused as exc:
                outcome = f"{asked} refused: {exc}; clock unchanged"
            except FrequencyFailed as exc:
                outcome = f"{asked} failed: {exc}"
            else:
                self.control.set_frequency(state)
                outcome = (
                    f"{asked} applied: {state.controller} {state.mhz} MHz "
                    f"(factor {state.factor:.4f} of nominal {state.nominal_mhz})"
                )
        log_event(logging.INFO, "set_frequency", mhz=mhz, outcome=outcome)
        return outcome
