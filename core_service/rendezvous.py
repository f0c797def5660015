"""`POST /api/v1/rendezvous/{job}`: the nodes of `elaswave run --core` join one job (docs/api.md).

Every node runs the same command; its launcher describes the model and posts its description
here with the job's shape (nnodes, nproc_per_node, pp), then posts the same request again
whenever an answer comes back 202 (still waiting: who joined, how many are missing). Each request
waits at most its `poll_s`; the node's whole wait is bounded by the `timeout_s` of its first
request. Once all `nnodes` nodes have joined with the same shape and the same model, every node
gets the same answer (200) but its own place:

* node indices in join order, ranks `n*K .. n*K+K-1` on node n;
* the layout and rank -> node map of `planners.placement.plan_placement`, computed once, from the
  first node's description (measured costs differ a little from node to node; one set of them
  makes every node see the same layout), so each stage's ranks are spread over the nodes;
* the job, created here through the same path as `POST /api/v1/jobs`, and its token;
* the Core's gRPC port (reached at the host the node reached this REST API at), and the job's
  rendezvous stores: each node brings the stores its launcher started beside it (`stores`), and
  the job gets `STORES_PER_JOB` of them from different nodes in join order (the store on node
  0, its standby on node 1), recorded in the job's spec in the registry so that any Core that
  leads later knows them. No Core runs a store: a job outlives every Core (docs/control-plane.md).

Refusals change nothing: 409 for a node whose shape or model differs from the first node's
(naming the difference), a node id that already joined, or a node more than `nnodes` (also once
the job exists); 422 for a description that cannot be read or a shape that cannot be laid out;
408 when the wait expires (the node is withdrawn; the answer says who joined and who is
missing). A node that stops asking (its launcher was stopped, its machine died) is withdrawn
`LEASE_S` after its last answer. A node is known by its `node_id` and the `session` its launcher
made up, so a second node that reuses an id is refused instead of taken for the first.

Why polls and not one long request that waits for the others: a node whose machine dies leaves
its connection half open and a long request would hold its place forever, and the Core's HTTP
middleware hides a client's disconnect from the handler anyway.

Who joined (in order) and, once formed, every node's answer are stored in the registry
(`core_service.rendezvous_record`) before a node hears of them: a Core that takes over continues
the rendezvous, so a node keeps its place and index across a failover, and a node whose answer
was lost with the old leader gets it from the new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol

from fastapi import APIRouter, HTTPException, Response
from fastapi.encoders import jsonable_encoder
from fastapi.params import Depends
from pydantic import BaseModel, ConfigDict, Field

from core_service.config import JOB_NAME_PATTERN
from core_service.grpc_util import RpcError
from core_service.http_guard import JobName, error_responses, field_error
from core_service.job_create import CreateJobRequest, store_new_job, store_problem
from core_service.persist import registry_call
from core_service.registry import RegistryError
from core_service.rendezvous_record import (
    StoredFormed,
    StoredGathering,
    StoredNode,
    formed_json,
    gathering_json,
    parse_record,
)
from core_service.seams import ServicerCore
from planners.described_model import job_model, model_difference, unit_costs
from planners.placement import Placement, PlacementError, plan_placement
from planners.redundancy import initial_copies
from wire.worker_env import ModelDescription

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_POLL_S = 10.0
LEASE_S = 5.0  # a node that has not polled again this long after its last answer is withdrawn
POLL_STEP_S = 0.5
MAX_PENDING_JOBS = 64
REMEMBERED_JOBS = 1024  # formed jobs kept to answer their nodes' next poll and refuse latecomers
STORES_PER_JOB = 2  # the store and its standby


class RendezvousCore(ServicerCore, Protocol):
    """What the rendezvous needs of the Core beyond the guards and the job state."""

    grpc_port: int


class JoinRequest(BaseModel):
    """Body of POST /api/v1/rendezvous/{job}."""

    model_config = ConfigDict(extra="forbid", strict=True)  # no "1" for 1, no false for 0
    node_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$", description="unique per node")
    session: str = Field(
        pattern=r"^[A-Za-z0-9_-]{8,64}$",
        description="random, one per launcher run: tells a node's next poll from another node reusing its id",
    )
    nnodes: int = Field(ge=1, le=4096)
    nproc_per_node: int = Field(ge=1, le=4096)
    pp: int = Field(ge=1, le=4096)
    description: dict[str, Any] = Field(description="the node's ModelDescription (its describe run)")
    host: str = Field(default="", max_length=255, description="where this node runs (recorded, shown)")
    timeout_s: float = Field(
        default=DEFAULT_TIMEOUT_S,
        gt=0,
        le=3600,
        description="how long to wait for the others, from the node's first poll",
    )
    poll_s: float = Field(default=DEFAULT_POLL_S, gt=0, le=60, description="how long this request may wait")
    mem_per_worker_bytes: float | None = Field(default=None, gt=0, description="--mem-per-worker, in bytes")
    stores: list[str] = Field(
        min_length=1,
        max_length=STORES_PER_JOB,
        description="HOST:PORT of the rendezvous stores this node's launcher runs, for the job to use",
    )


@dataclass(eq=False)  # a node is itself: compared by identity
class Node:
    node_id: str
    session: str
    host: str
    description: ModelDescription
    deadline: float  # monotonic: its first poll + timeout_s
    seen: float = field(default_factory=time.monotonic)  # the end of its last poll
    polls: int = 0  # requests of this node waiting now
    stores: tuple[str, ...] = ()  # the stores its launcher runs (JoinRequest.stores)


@dataclass
class Gathering:
    """One job's nodes while they join."""

    job: str
    nnodes: int
    nproc_per_node: int
    pp: int
    mem_per_worker_bytes: float | None
    placement: Placement
    nodes: list[Node] = field(default_factory=list)
    closed: bool = False  # all nodes joined: the job is being created, no one joins or leaves
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    error: HTTPException | None = None


def placement_json(placement: Placement) -> dict[str, Any]:
    """Every field of the placement (the launcher rebuilds it: `elaswave.launcher_join.placement_of`)."""
    out: dict[str, Any] = {f.name: getattr(placement, f.name) for f in fields(placement)}
    out["layout"] = json.loads(placement.layout.to_json())
    return out


@dataclass
class Formed:
    """A job whose nodes all joined: each node's answer, for its next poll."""

    nnodes: int
    answers: dict[str, tuple[str, dict[str, Any]]]  # node id -> (session, answer)
    common: dict[str, Any] = field(default_factory=dict)  # what every node's answer holds
    description: ModelDescription | None = None  # the job's model, for nodes that come later
    node_id: str = ""  # the node the description came from


class Rendezvous:
    """The joining nodes of every job, on the event loop (asyncio only, no locks)."""

    def __init__(self, core: RendezvousCore) -> None:
        self.core = core
        self.gatherings: dict[str, Gathering] = {}
        self.formed: OrderedDict[str, Formed] = OrderedDict()
        self._completing: set[asyncio.Task[None]] = set()
        self._term = -1  # the leadership term whose registry records `gatherings`/`formed` hold

    async def join(self, job: str, body: JoinRequest) -> tuple[int, dict[str, Any]]:
        """One poll of one node: (200, its place) once the job is formed, (202, who joined so far)
        when `poll_s` passed first; raises HTTPException for a refusal or the expired wait (408)."""
        if not JOB_NAME_PATTERN.match(job):
            raise HTTPException(
                422,
                detail=field_error(
                    "job", f"job name {job[:80]!r} is not valid (letters, digits, '.', '_', '-')"
                ),
            )
        try:
            desc = ModelDescription.from_json(json.dumps(body.description))
        except (ValueError, TypeError, KeyError) as exc:
            raise HTTPException(
                422,
                detail=field_error(
                    "description", f"description: not a model description this Core can read ({exc})"
                ),
            ) from None
        await self._follow_term()
        if problem := store_problem(body.stores):
            raise HTTPException(422, detail=field_error("stores", problem))
        if (formed := self.formed.get(job)) is not None:
            session, answer = formed.answers.get(body.node_id, ("", {}))
            if body.node_id not in formed.answers and self._running(job):
                answer = self._spare_node(job, formed, body, desc)
                self._save_formed(job, formed)
                await self._durable()
                return 200, answer
            if session != body.session:
                raise HTTPException(
                    409,
                    detail=f"all {formed.nnodes} nodes of job {job!r} have joined already; "
                    "this node is one too many (check --nnodes), or start a new job "
                    "under another --job name",
                )
            return 200, answer
        g = self.gatherings.get(job)
        if g is not None:
            self._expire(g)
            g = self.gatherings.get(job)
        node = None if g is None else next((n for n in g.nodes if n.node_id == body.node_id), None)
        if g is None or node is None or node.session != body.session:
            g = g or self._open(job, body, desc)
            self._admit(g, body, desc)
            node = Node(
                body.node_id,
                body.session,
                body.host,
                desc,
                time.monotonic() + body.timeout_s,
                stores=tuple(body.stores),
            )
            g.nodes.append(node)
            log.info("rendezvous %s: node %s joined (%d of %d)", job, node.node_id, len(g.nodes), g.nnodes)
            self._save_gathering(g)
            if len(g.nodes) == g.nnodes:
                g.closed = True
                task = asyncio.ensure_future(self._complete(g))  # not this request's task: it may go away
                self._completing.add(task)  # the loop holds tasks weakly
                task.add_done_callback(self._completing.discard)
            # Its place is stored before it waits: a new leader keeps it (and its join order).
            await self._durable()
        node.polls += 1
        try:
            await self._wait(g, node, body.poll_s)
        finally:
            node.polls, node.seen = (
                node.polls - 1,
                time.monotonic(),
            )  # its lease runs from the end of the poll
        if g.ready.is_set():
            if g.error is not None:
                raise g.error
            return 200, self.formed[job].answers[node.node_id][1]
        joined = [n.node_id for n in g.nodes]
        if not g.closed and time.monotonic() >= node.deadline:
            self._withdraw(g, node)
            raise HTTPException(
                408,
                detail=f"job {job!r}: only {len(joined)} of {g.nnodes} nodes joined within "
                f"{body.timeout_s:g} s ({', '.join(joined)}); {g.nnodes - len(joined)} "
                "never came. This node withdrew: start the missing nodes (or check "
                "--nnodes), then this one again",
            )
        return 202, {"job": job, "joined": joined, "nnodes": g.nnodes, "missing": g.nnodes - len(joined)}

    def _running(self, job: str) -> bool:
        """Whether `job` still trains here (not COMPLETED, not deleted): a node may join it."""
        found = self.core.table.jobs.get(job)
        return found is not None and not found.phase.terminal

    def _spare_node(
        self, job: str, formed: Formed, body: JoinRequest, desc: ModelDescription
    ) -> dict[str, Any]:
        """A node that comes after the job formed (a replacement, a node a scheduler gave back):
        its workers join as spares (`elaswave agent` without a rank, `ELASWAVE_RANK=spare`), each
        taken in by a plan when the Core's policy says so (growth, `Plan.joiners`). Same model and
        same command as the job's nodes, or 409."""
        if body.nproc_per_node != formed.common.get("nproc_per_node") or body.pp != formed.common.get("pp"):
            raise HTTPException(
                409,
                detail=f"--nproc-per-node {body.nproc_per_node} / --pp {body.pp} here, but job {job!r} "
                f"runs {formed.common.get('nproc_per_node')} / {formed.common.get('pp')}: a node joining "
                "a running job must run the same command",
            )
        if formed.description is not None and (
            diff := model_difference(desc, formed.description, formed.node_id)
        ):
            raise HTTPException(409, detail=f"this node's model differs from the job's: {diff}")
        found = self.core.table.jobs[job]
        live, limit = len(found.live_members()), self.core.membership.member_limit(found)
        if live + body.nproc_per_node > limit:
            raise HTTPException(
                409,
                detail=f"job {job!r} has {live} live workers of its limit {limit} (expected workers + "
                f"spare_workers + workers admitted by offers): no room for this node's "
                f"{body.nproc_per_node}; it is taken once the job has lost as many, or after an offer",
            )
        spares = [f"{body.node_id}-spare-{k}" for k in range(body.nproc_per_node)]
        answer = {
            **formed.common,
            "stores": list(found.stores),  # the job's list now: any Core reads it from the registry
            "role": "spare",
            "node_index": -1,
            "node_id": body.node_id,
            "ranks": [],
            "spare_worker_ids": spares,
        }
        formed.answers[body.node_id] = (body.session, answer)
        log.info("rendezvous %s: node %s joins the running job with spares %s", job, body.node_id, spares)
        return answer

    def _open(self, job: str, body: JoinRequest, desc: ModelDescription) -> Gathering:
        """The first node of a job: check the job is new and can be laid out (nothing stored yet)."""
        if job in self.core.table.jobs:
            raise HTTPException(
                409, detail=f"job {job!r} already exists on this Core; use another --job name"
            )
        if len(self.gatherings) >= MAX_PENDING_JOBS:
            raise HTTPException(
                503, detail=f"{MAX_PENDING_JOBS} jobs are gathering their nodes already; try later"
            )
        try:
            placement = _placement(desc, body.nnodes, body.nproc_per_node, body.pp, body.mem_per_worker_bytes)
        except PlacementError as exc:
            raise HTTPException(422, detail=field_error("", str(exc))) from None
        gathering = Gathering(
            job, body.nnodes, body.nproc_per_node, body.pp, body.mem_per_worker_bytes, placement
        )
        self.gatherings[job] = gathering
        return gathering

    # ---- registry records (core_service.rendezvous_record) -----------------------------------------
    def _key(self, job: str) -> str:
        return f"{self.core.table.settings.key_prefix}/rendezvous/{job}"

    def _save_gathering(self, g: Gathering) -> None:
        wall, mono = time.time(), time.monotonic()
        nodes = tuple(
            StoredNode(n.node_id, n.session, n.host, n.description, wall + (n.deadline - mono), n.stores)
            for n in g.nodes
        )
        record = StoredGathering(g.nnodes, g.nproc_per_node, g.pp, g.mem_per_worker_bytes, nodes)
        self.core.table.persister.put(self._key(g.job), gathering_json(record))

    def _save_formed(self, job: str, f: Formed) -> None:
        # The answers as the REST API serves them (the placement holds dataclasses).
        answers, common = jsonable_encoder(f.answers), jsonable_encoder(f.common)
        record = StoredFormed(f.nnodes, answers, common, f.description, f.node_id)
        self.core.table.persister.put(self._key(job), formed_json(record))

    async def _durable(self) -> None:
        """Waits until the records are stored; 503 saying why when they cannot be."""
        try:
            await self.core.wait_durable()
        except RpcError as err:
            raise HTTPException(503, detail=err.message) from None

    async def _follow_term(self) -> None:
        """At the first request of a leadership term, what the registry holds replaces what this
        Core remembers (another Core may have led in between): the gatherings and formed jobs."""
        term = self.core.table.persister.terms_started
        if term == self._term:
            return
        registry = self.core.table.registry
        prefix = self._key("")
        try:
            records = await registry_call(registry, registry.get_prefix, prefix)
        except RegistryError as exc:
            raise HTTPException(503, detail=f"the rendezvous records cannot be read: {exc}") from None
        if self.core.table.persister.terms_started != term:
            raise HTTPException(503, detail="this Core's leadership changed while it read the rendezvous")
        self.gatherings.clear()
        self.formed.clear()
        for key, raw in records:
            self._restore(key[len(prefix) :], raw)
        self._term = term
        log.info(
            "rendezvous: %d gathering and %d formed jobs from the registry",
            len(self.gatherings),
            len(self.formed),
        )

    def _restore(self, job: str, raw: bytes) -> None:
        try:
            record = parse_record(raw)
            if isinstance(record, StoredFormed):
                self.formed[job] = Formed(
                    record.nnodes, record.answers, record.common, record.description, record.node_id
                )
                return
            first = record.nodes[0].description
            placement = _placement(
                first, record.nnodes, record.nproc_per_node, record.pp, record.mem_per_worker_bytes
            )
        except (ValueError, IndexError, PlacementError) as exc:
            log.error("rendezvous %s: stored record ignored (%s)", job, exc)
            return
        g = Gathering(
            job, record.nnodes, record.nproc_per_node, record.pp, record.mem_per_worker_bytes, placement
        )
        wall, mono = time.time(), time.monotonic()
        # No node has polled this Core yet: each gets a fresh lease from now to do so.
        g.nodes = [
            Node(
                n.node_id, n.session, n.host, n.description, mono + (n.deadline_unix - wall), stores=n.stores
            )
            for n in record.nodes
        ]
        self.gatherings[job] = g

    @staticmethod
    def _admit(g: Gathering, body: JoinRequest, desc: ModelDescription) -> None:
        if g.closed:
            raise HTTPException(
                409,
                detail=f"all {g.nnodes} nodes of job {g.job!r} have joined already; this "
                "node is one too many (check --nnodes)",
            )
        first = g.nodes[0] if g.nodes else None
        if first is None:  # the node that opened the gathering: nothing to compare with
            return
        for name in ("nnodes", "nproc_per_node", "pp", "mem_per_worker_bytes"):
            if getattr(body, name) != getattr(g, name):
                flag = (
                    "--mem-per-worker (bytes)"
                    if name == "mem_per_worker_bytes"
                    else "--" + name.replace("_", "-")
                )
                raise HTTPException(
                    409,
                    detail=f"{flag} {getattr(body, name)} here but "
                    f"{getattr(g, name)} on node {first.node_id!r}: every node of job "
                    f"{g.job!r} must run the same command",
                )
        if any(n.node_id == body.node_id for n in g.nodes):
            raise HTTPException(
                409,
                detail=f"node {body.node_id!r} has joined job {g.job!r} already; give every "
                "node its own --node-id",
            )
        if diff := model_difference(desc, first.description, first.node_id):
            raise HTTPException(409, detail=f"this node's model differs from the job's: {diff}")

    @staticmethod
    async def _wait(g: Gathering, node: Node, poll_s: float) -> None:
        """Until the job is formed, `poll_s` passed or the node's deadline; once all nodes are in,
        until the job is formed (bounded by the store's start and the registry write)."""
        end = min(time.monotonic() + poll_s, node.deadline)
        while not g.ready.is_set() and (g.closed or time.monotonic() < end):
            # Never long between looks: the gathering may close while this node waits.
            step = POLL_STEP_S if g.closed else max(0.0, min(POLL_STEP_S, end - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(g.ready.wait(), step)

    def _expire(self, g: Gathering) -> None:
        """Withdraw the nodes that stopped polling (launcher stopped, machine gone)."""
        if g.closed:
            return
        now = time.monotonic()
        for node in [n for n in g.nodes if not n.polls and now - n.seen > LEASE_S]:
            log.info(
                "rendezvous %s: node %s stopped asking for %.0f s; withdrawn",
                g.job,
                node.node_id,
                now - node.seen,
            )
            self._withdraw(g, node)

    def _withdraw(self, g: Gathering, node: Node) -> None:
        if node in g.nodes:  # a node's two polls may both expire
            g.nodes.remove(node)
            self._save_gathering(g)
        if not g.nodes and self.gatherings.get(g.job) is g:
            del self.gatherings[g.job]
            self.core.table.persister.delete(self._key(g.job))

    async def _complete(self, g: Gathering) -> None:
        """Create the job with its nodes' stores, answer every node (errors go to every node)."""

        placement = g.placement
        stores = pick_stores(g.nodes)
        try:
            created = await store_new_job(
                self.core,
                CreateJobRequest(
                    name=g.job,
                    expected_workers=len(placement.rank_node),
                    layout=json.loads(placement.layout.to_json()),
                    # The first node's describe run as the job's model: offers are judged.
                    model=job_model(g.nodes[0].description, placement.layout, g.mem_per_worker_bytes),
                    stores=stores,
                ),
            )
            common = {
                "job": g.job,
                "token": created.token,
                "nnodes": g.nnodes,
                "nproc_per_node": g.nproc_per_node,
                "pp": g.pp,
                "layout": json.loads(placement.layout.to_json()),
                "rank_node": list(placement.rank_node),
                "placement": placement_json(placement),
                "grpc_port": self.core.grpc_port,
                "stores": stores,  # the store, then its standby (the groups move there if it dies)
                "nodes": [
                    {
                        "index": i,
                        "node_id": n.node_id,
                        "host": n.host,
                        "ranks": list(placement.ranks_on_node(i)),
                    }
                    for i, n in enumerate(g.nodes)
                ],
            }
            self.formed[g.job] = Formed(
                g.nnodes,
                {
                    n.node_id: (
                        n.session,
                        {
                            **common,
                            "node_index": i,
                            "node_id": n.node_id,
                            "ranks": list(placement.ranks_on_node(i)),
                        },
                    )
                    for i, n in enumerate(g.nodes)
                },
                {**common, "role": "rank"},
                g.nodes[0].description,
                g.nodes[0].node_id,
            )
            self._save_formed(g.job, self.formed[g.job])
            while len(self.formed) > REMEMBERED_JOBS:
                self.core.table.persister.delete(self._key(self.formed.popitem(last=False)[0]))
            await self._durable()  # the answers are stored before any node gets one
            log.info(
                "rendezvous %s: all %d nodes joined; job created, stores %s",
                g.job,
                g.nnodes,
                ", ".join(stores),
            )
        except HTTPException as exc:
            g.error = exc
        except Exception as exc:  # answer the nodes whatever went wrong, then let the log say it
            log.exception("rendezvous %s: creating the job failed", g.job)
            g.error = HTTPException(500, detail=f"the Core could not create job {g.job!r}: {exc}")
        finally:
            if self.gatherings.get(g.job) is g:
                del self.gatherings[g.job]
            if g.error is not None and g.job not in self.formed:
                self.core.table.persister.delete(self._key(g.job))
            g.ready.set()


def _placement(
    desc: ModelDescription, nnodes: int, nproc_per_node: int, pp: int, mem: float | None
) -> Placement:
    """The job's layout over its nodes, from one node's description (the same on every Core),
    with the backup copies k the redundancy prior asks for before any loss is seen, as far as
    the placement's memory check allows (`planners.redundancy.initial_copies`); its reason joins
    the placement's."""

    def place(copies: int) -> Placement:
        return plan_placement(
            unit_costs(desc),
            global_batch=desc.global_batch,
            micro_batches=desc.micro_batches,
            nnodes=nnodes,
            nproc_per_node=nproc_per_node,
            pp=pp,
            mem_cap_bytes=mem,
            backup_copies=copies,
        )

    placement, choice = initial_copies(place, mem)
    return replace(placement, reason=f"{placement.reason}; {choice.reason}")


def pick_stores(nodes: list[Node]) -> list[str]:
    """The job's stores: the first store of each node in join order, then the nodes' second ones,
    until `STORES_PER_JOB`; so the store and its standby run on different nodes where there are
    several (losing one node never takes both)."""
    picked: list[str] = []
    for k in range(STORES_PER_JOB):
        for node in nodes:
            if k < len(node.stores) and node.stores[k] not in picked and len(picked) < STORES_PER_JOB:
                picked.append(node.stores[k])
    return picked


def rendezvous_router(core: RendezvousCore, dependencies: list[Depends]) -> APIRouter:
    """The REST route; `dependencies` are the app's leader and scheduler-token checks."""
    router = APIRouter(dependencies=dependencies)
    rendezvous = Rendezvous(core)

    @router.post(
        "/api/v1/rendezvous/{job}",
        responses={
            202: {"description": "still waiting for nodes"},
            **error_responses(400, 401, 403, 408, 409, 413, 422, 500, 503),
        },
    )
    async def post_rendezvous(job: JobName, body: JoinRequest, response: Response) -> dict[str, Any]:
        # async: the gatherings and the job table are only touched on the event loop.
        response.status_code, answer = await rendezvous.join(job, body)
        return answer

    return router
