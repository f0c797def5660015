"""``open_registry``: pick and connect a registry backend from a URL.

- ``memory://`` — a new, private in-memory registry (one process; the default for demos).
- ``etcd://host:port[,host:port...][?timeout=S&connect_timeout=S]`` — etcd v3; the first
  endpoint that answers is used, and the error lists every endpoint tried when none does.
"""

from __future__ import annotations

from urllib.parse import parse_qs

from core_service.registry.base import Registry
from core_service.registry.etcd import EtcdEndpoint, EtcdRegistry, EtcdSecurity
from core_service.registry.memory import MemoryRegistry

_ETCD_OPTIONS = {"timeout": "timeout_s", "connect_timeout": "connect_timeout_s"}


def open_registry(url: str, security: EtcdSecurity | None = None) -> Registry:
    """Open the registry named by ``url`` (see the module docstring for the forms); ``security``:
    TLS and/or user and password for etcd."""
    if not isinstance(url, str):
        raise TypeError(f"registry url must be a str, got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"registry url {url!r} has no scheme; expected memory:// or etcd://host:port")
    if scheme == "memory":
        if rest:
            raise ValueError(f"memory registry url takes nothing after memory://, got {url!r}")
        return MemoryRegistry()
    if scheme == "etcd":
        endpoints, options = parse_etcd_url(url)
        return EtcdRegistry(endpoints, security=security, **options)
    raise ValueError(f"unknown registry scheme {scheme!r} in {url!r}; expected memory:// or etcd://")


def parse_etcd_url(url: str) -> tuple[list[EtcdEndpoint], dict[str, float]]:
    """``etcd://h1:p1,h2:p2?timeout=3`` -> endpoints in order, and keyword options for EtcdRegistry."""
    rest = url.partition("://")[2]
    hosts, _, query = rest.partition("?")
    hosts = hosts.rstrip("/")
    if not hosts:
        raise ValueError(f"etcd url {url!r} names no endpoint; expected etcd://host:port[,host:port]")
    endpoints = [_parse_endpoint(part.strip(), url) for part in hosts.split(",")]
    options: dict[str, float] = {}
    for name, values in parse_qs(query, keep_blank_values=True, strict_parsing=bool(query)).items():
        if name not in _ETCD_OPTIONS:
            raise ValueError(f"unknown etcd url option {name!r} in {url!r}; known: {sorted(_ETCD_OPTIONS)}")
        try:
            options[_ETCD_OPTIONS[name]] = float(values[-1])
        except ValueError:
            raise ValueError(f"etcd url option {name}={values[-1]!r} is not a number of seconds") from None
    return endpoints, options


def _parse_endpoint(text: str, url: str) -> EtcdEndpoint:
    host, sep, port_text = text.rpartition(":")  # rpartition keeps "[::1]" whole for gRPC
    if not sep or not host.strip("[]") or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad etcd endpoint {text!r} in {url!r}; expected host:port with port 1-65535")
    return EtcdEndpoint(host, int(port_text))
