"""Typed reasons of the ElasWave policy: which step said it, whether it changes the layout, the
sentence for the plan record and the short form for the event log.

The Core, `elaswave plan` and the simulator read these fields; nothing parses the sentences.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum


class Step(StrEnum):
    """The policy step a reason comes from (ElasWave §4.1-4.3)."""

    MODEL = "model"  # which cost model priced the plan
    RESIZE = "resize"  # dataflow: going ranks leave, survivors take their samples (§4.1)
    SLOW = "slow"  # a fail-slow rank's measured slowdown
    GRAPH = "graph"  # Algorithm 1 re-partition under the executor's adjacency rule (§4.2)
    CLOCK = "clock"  # DVFS (§4.3)
    PREDICTION = "prediction"  # predicted step time after the change
    PAYBACK = "payback"  # an optional plan declined: it does not pay back, or moves a cooling unit
    REDUNDANCY = "redundancy"  # how many backup copies of every shard (planners.redundancy)
    REPLICA = "replica"  # a whole DP replica dropped rather than every stage thinned


class Outcome(StrEnum):
    CHANGED = "changed"  # the step changes the layout
    KEPT = "kept"  # the step found nothing to change
    DECLINED = "declined"  # the step could change something and does not (not possible, not worth it)
    INFO = "info"  # context: a cost model, a measurement, a prediction


@dataclass(frozen=True)
class Reason:
    step: Step
    outcome: Outcome
    text: str
    headline: str = ""  # what the event log says of a change; empty: nothing to say there

    def __str__(self) -> str:
        return self.text


def texts(reasons: Iterable[Reason]) -> tuple[str, ...]:
    return tuple(r.text for r in reasons)


def headlines(reasons: Iterable[Reason]) -> list[str]:
    """The event-log parts: the headline of every reason that has one, in order."""
    return [r.headline for r in reasons if r.headline]
