"""The store listens on a socket of its host's family, so a loopback client costs no DNS query.

TCPStore's server names every client it accepts with `getnameinfo` (a reverse DNS query) on its
one event loop thread. On TCPStore's own dual-stack socket an IPv4 client is
"::ffff:127.0.0.1", which no hosts file lists: every accept asked the DNS server, and one lost
answer stalled every client of the store for the resolver's 5 s timeout. Losing the store then
cost 5.6 s in 5 of 6 runs (`bench.mttr --case "the store"`, docs/benchmarks.md). Here a real
store process must listen on IPv4 only (an IPv4 client is then 127.0.0.1, named by /etc/hosts)
and still serve many clients that connect at once; bad hosts are refused with a clear error.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from executor.store_server import StoreServer, listening_socket

CONCURRENT_CLIENTS = 16


def _listening_ports(table: str) -> set[int]:
    """Ports in LISTEN state (st 0A) in /proc/net/tcp or tcp6."""
    path = Path("/proc/net") / table
    if not path.exists():
        return set()
    ports = set()
    for line in path.read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A":
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_the_store_listens_on_ipv4_and_serves_clients_that_connect_at_once() -> None:
    server = StoreServer.start()
    try:
        assert server.port in _listening_ports("tcp"), "the store does not listen on IPv4"
        assert server.port not in _listening_ports("tcp6"), (
            "the store listens on a dual-stack socket: its IPv4 clients are ::ffff: addresses"
        )

        def client(i: int) -> bytes:
            store = server.connect(timeout_s=20.0)
            store.set(f"k{i}", str(i))
            store.wait([f"k{j}" for j in range(CONCURRENT_CLIENTS)])
            return store.get(f"k{(i + 1) % CONCURRENT_CLIENTS}")

        with ThreadPoolExecutor(CONCURRENT_CLIENTS) as pool:  # a client's error is raised here
            got = list(pool.map(client, range(CONCURRENT_CLIENTS), timeout=30))
        assert got == [str((i + 1) % CONCURRENT_CLIENTS).encode() for i in range(CONCURRENT_CLIENTS)]
    finally:
        server.stop()


def test_the_listening_socket_takes_the_family_of_the_host() -> None:
    sock = listening_socket("127.0.0.1", 0)
    try:
        assert sock.family == socket.AF_INET
        assert sock.getsockname()[0] == "0.0.0.0"  # every IPv4 address, as the store served before
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


def test_an_ipv6_host_gets_a_dual_stack_socket() -> None:
    try:
        sock = listening_socket("[::1]", 0)
    except OSError as exc:
        pytest.skip(f"this machine has no IPv6: {exc}")
    try:
        assert sock.family == socket.AF_INET6
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
    finally:
        sock.close()


def test_a_host_that_does_not_resolve_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="does not resolve"):
        listening_socket("no-such-host.invalid", 0)
