"""Fail-slow detection against stage peers, with hysteresis."""

from __future__ import annotations

import pytest

from core_service.config import FailSlowSettings
from core_service.failslow import FailSlowDetector


def feed(detector: FailSlowDetector, times: dict[str, float], stage: int = 0) -> list:
    return [t for w, s in times.items() if (t := detector.observe(w, stage, s)) is not None]


def test_one_slow_step_never_triggers_but_a_persistent_straggler_does() -> None:
    d = FailSlowDetector(FailSlowSettings(ratio=1.5, trigger_steps=3, clear_steps=2))
    healthy = {"a": 1.0, "b": 1.02, "c": 0.98, "d": 1.01}
    assert feed(d, healthy) == []
    assert feed(d, {**healthy, "d": 3.0}) == []  # a single GC pause
    assert feed(d, healthy) == []
    transitions = []
    for _ in range(3):
        transitions += feed(d, {**healthy, "d": 2.0})
    assert [(t.worker_id, t.slow) for t in transitions] == [("d", True)]
    assert "peer median 1.0" in transitions[0].reason and d.is_slow("d")
    # Recovery needs clear_steps normal steps in a row.
    assert feed(d, healthy) == []
    back = feed(d, healthy)
    assert [(t.worker_id, t.slow) for t in back] == [("d", False)] and not d.is_slow("d")


def test_peers_are_per_stage_and_a_lone_worker_is_never_judged() -> None:
    d = FailSlowDetector(FailSlowSettings(ratio=1.5, trigger_steps=1, clear_steps=1))
    # Stage 1 is legitimately slower (more layers): no stage-0 worker is compared with it.
    for _ in range(3):
        assert feed(d, {"a": 1.0, "b": 1.0}, stage=0) == []
        assert feed(d, {"x": 3.0, "y": 3.1}, stage=1) == []
        assert feed(d, {"solo": 50.0}, stage=2) == []


def test_invalid_step_time_is_refused_and_changes_nothing() -> None:
    d = FailSlowDetector(FailSlowSettings())
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="step_time_s"):
            d.observe("a", 0, bad)
    assert not d.is_slow("a")
    assert d._tracks == {}


def test_large_stage_shared_reference_flags_the_straggler_and_nobody_else() -> None:
    """2,000 workers in one stage (a large DP group, shared reference): the straggler is flagged on
    its trigger step and nobody else ever is; moving a worker to another stage is bookkept."""
    import random

    rng = random.Random(3)
    settings = FailSlowSettings(ratio=1.3, trigger_steps=3, clear_steps=2)
    d = FailSlowDetector(settings)
    workers = [f"w{i}" for i in range(2000)]
    flagged: list[tuple[str, bool, int]] = []
    for step in range(6):
        times = {w: 1.0 + rng.uniform(-0.05, 0.05) for w in workers}
        if step >= 2:
            times["w17"] = 1.6  # a straggler from step 2 on
        flagged += [(t.worker_id, t.slow, step) for t in feed(d, times)]
    assert flagged == [("w17", True, 4)]
    assert abs(d._references[0].median - 1.0) < 0.01  # noqa: SLF001 - the shared reference
    # w17 moves to stage 1 (a layout change): stage 0 no longer counts it, stage 1 has one worker.
    assert d.observe("w17", 1, 1.6) is None and "w17" not in d._stage_times[0]  # noqa: SLF001
    d.forget("w18")
    assert "w18" not in d._stage_times[0] and len(d._stage_times[0]) == 1998  # noqa: SLF001


def test_a_flagged_worker_stays_slow_until_it_is_faster_by_the_margin() -> None:
    """Hysteresis: flagged above ratio x median; it counts as normal again only at or below
    clear_ratio x median, so a worker hovering between the two never flips back and forth."""
    d = FailSlowDetector(FailSlowSettings(ratio=1.5, clear_ratio=1.2, trigger_steps=2, clear_steps=2))
    peers = {"a": 1.0, "b": 1.0, "c": 1.0}
    flips = []
    for _ in range(2):
        flips += feed(d, {**peers, "d": 2.0})
    assert [(t.worker_id, t.slow) for t in flips] == [("d", True)]
    for _ in range(10):  # 1.3x: below the trigger, above the clearing margin
        assert feed(d, {**peers, "d": 1.3}) == []
    assert d.is_slow("d")
    back = feed(d, {**peers, "d": 1.1}) + feed(d, {**peers, "d": 1.1})
    assert [(t.worker_id, t.slow) for t in back] == [("d", False)]


def test_a_peers_noisy_step_does_not_make_the_others_look_slow() -> None:
    """A peer's reference time is its median over window_steps: one fast outlier step of a peer
    does not lower the stage's reference below everyone else."""
    d = FailSlowDetector(FailSlowSettings(ratio=1.5, trigger_steps=1, clear_steps=1, window_steps=5))
    for _ in range(5):
        assert feed(d, {"a": 1.0, "b": 1.0}) == []
    assert feed(d, {"a": 0.3, "b": 1.0}) == []  # a's one fast step: b is not 1.5x its median
