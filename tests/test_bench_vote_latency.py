"""bench.vote_latency: who wrote each decision, how late each waiter read it, and a real run."""

from __future__ import annotations

import pytest

from bench.vote_latency import run, summarise

pytestmark = pytest.mark.timeout(120)


def test_a_waiter_is_late_by_how_long_after_the_writer_it_returned() -> None:
    # (mode, base, arrived, returned, ok); the last to arrive wrote the decision
    results = {
        0: [("watch", "w/0", 0.000, 0.0052, True), ("poll", "p/0", 1.000, 1.0090, True)],
        1: [("watch", "w/0", 0.005, 0.0051, True), ("poll", "p/0", 1.004, 1.0041, True)],
    }
    table = summarise(results)
    assert table["watch"]["late median"] == pytest.approx(0.1)
    assert table["watch"]["wait median"] == pytest.approx(5.2)
    assert table["poll"]["late median"] == pytest.approx(4.9)
    assert table["poll"]["wait mean"] == pytest.approx(9.0)


def test_an_abort_in_a_fault_free_vote_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="ABORT"):
        summarise({0: [("watch", "w/0", 0.0, 0.1, False)]})


def test_runs_both_modes_with_real_voter_processes() -> None:
    table = run(voters=2, steps=5, skew_ms=1.0)
    assert set(table) == {"watch", "poll"}
    for row in table.values():
        assert set(row) == {"late median", "late mean", "wait median", "wait mean"}
        assert all(v >= 0.0 for v in row.values())
