"""The agent's one bidirectional ``AgentService.Connect`` stream to the leading Core.

``CoreLink.run`` keeps a stream up until shutdown: Register first (with the job token as
``authorization: Bearer`` metadata), then heartbeats every interval and every queued report;
Core commands go to the agent's callbacks. On any failure it reconnects across the Core list with
backoff (see ``agent.backoff``) and registers again. Reports that must not be lost
(``send_critical``: preemption, worker exit) are re-sent after every re-registration; the rest
(metrics, probes) sit in a bounded queue while no Core is connected, oldest dropped first.
A Core that answers nothing, not even an echo, for the silence bound is left only for another
Core that accepts this agent's registration meanwhile (make-before-break, ``_standby_taking_over``).
While none does (one answering "not leader; leader is <the silent one>": a pause, not a death)
the silent stream is kept, as the only Core an agent knows is waited out (``_silence_limit_s``),
and the others are asked again every silence bound. Dropping it would read, once that Core runs
again, as the worker's failure.
Every network wait is bounded (docs/architecture.md ("Promises and rules"): no unbounded retries or blocking calls).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import grpc.aio

from agent.backoff import AddressRotation, Backoff, parse_leader_hint
from agent.config import Address, AgentConfig, load_job_token
from agent.logs import log_event
from wire.v1 import agent_pb2, agent_pb2_grpc

OUTBOX_LIMIT = 1000
# The longest a stream to the only Core an agent knows is kept while the Core answers nothing:
# the Core's default heartbeat ceiling, past which the Core itself judges a silent worker lost.
LONE_CORE_PATIENCE_S = 30.0


# gRPC metadata key the worker's own credential is presented under when registering again
# (core_service.membership.WORKER_TOKEN_METADATA).
WORKER_TOKEN_METADATA = "x-elaswave-worker-token"


class StreamRefused(Exception):
    """The Core ended the stream or answered Register with something other than a RegisterAck."""


class CoreSilent(Exception):
    """The Core accepted the stream but has answered nothing, not even an echo, for too long."""


class MovedCore(Exception):  # noqa: N818 - a hand-over, not an error
    """Another Core accepted this agent's registration while the current one was silent: the
    stream to serve from now on (its channel and call are open, Register acknowledged)."""

    def __init__(self, address: Address, channel: grpc.aio.Channel, call: grpc.aio.StreamStreamCall) -> None:
        super().__init__(f"moved to core {address}")
        self.address, self.channel, self.call = address, channel, call


def _moved_by(task: asyncio.Task[None]) -> MovedCore | None:
    """The stream a finished writer task handed over, if that is how it ended."""
    if not task.done() or task.cancelled():
        return None
    exc = task.exception()
    return exc if isinstance(exc, MovedCore) else None


@dataclass(frozen=True)
class CommandHandlers:
    """What the agent does with each Core command; each runs to completion before the next."""

    report_now: Callable[[], Awaitable[None]]
    drain: Callable[[agent_pb2.Drain], Awaitable[None]]
    set_frequency: Callable[[agent_pb2.SetFrequency], Awaitable[None]]
    checkpoint: Callable[[agent_pb2.Checkpoint], Awaitable[None]] | None = None


class CoreLink:
    def __init__(
        self,
        config: AgentConfig,
        build_register: Callable[[], agent_pb2.Register],
        handlers: CommandHandlers,
        on_worker_token: Callable[[str], None] | None = None,
    ) -> None:
        """`on_worker_token`: called with the worker's credential from each RegisterAck (the
        agent hands it to its worker process for the executor's own calls)."""
        self._on_worker_token = on_worker_token
        self.worker_token: str | None = None  # presented on every later registration
        self._last_heard = 0.0  # monotonic: when the Core last sent anything on this stream
        self._give_up_after_s = config.silence_bound_s  # for the current stream: _silence_limit_s
        self._waiting_out = False  # silent past the bound, the stream kept (see _silence_limit_s)
        self._echo_asked_at: float | None = None  # monotonic: the first echo asked for, unanswered
        self._address: Address | None = None  # the Core of the current stream
        self._handover: MovedCore | None = None  # accepted by a probe cut short: the next session's
        self._next_standby_ask = 0.0  # monotonic: when a silent Core's peers may be asked again
        self._commands: asyncio.Queue[agent_pb2.ConnectResponse] = asyncio.Queue()
        self._config = config
        self._build_register = build_register
        self._handlers = handlers
        self._rotation = AddressRotation(config.cores)
        self._backoff = Backoff(config.backoff_initial_s, config.backoff_max_s)
        self._outbox: collections.deque[agent_pb2.ConnectRequest] = collections.deque(maxlen=OUTBOX_LIMIT)
        self._critical: collections.deque[agent_pb2.ConnectRequest] = collections.deque()
        self._critical_written: list[agent_pb2.ConnectRequest] = []
        self._wakeup = asyncio.Event()
        self._leave: agent_pb2.ConnectRequest | None = None
        self._left = asyncio.Event()
        self._leave_written = False  # Leave went out on the current stream
        self._stopping = False
        self._heartbeat_seq = 0
        self._beat_now = False
        self.sessions = 0
        self.last_ack: agent_pb2.RegisterAck | None = None

    # ---- what the agent calls -------------------------------------------------------------

    def send(self, request: agent_pb2.ConnectRequest) -> None:
        """Queue a report; dropped (oldest first) if no Core takes it before the queue fills."""
        if self._leave is None:
            self._outbox.append(request)
            self._wakeup.set()

    def send_critical(self, request: agent_pb2.ConnectRequest) -> None:
        """Queue a report that every Core this agent registers with from now on must see."""
        if self._leave is None:
            self._critical.append(request)
            self._wakeup.set()

    def heartbeat_now(self) -> None:
        """Write a heartbeat before any queued report, without waiting for the interval (ReportNow)."""
        self._beat_now = True
        self._wakeup.set()

    async def leave(self, reason: str, finished: bool = False, checkpoint: str = "") -> bool:
        """Send Leave after everything queued, close the stream; True when it was written in time.
        ``finished``: the worker completed its work (see ``agent_pb2.Leave.finished``);
        ``checkpoint``: the job's final checkpoint it named (``Leave.checkpoint``)."""
        leave = agent_pb2.Leave(reason=reason, finished=finished, checkpoint=checkpoint)
        self._leave = agent_pb2.ConnectRequest(leave=leave)
        self._wakeup.set()
        try:
            await asyncio.wait_for(self._left.wait(), self._config.leave_timeout_s)
        except TimeoutError:
            log_event(
                logging.WARNING, "leave_not_delivered", reason=reason, timeout_s=self._config.leave_timeout_s
            )
        self._stopping = True
        return self._left.is_set()

    async def run(self) -> None:
        """Connect, serve, reconnect, until Leave has been delivered or ``leave`` gave up."""
        commands = asyncio.create_task(self._run_commands())
        try:
            await self._connect_until_done()
        finally:
            commands.cancel()
            await asyncio.gather(commands, return_exceptions=True)
            if self._handover is not None:
                await self._discard(self._handover)
                self._handover = None

    async def _connect_until_done(self) -> None:
        while not self._stopping and not self._left.is_set():
            address = self._rotation.current()
            hint = None
            try:
                await self._session(address)
            except grpc.aio.AioRpcError as exc:
                hint = parse_leader_hint(exc.details() or "")
                log_event(
                    logging.WARNING,
                    "core_stream_failed",
                    core=self._address or address,
                    code=exc.code().name,
                    details=(exc.details() or "")
                    + (
                        " (TLS?)"
                        if self._config.tls is None and exc.code() == grpc.StatusCode.UNAVAILABLE
                        else ""
                    ),
                    leader_hint=hint or "",
                )
            except Exception as exc:  # whatever broke this stream, the link must keep trying
                log_event(
                    logging.WARNING,
                    "core_stream_failed",
                    core=self._address or address,
                    error=type(exc).__name__,
                    details=str(exc),
                )
            if self._stopping or self._left.is_set():
                return
            self._rotation.failed(hint)
            delay = self._backoff.next_delay()
            log_event(
                logging.INFO,
                "core_reconnect_wait",
                next_core=self._rotation.current(),
                delay_ms=round(delay * 1000, 1),
                failures=self._backoff.failures,
            )
            await asyncio.sleep(delay)

    # ---- one stream -----------------------------------------------------------------------

    def _channel(self, address: Address) -> grpc.aio.Channel:
        tls = self._config.tls
        if tls is None:
            return grpc.aio.insecure_channel(str(address))
        try:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=tls.ca.read_bytes(),
                private_key=tls.key.read_bytes() if tls.key else None,
                certificate_chain=tls.cert.read_bytes() if tls.cert else None,
            )
        except OSError as exc:
            raise ValueError(f"cannot read TLS file {exc.filename}: {exc.strerror}") from exc
        return grpc.aio.secure_channel(str(address), credentials)

    def _connect(self, address: Address) -> tuple[grpc.aio.Channel, grpc.aio.StreamStreamCall]:
        """A channel to `address` and the Connect stream on it, with this agent's credentials."""
        token = load_job_token(self._config.job_token_file)
        metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        if self.worker_token:
            metadata += ((WORKER_TOKEN_METADATA, self.worker_token),)
        channel = self._channel(address)
        return channel, agent_pb2_grpc.AgentServiceStub(channel).Connect(metadata=metadata)

    def _begin_stream(self, address: Address) -> None:
        """Reset what the link tracks per stream, for a stream to `address`."""
        self._address = address
        self._leave_written = False
        self._give_up_after_s, self._waiting_out = self._silence_limit_s(address), False
        self._echo_asked_at = None

    async def _session(self, address: Address) -> None:
        handover, self._handover = self._handover, None
        if handover is not None:  # registered by a probe whose stream then failed: adopt it
            address, channel, call = handover.address, handover.channel, handover.call
            self._rotation.moved_to(address)
            self._begin_stream(address)
        else:
            self._begin_stream(address)
            channel, call = self._connect(address)
        try:
            if handover is None:
                await self._register(call, address)
            while True:
                try:
                    await self._serve(call)
                    return
                except MovedCore as moved:  # the old stream goes only now that the new one is up
                    old = MovedCore(self._address or address, channel, call)
                    channel, call = moved.channel, moved.call
                    self._rotation.moved_to(moved.address)
                    self._begin_stream(moved.address)
                    log_event(logging.WARNING, "core_moved", core=moved.address, sessions=self.sessions)
                    await self._discard(old)
        finally:
            call.cancel()
            await channel.close()

    async def _standby_taking_over(self) -> MovedCore | None:
        """Asked while the current Core is silent past the bound: registers with each other Core
        in turn, and with a leader one of them names that the list spells otherwise, and returns
        the first that accepts (it leads now: a standby refuses). None when none accepts: each
        refused (one naming the silent Core as the leader ends the round: that one is paused,
        not gone) or did not answer within the register timeout."""
        current = self._address
        queue = [a for a in self._config.cores if a != current]
        tried: set[Address] = set()
        while queue:
            address = queue.pop(0)
            if address in tried or address == current:
                continue
            tried.add(address)
            outcome = await self._try_standby(address)
            if isinstance(outcome, MovedCore):
                return outcome
            if outcome == current:
                break
            if outcome is not None:
                queue.insert(0, outcome)  # the leader it named
        return None

    async def _try_standby(self, address: Address) -> MovedCore | Address | None:
        """One registration with `address`: MovedCore when it accepts, else the leader it named,
        else None. Left to finish when the caller is cancelled meanwhile (the old stream failed):
        a stream the Core has registered must not be dropped, it would read as the worker's
        failure, so an accepted one is kept for the next session (`_handover`)."""
        attempt = asyncio.ensure_future(self._attempt_registration(address))
        try:
            return await asyncio.shield(attempt)
        except asyncio.CancelledError:
            attempt.add_done_callback(self._keep_for_next_session)
            raise

    async def _attempt_registration(self, address: Address) -> MovedCore | Address | None:
        channel, call = self._connect(address)
        outcome: Address | None = None
        try:
            await self._register(call, address, timeout_s=self._config.register_timeout_s)
            return MovedCore(address, channel, call)
        except grpc.aio.AioRpcError as exc:
            outcome = parse_leader_hint(exc.details() or "")
            log_event(logging.INFO, "core_standby_refused", core=address, leader_hint=outcome or "")
        except (TimeoutError, StreamRefused) as exc:
            log_event(logging.INFO, "core_standby_refused", core=address, error=type(exc).__name__)
        except BaseException:
            await self._discard(MovedCore(address, channel, call))
            raise
        await self._discard(MovedCore(address, channel, call))
        return outcome

    def _keep_for_next_session(self, attempt: asyncio.Future[MovedCore | Address | None]) -> None:
        if attempt.cancelled() or attempt.exception() is not None:
            return
        moved = attempt.result()
        if isinstance(moved, MovedCore):
            if self._handover is not None:
                moved.call.cancel()  # one is enough; the Core supersedes an older session anyway
                return
            self._handover = moved

    @staticmethod
    async def _discard(stream: MovedCore) -> None:
        stream.call.cancel()
        await stream.channel.close()

    async def _register(
        self, call: grpc.aio.StreamStreamCall, address: Address, timeout_s: float | None = None
    ) -> None:
        # A lone Core's ack is waited for as long as its silence is (`_silence_limit_s`): one
        # stalled past the register timeout still registers the worker when it runs again, then
        # reads the stream this agent dropped meanwhile as the worker's failure (seen in a test
        # run: a spare marked LOST while it was joining, for the Core's 5 s pause).
        timeout = (
            max(self._config.register_timeout_s, self._give_up_after_s) if timeout_s is None else timeout_s
        )
        register = agent_pb2.ConnectRequest(register=self._build_register())
        await asyncio.wait_for(call.write(register), timeout)
        first = await asyncio.wait_for(call.read(), timeout)
        if first is grpc.aio.EOF:
            raise StreamRefused(f"core {address} closed the stream before acknowledging Register")
        if first.WhichOneof("body") != "ack":
            raise StreamRefused(f"core {address} answered Register with {first.WhichOneof('body')}, not ack")
        self.last_ack = first.ack
        self._last_heard = time.monotonic()
        if first.ack.worker_token and first.ack.worker_token != self.worker_token:
            self.worker_token = first.ack.worker_token
            if self._on_worker_token is not None:
                self._on_worker_token(first.ack.worker_token)
        self.sessions += 1
        self._backoff.reset()
        # Re-send what earlier Cores saw but this one may not have (a new leader, a restart).
        self._critical.extendleft(reversed(self._critical_written))
        self._critical_written.clear()
        log_event(
            logging.INFO,
            "core_registered",
            core=address,
            session=first.ack.session,
            core_id=first.ack.core_id,
            heartbeat_timeout_ms=first.ack.heartbeat_timeout_ms,
            sessions=self.sessions,
        )

    async def _serve(self, call: grpc.aio.StreamStreamCall) -> None:
        reader = asyncio.create_task(self._read_commands(call))
        writer = asyncio.create_task(self._write_reports(call))
        handed_over = False
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if self._leave_written:
                # Leave is out. The Core answers it by closing the stream once the departure is
                # stored; the reader can see that before the writer's half-close returns, or the
                # half-close can fail on it. Wait (bounded) for the close: shutting down must not
                # cancel the stream while Leave is in flight, and a clean close means delivered,
                # not a broken stream to reconnect (and re-register a departed worker) on.
                with contextlib.suppress(TimeoutError, grpc.aio.AioRpcError, StreamRefused):
                    await asyncio.wait_for(asyncio.shield(reader), self._config.rpc_timeout_s)
                closed = (
                    reader.done() and not reader.cancelled() and isinstance(reader.exception(), StreamRefused)
                )
                half_closed = writer.done() and not writer.cancelled() and writer.exception() is None
                if closed or half_closed:
                    self._left.set()
                    return
                done = {t for t in (reader, writer) if t.done()}
            moved = _moved_by(writer)
            if moved is not None:
                handed_over = True
                raise moved  # before the reader's error: the new stream is up, keep it
            for task in done:
                task.result()
        finally:
            for task in (reader, writer):
                task.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
            unused = _moved_by(writer)
            if unused is not None and not handed_over:
                await self._discard(unused)  # the job left, or the link stopped, meanwhile

    async def _read_commands(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                raise StreamRefused("core closed the stream")
            self._last_heard = time.monotonic()
            if self._waiting_out:
                self._waiting_out = False
                if self._address is not None:  # patience raised while no other Core led: reset
                    self._give_up_after_s = self._silence_limit_s(self._address)
                log_event(logging.INFO, "core_answers_again")
            self._echo_asked_at = None
            if response.WhichOneof("body") == "echo":
                continue  # the Core answers: that is all an echo says
            # Handlers run on their own task: one that takes a while (probes on a loaded host)
            # must not stop this loop from seeing that the Core answers.
            self._commands.put_nowait(response)

    async def _run_commands(self) -> None:
        """Runs the Core's commands in the order they came, each to completion before the next."""
        while True:
            await self._dispatch(await self._commands.get())

    async def _dispatch(self, response: agent_pb2.ConnectResponse) -> None:
        kind = response.WhichOneof("body")
        log_event(logging.INFO, "core_command", command=kind)
        try:
            if kind == "report_now":
                await self._handlers.report_now()
            elif kind == "drain":
                await self._handlers.drain(response.drain)
            elif kind == "set_frequency":
                await self._handlers.set_frequency(response.set_frequency)
            elif kind == "checkpoint" and self._handlers.checkpoint is not None:
                await self._handlers.checkpoint(response.checkpoint)
            elif kind == "rejected":
                # The Core refused one report; the stream stays up. A bug on our side: say it loudly.
                log_event(
                    logging.ERROR,
                    "core_rejected_report",
                    report=response.rejected.report,
                    reason=response.rejected.reason,
                )
            else:
                log_event(logging.WARNING, "core_command_ignored", command=kind)
        except Exception as exc:  # a failing handler must not take the stream down
            log_event(logging.ERROR, "core_command_failed", command=kind, error=repr(exc))

    async def _write_reports(self, call: grpc.aio.StreamStreamCall) -> None:
        interval = self._config.heartbeat_interval_s
        next_heartbeat = time.monotonic()
        while True:
            now = time.monotonic()
            silent = now - self._last_heard
            if silent > self._config.silence_bound_s and self._echo_unanswered(now):
                await self._silent_core(silent, now)
            give_up_at = self._give_up_after_s
            if silent > give_up_at and self._echo_unanswered(now):
                raise CoreSilent(
                    f"the Core answered nothing (not even an echo) for {silent:.1f} s (bound {give_up_at:g} s)"
                )
            if silent > self._config.silence_bound_s and not self._waiting_out:
                self._waiting_out = True
                log_event(
                    logging.WARNING,
                    "core_silent_waiting",
                    silent_s=round(silent, 1),
                    give_up_after_s=give_up_at,
                    reason="no other Core to move to, or none leads instead; dropping the stream would read as this worker's failure",
                )
            if self._critical:
                # Pop only once written: a stream that breaks mid-write must not lose it.
                request = self._critical[0]
                await self._write(call, request)
                self._critical_written.append(self._critical.popleft())
            elif now >= next_heartbeat or self._beat_now:
                self._beat_now = False
                # Halfway to the silence bound, ask the Core to answer this one.
                echo = silent >= self._config.silence_bound_s / 2
                await self._write(call, self._heartbeat(echo=echo))
                if echo and self._echo_asked_at is None:
                    self._echo_asked_at = time.monotonic()
                next_heartbeat = (
                    max(next_heartbeat + interval, now) if now >= next_heartbeat else next_heartbeat
                )
            elif self._outbox:
                await self._write(call, self._outbox.popleft())
            elif self._leave is not None:
                # Set before the write returns: the Core may store the departure and close the
                # stream before this coroutine resumes, and that close means delivered (see _serve).
                self._leave_written = True
                await self._write(call, self._leave)
                await asyncio.wait_for(call.done_writing(), self._config.rpc_timeout_s)
                log_event(logging.INFO, "leave_sent", reason=self._leave.leave.reason)
                return
            else:
                self._wakeup.clear()
                until_check = (give_up_at if self._waiting_out else self._config.silence_bound_s) - silent
                if self._echo_asked_at is not None:
                    until_check = max(until_check, self._echo_asked_at + self._echo_grace_s() - now)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._wakeup.wait(), max(0.0, min(next_heartbeat - now, until_check)) + 0.001
                    )

    async def _silent_core(self, silent: float, now: float) -> None:
        """The Core is silent past the bound with its echo unanswered: with other Cores, ask them
        (every silence bound) whether one leads now, raising MovedCore for the first that accepts;
        while none does, keep this stream as a lone Core's is kept (`_silence_limit_s`)."""
        if not any(a != self._address for a in self._config.cores) or now < self._next_standby_ask:
            return
        self._next_standby_ask = now + self._config.silence_bound_s
        moved = await self._standby_taking_over()
        if moved is not None:
            raise moved
        if self._give_up_after_s < LONE_CORE_PATIENCE_S:
            self._give_up_after_s = LONE_CORE_PATIENCE_S
            log_event(
                logging.WARNING,
                "core_silent_still_leading",
                core=self._address,
                silent_s=round(silent, 1),
                give_up_after_s=LONE_CORE_PATIENCE_S,
                reason="no other Core accepts this agent (none leads instead): the silent stream is kept",
            )

    def _echo_grace_s(self) -> float:
        """How long an echo asked for has to come back: half the silence bound, as long as the
        silence that made the agent ask."""
        return self._config.silence_bound_s / 2

    def _echo_unanswered(self, now: float) -> bool:
        """Whether an echo this agent asked for has gone unanswered for its grace. Silence alone
        is not enough: an agent whose own process stalled (a loaded host) wakes up to a long
        silence that says nothing about the Core, which has not been asked yet."""
        return self._echo_asked_at is not None and now - self._echo_asked_at >= self._echo_grace_s()

    def _silence_limit_s(self, address: Address) -> float:
        """How long the Core at `address` may answer nothing before its stream is dropped.

        With another Core to move to (a standby may have taken over from a hung leader), the
        silence bound. With none, dropping the stream gains nothing and costs the worker: a Core
        that was only stalled (a loaded machine, a paused process) reads the closed stream as this
        worker's failure when it runs again. So a lone Core's stream is kept, asking for echoes,
        until LONE_CORE_PATIENCE_S: past that even the Core would call the worker lost, and the
        connection is likely half-open (the Core's host vanished), so reconnecting is right."""
        bound = self._config.silence_bound_s
        if any(other != address for other in self._config.cores):
            return bound
        return max(LONE_CORE_PATIENCE_S, bound)

    def _heartbeat(self, echo: bool = False) -> agent_pb2.ConnectRequest:
        self._heartbeat_seq += 1
        return agent_pb2.ConnectRequest(
            heartbeat=agent_pb2.Heartbeat(seq=self._heartbeat_seq, sent_unix=time.time(), echo=echo)
        )

    async def _write(self, call: grpc.aio.StreamStreamCall, request: agent_pb2.ConnectRequest) -> None:
        """Write one request, bounded by the RPC timeout; to a lone Core, by what is left of its
        silence's bound when that is longer, as every other wait on a lone Core is
        (`_silence_limit_s`). In a CI run a write failed on the 2 s timeout during a 7 s stall of
        the Core, and the dropped stream read as the rank's failure; why that write was slow is
        not known (1 MB of reports to a Core that reads nothing does not hold a write here)."""
        timeout = self._config.rpc_timeout_s
        if self._give_up_after_s > self._config.silence_bound_s:  # no other Core to move to
            silent = time.monotonic() - self._last_heard
            timeout = max(timeout, self._give_up_after_s - silent)
        await asyncio.wait_for(call.write(request), timeout)
