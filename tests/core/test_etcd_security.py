"""The Core's etcd connection with TLS (client certificates) and with etcd's user authentication,
against real etcd servers configured to require them. The defect: the etcd client was plaintext
with no authentication, so a Core could not use an etcd that requires either."""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

import pytest

from core_service.config import load_settings
from core_service.core import Core, etcd_security
from core_service.registry import EtcdSecurity, KVEvent, open_registry
from core_service.registry.base import RegistryError
from tests.core.test_mtls import make_pki
from tests.etcd_server import EtcdServer

pytestmark = pytest.mark.etcd

PASSWORD = "etcd-root-password-0123"


class TlsEtcd(EtcdServer):
    """An etcd whose clients must speak TLS (and, with `client_certs`, present a certificate
    signed by `ca.crt`)."""

    def __init__(self, pki: Path, client_certs: bool = True) -> None:
        super().__init__()
        self.pki = pki
        self.client_certs = client_certs

    def _command(self) -> list[str]:
        plain = f"http://127.0.0.1:{self.client_port}"
        secure = f"https://127.0.0.1:{self.client_port}"
        command = [arg.replace(plain, secure) for arg in super()._command()]
        return command + [
            f"--cert-file={self.pki / 'core.crt'}",
            f"--key-file={self.pki / 'core.key'}",
            f"--trusted-ca-file={self.pki / 'ca.crt'}",
            *(["--client-cert-auth"] if self.client_certs else []),
        ]

    def _healthy(self) -> bool:
        if not self._listening_on_client_port():
            return False
        context = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        context.load_cert_chain(str(self.pki / "client.crt"), str(self.pki / "client.key"))
        try:
            with urllib.request.urlopen(f"https://{self.endpoint}/health", timeout=1.0, context=context) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    make_pki(tmp_path)
    return tmp_path


@pytest.fixture
def tls_etcd(pki: Path) -> Iterator[TlsEtcd]:
    server = TlsEtcd(pki).start()
    yield server
    server.stop()


@pytest.fixture
def auth_etcd(pki: Path) -> Iterator[EtcdServer]:
    server = TlsEtcd(pki, client_certs=False).start()
    tls = [f"--cacert={pki / 'ca.crt'}", f"--cert={pki / 'client.crt'}", f"--key={pki / 'client.key'}"]
    endpoint = f"--endpoints=https://{server.endpoint}"
    for args in (
        ["user", "add", "root", f"--new-user-password={PASSWORD}", "--interactive=false"],
        ["user", "grant-role", "root", "root"],
        ["auth", "enable"],
    ):
        subprocess.run(["etcdctl", endpoint, *tls, *args], check=True, capture_output=True, timeout=20)
    yield server
    server.stop()


def round_trip(security: EtcdSecurity, url: str) -> list[str]:
    """A put seen by a get and by a watch, through a registry opened with `security`."""
    registry = open_registry(url + "?connect_timeout=2", security)
    seen: list[str] = []
    arrived = threading.Event()

    def on_event(event: KVEvent) -> None:
        seen.append(f"{event.kind}:{event.key}")
        arrived.set()

    try:
        with registry.watch_prefix("/sec/", on_event):
            registry.put("/sec/a", b"1")
            assert registry.get("/sec/a") == b"1"
            assert arrived.wait(5), "the watch delivered nothing"
    finally:
        registry.close()
    return seen


@pytest.mark.timeout(60)
def test_etcd_over_tls_with_a_client_certificate(tls_etcd: TlsEtcd, pki: Path) -> None:
    url = f"etcd://{tls_etcd.endpoint}"
    with pytest.raises(RegistryError):  # plaintext, as before: refused
        open_registry(url + "?connect_timeout=1")
    with pytest.raises(RegistryError):  # TLS without a client certificate: refused
        open_registry(url + "?connect_timeout=1", EtcdSecurity(ca=(pki / "ca.crt").read_bytes()))
    settings = load_settings(
        dev_mode=True,
        registry_url=url,
        etcd_ca=pki / "ca.crt",
        etcd_cert=pki / "client.crt",
        etcd_key=pki / "client.key",
    )
    assert round_trip(etcd_security(settings), url) == ["put:/sec/a"]


class _ClientTls(TypedDict):
    """EtcdSecurity's TLS fields: the CA, and this client's certificate and key (PEM)."""

    ca: bytes
    cert: bytes
    key: bytes


@pytest.mark.timeout(60)
def test_etcd_with_user_authentication(auth_etcd: EtcdServer, pki: Path) -> None:
    url = f"etcd://{auth_etcd.endpoint}"
    tls: _ClientTls = {
        "ca": (pki / "ca.crt").read_bytes(),
        "cert": (pki / "client.crt").read_bytes(),
        "key": (pki / "client.key").read_bytes(),
    }
    with pytest.raises(RegistryError):
        open_registry(url + "?connect_timeout=1", EtcdSecurity(**tls, user="root", password="wrong-password"))
    with pytest.raises(RegistryError):  # no user: etcd refuses every request
        round_trip(EtcdSecurity(**tls), url)
    login = {
        "registry_url": url,
        "etcd_ca": pki / "ca.crt",
        "etcd_cert": pki / "client.crt",
        "etcd_key": pki / "client.key",
        "etcd_user": "root",
        "etcd_password": PASSWORD,
    }
    assert round_trip(etcd_security(load_settings(dev_mode=True, **login)), url) == ["put:/sec/a"]
    # A Core configured so leads on it: its election, fenced writes and watches all authenticate.
    core = Core(load_settings(dev_mode=True, grpc_port=0, http_port=0, **login))

    async def lead() -> bool:
        await core.start()
        try:
            return await core.wait_leader(10)
        finally:
            await core.stop()

    assert asyncio.run(lead())
