"""Per-group op accounting, so an edit can tell a clean group from a half-matched one.

Gloo gives no way to cancel an op. When a survivor abandons an op because another peer failed,
its peers may have issued (or even completed) the matching op. A group is reusable only if, for
every member, nothing is pending, nothing failed, every member issued the same number of
collectives, and every send has its matching receive.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class GroupLedger:
    # Which group object this is: the epoch it was built (or shrunk) in and its members. Workers
    # whose recoveries diverged (one finished an edit another abandoned) may hold different
    # objects under one name; such a group is never reused.
    built: int = 0
    workers: tuple[int, ...] = ()
    collectives: int = 0
    sent: Counter[int] = field(default_factory=Counter)
    received: Counter[int] = field(default_factory=Counter)
    pending: int = 0
    failed: bool = False

    def as_json(self) -> dict[str, object]:
        return {
            "built": self.built,
            "workers": list(self.workers),
            "collectives": self.collectives,
            "sent": {str(k): v for k, v in self.sent.items()},
            "received": {str(k): v for k, v in self.received.items()},
            "pending": self.pending,
            "failed": self.failed,
        }


# worker -> group name -> that worker's ledger entry for the group (as JSON-able dict)
LedgerRecord = Mapping[str, Mapping[str, object]]


def encode(ledgers: Mapping[str, GroupLedger]) -> bytes:
    return json.dumps({name: led.as_json() for name, led in ledgers.items()}).encode()


def decode(raw: bytes) -> dict[str, dict[str, object]]:
    return json.loads(raw.decode())


def group_is_clean(name: str, workers: Sequence[int], ledgers: Mapping[int, LedgerRecord]) -> bool:
    entries = _entries(name, workers, ledgers)
    if entries is None or any(e["pending"] or e["failed"] for e in entries) or not _same_object(entries):
        return False
    return len({e["collectives"] for e in entries}) == 1 and _p2p_balanced(name, workers, entries, ledgers)


def survivors_are_quiet(name: str, survivors: Sequence[int], ledgers: Mapping[int, LedgerRecord]) -> bool:
    """Whether a group that lost members can be shrunk in place (SHRINK_DEFAULT) by `survivors`.

    A default-mode shrink neither aborts nor drains in-flight work, so no survivor may have an op
    pending or failed on the group, the survivors must have issued the same number of
    collectives, and every send among them must be matched (ops with the lost workers are moot:
    they leave the communicator). The count must also be positive: a communicator is created at
    its first collective, and shrinking one never used would first create it with the lost ranks.
    """
    entries = _entries(name, survivors, ledgers)
    if entries is None or any(e["pending"] or e["failed"] for e in entries) or not _same_object(entries):
        return False
    counts = {e["collectives"] for e in entries}
    return len(counts) == 1 and counts != {0} and _p2p_balanced(name, survivors, entries, ledgers)


def _same_object(entries: Sequence[Mapping[str, object]]) -> bool:
    """Every member holds the same group object (built in the same epoch, same members)."""
    return len({json.dumps([e.get("built"), e.get("workers")]) for e in entries}) == 1


def _entries(
    name: str, workers: Sequence[int], ledgers: Mapping[int, LedgerRecord]
) -> list[Mapping[str, object]] | None:
    entries = []
    for w in workers:
        rec = ledgers.get(w, {}).get(name)
        if rec is None:
            return None
        entries.append(rec)
    return entries


def _p2p_balanced(
    name: str,
    workers: Sequence[int],
    entries: Sequence[Mapping[str, object]],
    ledgers: Mapping[int, LedgerRecord],
) -> bool:
    """Every send from one of `workers` to another has its receive, and vice versa."""
    among = set(workers)
    for me, e in zip(workers, entries, strict=True):
        for peer, count in _counts(e["sent"]).items():
            if peer in among and _counts(ledgers[peer][name]["received"]).get(me, 0) != count:
                return False
        for peer, count in _counts(e["received"]).items():
            if peer in among and _counts(ledgers[peer][name]["sent"]).get(me, 0) != count:
                return False
    return True


def _counts(raw: object) -> dict[int, int]:
    assert isinstance(raw, Mapping)
    return {int(k): int(v) for k, v in raw.items()}
