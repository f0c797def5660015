"""The executor's link to the Core's `ExecutorService` (docs/architecture.md ("Processes", "The central idea")): plans by epoch, phase acks.

A training process follows its job's plans through one background subscription
(`SubscribePlans`, a server stream fenced by epoch) and answers each plan with phase acks
(`AckPlanPhase`). The subscription survives a Core failover: on `UNAVAILABLE` (a standby, or a
Core that died) it moves to the Core a standby names as leader ("not leader; leader is
<host:port>"), else to the next address of the list (`ELASWAVE_CORE` holds every Core's), with
bounded exponential backoff, and resumes after the newest epoch it already holds, so no plan is
missed or seen twice.

Blocking behaviour, stated per call: `wait_plan` blocks at most its `timeout_s`; `ack` and
`report_peer_failure` block at most `rpc_timeout_s` and never raise on a transport error (the
Core hears about the worker through its agent anyway); `close` joins the subscription thread
for at most `rpc_timeout_s`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from planners.layout import Plan
from planners.reprotect import ReprotectWindow
from wire import core_tls
from wire.v1 import executor_pb2, executor_pb2_grpc
from wire.worker_env import WORKER_TOKEN_FILE_ENV

log = logging.getLogger("elaswave.executor.plans")

PHASES = {
    "RECEIVED": executor_pb2.PLAN_PHASE_RECEIVED,
    "PAUSED": executor_pb2.PLAN_PHASE_PAUSED,
    "APPLIED": executor_pb2.PLAN_PHASE_APPLIED,
    "RESUMED": executor_pb2.PLAN_PHASE_RESUMED,
    "FAILED": executor_pb2.PLAN_PHASE_FAILED,
    # the plan's re-protection window closed (not a step of the apply: sent after RESUMED)
    "REPROTECTED": executor_pb2.PLAN_PHASE_REPROTECTED,
}
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.05, 2.0
_LEADER_HINT = re.compile(r"leader is\s+(\[[^\]]+\]:\d+|[^\s;,:/]+:\d+)")


FAILURES = {
    "NOT_APPLICABLE": executor_pb2.PLAN_FAILURE_NOT_APPLICABLE,
    "INTERRUPTED": executor_pb2.PLAN_FAILURE_INTERRUPTED,
}


class PlanTimeout(TimeoutError):
    """No plan newer than the executor's epoch arrived in time."""


class PlanClient:
    """One worker's subscription to its job's plans, and its acks."""

    def __init__(
        self,
        addresses: Sequence[str],
        job: str,
        worker_id: str,
        token: str,
        rpc_timeout_s: float = 2.0,
        on_plan: Callable[[Plan], None] | None = None,
        tls: core_tls.CoreTls | None = None,
    ) -> None:
        """`tls`: the files to reach a TLS Core with; by default those the environment names
        (wire.core_tls: the launcher hands its own to every worker)."""
        if not addresses:
            raise ValueError("at least one Core address (host:port) is needed")
        if rpc_timeout_s <= 0:
            raise ValueError(f"rpc_timeout_s must be positive, got {rpc_timeout_s}")
        self.addresses, self.job, self.worker_id = list(addresses), job, worker_id
        self.rpc_timeout_s = rpc_timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),)
        # The worker's own credential (its agent writes it once the Core issues it): acks and
        # failure reports speak for this worker only, so the Core wants it, not the job token.
        self._worker_token_file = os.environ.get(WORKER_TOKEN_FILE_ENV)
        self._tls = tls if tls is not None else core_tls.from_env()
        self._on_plan = on_plan
        self._newest: Plan | None = None
        self._floor = 0  # the epoch the executor already runs: plans at or below it are old
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._address_index = 0
        self._channel: grpc.Channel | None = None
        self._call: grpc.Future | None = None
        self._thread: threading.Thread | None = None

    # ----- subscription --------------------------------------------------------------------
    def start(self, after_epoch: int) -> None:
        """Subscribe in a background thread to plans newer than `after_epoch`. Never blocks."""
        if after_epoch < 0:
            raise ValueError(f"after_epoch must be >= 0, got {after_epoch}")
        with self._cond:
            self._floor = after_epoch
        self._thread = threading.Thread(target=self._follow, name="elaswave-plans", daemon=True)
        self._thread.start()

    def newest_epoch(self) -> int:
        with self._cond:
            return self._floor if self._newest is None else max(self._floor, self._newest.epoch)

    def wait_plan(self, after_epoch: int, timeout_s: float) -> Plan:
        """Block (at most `timeout_s`) until a plan with epoch > `after_epoch` is known; the newest
        one wins, so an executor that missed several epochs jumps straight to the latest layout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._newest is None or self._newest.epoch <= after_epoch:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PlanTimeout(
                        f"no plan newer than epoch {after_epoch} from the Core within {timeout_s}s"
                    )
                self._cond.wait(left)
            return self._newest

    def _follow(self) -> None:
        backoff = BACKOFF_FIRST_S
        while not self._stop.is_set():
            address = self.addresses[self._address_index % len(self.addresses)]
            try:
                self._stream_from(address)
                backoff = BACKOFF_FIRST_S
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                code = exc.code() if isinstance(exc, grpc.Call) else None
                if code in (
                    grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED,
                    grpc.StatusCode.NOT_FOUND,
                    grpc.StatusCode.INVALID_ARGUMENT,
                ):
                    log.error("plan subscription refused by %s: %s", address, exc.details())
                    return  # retrying cannot help; the training loop times out waiting for a plan
                hint = core_tls.plaintext_hint(self._tls) if code == grpc.StatusCode.UNAVAILABLE else ""
                log.warning(
                    "plan subscription to %s ended (%s); next address in %.2fs.%s",
                    address,
                    code,
                    backoff,
                    hint,
                )
                self._next_core(exc.details() if isinstance(exc, grpc.Call) else None)
            self._stop.wait(backoff)
            backoff = min(BACKOFF_MAX_S, backoff * 2)

    def _stream_from(self, address: str) -> None:
        self._channel = core_tls.channel(address, self._tls)
        try:
            stub = executor_pb2_grpc.ExecutorServiceStub(self._channel)
            request = executor_pb2.SubscribePlansRequest(
                job=self.job, worker_id=self.worker_id, after_epoch=self.newest_epoch()
            )
            # Its own credential where the agent gave one: a spare's subscription with it tells the
            # Core the worker is ready to join (the job token reads plans too, but speaks for no one).
            self._call = stub.SubscribePlans(request, metadata=self._worker_metadata())
            for response in self._call:
                self._publish(response.plan)
        finally:
            self._channel.close()

    def _publish(self, proto: object) -> None:
        try:
            plan = Plan.from_json(proto.plan_json)  # type: ignore[attr-defined]
        except ValueError as exc:
            log.error("plan epoch %s from the Core cannot be read: %s", proto.epoch, exc)  # type: ignore[attr-defined]
            return  # the wait for a plan times out and says so
        if plan.epoch != int(proto.epoch):  # type: ignore[attr-defined]
            log.error("plan body says epoch %d, the stream says %d: ignored", plan.epoch, proto.epoch)  # type: ignore[attr-defined]
            return
        with self._cond:
            if plan.epoch <= self._floor or (self._newest is not None and plan.epoch <= self._newest.epoch):
                return  # fenced: never go back to an older epoch
            self._newest = plan
            self._cond.notify_all()
        log.info("plan epoch %d received: %s", plan.epoch, "; ".join(plan.reasons))
        if self._on_plan is not None:
            self._on_plan(plan)

    # ----- acks ----------------------------------------------------------------------------
    def ack(
        self,
        epoch: int,
        phase: str,
        seconds: float,
        reason: str = "",
        failure: str = "",
        steps_replayed: int = 0,
        window: ReprotectWindow | None = None,
    ) -> bool:
        """Acknowledge `phase` of plan `epoch`; True when the Core took it (bounded, never raises).
        A FAILED phase names its `failure` (a key of FAILURES) and `reason`; a RESUMED after a
        restore says how many committed steps it went back over (`steps_replayed`); APPLIED and
        REPROTECTED carry the plan's re-protection `window` (open, then closed)."""
        request = executor_pb2.AckPlanPhaseRequest(
            job=self.job,
            worker_id=self.worker_id,
            epoch=epoch,
            phase=PHASES[phase],
            phase_time_s=max(0.0, seconds),
            failure_reason=reason,
            failure=FAILURES[failure] if failure else executor_pb2.PLAN_FAILURE_UNSPECIFIED,
            steps_replayed=steps_replayed,
        )
        if window is not None:
            request.backup_window.CopyFrom(window_message(window))
        return self._unary("AckPlanPhase", request)

    def report_peer_failure(self, peer_rank: int, step: int, operation: str, error: str) -> bool:
        """Tell the Core a collective failed because of `peer_rank` (-1: no peer could be named;
        the Core then replays the step on the same layout). Bounded, never raises."""
        request = executor_pb2.ReportPeerFailureRequest(
            job=self.job,
            worker_id=self.worker_id,
            peer_rank=peer_rank,
            step=step,
            operation=operation,
            error=error[:500],
        )
        return self._unary("ReportPeerFailure", request)

    def job_stores(self) -> list[str] | None:
        """The job's store list as the leading Core holds it ("host:port" each, the workers'
        order; empty when no launcher reports one), or None when no Core answered. Bounded by
        the RPC timeout, never raises."""
        request = executor_pb2.GetJobStoresRequest(job=self.job, worker_id=self.worker_id)
        answer = self._answer("GetJobStores", request)
        return None if answer is None else list(answer.stores)

    def _unary(self, method: str, request: object) -> bool:
        return self._answer(method, request) is not None

    def _answer(self, method: str, request: object) -> Any:
        """The answer of the first Core (leader hints followed) that takes `request`, or None."""
        deadline = time.monotonic() + self.rpc_timeout_s
        for attempt in range(len(self.addresses)):
            address = self.addresses[(self._address_index + attempt) % len(self.addresses)]
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with core_tls.channel(address, self._tls) as channel:
                stub = executor_pb2_grpc.ExecutorServiceStub(channel)
                try:
                    return getattr(stub, method)(request, metadata=self._worker_metadata(), timeout=left)
                except grpc.RpcError as exc:
                    code = exc.code() if isinstance(exc, grpc.Call) else None
                    # A newer plan superseded this one: the Core refuses acks of old epochs.
                    level = logging.INFO if code == grpc.StatusCode.FAILED_PRECONDITION else logging.WARNING
                    log.log(
                        level,
                        "%s to %s failed: %s %s",
                        method,
                        address,
                        code,
                        exc.details() if isinstance(exc, grpc.Call) else exc,
                    )
                    if code != grpc.StatusCode.UNAVAILABLE:
                        return None
        return None

    def _next_core(self, details: str | None) -> None:
        """After a refusal or a broken stream: the leader a standby named, else the next Core."""
        match = _LEADER_HINT.search(details or "")
        hint = match.group(1) if match else None
        current = self.addresses[self._address_index % len(self.addresses)]
        if hint is None or hint == current:
            self._address_index += 1
            return
        if hint not in self.addresses:
            self.addresses.append(hint)  # a leader the launcher did not know of (a new replica)
        self._address_index = self.addresses.index(hint)

    def wait_worker_credential(self, timeout_s: float) -> bool:
        """Block (at most `timeout_s`, polling) until the agent has written this worker's own
        credential; True at once when no agent hands one over (`ELASWAVE_WORKER_TOKEN_FILE` unset).
        A spare subscribes with it: that is how the Core learns it is ready to join."""
        if not self._worker_token_file:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError):
                if Path(self._worker_token_file).read_text().strip():
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def _worker_metadata(self) -> tuple[tuple[str, str], ...]:
        """`authorization` with the worker's credential when its agent has written it, else the
        job token (then the Core refuses acks and reports: they need the worker's own)."""
        if self._worker_token_file:
            try:
                token = Path(self._worker_token_file).read_text().strip()
            except OSError:
                token = ""
            if token:
                return (("authorization", f"Bearer {token}"),)
        return self._metadata

    def close(self) -> None:
        """Stop following plans (joins the thread for at most rpc_timeout_s)."""
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        if self._thread is not None:
            self._thread.join(self.rpc_timeout_s)


def window_message(window: ReprotectWindow) -> executor_pb2.BackupWindow:
    """The wire form of a re-protection window (executor.proto `BackupWindow`)."""
    return executor_pb2.BackupWindow(
        pairs=[executor_pb2.BackupPair(owner=o, holder=h) for o, h in window.pairs],
        from_step=window.from_step,
        until_step=window.until_step,
        closed_step=window.closed_step or 0,
    )
