"""The agent's own etcd liveness lease on ``<prefix>/jobs/<job>/alive/<worker>`` (docs/architecture.md ("Processes")).

While the agent lives the key exists; when the agent (or its node) dies the lease runs out and
etcd deletes the key, which the Core watches: node loss is detected even with no stream to close.
The lease is refreshed every TTL/3; if it expired anyway (a stall longer than the TTL, an etcd
outage) it is granted again and the key rewritten. etcd v3 only, through the ``etcd3`` module;
its blocking calls run in a thread, each bounded by the client timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable

import etcd3

from agent.config import Address
from agent.logs import log_event


class AliveLease:
    def __init__(
        self, etcd: Address, key: str, describe: Callable[[], dict[str, object]], ttl_s: int, timeout_s: float
    ) -> None:
        self.etcd = etcd
        self.key = key
        self.ttl_s = ttl_s
        self.grants = 0
        self._describe = describe
        self._timeout_s = timeout_s
        self._client: etcd3.Etcd3Client | None = None
        self._lease_id: int | None = None
        self.held = False  # True while a live lease carries the key
        # One etcd call at a time: a refresh still running in its thread when shutdown revokes
        # must not grant a fresh lease behind the revoke.
        self._lock = threading.Lock()
        self._closed = False

    async def run(self) -> None:
        """Hold the lease until cancelled; never raises for an etcd problem, keeps retrying."""
        while True:
            try:
                await asyncio.to_thread(self._keep)
            except Exception as exc:  # any etcd/gRPC failure: drop the client, try again next round
                log_event(logging.WARNING, "etcd_lease_error", etcd=self.etcd, key=self.key, error=repr(exc))
                self.held = False
                await asyncio.to_thread(self._drop_client)
            await asyncio.sleep(self.ttl_s / 3)

    def _keep(self) -> None:
        """Refresh the lease, or grant a new one and write the key when there is none."""
        with self._lock:
            if not self._closed:
                self._keep_locked()

    def _keep_locked(self) -> None:
        client = self._connect()
        if self._lease_id is not None:
            # etcd answers a keep-alive for an expired lease with TTL 0.
            responses = list(client.refresh_lease(self._lease_id))
            if responses and responses[0].TTL > 0:
                return
            log_event(logging.WARNING, "etcd_lease_expired", key=self.key, lease=self._lease_id)
            self._lease_id = None
            self.held = False
        lease = client.lease(self.ttl_s)
        client.put(self.key, json.dumps(self._describe(), sort_keys=True), lease=lease)
        self._lease_id = lease.id
        self.grants += 1
        self.held = True
        log_event(
            logging.INFO,
            "etcd_lease_granted",
            key=self.key,
            lease=lease.id,
            ttl_s=self.ttl_s,
            grants=self.grants,
        )

    def _connect(self) -> etcd3.Etcd3Client:
        # A fresh client after every error: etcd3 marks a failed endpoint unusable for 300 s.
        if self._client is None:
            self._client = etcd3.client(host=self.etcd.host, port=self.etcd.port, timeout=self._timeout_s)
        return self._client

    def _drop_client(self) -> None:
        with self._lock:
            client, self._client = self._client, None
            if client is not None:
                client.close()

    async def revoke(self) -> None:
        """Delete the key now (clean shutdown), best effort within the client timeout."""
        try:
            lease_id = await asyncio.to_thread(self._revoke_locked)
            if lease_id is not None:
                log_event(logging.INFO, "etcd_lease_revoked", key=self.key, lease=lease_id)
        except Exception as exc:  # best effort: the TTL removes the key anyway
            log_event(logging.WARNING, "etcd_lease_revoke_failed", key=self.key, error=repr(exc))
        finally:
            self.held = False
            await asyncio.to_thread(self._drop_client)

    def _revoke_locked(self) -> int | None:
        with self._lock:
            self._closed = True
            lease_id, self._lease_id = self._lease_id, None
            if lease_id is not None:
                self._connect().revoke_lease(lease_id)
            return lease_id
