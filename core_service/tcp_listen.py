"""The REST API's listening socket, bound here (not by uvicorn) so that the Core knows its port
before serving and can report a taken port clearly."""

from __future__ import annotations

import ipaddress
import socket


def tcp_listener(host: str, port: int) -> socket.socket:
    """A bound, not yet listening, TCP socket on `host:port` (port 0: the kernel picks one).

    The socket is made with the protocol number IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on
    an accepted connection only when the socket says it is TCP. Without it, Nagle's algorithm
    holds back a response's body (a second small write) until the client acknowledges the headers,
    and a keep-alive client's delayed ACK makes every request after the first take ~40 ms.

    Raises OSError (the socket closed) when the address cannot be bound."""
    family = socket.AF_INET6 if _is_ipv6(host) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    return sock


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).version == 6
    except ValueError:
        return False  # a host name: resolved as IPv4, as before
