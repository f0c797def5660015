"""The REST listener's sockets: connections accepted by asyncio from them have Nagle's algorithm
off (else a keep-alive client waits ~40 ms for every response's body), and a taken port is an
OSError that leaves nothing open."""

from __future__ import annotations

import asyncio
import socket

import pytest

from core_service.tcp_listen import tcp_listener


async def accepted_nodelay(host: str) -> int:
    listener = tcp_listener(host, 0)
    seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(accepted, sock=listener)
    port = listener.getsockname()[1]
    _, writer = await asyncio.open_connection(host.strip("[]"), port)
    try:
        return await asyncio.wait_for(seen, 10)
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


def test_connections_accepted_on_the_listener_have_nagle_off() -> None:
    assert asyncio.run(accepted_nodelay("127.0.0.1")) != 0


def test_an_ipv6_host_gets_an_ipv6_listener_with_nagle_off() -> None:
    try:
        probe = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    probe.close()
    assert asyncio.run(accepted_nodelay("::1")) != 0
    with tcp_listener("[::1]", 0) as sock:
        assert sock.family == socket.AF_INET6


def test_a_taken_port_raises_and_leaves_no_socket_open() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError):
            tcp_listener("127.0.0.1", port)
