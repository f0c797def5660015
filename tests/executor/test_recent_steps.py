"""A worker's per-step records stay bounded on a long job (`executor.worker.RecentSteps`): the most
recent steps are kept, the oldest dropped, a replayed step keeps its place, and the records still
serialise as the results file's JSON objects."""

from __future__ import annotations

import json

import pytest

from executor.worker import HISTORY_STEPS, RecentSteps


def test_a_long_run_keeps_only_its_most_recent_steps() -> None:
    kept = RecentSteps(capacity=3)
    for step in range(10):
        kept[step] = [step, step + 1]
    assert list(kept) == [7, 8, 9] and kept[9] == [9, 10]
    kept[8] = ["replayed"]  # a step replayed after a rollback: its value changes, not its place
    kept[10] = [10]
    assert list(kept) == [8, 9, 10] and kept[8] == ["replayed"]
    assert json.loads(json.dumps(kept)) == {"8": ["replayed"], "9": [9, 10], "10": [10]}


def test_the_default_history_covers_every_test_job_and_bad_capacities_are_refused() -> None:
    assert HISTORY_STEPS >= 2000  # the longest launched job of the suite (test_operator_checkpoint_e2e)
    with pytest.raises(ValueError, match="keeps at least 1 step, got 0"):
        RecentSteps(capacity=0)
