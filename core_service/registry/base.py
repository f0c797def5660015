"""The membership registry interface shared by the in-memory and the etcd backends.

The registry is the source of truth for membership, liveness, plans and Core leadership
(docs/architecture.md ("Processes", "The Core's decisions")). It is a small synchronous key-value API with leases, atomic put-if-absent,
compare-and-swap and prefix watches; every method is thread-safe. The Core calls it from asyncio
through ``asyncio.to_thread``.

Key layout (``<prefix>`` is a deployment-wide namespace such as ``/elaswave``)::

    <prefix>/jobs/<job>/members/<worker>   member record (persistent, no lease)
    <prefix>/jobs/<job>/alive/<worker>     liveness key, attached to the agent's lease
    <prefix>/jobs/<job>/epoch              current plan epoch of the job (decimal ASCII)
    <prefix>/jobs/<job>/plans/<epoch>      plan JSON; epoch zero-padded to 20 digits
    <prefix>/jobs/<job>/events/<seq>       event log of the job (plans, decisions, effects)
    <prefix>/jobs/<job>/recovery           retry bounds, retry request, committed epoch
    <prefix>/rendezvous/<job>              nodes of an `elaswave run --core` job joining, or
                                           the answers of a formed one (bounded count)
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
- ``transact`` is the one atomic primitive: compare some keys' values, then apply every write
  (puts and deletes) or none. ``create``, ``compare_and_swap`` and the fenced writes
  (``put_fenced`` / ``delete_fenced``: only while a ``Fence`` key, e.g. the leader key, holds
  the expected value, else ``FenceLost``) are built on it;
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
class Fence:
    """A condition on writes: ``key`` must hold exactly ``value`` when they happen. The leading
    Core fences its writes with the leader key and its election entry, so once another Core
    leads (or nobody does) they are refused instead of overwriting the successor's records."""

    key: str
    value: bytes


class FenceLost(RegistryError):
    """A fenced write was refused: the fence key no longer holds the expected value. Nothing of
    the write was stored; ``holder`` is what the fence key held instead (None: absent)."""

    def __init__(self, fence: Fence, holder: bytes | None, what: str) -> None:
        self.fence = fence
        self.holder = holder
        now = "is absent" if holder is None else f"holds {holder!r}"
        super().__init__(
            f"{what} refused: fence {fence.key!r} {now}, not {fence.value!r}; nothing was written"
        )


@dataclass(frozen=True)
class TxnWrite:
    """One write of a transaction: a put (``value`` set, optionally attached to ``lease``) or a
    delete (``value`` None)."""

    key: str
    value: bytes | None
    lease: int | None = None


@dataclass(frozen=True)
class TxnResult:
    """Whether a transaction's comparisons held (and its writes were applied); when they did not,
    ``current`` holds each compared key's value at that revision (None: absent), in order."""

    succeeded: bool
    current: tuple[bytes | None, ...] = ()


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
    def transact(self, compares: Sequence[tuple[str, bytes | None]], writes: Sequence[TxnWrite]) -> TxnResult:
        """Atomically: if every ``(key, expected)`` of ``compares`` holds (``expected`` None: the
        key must be absent), apply every write of ``writes`` in one revision; else apply none.
        Inputs are checked with ``check_transaction`` before anything is sent; a write naming an
        unknown lease raises ``LeaseNotFound`` (only once the comparisons held) and writes nothing."""

    def compare_and_swap(
        self,
        key: str,
        expected: bytes | None,
        value: bytes,
        lease: int | None = None,
        also: Sequence[tuple[str, bytes]] = (),
        fence: Fence | None = None,
    ) -> bool:
        """Atomically write ``key`` if its value equals ``expected`` (None: must be absent), and
        in the same transaction every ``(key, value)`` of ``also`` (no lease): all or nothing.
        With ``fence``, only while the fence holds too; else ``FenceLost`` and nothing is written."""
        key, value, lease = check_key(key), check_value(value), check_optional_lease(lease)
        companions = check_writes(also)
        if key in {k for k, _ in companions}:
            raise ValueError(f"also names the compared key {key!r}")
        if expected is not None:
            expected = check_value(expected, "expected")
        compares: list[tuple[str, bytes | None]] = [(key, expected)]
        if fence is not None:
            fence = check_fence(fence)
            if fence.key == key or fence.key in {k for k, _ in companions}:
                raise ValueError(f"a fenced write must not write its own fence key {fence.key!r}")
            compares.append((fence.key, fence.value))
        writes = [TxnWrite(key, value, lease), *(TxnWrite(k, v) for k, v in companions)]
        result = self.transact(compares, writes)
        if fence is not None and not result.succeeded and result.current[1] != fence.value:
            raise FenceLost(fence, result.current[1], f"compare-and-swap of {key!r}")
        return result.succeeded

    def put_fenced(self, fence: Fence, key: str, value: bytes, lease: int | None = None) -> None:
        """Write ``key`` (attached to ``lease`` if given) only while ``fence.key`` holds
        ``fence.value``, in one transaction; otherwise raise ``FenceLost`` and write nothing."""
        write = TxnWrite(check_key(key), check_value(value), check_optional_lease(lease))
        self._write_fenced(fence, write, f"put {key!r}")

    def delete_fenced(self, fence: Fence, key: str) -> None:
        """Delete ``key`` (absent: nothing to do) only while ``fence.key`` holds ``fence.value``,
        in one transaction; otherwise raise ``FenceLost`` and delete nothing."""
        self._write_fenced(fence, TxnWrite(check_key(key), None), f"delete {key!r}")

    def _write_fenced(self, fence: Fence, write: TxnWrite, what: str) -> None:
        fence = check_fence(fence)
        if write.key == fence.key:
            raise ValueError(f"a fenced write must not write its own fence key {fence.key!r}")
        result = self.transact([(fence.key, fence.value)], [write])
        if not result.succeeded:
            raise FenceLost(fence, result.current[0], what)

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


def check_fence(fence: object) -> Fence:
    if not isinstance(fence, Fence):
        raise TypeError(f"fence must be a Fence, got {type(fence).__name__}")
    check_key(fence.key, "fence key")
    check_value(fence.value, "fence value")
    return fence


def check_transaction(
    compares: object, writes: object
) -> tuple[list[tuple[str, bytes | None]], list[TxnWrite]]:
    """A transaction's comparisons and writes, checked: at least one write, distinct write keys
    (etcd refuses a key written twice in one transaction)."""
    if isinstance(compares, str | bytes) or not isinstance(compares, Sequence):
        raise TypeError(
            f"compares must be a sequence of (key, expected) pairs, got {type(compares).__name__}"
        )
    if isinstance(writes, str | bytes) or not isinstance(writes, Sequence):
        raise TypeError(f"writes must be a sequence of TxnWrite, got {type(writes).__name__}")
    checked_compares = [_check_compare(item) for item in compares]
    checked_writes = [_check_txn_write(item) for item in writes]
    if not checked_writes:
        raise ValueError("a transaction needs at least one write")
    if len({w.key for w in checked_writes}) != len(checked_writes):
        raise ValueError("the transaction writes a key twice")
    return checked_compares, checked_writes


def _check_compare(item: object) -> tuple[str, bytes | None]:
    if not (isinstance(item, tuple) and len(item) == 2):
        raise TypeError(f"compares must hold (key, expected) pairs, got {item!r}")
    key, expected = item
    return check_key(key), None if expected is None else check_value(expected, f"expected value of {key!r}")


def _check_txn_write(item: object) -> TxnWrite:
    if not isinstance(item, TxnWrite):
        raise TypeError(f"writes must hold TxnWrite items, got {item!r}")
    value = None if item.value is None else check_value(item.value, f"value of {item.key!r}")
    if value is None and item.lease is not None:
        raise ValueError(f"a delete of {item.key!r} cannot name a lease")
    return TxnWrite(check_key(item.key), value, check_optional_lease(item.lease))


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
