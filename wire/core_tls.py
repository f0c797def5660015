"""How a client (launcher, agent, node multiplexer, worker) reaches a Core that serves TLS.

A Core serves gRPC over TLS with `tls_cert`/`tls_key` (and asks for client certificates with
`tls_client_ca`: mTLS) and REST over HTTPS with `http_tls_cert`/`http_tls_key`
(core_service.config). Its clients then need the CA bundle that signed the Core's certificate
and, for mTLS, a client certificate and key. The same three files travel everywhere through
the environment, so a launcher hands them to its agents and workers unchanged:

    ELASWAVE_CORE_TLS_CA     PEM CA bundle: speak TLS to the Core (gRPC and REST) and verify it
    ELASWAVE_CORE_TLS_CERT   PEM client certificate (mTLS; with the key, needs the CA)
    ELASWAVE_CORE_TLS_KEY    PEM client private key

Without a CA bundle the client speaks plaintext, as before: a plaintext client of a TLS-only
Core gets a clear error (`plaintext_hint`) instead of a silent hang.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

CA_ENV = "ELASWAVE_CORE_TLS_CA"
CERT_ENV = "ELASWAVE_CORE_TLS_CERT"
KEY_ENV = "ELASWAVE_CORE_TLS_KEY"


class TlsConfigError(ValueError):
    """The TLS settings are incomplete or a file cannot be read; the message names which."""


@dataclass(frozen=True)
class CoreTls:
    """The files a client needs to reach a TLS Core: a CA bundle, and for mTLS a certificate
    and its key. `check` reads them once, so a wrong path fails at start, not at the first call."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def check(self) -> CoreTls:
        if (self.cert is None) != (self.key is None):
            raise TlsConfigError("a client certificate and its key go together (both or neither)")
        for what, path in (
            ("CA bundle", self.ca),
            ("client certificate", self.cert),
            ("client key", self.key),
        ):
            if path is not None and not path.is_file():
                raise TlsConfigError(f"TLS {what} {str(path)!r} is not a readable file")
        return self

    def env(self) -> dict[str, str]:
        """The environment that hands these files to a child process (agent, worker)."""
        out = {CA_ENV: str(self.ca.resolve())}
        if self.cert is not None and self.key is not None:
            out |= {CERT_ENV: str(self.cert.resolve()), KEY_ENV: str(self.key.resolve())}
        return out

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        try:
            return grpc.ssl_channel_credentials(
                root_certificates=self.ca.read_bytes(),
                private_key=self.key.read_bytes() if self.key else None,
                certificate_chain=self.cert.read_bytes() if self.cert else None,
            )
        except OSError as exc:
            raise TlsConfigError(f"cannot read TLS file {exc.filename}: {exc.strerror}") from None

    def ssl_context(self) -> ssl.SSLContext:
        """For HTTPS to the Core's REST API (httpx `verify=`): verifies the Core against the CA
        bundle and presents the client certificate when one is given."""
        try:
            context = ssl.create_default_context(cafile=str(self.ca))
            if self.cert is not None and self.key is not None:
                context.load_cert_chain(str(self.cert), str(self.key))
        except (OSError, ssl.SSLError) as exc:
            raise TlsConfigError(f"cannot load the TLS files ({self.ca}, {self.cert}): {exc}") from None
        return context


def from_env(env: Mapping[str, str] | None = None) -> CoreTls | None:
    """The TLS files the environment names (None: plaintext); TlsConfigError when incomplete."""
    env = os.environ if env is None else env
    ca, cert, key = (env.get(name) or None for name in (CA_ENV, CERT_ENV, KEY_ENV))
    if ca is None:
        if cert or key:
            raise TlsConfigError(f"${CERT_ENV}/${KEY_ENV} need ${CA_ENV} (the CA bundle of the Core)")
        return None
    return CoreTls(Path(ca), Path(cert) if cert else None, Path(key) if key else None).check()


def channel(address: str, tls: CoreTls | None) -> grpc.Channel:
    """A blocking gRPC channel to `address`, over TLS when `tls` is given."""
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.grpc_credentials())


def scheme(tls: CoreTls | None) -> str:
    return "http" if tls is None else "https"


def plaintext_hint(tls: CoreTls | None) -> str:
    """What to add to a connection error: a plaintext client of a TLS Core sees only a closed
    connection or an unreadable answer, so say what may be missing."""
    if tls is not None:
        return ""
    return (
        f" If the Core serves TLS, give its CA bundle (${CA_ENV} or --core-tls-ca; for mTLS also a "
        "client certificate and key)."
    )
