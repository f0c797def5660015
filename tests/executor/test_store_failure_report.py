"""A step that failed on the store alone is reported to the Core at once (`PlanFollowing._wait_plan`).

No agent reports a store's loss (the store is no worker), so no plan can come before a worker
reports the failed step; the worker used to wait NO_PLAN_REPORT_S (0.25 s) for one first, most of
the 0.33 s "plan" phase of losing the store (`bench.mttr --case "the store"`). A step that also
failed on a group of workers may be a node's loss that the agents are about to report: that one
still waits, so the Core plans the loss, not a replay it would then replace.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from executor.plan_client import PlanTimeout
from executor.worker_recovery import NO_PLAN_REPORT_S, PlanFollowing

PLAN = SimpleNamespace(epoch=1)


class CoreClient:
    """Records what the worker asks of the Core: a plan comes only once the step is reported."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []
        self.reported = False

    def wait_plan(self, newer_than: int, timeout_s: float) -> Any:
        self.calls.append(("wait_plan", timeout_s))
        if not self.reported:
            raise PlanTimeout(f"no plan newer than {newer_than} within {timeout_s}s")
        return PLAN

    def report_peer_failure(self, peer_rank: int, step: int, operation: str, error: str) -> bool:
        self.calls.append(("report", float(peer_rank)))
        self.reported = True
        return True


class Follower(PlanFollowing):
    def __init__(self, failures: list[dict[str, Any]]) -> None:
        self.args = SimpleNamespace(timeout_s=30.0)
        self.proto = SimpleNamespace(failure="the step failed")
        self.results = {"failures": failures}
        self.plans = CoreClient()


@pytest.mark.parametrize(
    ("failures", "first_wait"),
    [
        ([{"step": 7, "group": "store"}], 0.0),
        ([{"step": 7, "group": "store"}, {"step": 7, "group": "store"}], 0.0),
        ([{"step": 7, "group": "dp/0"}], NO_PLAN_REPORT_S),
        ([{"step": 7, "group": "store"}, {"step": 7, "group": "world"}], NO_PLAN_REPORT_S),
        # an earlier step's store failure says nothing about this one
        ([{"step": 6, "group": "store"}, {"step": 7, "group": "dp/1"}], NO_PLAN_REPORT_S),
    ],
)
def test_the_first_wait_for_a_plan_is_skipped_only_when_the_store_alone_failed(
    failures: list[dict[str, Any]], first_wait: float
) -> None:
    worker = Follower(failures)
    assert worker._wait_plan(7, newer_than=0) is PLAN
    calls = worker.plans.calls
    assert calls[0] == ("wait_plan", first_wait)
    assert calls[1] == ("report", -1.0)  # no peer named: the Core replays the step
    assert calls[2][0] == "wait_plan"
