"""`bench.vs_ddp`'s itemisation of what the fault-tolerant path adds to the static one (issue 23's
fixed-cost goal): its own items from its profile, plus the other threads' CPU beyond the static
path's; items it does not share with the static path only."""

from __future__ import annotations

import pytest

from bench.vs_ddp import (
    COMMIT,
    FT_OTHER_THREADS,
    HELPER_ROLLBACK,
    REST,
    SNAPSHOT_POST,
    VOTE,
    fault_tolerance_cost,
)

FORWARD = "forward"


def test_the_fault_tolerant_paths_own_items_and_its_extra_thread_cpu() -> None:
    ft = {
        FORWARD: (8.0, 7.5),  # shared with the static path: not counted
        SNAPSHOT_POST: (0.9, 0.22),
        VOTE: (0.7, 0.15),
        COMMIT: (0.2, 0.14),
        HELPER_ROLLBACK: (0.0, 0.27),
        REST: (0.02, 2.5),
    }
    static = {FORWARD: (8.1, 7.4), REST: (0.01, 2.0)}
    rows = dict(fault_tolerance_cost(ft, static))
    assert set(rows) == {SNAPSHOT_POST, VOTE, COMMIT, HELPER_ROLLBACK, FT_OTHER_THREADS}
    assert rows[VOTE] == 0.15 and rows[HELPER_ROLLBACK] == 0.27  # CPU, not wall
    assert rows[FT_OTHER_THREADS] == pytest.approx(0.5)
    assert sum(rows.values()) == pytest.approx(0.22 + 0.15 + 0.14 + 0.27 + 0.5)


def test_other_threads_below_the_static_paths_are_reported_as_measured() -> None:
    rows = dict(fault_tolerance_cost({REST: (0.0, 1.8)}, {REST: (0.0, 2.0)}))
    assert rows == {FT_OTHER_THREADS: pytest.approx(-0.2)}  # noise is shown, not clipped
