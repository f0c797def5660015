"""etcd v3 backend of the registry, built on python3-etcd3 (module ``etcd3``).

Atomic operations are etcd transactions (``transact``: absent is ``create_revision == 0``, else
``value == expected``; create, CAS and fenced writes are built on it in ``base``); lease expiry is
etcd's own, so the keys go and every watcher sees the deletions. Every RPC carries a deadline (``timeout_s``), and every connection failure surfaces as
``BackendUnavailable`` naming the endpoint.

The client's endpoints are built with ``time_retry=0``: etcd3's default parks an endpoint as
"failed" for 300 s after a single timeout, which would turn one slow call into five minutes of
refusals. gRPC's own reconnect backoff is capped at 1 s for the same reason.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import etcd3
import etcd3.exceptions
import grpc

from core_service.registry.base import (
    BackendUnavailable,
    LeaseNotFound,
    Registry,
    RegistryError,
    TxnResult,
    TxnWrite,
    WatchCallback,
    WatchHandle,
    check_callback,
    check_key,
    check_lease_id,
    check_optional_lease,
    check_prefix,
    check_transaction,
    check_ttl,
    check_value,
)
from core_service.registry.etcd_watch import EtcdPrefixWatch

log = logging.getLogger(__name__)
T = TypeVar("T")

GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # etcd refuses pings more often than every 5 s (--grpc-keepalive-min-time).
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 3_000),
]

# Exceptions etcd3 raises when the server cannot be reached or does not answer in time.
_UNREACHABLE = (
    etcd3.exceptions.ConnectionFailedError,
    etcd3.exceptions.ConnectionTimeoutError,
    etcd3.exceptions.NoServerAvailableError,
)
_UNREACHABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(frozen=True)
class EtcdEndpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class EtcdSecurity:
    """How the Core authenticates to etcd: TLS (the servers' CA, optionally a client certificate)
    and/or a user and password (etcd's own auth). All None: plaintext, no auth."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    user: str | None = None
    password: str | None = None

    def credentials(self) -> grpc.ChannelCredentials | None:
        if self.ca is None and self.cert is None:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


class EtcdRegistry(Registry):
    """Registry on an etcd v3 cluster; connects to the first endpoint that answers."""

    def __init__(
        self,
        endpoints: Sequence[EtcdEndpoint],
        timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        security: EtcdSecurity | None = None,
    ) -> None:
        self._security = security or EtcdSecurity()
        if not endpoints:
            raise ValueError("EtcdRegistry needs at least one endpoint")
        self._endpoints = tuple(endpoints)
        self._timeout_s = check_ttl(timeout_s)
        self._connect_timeout_s = check_ttl(connect_timeout_s)
        self._lock = threading.Lock()
        self._watches: list[EtcdPrefixWatch] = []
        self._closed = False
        self._stale = False  # the current endpoint failed; pick again on the next call
        self._client, self._endpoint = self._connect_first_reachable(wait_for_ready=True)

    @property
    def endpoint(self) -> EtcdEndpoint:
        """The endpoint in use."""
        return self._endpoint

    # leases

    def grant_lease(self, ttl_s: float) -> int:
        whole_seconds = max(1, math.ceil(check_ttl(ttl_s)))
        return self._call(f"grant a {whole_seconds} s lease", lambda c: c.lease(whole_seconds).id)

    def refresh_lease(self, lease_id: int) -> None:
        check_lease_id(lease_id, "lease_id")
        answers = self._call(f"refresh lease {lease_id}", lambda c: list(c.refresh_lease(lease_id)))
        if not answers or answers[0].TTL <= 0:
            raise LeaseNotFound(f"lease {lease_id} not found (expired, revoked or never granted)")

    def revoke_lease(self, lease_id: int) -> None:
        check_lease_id(lease_id, "lease_id")
        self._call(f"revoke lease {lease_id}", lambda c: c.revoke_lease(lease_id))

    # reads

    def get(self, key: str) -> bytes | None:
        check_key(key)
        value, _meta = self._call(f"get {key!r}", lambda c: c.get(key))
        return None if value is None else bytes(value)

    def get_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        check_prefix(prefix)
        response = self._call(f"get prefix {prefix!r}", lambda c: c.get_prefix_response(prefix))
        return sorted((kv.key.decode("utf-8"), bytes(kv.value)) for kv in response.kvs)

    # writes

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        key, value, lease = check_key(key), check_value(value), check_optional_lease(lease)
        response = self._call(_describe("put", key, lease), lambda c: c.put(key, value, lease=lease))
        return int(response.header.revision)

    def create(self, key: str, value: bytes, lease: int | None = None) -> bool:
        return self.compare_and_swap(key, None, value, lease)

    def transact(self, compares: Sequence[tuple[str, bytes | None]], writes: Sequence[TxnWrite]) -> TxnResult:
        checked_compares, checked_writes = check_transaction(compares, writes)

        def commit(client: etcd3.MultiEndpointEtcd3Client) -> TxnResult:
            txn = client.transactions
            guards = [
                txn.create(key) == 0 if expected is None else txn.value(key) == expected
                for key, expected in checked_compares
            ]
            ops = [
                txn.delete(w.key) if w.value is None else txn.put(w.key, w.value, lease=w.lease)
                for w in checked_writes
            ]
            # On failure the compared keys are read in the same revision: the caller learns what
            # held them (e.g. who leads now) without a second, racy read.
            succeeded, responses = client.transaction(
                compare=guards, success=ops, failure=[txn.get(key) for key, _ in checked_compares]
            )
            if succeeded:
                return TxnResult(True)
            return TxnResult(False, tuple(bytes(kvs[0][0]) if kvs else None for kvs in responses))

        first = checked_writes[0]
        return self._call(_describe("transaction writing", first.key, first.lease), commit)

    def delete(self, key: str) -> bool:
        check_key(key)
        return bool(self._call(f"delete {key!r}", lambda c: c.delete(key)))

    def delete_prefix(self, prefix: str) -> int:
        check_prefix(prefix)
        return int(self._call(f"delete prefix {prefix!r}", lambda c: c.delete_prefix(prefix)).deleted)

    # watches and lifecycle

    def watch_prefix(self, prefix: str, callback: WatchCallback) -> WatchHandle:
        check_prefix(prefix)
        check_callback(callback)
        self._session()
        watch = EtcdPrefixWatch(
            channel=lambda: self._session()[0].channel,
            metadata=lambda: self._session()[0].metadata,
            endpoint=lambda: str(self._endpoint),
            prefix=prefix,
            callback=callback,
            start_timeout_s=self._timeout_s,
            on_broken=self._mark_stale,
        )
        with self._lock:
            self._watches = [w for w in self._watches if w.active] + [watch]
        return watch

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            watches, self._watches = self._watches, []
        for watch in watches:
            watch.cancel()
        self._client.close()

    # connection handling

    def _connect_first_reachable(
        self, wait_for_ready: bool = False
    ) -> tuple[etcd3.MultiEndpointEtcd3Client, EtcdEndpoint]:
        """The first endpoint that answers. `wait_for_ready` (the first connect only): give each
        endpoint's channel the connect window before asking it. A reconnect after a loss asks at
        once: its callers retry, and calls queued behind the reconnect must not wait a window
        each while etcd is down."""
        failures = []
        for endpoint in self._endpoints:
            credentials = self._security.credentials()
            channel_end = etcd3.Endpoint(
                endpoint.host,
                endpoint.port,
                secure=credentials is not None,
                creds=credentials,
                time_retry=0,
                opts=GRPC_OPTIONS,
            )
            # A call on a channel that is not connected yet fails at once on the first failed
            # attempt (gRPC's fail-fast): a refused or cut connection then read as an endpoint
            # down, with most of the connect window unused (a session fixture once failed so on
            # a loaded machine, "tcp handshaker shutdown"). Give the channel the window to
            # connect, retrying at gRPC's reconnect backoff; the calls below then say why not.
            if wait_for_ready:
                with contextlib.suppress(grpc.FutureTimeoutError):
                    grpc.channel_ready_future(channel_end.channel).result(timeout=self._connect_timeout_s)
            try:
                client = etcd3.MultiEndpointEtcd3Client(
                    endpoints=[channel_end],
                    timeout=self._connect_timeout_s,
                    user=self._security.user,
                    password=self._security.password,
                )
            except (grpc.RpcError, etcd3.exceptions.Etcd3Exception) as exc:  # the login failed
                channel_end.close()
                failures.append(f"{endpoint} ({_reason(exc)})")
                continue
            try:
                client.status()
            except (grpc.RpcError, etcd3.exceptions.Etcd3Exception) as exc:
                client.close()
                failures.append(f"{endpoint} ({_reason(exc)})")
                continue
            client.timeout = self._timeout_s
            return client, endpoint
        raise BackendUnavailable(
            f"no etcd endpoint reachable within {self._connect_timeout_s:.1f} s each; tried: "
            + ", ".join(failures)
        )

    def _session(self) -> tuple[etcd3.MultiEndpointEtcd3Client, EtcdEndpoint]:
        with self._lock:
            if self._closed:
                raise RegistryError("the etcd registry is closed")
            if self._stale:
                old = self._client
                self._client, self._endpoint = self._connect_first_reachable()
                self._stale = False
                if old is not self._client:
                    old.close()
            return self._client, self._endpoint

    def _call(self, what: str, operation: Callable[[etcd3.MultiEndpointEtcd3Client], T]) -> T:
        client, endpoint = self._session()
        try:
            return operation(client)
        except _UNREACHABLE as exc:
            self._mark_stale()
            raise BackendUnavailable(f"etcd at {endpoint} unavailable during {what}: {_reason(exc)}") from exc
        except grpc.RpcError as exc:
            raise self._translate(exc, what, endpoint) from exc

    def _translate(self, exc: grpc.RpcError, what: str, endpoint: EtcdEndpoint) -> RegistryError:
        code, details = exc.code(), exc.details()
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in (details or ""):
            return LeaseNotFound(f"{what} failed: lease not found (expired, revoked or never granted)")
        if code in _UNREACHABLE_CODES:
            self._mark_stale()
            return BackendUnavailable(f"etcd at {endpoint} unavailable during {what}: {details}")
        return RegistryError(f"etcd at {endpoint} refused to {what}: {code.name}: {details}")

    def _mark_stale(self) -> None:
        # With one endpoint gRPC reconnects on its own; with several, the next call picks again.
        if len(self._endpoints) > 1:
            with self._lock:
                self._stale = True


def _describe(operation: str, key: str, lease: int | None) -> str:
    return f"{operation} {key!r}" + ("" if lease is None else f" with lease {lease}")


def _reason(exc: BaseException) -> str:
    """The most telling message: etcd3's own exceptions hide the gRPC details in their context."""
    for err in (exc, exc.__context__):
        if isinstance(err, grpc.RpcError):
            return f"{err.code().name}: {err.details()}"
    return str(exc) or type(exc).__name__
