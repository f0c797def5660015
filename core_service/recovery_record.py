"""A job's recovery state as one registry record, so a new leader continues its retry bounds.

`core_service.recovery` bounds retries that make no progress (in-place retries, failed RESTOREs,
collective replays) and keeps a RESTORE sticky until a step commits on it. The counters live in
`Job.recovery`; the commit that resets them and ends the stickiness is `Job.committed_epoch`.
A leader that forgot them after a takeover would grant a job stuck in a failing apply a fresh
set of retries per takeover, and could publish IN_PLACE to workers that already dropped their
state for a RESTORE once the commit events were pruned from the bounded event log.

Key: ``<prefix>/jobs/<job>/recovery``, one small JSON record per job, rewritten only when its
content changes (`RecoveryRecords.save`), deleted with the job's other keys. Its size is bounded
by the job's ranks (collective replays per rank) and members (failed acknowledgements of one
plan), both already bounded (core_service.member_bounds).
"""

from __future__ import annotations

import json
from typing import Any

from core_service.model import Ack, AckPhase, PlanFailure, Recovery, RetryRequest

RECORD_VERSION = 1


def recovery_json(recovery: Recovery, committed_epoch: int) -> bytes:
    """The record of `recovery` with the job's committed epoch (sorted keys: equal state, equal bytes)."""
    request = recovery.request
    body: dict[str, Any] = {
        "version": RECORD_VERSION,
        "committed_epoch": committed_epoch,
        "in_place_retries": recovery.in_place_retries,
        "restore_failures": recovery.restore_failures,
        "collective_retries": {str(rank): n for rank, n in sorted(recovery.collective_retries.items())},
        "gave_up_at": recovery.gave_up_at,
        "request": None if request is None else _request_json(request),
    }
    return json.dumps(body, sort_keys=True).encode()


def parse_recovery(raw: bytes) -> tuple[Recovery, int]:
    """(recovery, committed epoch) of a stored record; ValueError saying what is wrong."""
    try:
        body = json.loads(raw)
        if body.get("version") != RECORD_VERSION:
            raise ValueError(f"version {body.get('version')!r}, this Core reads {RECORD_VERSION}")
        request = body.get("request")
        recovery = Recovery(
            in_place_retries=int(body["in_place_retries"]),
            restore_failures=int(body["restore_failures"]),
            collective_retries={int(r): int(n) for r, n in body["collective_retries"].items()},
            request=None if request is None else _parse_request(request),
            gave_up_at=None if body["gave_up_at"] is None else int(body["gave_up_at"]),
        )
        return recovery, int(body["committed_epoch"])
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable recovery record: {exc!r}") from None


def _request_json(request: RetryRequest) -> dict[str, Any]:
    return {
        "epoch": request.epoch,
        "failed": {
            worker: {
                "phase": ack.phase.value,
                "failure": None if ack.failure is None else ack.failure.value,
                "reason": ack.reason,
            }
            for worker, ack in sorted(request.failed.items())
        },
        "collective": list(request.collective),
        "peers": sorted(request.peers),
    }


def _parse_request(body: dict[str, Any]) -> RetryRequest:
    failed = {
        str(worker): Ack(
            AckPhase(ack["phase"]),
            None if ack["failure"] is None else PlanFailure(ack["failure"]),
            str(ack["reason"]),
        )
        for worker, ack in body["failed"].items()
    }
    return RetryRequest(
        int(body["epoch"]),
        failed,
        [str(c) for c in body["collective"]],
        {int(p) for p in body["peers"]},
    )


class RecoveryRecords:
    """What of each job's recovery record this leadership term stored last, so that a tick that
    changed nothing writes nothing (the leader ticks hundreds of times a second under load)."""

    def __init__(self) -> None:
        self._stored: dict[str, bytes] = {}

    def changed(self, job: str, recovery: Recovery, committed_epoch: int) -> bytes | None:
        """The record to store for `job`, or None when it equals the one stored last."""
        raw = recovery_json(recovery, committed_epoch)
        if self._stored.get(job) == raw:
            return None
        self._stored[job] = raw
        return raw

    def loaded(self, job: str, raw: bytes) -> None:
        """The record a takeover read: stored already."""
        self._stored[job] = raw

    def forget(self, job: str | None = None) -> None:
        """A job gone (or, without one, every job: a new term reloads them all)."""
        if job is None:
            self._stored.clear()
        else:
            self._stored.pop(job, None)
