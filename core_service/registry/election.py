"""Leader election over a registry lease: one key, held by the leader's lease.

A candidate wins by creating ``key`` (atomic put-if-absent) attached to a fresh lease, then keeps
the lease alive from a background thread every ``ttl/3``. Losers watch the key and retry when it
is deleted, which happens at once on ``resign()`` (the lease is revoked) and within the TTL when
the leader dies (the lease expires). Leadership is also bounded locally: ``is_leader`` turns
False once ``ttl`` has passed since the last refresh that was *sent* before it succeeded, which
is never later than the moment the backend lets the lease expire; so a partitioned leader stops
believing it leads before a standby can take over (docs/architecture.md ("Processes"): a second Core takes over with no
lost state).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from core_service.registry.base import (
    Fence,
    KVEvent,
    LeaseNotFound,
    Registry,
    RegistryError,
    check_key,
    check_ttl,
)

log = logging.getLogger(__name__)

# A standby re-reads the key at least this often, in case a watch event was missed.
_RECHECK_S = 0.5
# How often the keepalive thread asks the leader's watchdog whether it can still lead.
WATCHDOG_PERIOD_S = 0.1
# The key holds "<candidate><separator><term>": the term (the lease id, unique per grant) makes
# each term's fence distinct, so a write left over from an earlier term of the same candidate
# cannot pass the fence of a later one.
_TERM_SEPARATOR = "\n#term="


def holder_of(value: bytes) -> str:
    """The candidate id recorded in a leadership key's value (without its term)."""
    return value.decode("utf-8").split(_TERM_SEPARATOR, 1)[0]


class LeaderElection:
    """Campaign for, hold and give up the leadership recorded at ``key``."""

    def __init__(
        self,
        registry: Registry,
        key: str,
        candidate_id: str,
        ttl_s: float,
        on_lost: Callable[[], None] | None = None,
        stalled: Callable[[], str | None] | None = None,
    ) -> None:
        """`stalled`: the leader's watchdog, asked by the keepalive thread before every refresh;
        a reason (not None) means the process cannot act as leader (its event loop stopped
        turning), so the lease is revoked at once and a standby takes over."""
        self.stalled = stalled
        self._registry = registry
        self._key = check_key(key)
        if not isinstance(candidate_id, str) or not candidate_id:
            raise ValueError(f"candidate_id must be a non-empty string, got {candidate_id!r}")
        self._candidate = candidate_id
        self._ttl_s = check_ttl(ttl_s)
        self.on_lost = on_lost
        self._lock = threading.Lock()
        self._lease: int | None = None
        self._term: bytes | None = None  # the key's value in this candidate's latest term
        self._valid_until = 0.0
        self._stop_keepalive = threading.Event()
        self._keepalive: threading.Thread | None = None

    @property
    def candidate_id(self) -> str:
        return self._candidate

    @property
    def lease_id(self) -> int | None:
        """The lease holding the leadership key while leading, so other keys can share its life."""
        with self._lock:
            return self._lease

    @property
    def fence(self) -> Fence:
        """The condition "this candidate still holds the key", for writes only a leader may make
        (``Registry.put_fenced``): checked by the backend in the write's own transaction, so it
        holds even when this process's view of its lease is late."""
        with self._lock:
            term = self._term
        # After a lost term this is still that term's value (refused: the key holds another now);
        # before any term, a value no term stores, so every fenced write is refused.
        return Fence(self._key, term if term is not None else b"")

    def _term_value(self, lease: int) -> bytes:
        return f"{self._candidate}{_TERM_SEPARATOR}{lease:x}".encode()

    @property
    def is_leader(self) -> bool:
        with self._lock:
            return self._lease is not None and time.monotonic() < self._valid_until

    def leader_id(self) -> str | None:
        """Who holds the leadership now, as recorded in the registry (None: nobody)."""
        holder = self._registry.get(self._key)
        return None if holder is None else holder_of(holder)

    def campaign(self, timeout_s: float) -> bool:
        """Block until this candidate leads (True) or ``timeout_s`` passes (False)."""
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        if self.is_leader:
            return True
        deadline = time.monotonic() + timeout_s
        key_deleted = threading.Event()

        def on_change(event: KVEvent) -> None:
            if event.key == self._key and event.kind == "delete":
                key_deleted.set()

        with self._registry.watch_prefix(self._key, on_change):
            while True:
                key_deleted.clear()  # before the read, so a deletion after it still wakes us
                if self._registry.get(self._key) is None and self._try_acquire():
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                key_deleted.wait(min(remaining, _RECHECK_S))

    def resign(self) -> None:
        """Give up leadership now; the lease is revoked so a standby can take over at once."""
        lease = self._stop(reason="resigned")
        if lease is None:
            return
        # LeaseNotFound: it already expired, which released the key just the same.
        with contextlib.suppress(LeaseNotFound):
            self._registry.revoke_lease(lease)

    def abandon(self) -> None:
        """Stop refreshing without revoking, as a crashed leader would (tests, dying processes)."""
        self._stop(reason="abandoned")

    # internals

    def _try_acquire(self) -> bool:
        sent_at = time.monotonic()
        lease = self._registry.grant_lease(self._ttl_s)
        if not self._registry.create(self._key, self._term_value(lease), lease=lease):
            with contextlib.suppress(LeaseNotFound):
                self._registry.revoke_lease(lease)
            return False
        with self._lock:
            self._lease = lease
            self._term = self._term_value(lease)
            self._valid_until = sent_at + self._ttl_s
            self._stop_keepalive = threading.Event()
            self._keepalive = threading.Thread(
                target=self._keep_alive,
                args=(lease, self._stop_keepalive),
                name=f"election-keepalive:{self._candidate}",
                daemon=True,
            )
            self._keepalive.start()
        log.info("%s leads %s (lease %d)", self._candidate, self._key, lease)
        return True

    def _keep_alive(self, lease: int, stop: threading.Event) -> None:
        interval = self._ttl_s / 3
        next_refresh = time.monotonic() + interval
        # The watchdog is asked more often than the lease is refreshed, so a stall is acted on
        # within WATCHDOG_PERIOD_S of its bound, not a third of the TTL later.
        while not stop.wait(min(WATCHDOG_PERIOD_S, max(0.0, next_refresh - time.monotonic()))):
            reason = self.stalled() if self.stalled is not None else None
            if reason is not None:
                self._give_up(lease, reason)
                return
            if time.monotonic() < next_refresh:
                continue
            next_refresh = time.monotonic() + interval
            sent_at = time.monotonic()
            try:
                self._registry.refresh_lease(lease)
                holder = self._registry.get(self._key)
            except LeaseNotFound:
                self._lose(lease, "lease expired")
                return
            except RegistryError as exc:
                # Unreachable backend: keep trying while the lease may still be valid.
                if time.monotonic() + interval >= self._valid_until:
                    self._lose(lease, f"could not refresh the lease in time: {exc}")
                    return
                continue
            if holder != self._term_value(lease):
                self._lose(lease, f"key now held by {holder!r}")
                return
            with self._lock:
                if self._lease == lease:
                    self._valid_until = sent_at + self._ttl_s

    def _give_up(self, lease: int, reason: str) -> None:
        """The watchdog fired: stop leading and revoke the lease, so the key goes now."""
        self._lose(lease, f"watchdog: {reason}")
        try:
            self._registry.revoke_lease(lease)
        except RegistryError as exc:  # LeaseNotFound included: then it is gone already
            log.warning("%s could not revoke its lease (%s); it lapses within the TTL", self._candidate, exc)

    def _lose(self, lease: int, reason: str) -> None:
        with self._lock:
            if self._lease != lease:
                return  # already resigned or abandoned
            self._lease = None
            self._stop_keepalive.set()
        log.warning("%s lost leadership of %s: %s", self._candidate, self._key, reason)
        if self.on_lost is not None:
            try:
                self.on_lost()
            except Exception:
                log.exception("on_lost callback of %s failed", self._candidate)

    def _stop(self, reason: str) -> int | None:
        with self._lock:
            lease, self._lease = self._lease, None
            self._stop_keepalive.set()
            keepalive, self._keepalive = self._keepalive, None
        if keepalive is not None and keepalive is not threading.current_thread():
            keepalive.join(timeout=5.0)
        if lease is not None:
            log.info("%s %s leadership of %s", self._candidate, reason, self._key)
        return lease
