"""The adaptive heartbeat detector (core_service.liveness) on recorded inter-arrival sequences, and
the registration bucket and gone-member order of core_service.member_bounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core_service.liveness import MIN_SAMPLES, ArrivalWindow
from core_service.member_bounds import GoneMembers, RegistrationBucket

RECORDED = json.loads((Path(__file__).parent / "recorded" / "heartbeat_gaps.json").read_text())


def window(floor_s: float = 0.3, ceiling_s: float = 30.0, phi: float = 8.0, size: int = 100) -> ArrivalWindow:
    return ArrivalWindow(floor_s=floor_s, ceiling_s=ceiling_s, phi=phi, window=size, start=0.0)


def replay(w: ArrivalWindow, gaps: list[float], start: float = 0.0) -> float:
    """Feeds `gaps` as heartbeat arrivals; returns the last arrival time."""
    t = start
    for gap in gaps:
        t += gap
        w.record(t)
    return t


@pytest.mark.parametrize("sequence", ["idle", "loaded"])
def test_no_recorded_gap_is_late_against_the_deadline_before_it(sequence: str) -> None:
    # Every beat of a real stream, idle or on an overloaded machine, arrives before the deadline
    # its own history set: the detector would have called none of them late. (The floor covers
    # the first beats, before the history says anything: a little over two intervals here.)
    w = window(floor_s=0.6)
    t = 0.0
    for gap in RECORDED[sequence]:
        assert gap < w.deadline_s(), (gap, w.deadline_s())
        t += gap
        w.record(t)


def test_a_jittery_stream_gets_a_later_deadline_than_a_steady_one() -> None:
    idle, loaded = window(), window()
    replay(idle, RECORDED["idle"])
    replay(loaded, RECORDED["loaded"])
    assert loaded.deadline_s() > idle.deadline_s() > 0.3
    # The loaded stream's worst gap (0.61 s) is far less suspicious to it than to the steady one.
    assert loaded.suspicion(0.61) < idle.suspicion(0.61)


def test_silence_of_a_dead_stream_passes_the_deadline_and_suspicion_grows() -> None:
    w = window()
    replay(w, RECORDED["loaded"])
    deadline = w.deadline_s()
    assert deadline < 1.0  # a stream beating every 0.25 s is late within a second of silence
    phis = [w.suspicion(s) for s in (0.2, 0.4, 0.8, 1.6)]
    assert phis == sorted(phis) and phis[0] < 1.0 and phis[-1] >= 8.0


def test_floor_until_enough_samples_and_when_the_stream_is_steady() -> None:
    w = window(floor_s=2.0)
    assert w.deadline_s() == 2.0 and w.suspicion(100.0) == 0.0
    replay(w, [0.25] * (MIN_SAMPLES - 1))
    assert w.deadline_s() == 2.0
    replay(w, RECORDED["idle"], start=1.0)
    assert w.deadline_s() == 2.0  # 0.62 s computed, the floor wins


def test_ceiling_caps_a_stream_with_long_gaps() -> None:
    w = window(ceiling_s=5.0)
    replay(w, [0.5, 4.0, 0.5, 6.0, 0.5, 3.0, 0.5, 7.0])
    assert w.deadline_s() == 5.0


def test_the_window_forgets_old_gaps() -> None:
    w = window(size=MIN_SAMPLES)
    t = replay(w, [5.0] * MIN_SAMPLES)
    assert w.deadline_s() > 5.0
    replay(w, [0.25] * MIN_SAMPLES, start=t)
    assert w.samples == MIN_SAMPLES and w.deadline_s() < 1.0


@pytest.mark.parametrize(
    "kwargs",
    [{"floor_s": 0.0}, {"floor_s": 3.0, "ceiling_s": 2.0}, {"phi": 0.0}, {"size": MIN_SAMPLES - 1}],
)
def test_bad_parameters_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        window(**kwargs)


def test_registration_bucket_allows_the_burst_then_the_rate_and_says_when() -> None:
    bucket = RegistrationBucket(rate_per_s=10.0, burst=3, now=100.0)
    assert [bucket.take(100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(100.0) == pytest.approx(0.1)
    assert bucket.take(100.05) == pytest.approx(0.05)
    assert bucket.take(100.11) == 0.0
    assert bucket.take(99.0) > 0.0  # a clock stepping back refills nothing
    assert [bucket.take(200.0) for _ in range(4)][-1] > 0.0  # refilled to the burst, no more


def test_gone_members_overflow_is_oldest_first_and_skips_protected() -> None:
    gone = GoneMembers()
    for worker in ("a", "b", "c", "d", "e"):
        gone.went(worker)
    gone.went("a")  # went again (rejoined, then gone): now the newest
    assert list(gone) == ["b", "c", "d", "e", "a"]
    assert gone.overflow(3, lambda w: w == "b") == ["c", "d"]
    assert gone.overflow(5, lambda w: False) == []
    gone.returned("c")
    assert len(gone) == 4 and gone.overflow(3, lambda w: False) == ["b"]
