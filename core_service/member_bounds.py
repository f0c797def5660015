"""Bounded per-job membership state: a registration rate limit per job token, and compaction of
LOST and LEFT members beyond a bound (docs/control-plane.md, "Bounded state").

A job token holder that registers a new worker id and disconnects, in a loop, would otherwise
leave one LOST member per id in the job, in the Core's memory and in etcd, forever. Two bounds
stop it: new registrations pass a token bucket per job (reconnects of a live member with its own
credential do not, so a takeover's reconnect storm is never refused), and a job keeps at most
`gone_members_kept` gone members; the oldest beyond it are removed from the job and the
registry. Their history stays in the job's event log, which `events_kept` bounds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc

from core_service.grpc_util import RpcError


class RegistrationBucket:
    """Token bucket: `burst` registrations at once, refilled at `rate_per_s`. Hand-written rather
    than a rate-limit library because the refusal must say exactly when to retry."""

    __slots__ = ("rate_per_s", "burst", "_tokens", "_updated")

    def __init__(self, rate_per_s: float, burst: int, now: float) -> None:
        self.rate_per_s, self.burst = rate_per_s, burst
        self._tokens = float(burst)
        self._updated = now

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self._updated)  # a clock stepping back refills nothing
        self._tokens = min(float(self.burst), self._tokens + elapsed * self.rate_per_s)
        self._updated = now

    def take(self, now: float) -> float:
        """Takes one registration; 0.0 when allowed, else the seconds until one is."""
        self._refill(now)
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate_per_s


def rate_limited(job: str, worker_id: str, bucket: RegistrationBucket, retry_s: float) -> RpcError:
    """The refusal of a registration over the job token's rate: why, and when to retry."""
    return RpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"job {job!r}: new worker registrations with this job token are over its rate limit "
        f"({bucket.rate_per_s:g}/s, burst {bucket.burst}; Core settings registrations_per_s and "
        f"registration_burst): worker {worker_id!r} refused, retry in {retry_s:.2f} s",
    )


class GoneMembers:
    """The worker ids of a job's LOST and LEFT members, oldest departure first."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: dict[str, None] = {}  # insertion-ordered: a FIFO with O(1) removal

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def went(self, worker_id: str) -> None:
        self._order.pop(worker_id, None)
        self._order[worker_id] = None

    def returned(self, worker_id: str) -> None:
        self._order.pop(worker_id, None)

    def overflow(self, keep: int, protected: Callable[[str], bool]) -> list[str]:
        """The oldest ids beyond `keep`, skipping `protected` ones (which stay, and count). Scans
        at most the protected ids plus the excess: cheap enough for every leader tick."""
        excess = len(self._order) - keep
        chosen: list[str] = []
        if excess <= 0:
            return chosen
        for worker_id in self._order:
            if not protected(worker_id):
                chosen.append(worker_id)
                if len(chosen) == excess:
                    break
        return chosen
