"""Fixtures shared by the whole suite. Keep each fixture small and documented; add yours below."""

from __future__ import annotations

from collections.abc import Iterator

import etcd3
import pytest

from core_service.registry import EtcdRegistry, Registry, open_registry
from core_service.registry.factory import parse_etcd_url
from tests.etcd_server import EtcdServer, EtcdServerError

# --- registry -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd for the session. A missing binary fails the test (run `make system-deps`)."""
    try:
        server = EtcdServer(data_dir=tmp_path_factory.mktemp("etcd")).start()
    except EtcdServerError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield server
    server.stop()


def _wipe_etcd(url: str) -> None:
    """Delete every key so that one test's keys never leak into the next."""
    host, port = url.removeprefix("etcd://").rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port), timeout=5)
    try:
        txn = client.transactions
        client.transaction(compare=[], success=[txn.delete(b"\0", range_end=b"\0")], failure=[])
    finally:
        client.close()


@pytest.fixture
def etcd_registry_url(etcd_server: EtcdServer) -> str:
    """URL of the session etcd, emptied for this test."""
    _wipe_etcd(etcd_server.url)
    return etcd_server.url


# The registry's default connect timeout (2 s per endpoint) gives up soon on a dead endpoint. The
# suite's own etcd is alive but shares 2 loaded cores with every test, so it gets more. (The
# fixture failures once blamed on a slow handshake were gRPC failing the first call at once on a
# failed first connection attempt; the registry now waits out its window: test_etcd_backend.py.)
# Tests of dead endpoints pass their own connect_timeout.
SESSION_ETCD_CONNECT_TIMEOUT_S = 15.0


@pytest.fixture
def etcd_registry(etcd_registry_url: str) -> Iterator[EtcdRegistry]:
    """An EtcdRegistry on the emptied session etcd; closed after the test."""
    reg = EtcdRegistry(parse_etcd_url(etcd_registry_url)[0], connect_timeout_s=SESSION_ETCD_CONNECT_TIMEOUT_S)
    yield reg
    reg.close()


@pytest.fixture(params=["memory", pytest.param("etcd", marks=pytest.mark.etcd)])
def registry_url(request: pytest.FixtureRequest) -> str:
    """URL of an empty registry of each backend ("memory://" or the session etcd, wiped)."""
    if request.param == "memory":
        return "memory://"
    return request.getfixturevalue("etcd_registry_url")


@pytest.fixture
def registry(registry_url: str) -> Iterator[Registry]:
    """A fresh, empty registry of each backend; closed after the test."""
    if registry_url.startswith("etcd://"):
        registry_url += f"?connect_timeout={SESSION_ETCD_CONNECT_TIMEOUT_S:g}"
    reg = open_registry(registry_url)
    yield reg
    reg.close()


# --- order --------------------------------------------------------------------------------------


def _timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    return float(marker.args[0]) if marker is not None and marker.args else 0.0


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Longest modules first (a module's longest timeout is the proxy for its length), each
    module's tests kept together and in their order: on the parallel workers the long end-to-end
    tests start at once and the short ones fill the end, so no worker idles while another still
    runs a long test (and module-scoped fixtures are built once)."""
    longest: dict[str, float] = {}
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        module = item.nodeid.split("::", 1)[0]
        longest[module] = max(longest.get(module, 0.0), _timeout_of(item))
        first_seen.setdefault(module, index)
    items.sort(
        key=lambda it: (-longest[it.nodeid.split("::", 1)[0]], first_seen[it.nodeid.split("::", 1)[0]])
    )
