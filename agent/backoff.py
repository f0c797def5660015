"""Reconnect pacing and Core address rotation for the agent's stream.

Exponential backoff with jitter (50 ms doubling to a 2 s cap, each delay drawn from its upper
half so it still grows), reset after a Core accepts the stream. A standby Core names the leader
in its refusal ("not leader; leader is <addr>"); the next attempt goes there.
"""

from __future__ import annotations

import random
import re

from agent.config import Address, parse_address

_LEADER_HINT = re.compile(r"leader is\s+(\[[^\]]+\]:\d+|[^\s;,:]+:\d+)")


class Backoff:
    def __init__(self, initial_s: float, cap_s: float, rng: random.Random | None = None) -> None:
        if not 0 < initial_s <= cap_s:
            raise ValueError(f"backoff needs 0 < initial ({initial_s}) <= cap ({cap_s})")
        self.initial_s = initial_s
        self.cap_s = cap_s
        self.failures = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        """Seconds to wait before the next attempt; each call counts one more failure."""
        ceiling = min(self.cap_s, self.initial_s * 2.0 ** min(self.failures, 62))
        self.failures += 1
        return ceiling * self._rng.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.failures = 0


def parse_leader_hint(message: str) -> Address | None:
    """The leader address a standby Core put in its refusal, or None when there is none."""
    match = _LEADER_HINT.search(message or "")
    if not match:
        return None
    try:
        return parse_address(match.group(1), "leader hint")
    except ValueError:
        return None


class AddressRotation:
    """Which Core to try next: a leader hint first, else the next address in the list."""

    def __init__(self, addresses: tuple[Address, ...]) -> None:
        self.addresses = addresses
        self._index = 0
        self._hint: Address | None = None

    def current(self) -> Address:
        return self._hint or self.addresses[self._index]

    def moved_to(self, address: Address) -> None:
        """`address` accepted this agent while the current one was silent: it is current now."""
        if address in self.addresses:
            self._index, self._hint = self.addresses.index(address), None
        else:  # a leader hint the configured list spells otherwise
            self._hint = address

    def failed(self, leader_hint: Address | None) -> None:
        """The current address refused or broke; a hint pointing at itself is ignored."""
        tried = self.current()
        if self._hint is None:
            self._index = (self._index + 1) % len(self.addresses)
        self._hint = leader_hint if leader_hint is not None and leader_hint != tried else None
