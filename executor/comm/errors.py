"""Errors raised by the dynamic communicator."""

from __future__ import annotations


class PeerFailure(RuntimeError):
    """A collective or point-to-point op could not complete because a peer is gone or hung.

    Raised quickly when a peer's socket closes (gloo reports the closed connection), when another
    survivor has flagged the epoch as aborted in the store, or at the latest when the group's
    timeout expires. `group` names the logical group; `cause` is the backend's message.
    """

    def __init__(self, group: str, reason: str) -> None:
        super().__init__(f"peer failure in group {group!r}: {reason}")
        self.group = group
        self.reason = reason


class Interrupted(PeerFailure):
    """A wait was abandoned because it no longer matters (a newer plan exists): not a failure
    of the group's peers, but handled like one (the step or the recovery is rolled back)."""


class StoreLost(PeerFailure):
    """The rendezvous store cannot be reached (its process or host is gone). Handled like a peer
    failure inside a step; the worker moves to the next store address before the next plan
    (docs/architecture.md ("Recovery"))."""

    def __init__(self, reason: str) -> None:
        super().__init__("store", reason)


class MembershipError(ValueError):
    """A membership (group name -> ordered worker ids) is malformed or inconsistent."""
