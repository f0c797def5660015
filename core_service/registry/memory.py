"""Embedded in-memory registry: the default backend for single-machine runs and the demo.

It follows the etcd semantics the rest of the system relies on (docs/architecture.md ("Processes")): a global revision
counter, leases whose expiry deletes their keys in one revision, and watches that see those
deletions. One lock guards the state; every change is queued to the watchers while that lock is
held, so each watch receives events in revision order. Each watch delivers on its own thread, so
a slow callback delays only itself.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from core_service.registry.base import (
    KVEvent,
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

log = logging.getLogger(__name__)

# Expiry is checked at least this often, so a lease ends at most this late.
EXPIRY_CHECK_S = 0.05


@dataclass
class _Entry:
    value: bytes
    lease: int | None


@dataclass
class _Lease:
    ttl_s: float
    deadline: float
    keys: set[str] = field(default_factory=set)


class _MemoryWatch(WatchHandle):
    def __init__(self, owner: MemoryRegistry, prefix: str, callback: WatchCallback) -> None:
        self.prefix = prefix
        self._owner = owner
        self._callback = callback
        self._queue: queue.SimpleQueue[KVEvent | None] = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._deliver, name=f"memwatch:{prefix}", daemon=True)
        self._thread.start()

    def offer(self, event: KVEvent) -> None:
        if event.key.startswith(self.prefix):
            self._queue.put(event)

    def _deliver(self) -> None:
        while (event := self._queue.get()) is not None:
            if self._cancelled.is_set():
                return
            try:
                self._callback(event)
            except Exception:
                log.exception("watch callback for prefix %r failed on %s", self.prefix, event)

    def cancel(self) -> None:
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        self._owner._forget_watch(self)
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)


class MemoryRegistry(Registry):
    """The registry held in this process's memory; nothing persists past ``close``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, _Entry] = {}
        self._leases: dict[int, _Lease] = {}
        self._watches: list[_MemoryWatch] = []
        self._revision = 0
        self._lease_ids = itertools.count(1)
        self._closed = threading.Event()
        self._expirer = threading.Thread(target=self._expire_loop, name="memregistry-expiry", daemon=True)
        self._expirer.start()

    # leases

    def grant_lease(self, ttl_s: float) -> int:
        ttl = check_ttl(ttl_s)
        with self._lock:
            self._check_open()
            lease_id = next(self._lease_ids)
            self._leases[lease_id] = _Lease(ttl_s=ttl, deadline=time.monotonic() + ttl)
            return lease_id

    def refresh_lease(self, lease_id: int) -> None:
        check_lease_id(lease_id, "lease_id")
        with self._lock:
            self._check_open()
            lease = self._live_lease(lease_id)
            lease.deadline = time.monotonic() + lease.ttl_s

    def revoke_lease(self, lease_id: int) -> None:
        check_lease_id(lease_id, "lease_id")
        with self._lock:
            self._check_open()
            self._live_lease(lease_id)
            self._end_lease_locked(lease_id)

    # reads

    def get(self, key: str) -> bytes | None:
        check_key(key)
        with self._lock:
            self._check_open()
            entry = self._data.get(key)
            return None if entry is None else entry.value

    def get_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        check_prefix(prefix)
        with self._lock:
            self._check_open()
            found = [(k, e.value) for k, e in self._data.items() if k.startswith(prefix)]
        return sorted(found)

    # writes

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        key, value, lease = check_key(key), check_value(value), check_optional_lease(lease)
        with self._lock:
            self._check_open()
            return self._put_locked(key, value, lease)

    def create(self, key: str, value: bytes, lease: int | None = None) -> bool:
        return self.compare_and_swap(key, None, value, lease)

    def transact(self, compares: Sequence[tuple[str, bytes | None]], writes: Sequence[TxnWrite]) -> TxnResult:
        checked_compares, checked_writes = check_transaction(compares, writes)
        with self._lock:
            self._check_open()
            current = tuple(self._value_locked(key) for key, _ in checked_compares)
            if any(now != expected for now, (_, expected) in zip(current, checked_compares, strict=True)):
                return TxnResult(False, current)
            for write in checked_writes:
                if write.lease is not None:
                    self._live_lease(write.lease)  # fail before writing anything
            self._apply_locked(checked_writes)
            return TxnResult(True)

    def delete(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            self._check_open()
            if key not in self._data:
                return False
            self._revision += 1
            self._remove_locked(key)
            return True

    def delete_prefix(self, prefix: str) -> int:
        check_prefix(prefix)
        with self._lock:
            self._check_open()
            doomed = sorted(k for k in self._data if k.startswith(prefix))
            if doomed:
                self._revision += 1
                for key in doomed:
                    self._remove_locked(key)
            return len(doomed)

    # watches and lifecycle

    def watch_prefix(self, prefix: str, callback: WatchCallback) -> WatchHandle:
        check_prefix(prefix)
        check_callback(callback)
        with self._lock:
            self._check_open()
            watch = _MemoryWatch(self, prefix, callback)
            self._watches.append(watch)
            return watch

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            watches = list(self._watches)
        for watch in watches:
            watch.cancel()
        self._expirer.join(timeout=5.0)

    # internals; the *_locked methods expect self._lock to be held

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise RegistryError("the in-memory registry is closed")

    def _live_lease(self, lease_id: int) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None or lease.deadline <= time.monotonic():
            raise LeaseNotFound(f"lease {lease_id} not found (expired, revoked or never granted)")
        return lease

    def _value_locked(self, key: str) -> bytes | None:
        entry = self._data.get(key)
        return None if entry is None else entry.value

    def _apply_locked(self, writes: list[TxnWrite]) -> None:
        # Like etcd, a transaction's writes share one revision; deleting nothing changes nothing.
        if all(w.value is None and w.key not in self._data for w in writes):
            return
        self._revision += 1
        for write in writes:
            if write.value is not None:
                self._set_locked(write.key, write.value, write.lease)
            elif write.key in self._data:
                self._remove_locked(write.key)

    def _put_locked(self, key: str, value: bytes, lease_id: int | None) -> int:
        if lease_id is not None:
            self._live_lease(lease_id)  # fail before the revision moves
        self._revision += 1
        self._set_locked(key, value, lease_id)
        return self._revision

    def _set_locked(self, key: str, value: bytes, lease_id: int | None) -> None:
        """Write ``key`` at the current revision (the caller has already bumped it)."""
        new_lease = None if lease_id is None else self._live_lease(lease_id)
        old = self._data.get(key)
        if old is not None and old.lease is not None and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        if new_lease is not None:
            new_lease.keys.add(key)
        self._data[key] = _Entry(value=value, lease=lease_id)
        self._emit_locked(KVEvent("put", key, value, self._revision))

    def _remove_locked(self, key: str) -> None:
        """Delete ``key`` at the current revision (the caller has already bumped it)."""
        entry = self._data.pop(key)
        if entry.lease is not None and entry.lease in self._leases:
            self._leases[entry.lease].keys.discard(key)
        self._emit_locked(KVEvent("delete", key, None, self._revision))

    def _end_lease_locked(self, lease_id: int) -> None:
        # Like etcd, every key of the lease goes in one revision.
        lease = self._leases.pop(lease_id)
        if lease.keys:
            self._revision += 1
            for key in sorted(lease.keys):
                self._remove_locked(key)

    def _emit_locked(self, event: KVEvent) -> None:
        for watch in self._watches:
            watch.offer(event)

    def _forget_watch(self, watch: _MemoryWatch) -> None:
        with self._lock:
            if watch in self._watches:
                self._watches.remove(watch)

    def _expire_loop(self) -> None:
        while not self._closed.wait(EXPIRY_CHECK_S):
            now = time.monotonic()
            with self._lock:
                expired = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
                for lease_id in expired:
                    self._end_lease_locked(lease_id)
