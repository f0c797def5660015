"""Small helpers for the registry tests: backend-appropriate TTLs and a watch-event recorder."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from core_service.registry import EtcdRegistry, KVEvent, Registry

MEMORY_TTL_S = 0.5
ETCD_TTL_S = 2.0  # etcd counts whole seconds; 2 s keeps a clear margin over its 500 ms expiry sweep
EXPIRY_SLACK_S = 1.0  # a lease must be gone within ttl + this


def lease_ttl(registry: Registry) -> float:
    return ETCD_TTL_S if isinstance(registry, EtcdRegistry) else MEMORY_TTL_S


class EventRecorder:
    """A watch callback that keeps every event and lets the test wait for a condition on them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._events: list[KVEvent] = []
        self.threads: set[int] = set()

    def __call__(self, event: KVEvent) -> None:
        with self._cond:
            self._events.append(event)
            self.threads.add(threading.get_ident())
            self._cond.notify_all()

    @property
    def events(self) -> list[KVEvent]:
        with self._cond:
            return list(self._events)

    def wait_for(self, predicate: Callable[[list[KVEvent]], bool], timeout_s: float) -> list[KVEvent]:
        """Block until ``predicate(events)`` holds; fail the test with what arrived if it never does."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(self._events):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(
                        f"condition not met within {timeout_s:.1f} s; events: {self._events}"
                    )
                self._cond.wait(remaining)
            return list(self._events)

    def wait_for_key(self, kind: str, key: str, timeout_s: float) -> list[KVEvent]:
        return self.wait_for(lambda evs: any(e.kind == kind and e.key == key for e in evs), timeout_s)
