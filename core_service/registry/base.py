"""The membership registry interface shared by the in-memory and the etcd backends.

The registry is the source of truth for membership, liveness, plans and Core leadership
(DESIGN.md §2, §5). It is a small synchronous key-value API with leases, atomic put-if-absent,
compare-and-swap and prefix watches; every method is thread-safe. The Core calls it from asyncio
through ``asyncio.to_thread``.

Key layout (``<prefix>`` is a deployment-wide namespace such as ``/elaswave``)::

    <prefix>/jobs/<job>/members/<worker>   member record (persistent, no lease)
    <prefix>/jobs/<job>/alive/<worker>     liveness key, attached to the agent's lease
    <prefix>/jobs/<job>/epoch              current plan epoch of the job (decimal ASCII)
    <prefix>/jobs/<job>/plans/<epoch>      plan JSON; epoch zero-padded to 20 digits
    <prefix>/jobs/<job>/events/<seq>       event log of the job (plans, decisions, effects)
    <prefix>/core/leader                   id of the leading Core, attached to its lease

Zero-padding makes lexicographic key order equal numeric order, so ``get_prefix`` returns plans
and events oldest first.

Semantics common to both backends:

- revisions are global and strictly increasing; ``put`` returns the revision of the write;
- a lease that expires or is revoked deletes every key attached to it, and each deletion reaches
  the watchers as a ``"delete"`` event;
- ``revoke_lease`` / ``refresh_lease`` / a write naming an unknown lease raise ``LeaseNotFound``;
- a write naming a lease checks it only when the write happens: ``create`` on an existing key
  returns False even if the lease is unknown (etcd evaluates the comparison first);
- bad input raises ``ValueError`` (or ``TypeError`` for a wrong type) before anything changes;
- a backend that cannot be reached raises ``BackendUnavailable`` (etcd: after the call's deadline
  at the latest), naming the endpoint.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal


class RegistryError(Exception):
    """Base class of every error the registry raises on purpose."""


class LeaseNotFound(RegistryError):
    """The lease expired, was revoked, or never existed."""


class BackendUnavailable(RegistryError):
    """The backend could not be reached (or did not answer in time)."""


@dataclass(frozen=True)
class KVEvent:
    """One change seen by a watch: a write (``value`` set) or a deletion (``value`` None)."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes | None
    revision: int


WatchCallback = Callable[[KVEvent], None]


class WatchHandle(ABC):
    """A running watch; its callback runs on a background thread until ``cancel``."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop delivering events; idempotent. Safe to call from inside the callback."""

    def __enter__(self) -> WatchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class Registry(ABC):
    """Synchronous, thread-safe key-value registry with leases and prefix watches."""

    @abstractmethod
    def grant_lease(self, ttl_s: float) -> int:
        """Create a lease that expires ``ttl_s`` seconds from now unless refreshed.

        etcd counts whole seconds: it rounds ``ttl_s`` up (at least 1 s) and may grant more
        than asked for (its minimum TTL depends on the cluster's election timeout).
        """

    @abstractmethod
    def refresh_lease(self, lease_id: int) -> None:
        """Restart the lease's TTL; raises ``LeaseNotFound`` when it expired or was revoked."""

    @abstractmethod
    def revoke_lease(self, lease_id: int) -> None:
        """End the lease now and delete every key attached to it."""

    @abstractmethod
    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        """Write ``key``; returns the revision of the write."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """Value of ``key``, or None when absent."""

    @abstractmethod
    def get_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        """Every ``(key, value)`` whose key starts with ``prefix``, sorted by key."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Delete ``key``; True when it existed."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; returns how many were deleted."""

    @abstractmethod
    def create(self, key: str, value: bytes, lease: int | None = None) -> bool:
        """Atomically write ``key`` only if it is absent; True when this call wrote it."""

    @abstractmethod
    def compare_and_swap(
        self, key: str, expected: bytes | None, value: bytes, lease: int | None = None,
        also: Sequence[tuple[str, bytes]] = (),
    ) -> bool:
        """Atomically write ``key`` if its value equals ``expected`` (None: must be absent), and
        in the same transaction every ``(key, value)`` of ``also`` (no lease): all or nothing."""

    @abstractmethod
    def watch_prefix(self, prefix: str, callback: WatchCallback) -> WatchHandle:
        """Call ``callback`` for every change under ``prefix`` made after this call returns."""

    @abstractmethod
    def close(self) -> None:
        """Cancel every watch and release the backend; idempotent."""

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Input checks shared by both backends, so both reject exactly the same things with the same words.


def check_key(key: object, what: str = "key") -> str:
    if not isinstance(key, str):
        raise TypeError(f"{what} must be a str, got {type(key).__name__}")
    if not key:
        raise ValueError(f"{what} must be a non-empty string")
    if "\x00" in key:
        raise ValueError(f"{what} must not contain NUL characters: {key!r}")
    return key


def check_prefix(prefix: object) -> str:
    # An empty prefix would address the whole keyspace (delete_prefix("") would wipe everything).
    return check_key(prefix, "prefix")


def check_value(value: object, what: str = "value") -> bytes:
    if not isinstance(value, bytes | bytearray):
        raise TypeError(f"{what} must be bytes, got {type(value).__name__}")
    return bytes(value)


def check_writes(also: object) -> list[tuple[str, bytes]]:
    """The extra ``(key, value)`` writes of a transaction, checked; keys must be distinct."""
    if isinstance(also, str | bytes) or not isinstance(also, Sequence):
        raise TypeError(f"also must be a sequence of (key, value) pairs, got {type(also).__name__}")
    writes = []
    for item in also:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"also must hold (key, value) pairs, got {item!r}")
        writes.append((check_key(item[0]), check_value(item[1], f"value of {item[0]!r}")))
    if len({k for k, _ in writes}) != len(writes):
        raise ValueError("also names a key twice")
    return writes


def check_ttl(ttl_s: object) -> float:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float):
        raise TypeError(f"ttl_s must be a number of seconds, got {type(ttl_s).__name__}")
    if not math.isfinite(ttl_s) or ttl_s <= 0:
        raise ValueError(f"ttl_s must be a positive finite number of seconds, got {ttl_s!r}")
    return float(ttl_s)


def check_lease_id(lease: object, what: str = "lease") -> int:
    if isinstance(lease, bool) or not isinstance(lease, int):
        raise TypeError(f"{what} must be an int lease id, got {type(lease).__name__}")
    if lease <= 0:
        raise ValueError(f"{what} must be a positive lease id, got {lease}")
    return lease


def check_optional_lease(lease: object) -> int | None:
    return None if lease is None else check_lease_id(lease)


def check_callback(callback: object) -> WatchCallback:
    if not callable(callback):
        raise TypeError(f"callback must be callable, got {type(callback).__name__}")
    return callback
