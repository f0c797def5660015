"""Precomputed plans for the loss of 1..k workers (Chameleon §IV-A, last paragraph).

During fault-free training the planner computes the decision for every loss pattern of up to k
ranks, up to symmetry, so that at failure time the decision is a lookup. From a fault-free,
straggler-free state the DP replicas are interchangeable, so the canonical key of a failure set
is the sorted multiset of per-replica lost-stage sets; it keeps everything the policies here
depend on (which stages lost ranks, and which losses share a replica).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import combinations_with_replacement

from planners.chameleon.policy import DEFAULT_CHOICES, PolicyDecision, choose_policy
from planners.chameleon.state import ClusterState, JobShape

FailureKey = tuple[tuple[int, ...], ...]


def failure_key(shape: JobShape, failed: frozenset[int]) -> FailureKey:
    """Canonical form: sorted tuple of (sorted lost stages) for each replica that lost a rank."""
    per_replica: dict[int, list[int]] = {}
    for rank in failed:
        d, s = shape.position(rank)
        per_replica.setdefault(d, []).append(s)
    return tuple(sorted(tuple(sorted(stages)) for stages in per_replica.values()))


def representative(shape: JobShape, key: FailureKey) -> frozenset[int]:
    """A concrete failure set with this key: the i-th listed replica is replica i."""
    if len(key) > shape.dp:
        raise ValueError(f"key names {len(key)} replicas but the job has {shape.dp}")
    return frozenset(shape.rank(d, s) for d, stages in enumerate(key) for s in stages)


def failure_keys(shape: JobShape, max_failures: int) -> Iterator[FailureKey]:
    """Every canonical loss pattern of 1..max_failures ranks."""
    if max_failures < 1:
        raise ValueError(f"max_failures must be >= 1, got {max_failures}")
    seen: set[FailureKey] = set()
    for k in range(1, min(max_failures, shape.num_ranks) + 1):
        for ranks in _patterns(shape, k):
            key = failure_key(shape, ranks)
            if key not in seen:
                seen.add(key)
                yield key


def _patterns(shape: JobShape, k: int) -> Iterator[frozenset[int]]:
    # Up to symmetry, losses can be placed on replicas 0..k-1 in non-decreasing rank order.
    pool = [shape.rank(d, s) for d in range(min(k, shape.dp)) for s in range(shape.pp)]
    for combo in combinations_with_replacement(pool, k):
        if len(set(combo)) == k:
            yield frozenset(combo)


@dataclass(frozen=True)
class PlanCache:
    """Decisions keyed by canonical failure pattern, all computed from one base state."""

    base: ClusterState
    decisions: dict[FailureKey, PolicyDecision]
    reason: str

    def lookup(self, failed: frozenset[int]) -> PolicyDecision | None:
        return self.decisions.get(failure_key(self.base.shape, failed))


def precompute(base: ClusterState, max_failures: int, policies: Sequence[str] = DEFAULT_CHOICES) -> PlanCache:
    """Decide every loss pattern of 1..max_failures ranks ahead of time."""
    if base.failed:
        raise ValueError("precompute from a fault-free base state (its failed set must be empty)")
    decisions = {
        key: choose_policy(replace(base, failed=representative(base.shape, key)), policies)
        for key in failure_keys(base.shape, max_failures)
    }
    return PlanCache(
        base, decisions, f"precomputed {len(decisions)} loss patterns of 1..{max_failures} ranks"
    )
