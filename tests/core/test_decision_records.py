"""The registry records a new leader continues from (core_service.recovery_record,
core_service.rendezvous_record): what is stored reads back the same through either registry
backend, an unchanged recovery is not written again, and a record that cannot be read is refused
with what is wrong."""

from __future__ import annotations

import json

import pytest

from core_service.model import Ack, AckPhase, PlanFailure, Recovery, RetryRequest
from core_service.recovery_record import RecoveryRecords, parse_recovery, recovery_json
from core_service.registry import Registry
from core_service.rendezvous_record import (
    StoredFormed,
    StoredGathering,
    StoredNode,
    formed_json,
    gathering_json,
    parse_record,
)
from tests.test_launcher_multinode import description
from wire.worker_env import ModelDescription


def busy_recovery() -> Recovery:
    request = RetryRequest(
        7,
        {
            "w1": Ack(AckPhase.FAILED, PlanFailure.NOT_APPLICABLE, "cannot reach it"),
            "w2": Ack(AckPhase.FAILED, PlanFailure.INTERRUPTED, "peer hung up"),
        },
        ["collective all_reduce failed at step 9"],
        {3, -1},
    )
    return Recovery(
        in_place_retries=2,
        restore_failures=1,
        collective_retries={3: 2, -1: 1},
        request=request,
        gave_up_at=5,
    )


def test_a_recovery_record_reads_back_the_same_through_the_registry(registry: Registry) -> None:
    recovery = busy_recovery()
    registry.put("/elaswave/jobs/j/recovery", recovery_json(recovery, 6))
    raw = registry.get("/elaswave/jobs/j/recovery")
    assert raw is not None
    assert parse_recovery(raw) == (recovery, 6)
    assert parse_recovery(recovery_json(Recovery(), 0)) == (Recovery(), 0)


def test_an_unchanged_recovery_is_not_written_again() -> None:
    records, recovery = RecoveryRecords(), busy_recovery()
    assert records.changed("j", recovery, 6) is not None
    assert records.changed("j", recovery, 6) is None
    recovery.progress()
    assert records.changed("j", recovery, 6) is not None
    records.forget()
    assert records.changed("j", recovery, 6) is not None  # a new term writes what it holds


@pytest.mark.parametrize(
    "raw, says",
    [
        (b"{not json", "unreadable recovery record"),
        (json.dumps({"version": 99}).encode(), "version 99"),
        (json.dumps({"version": 1, "in_place_retries": 1}).encode(), "unreadable recovery record"),
    ],
)
def test_a_recovery_record_that_cannot_be_read_is_refused_with_why(raw: bytes, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_recovery(raw)


def test_rendezvous_records_read_back_the_same_through_the_registry(registry: Registry) -> None:
    desc = ModelDescription.from_json(json.dumps(description()))
    gathering = StoredGathering(2, 2, 2, None, (StoredNode("a", "session-a", "host-a", desc, 1e9),))
    formed = StoredFormed(2, {"a": ("session-a", {"node_index": 0, "token": "t"})}, {"nnodes": 2}, desc, "a")
    registry.put("/elaswave/rendezvous/g", gathering_json(gathering))
    registry.put("/elaswave/rendezvous/f", formed_json(formed))
    stored = dict(registry.get_prefix("/elaswave/rendezvous/"))
    assert parse_record(stored["/elaswave/rendezvous/g"]) == gathering
    assert parse_record(stored["/elaswave/rendezvous/f"]) == formed
    with pytest.raises(ValueError, match="unknown state 'lost'"):
        parse_record(json.dumps({"version": 1, "state": "lost"}).encode())
