"""A standalone rendezvous store that no training rank hosts (docs/architecture.md ("Processes")).

The executors build every communication group over this `torch.distributed.TCPStore`. A store
that lives inside a training rank dies with it and takes every survivor's rendezvous down, so
it runs in its own process (later: inside the Core). Run it as

    python -m executor.store_server --port 0

and it prints ``PORT <n>`` (the bound port) on one line, then serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import DistNetworkError, TCPStore

from executor.child_process import ChildProcess, Spawn
from executor.store_process import accepts_connections, announce_args, launch

DEFAULT_HOST = "127.0.0.1"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# A dead store's port refuses at once, but TCPStore's client retries a refused connect with
# back-off until its timeout (two tries of PEER_CONNECT_S each): a plain TCP connect first tells
# a gone store from a slow one in milliseconds (a live host's kernel accepts even when loaded).
PEER_PROBE_S = 1.0


def connect_store(host: str, port: int, timeout_s: float = 30.0) -> TCPStore:
    """A client connection to a running store server; raises if it cannot connect in time."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def connect_live(address: str, timeout_s: float) -> TCPStore:
    """A client of the store at "host:port" within `timeout_s`. A plain TCP connect first
    (at most PEER_PROBE_S): a dead store's port refuses at once, where TCPStore's own client
    retries a refused connect with back-off for its whole timeout. Raises ConnectionError for
    a port that refuses or does not answer, DistNetworkError/RuntimeError as `connect_store`."""
    if not accepts_connections(address, min(PEER_PROBE_S, timeout_s)):
        raise ConnectionError(f"{address} refuses connections")
    host, _, port = address.rpartition(":")
    return connect_store(host.strip("[]"), int(port), timeout_s)


def connect_first_answering(
    addresses: Sequence[str], timeout_s: float, attempt_s: float = 2.0
) -> tuple[int, TCPStore]:
    """(index, client) of the first of `addresses` ("host:port", in the job's order) that answers.

    A worker that joins a running job meets the others there: every worker moves down the same
    list when a store dies (`executor.worker_recovery`), so the stores before the first live one
    are gone. Each address gets `attempt_s`; the list is tried again until `timeout_s`, then
    TimeoutError names every address. (Only for joining a running job: at a job's start the
    first store may just be slow, and every worker must wait for that one.)"""
    if isinstance(addresses, str) or not addresses:
        raise ValueError(f"addresses must be a non-empty list of host:port, got {addresses!r}")
    deadline = time.monotonic() + timeout_s
    while True:
        for index, address in enumerate(addresses):
            left = deadline - time.monotonic()
            try:
                return index, connect_live(address, max(0.1, min(attempt_s, left)))
            except (ConnectionError, DistNetworkError, RuntimeError):
                continue
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no store of {list(addresses)} answered within {timeout_s:g} s")
        time.sleep(0.2)


# Every store of a job holds the job's current store list here ("host:port,host:port", in the
# order the workers try them): a replacement standby writes it into itself and into the stores
# still alive, and the workers re-read it (`executor.worker_recovery`), so a job keeps a standby
# after every store loss, not only the first.
STORES_KEY = "elaswave/stores"
PEER_CONNECT_S = 5.0
STOP_POLL_S = 0.05  # how soon a signalled store stops serving (seconds)
LISTEN_BACKLOG = 4096  # connections the kernel queues before the store's loop accepts them


def listening_socket(host: str, port: int) -> socket.socket:
    """The store's listening socket, of the family its clients reach `host` by, on every address
    of that family. TCPStore's server names each client it accepts (`getnameinfo`, a reverse DNS
    query) on its one event loop thread: on its own dual-stack socket every IPv4 client is
    "::ffff:a.b.c.d", which no hosts file lists, so even a loopback client costs a DNS query, and
    one query the resolver loses stalls every client of the store for the resolver's timeout
    (5 s by default). That is what made losing the store cost 5 s (docs/benchmarks.md). On an
    IPv4 socket a loopback client is 127.0.0.1, which /etc/hosts names without DNS."""
    bare = host.strip("[]")
    try:
        families = {info[0] for info in socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM)}
    except socket.gaierror as exc:
        raise ValueError(f"store host {host!r} does not resolve: {exc}") from None
    ipv4 = socket.AF_INET in families
    sock = socket.socket(socket.AF_INET if ipv4 else socket.AF_INET6, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if not ipv4:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("0.0.0.0" if ipv4 else "::", port))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def master_store(host: str, port: int, timeout_s: float) -> TCPStore:
    """A TCPStore server in this process on `listening_socket(host, port)` (port 0: a free one,
    `store.port`), with its own client of `timeout_s` per call."""
    listener = listening_socket(host, port)
    bound = listener.getsockname()[1]
    return TCPStore(
        host.strip("[]"),
        bound,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=listener.detach(),  # the store's server owns the descriptor from here
    )


def serve(
    host: str, port: int, stopped: Callable[[], bool], announce: bool = True, peers: tuple[str, ...] = ()
) -> None:
    """Host a TCPStore on (host, port) until `stopped()`, asked every STOP_POLL_S. Port 0 picks a
    free port. With `peers`, the job's list of live stores + this one is written under STORES_KEY
    here and into every live store (`job_list`)."""
    store = master_store(host, port, timeout_s=30.0)
    me = f"[{host}]:{store.port}" if ":" in host else f"{host}:{store.port}"
    if peers:  # a store started alone knows of no standby: it leaves the workers' own list alone
        live, listed = job_list(peers)
        listed.append(me)
        store.set(STORES_KEY, ",".join(listed))
        for address, client in live.items():
            try:
                client.set(STORES_KEY, ",".join(listed))
            except (RuntimeError, ValueError) as exc:  # died meanwhile: the list skips it next time
                print(f"store {me}: peer {address} did not take the store list: {exc}", file=sys.stderr)
    if announce:
        print(f"PORT {store.port}", flush=True)
        # The starter reads that one line and closes its end (`launch`): later output would
        # hit a closed pipe, so the rest goes nowhere (messages go to stderr, the store's log).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    while not stopped():
        time.sleep(STOP_POLL_S)
    del store


def job_list(peers: tuple[str, ...]) -> tuple[dict[str, TCPStore], list[str]]:
    """The job's stores that answer, and their list in the workers' order. `peers` is the
    starter's view, which may be stale (another node's launcher replaced its store): the list a
    live peer holds is newer, so it is read and joined with `peers`; a store that does not answer
    within PEER_CONNECT_S is left out."""
    live: dict[str, TCPStore] = {}
    down: set[str] = set()
    candidates = list(peers)
    while untried := [a for a in candidates if a not in live and a not in down]:
        address = untried[0]  # the list grows by what the first live peer holds
        try:
            client = connect_live(address, PEER_CONNECT_S)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            print(f"store list: {address} does not answer ({exc}); left out", file=sys.stderr)
            down.add(address)
            continue
        if not live:
            try:
                held = client.get(STORES_KEY).decode() if client.check([STORES_KEY]) else ""
            except (RuntimeError, ValueError):
                held = ""
            # the peer's list first (the workers' order), then what only the starter knew
            ordered = [a for a in held.split(",") if a] + candidates
            candidates = list(dict.fromkeys(ordered))
        live[address] = client
    return live, [a for a in candidates if a in live]


@dataclass
class StoreServer:
    """Handle on a store server running in another process (tests, benchmarks, the demo)."""

    process: ChildProcess
    host: str
    port: int

    @classmethod
    def start(
        cls,
        host: str = DEFAULT_HOST,
        timeout_s: float = 30.0,
        peers: tuple[str, ...] = (),
        spawn: Spawn | None = None,
        env: Mapping[str, str] | None = None,
    ) -> StoreServer:
        """Start one (`launch`: forked by `spawn` where it accepts, with `env`, default this
        process's) and wait at most timeout_s for its port; `peers`: the job's live stores, which
        learn the new list (`serve`)."""
        proc, port = launch(["--host", host, *announce_args(peers)], timeout_s, env, spawn=spawn)
        return cls(process=proc, host=host, port=port)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def connect(self, timeout_s: float = 30.0) -> TCPStore:
        return connect_store(self.host, self.port, timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout_s)


def _arm_parent_death(parent: int) -> None:
    """SIGTERM to this process when `parent` dies; exit now if it already has. Armed here, not by
    the parent between fork and exec: a launcher forks stores from a thread of a threaded
    process, where a `preexec_fn` may deadlock the child before it runs anything."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Standalone TCPStore rendezvous server for ElasWave executors"
    )
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed as 'PORT <n>')")
    parser.add_argument(
        "--parent",
        type=int,
        default=0,
        help="PID: end this store (SIGTERM) when that process dies (Linux); exit at once if it has",
    )
    parser.add_argument(
        "--announce-to",
        default="",
        help="HOST:PORT,... the job's live stores: the new list (them, then this one) is written to each",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    # The handlers only append: one that took a lock (Event.set) deadlocked when a second signal
    # came inside the first's handler (the parent-death SIGTERM, then the launcher's), and the
    # launcher killed the store 10 s later.
    signalled: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: signalled.append(signum))
    if args.parent:
        _arm_parent_death(args.parent)
    peers = tuple(a.strip() for a in args.announce_to.split(",") if a.strip())
    serve(args.host, args.port, lambda: bool(signalled), peers=peers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
