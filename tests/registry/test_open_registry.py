"""open_registry URL handling (no server needed)."""

from __future__ import annotations

import pytest

from core_service.registry import EtcdEndpoint, MemoryRegistry, RegistryError, open_registry
from core_service.registry.factory import parse_etcd_url


def test_memory_url_gives_a_fresh_private_registry() -> None:
    with open_registry("memory://") as first, open_registry("memory://") as second:
        assert isinstance(first, MemoryRegistry)
        first.put("/k", b"v")
        assert second.get("/k") is None


def test_etcd_url_parsing() -> None:
    endpoints, options = parse_etcd_url(
        "etcd://10.0.0.1:2379,etcd-b:2380,[::1]:2381?timeout=3&connect_timeout=0.5"
    )
    assert endpoints == [
        EtcdEndpoint("10.0.0.1", 2379),
        EtcdEndpoint("etcd-b", 2380),
        EtcdEndpoint("[::1]", 2381),
    ]
    assert options == {"timeout_s": 3.0, "connect_timeout_s": 0.5}
    assert parse_etcd_url("etcd://h:1/") == ([EtcdEndpoint("h", 1)], {})


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("localhost:2379", "no scheme"),
        ("zookeeper://h:1", "unknown registry scheme"),
        ("memory://somewhere", "nothing after memory://"),
        ("etcd://", "names no endpoint"),
        ("etcd://host", "bad etcd endpoint 'host'"),
        ("etcd://host:0", "port 1-65535"),
        ("etcd://host:http", "bad etcd endpoint"),
        ("etcd://h:1,,h:2", "bad etcd endpoint ''"),
        ("etcd://h:1?retries=3", "unknown etcd url option 'retries'"),
        ("etcd://h:1?timeout=soon", "not a number"),
        ("etcd://h:1?timeout=0", "positive"),
    ],
)
def test_bad_urls_are_refused_clearly(url: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        open_registry(url)


def test_closed_memory_registry_refuses_calls() -> None:
    reg = open_registry("memory://")
    reg.close()
    reg.close()
    with pytest.raises(RegistryError, match="closed"):
        reg.put("/k", b"v")
