"""The rendezvous of `elaswave run --core` jobs as registry records, so a new leader continues it.

One record per job under ``<prefix>/rendezvous/<job>`` (core_service.rendezvous):

* while its nodes gather: who joined, in join order (the order gives node indices and ranks),
  with each node's session, host, model description and the deadline of its wait;
* once formed: every node's answer (its place and the job's token), what a node joining the
  running job later is checked against (shape, model) and answered with.

A Core that takes over reads them all at its first rendezvous request, so a node that joined the
old leader keeps its place, and a node whose answer was lost in the failover gets it on its next
poll instead of a refusal. Deadlines are stored as wall-clock times (monotonic clocks do not
cross machines). How recently a node polled is not stored: every node gets a fresh `LEASE_S`
from the takeover to poll the new leader. The records are bounded like the Core's memory of
them: at most `MAX_PENDING_JOBS` gathering and `REMEMBERED_JOBS` formed.

A formed record holds the job token in clear, as the answers do: the registry holds the Core's
leadership and every job's state, so it must be private to the Cores already (docs/operations.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from wire.worker_env import ModelDescription

RECORD_VERSION = 1


@dataclass(frozen=True)
class StoredNode:
    node_id: str
    session: str
    host: str
    description: ModelDescription
    deadline_unix: float
    stores: tuple[str, ...] = ()  # the rendezvous stores this node's launcher runs


@dataclass(frozen=True)
class StoredGathering:
    nnodes: int
    nproc_per_node: int
    pp: int
    mem_per_worker_bytes: float | None
    nodes: tuple[StoredNode, ...]


@dataclass(frozen=True)
class StoredFormed:
    nnodes: int
    answers: dict[str, tuple[str, dict[str, Any]]]  # node id -> (session, answer)
    common: dict[str, Any]
    description: ModelDescription | None
    node_id: str


def gathering_json(g: StoredGathering) -> bytes:
    nodes = [
        {
            "node_id": n.node_id,
            "session": n.session,
            "host": n.host,
            "description": json.loads(n.description.to_json()),
            "deadline_unix": n.deadline_unix,
            "stores": list(n.stores),
        }
        for n in g.nodes
    ]
    body = {
        "version": RECORD_VERSION,
        "state": "gathering",
        "nnodes": g.nnodes,
        "nproc_per_node": g.nproc_per_node,
        "pp": g.pp,
        "mem_per_worker_bytes": g.mem_per_worker_bytes,
        "nodes": nodes,
    }
    return json.dumps(body, sort_keys=True).encode()


def formed_json(f: StoredFormed) -> bytes:
    body = {
        "version": RECORD_VERSION,
        "state": "formed",
        "nnodes": f.nnodes,
        "answers": {node: [session, answer] for node, (session, answer) in f.answers.items()},
        "common": f.common,
        "description": None if f.description is None else json.loads(f.description.to_json()),
        "node_id": f.node_id,
    }
    return json.dumps(body, sort_keys=True).encode()


def parse_record(raw: bytes) -> StoredGathering | StoredFormed:
    """A stored record; ValueError saying what is wrong with one this Core cannot read."""
    try:
        body = json.loads(raw)
        if body.get("version") != RECORD_VERSION:
            raise ValueError(f"version {body.get('version')!r}, this Core reads {RECORD_VERSION}")
        if body["state"] == "gathering":
            return StoredGathering(
                int(body["nnodes"]),
                int(body["nproc_per_node"]),
                int(body["pp"]),
                None if body["mem_per_worker_bytes"] is None else float(body["mem_per_worker_bytes"]),
                tuple(
                    StoredNode(
                        str(n["node_id"]),
                        str(n["session"]),
                        str(n["host"]),
                        _description(n["description"]),
                        float(n["deadline_unix"]),
                        tuple(str(a) for a in n.get("stores", ())),
                    )
                    for n in body["nodes"]
                ),
            )
        if body["state"] == "formed":
            return StoredFormed(
                int(body["nnodes"]),
                {str(node): (str(s), dict(a)) for node, (s, a) in body["answers"].items()},
                dict(body["common"]),
                None if body["description"] is None else _description(body["description"]),
                str(body["node_id"]),
            )
        raise ValueError(f"unknown state {body['state']!r}")
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable rendezvous record: {exc!r}") from None


def _description(body: object) -> ModelDescription:
    return ModelDescription.from_json(json.dumps(body))
