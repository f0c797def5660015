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
    collectives: int = 0
    sent: Counter[int] = field(default_factory=Counter)
    received: Counter[int] = field(default_factory=Counter)
    pending: int = 0
    failed: bool = False

    def as_json(self) -> dict[str, object]:
        return {
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
    entries = []
    for w in workers:
        rec = ledgers.get(w, {}).get(name)
        if rec is None:
            return False
        entries.append(rec)
    if any(e["pending"] or e["failed"] for e in entries):
        return False
    if len({e["collectives"] for e in entries}) != 1:
        return False
    for src, e in zip(workers, entries, strict=True):
        for dst, count in _counts(e["sent"]).items():
            if _counts(ledgers[dst][name]["received"]).get(src, 0) != count:
                return False
    for dst, e in zip(workers, entries, strict=True):
        for src, count in _counts(e["received"]).items():
            if _counts(ledgers[src][name]["sent"]).get(dst, 0) != count:
                return False
    return True


def _counts(raw: object) -> dict[int, int]:
    assert isinstance(raw, Mapping)
    return {int(k): int(v) for k, v in raw.items()}
