"""`elaswave run --core HOST:PORT[,HOST:PORT...]`: join a multi-node job through the Cores.

`HOST:PORT` is a Core's REST address (`elaswave core --http-host/--http-port`, default port
8080); give every Core's (those sharing one registry), so that the job outlives any of them. The
same command on every node posts this node's model description and the addresses of the
rendezvous stores its launcher started here (`elaswave.store_keeper`) to the leading Core's
rendezvous (`POST /api/v1/rendezvous/<job>`, core_service.rendezvous) and asks again every
`POLL_S` seconds, at most `--rendezvous-timeout` in all, until all `--nnodes` nodes have joined.
The answer is the job's layout, this node's index (join order) and ranks, the job token, the
job's stores (the store on one node, its standby on another) and the leader's gRPC port; every
other Core's gRPC port comes from its `/healthz`, each reached at the host of its `--core`
address. The launcher then starts agents for this node's ranks only, all of them and the workers
knowing every Core (they follow the leader), shows the job-wide progress from the leading Core
(`elaswave.core_rest`), and asks it to stop the whole job on Ctrl-C
(`POST /api/v1/jobs/<job>/checkpoint {"stop": true}`), so the stop reaches every node.

The rendezvous and the stop are scheduler calls: `$ELASWAVE_SCHEDULER_TOKEN` must hold the
Core's scheduler token (never on a command line).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wire import core_tls

if TYPE_CHECKING:
    from planners.placement import Placement

SCHEDULER_TOKEN_ENV = "ELASWAVE_SCHEDULER_TOKEN"
NODE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
POLL_S = 10.0  # each request waits this long at most, then the launcher asks again
# Past the rendezvous wait: the Core starts the job's store (it imports torch) and stores the job.
CREATION_MARGIN_S = 90.0
HEALTH_TIMEOUT_S = 5.0


class JoinError(RuntimeError):
    """The node could not join; the message says why. `exit_code`: 64 for what the user must fix."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def parse_core(text: str) -> tuple[str, int]:
    """`HOST:PORT` -> (host, port); raises ValueError saying what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"--core {text!r}: give the Core's REST address as HOST:PORT (its --http-port, "
            "default 8080), e.g. --core 10.0.0.5:8080, or every Core's, comma-separated"
        )
    return host, int(port)


def parse_cores(text: str) -> list[tuple[str, int]]:
    """`HOST:PORT[,HOST:PORT...]` -> [(host, port), ...], in order, without repeats."""
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise ValueError(f"--core {text!r}: an empty address in the list (HOST:PORT,HOST:PORT)")
    cores = list(dict.fromkeys(parse_core(p) for p in parts))
    return cores


def default_node_id() -> str:
    # The host name and pid alone repeat across containers that share the host's network (and
    # so its host name) and number their processes alike: the nodes of deploy/compose.
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"[:128]


@dataclass(frozen=True)
class Joined:
    """This node's place in the job, as the Core's rendezvous answered."""

    rest_urls: tuple[str, ...]  # every Core's REST API, the one that answered first
    grpc_address: str  # every Core's gRPC address (comma-separated), the leader's first
    store_address: str  # the job's stores (comma-separated), in the workers' order
    token: str
    node_index: int
    node_id: str
    ranks: tuple[int, ...]
    answer: dict[str, Any]
    # A node that came after the job formed: its workers join as spares, under these ids
    # (`elaswave agent` without a rank, `ELASWAVE_RANK=spare`), taken in by the Core's plans.
    spare_worker_ids: tuple[str, ...] = ()
    # How this node reaches the Core (None: plaintext); its agents and workers get the same.
    tls: core_tls.CoreTls | None = None

    @property
    def nodes(self) -> list[dict[str, Any]]:
        return list(self.answer["nodes"])


def join_job(
    args: argparse.Namespace, job: str, description_json: str, scheduler_token: str, stores: list[str]
) -> Joined:
    """Post this node's description and `stores` and ask again until the others joined (bounded
    by --rendezvous-timeout, which the Core enforces too); raises JoinError."""
    import httpx  # noqa: PLC0415 - only once the describe run succeeded

    from elaswave.core_rest import CoreClient  # noqa: PLC0415

    tls: core_tls.CoreTls | None = getattr(args, "core_tls", None)
    cores = parse_cores(args.core)
    rest_urls = [f"{core_tls.scheme(tls)}://{_bracket(host)}:{port}" for host, port in cores]
    rest_url = ", ".join(rest_urls)
    body = {
        "stores": stores,
        "node_id": args.node_id or default_node_id(),
        "session": secrets.token_urlsafe(12),
        "nnodes": args.nnodes,
        "nproc_per_node": args.nproc_per_node,
        "pp": args.pp,
        "description": json.loads(description_json),
        "host": socket.gethostname(),
        "timeout_s": args.rendezvous_timeout,
        "poll_s": POLL_S,
        "mem_per_worker_bytes": None if args.mem_per_worker is None else float(args.mem_per_worker) * 2**30,
    }
    deadline = time.monotonic() + args.rendezvous_timeout + CREATION_MARGIN_S
    shown: list[str] = []
    with CoreClient(
        rest_urls,
        timeout=httpx.Timeout(10.0, read=POLL_S + CREATION_MARGIN_S),
        headers={"Authorization": f"Bearer {scheduler_token}"},
        verify=rest_verify(tls),
    ) as client:
        while True:
            try:
                response = client.post(f"/api/v1/rendezvous/{job}", json=body)
            except httpx.HTTPError as exc:
                raise JoinError(
                    f"cannot reach the Core's REST API at {rest_url} ({type(exc).__name__}: {exc}); is "
                    "`elaswave core` running there, and is that its --http-port?"
                    + core_tls.plaintext_hint(tls)
                ) from None
            if response.status_code == 200:
                break
            if response.status_code != 202:
                raise JoinError(
                    f"the Core refused this node: HTTP {response.status_code}: {_detail(response)}",
                    64 if response.status_code in (401, 403, 409, 422) else 1,
                )
            waiting = response.json()
            if waiting["joined"] != shown:
                shown = list(waiting["joined"])
                print(
                    f"[elaswave] {len(shown)} of {waiting['nnodes']} nodes joined ({', '.join(shown)}); waiting "
                    f"for {waiting['missing']} more",
                    flush=True,
                )
            if time.monotonic() > deadline:  # the Core forgot us (restarted?) and keeps saying wait
                raise JoinError(f"the other nodes did not join within {args.rendezvous_timeout:g} s")
        leader = str(client.base_url).rstrip("/")
    answer = response.json()
    return Joined(
        rest_urls=tuple([leader, *(u for u in rest_urls if u != leader)]),
        grpc_address=",".join(grpc_addresses(rest_urls, leader, int(answer["grpc_port"]), tls)),
        # the job's store, then its standby (the workers move there if the first one dies)
        store_address=",".join(answer["stores"]),
        token=str(answer["token"]),
        node_index=int(answer["node_index"]),
        node_id=str(answer["node_id"]),
        ranks=tuple(answer["ranks"]),
        answer=answer,
        spare_worker_ids=tuple(str(w) for w in answer.get("spare_worker_ids", ())),
        tls=tls,
    )


def rest_verify(tls: core_tls.CoreTls | None) -> Any:
    """httpx's `verify` for the Core's REST API: its CA bundle (and this node's client
    certificate) over HTTPS, the default without TLS (plaintext http:// verifies nothing)."""
    return True if tls is None else tls.ssl_context()


def grpc_addresses(
    rest_urls: list[str], leader: str, leader_grpc_port: int, tls: core_tls.CoreTls | None = None
) -> list[str]:
    """Every Core's gRPC address, the leader's first: each at the host of its REST address, with
    the port its `/healthz` names. A Core that does not answer now is left out (said on stderr):
    the agents and workers follow the leader among the others."""
    import httpx  # noqa: PLC0415

    addresses = [f"{_bracket(httpx.URL(leader).host)}:{leader_grpc_port}"]
    for url in rest_urls:
        if url == leader:
            continue
        try:
            healthz = httpx.get(f"{url}/healthz", timeout=HEALTH_TIMEOUT_S, verify=rest_verify(tls))
            port = int(healthz.json()["grpc_port"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            print(
                f"[elaswave] WARNING: the Core at {url} does not answer ({type(exc).__name__}); this "
                "node's workers will not fail over to it",
                file=sys.stderr,
                flush=True,
            )
            continue
        addresses.append(f"{_bracket(httpx.URL(url).host)}:{port}")
    return list(dict.fromkeys(addresses))


def store_host(args: argparse.Namespace) -> str:
    """Where the other nodes reach this node's stores: --store-host, else the local address this
    machine reaches the first Core from (a UDP "connect" sends nothing; it only picks the route)."""
    if getattr(args, "store_host", None):
        return str(args.store_host)
    host, port = parse_cores(args.core)[0]
    try:
        family, kind, proto, _, target = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(target)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise JoinError(
            f"cannot tell which address of this node the others reach ({exc}); give --store-host"
        ) from None


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def placement_of(joined: Joined) -> Placement:
    """The Core's placement as a `planners.placement.Placement` (the same one on every node)."""
    from planners.layout import Layout  # noqa: PLC0415
    from planners.placement import Placement  # noqa: PLC0415

    fields: dict[str, Any] = dict(joined.answer["placement"])  # every field of Placement, as JSON
    layout = Layout.from_json(json.dumps(fields.pop("layout")))
    rest: dict[str, Any] = {k: v if isinstance(v, str) else tuple(v) for k, v in fields.items()}
    return Placement(layout=layout, **rest)


def _detail(response: Any) -> str:
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = None
    return str(detail if detail is not None else response.text[:500])


def stop_job(http: Any, job: str, scheduler_token: str) -> tuple[bool, str]:
    """Ask the Core to stop every worker of the job at a step boundary; (accepted, what it said)."""
    import httpx  # noqa: PLC0415

    try:
        response = http.post(
            f"/api/v1/jobs/{job}/checkpoint",
            json={"stop": True},
            headers={"Authorization": f"Bearer {scheduler_token}"},
        )
    except httpx.HTTPError as exc:
        return False, f"the Core did not answer ({type(exc).__name__})"
    if response.status_code == 202:
        return True, f"every worker stops after step {response.json()['after_step']}"
    return False, f"HTTP {response.status_code}: {_detail(response)}"


def stopped_by_the_core(events: list[dict[str, Any]]) -> bool:
    """Whether someone (another node's launcher, an operator) asked the Core to stop the job."""
    return any(
        e["kind"] == "job_stopped"
        or (e["kind"] == "checkpoint_requested" and (e.get("data") or {}).get("stop"))
        for e in events
    )
