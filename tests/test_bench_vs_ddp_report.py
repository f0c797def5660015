"""`bench.vs_ddp`'s ratios to the baseline: each repeat paired with the baseline's run of the same
repeat, reported as their median with the smallest and the largest, so that a reader sees the
run-to-run noise an effect of a few per cent has to stand out from."""

from __future__ import annotations

from bench.vs_ddp import RunResult, paired_spread


def result(step_s: list[float], cpu_s: list[float]) -> RunResult:
    return RunResult(step_times=step_s, cpu_times=cpu_s, losses={}, profile_ms={})


def test_each_repeat_is_divided_by_the_baseline_of_its_own_repeat() -> None:
    # the baseline drifts from 1.0 s to 2.0 s a step over the repeats (a machine getting loaded):
    # paired, the configuration is 1.1x, 1.05x and 1.2x of it, whatever the drift
    pairs: list[tuple[RunResult | None, RunResult | None]] = [
        (result([1.1, 1.1, 5.0], [2.2]), result([1.0, 1.0, 0.1], [2.0])),
        (result([2.1], [3.3]), result([2.0], [3.0])),
        (result([2.4], [4.0]), result([2.0], [4.0])),
    ]
    assert paired_spread(pairs, "step_times") == "1.10, 1.05-1.20"
    assert paired_spread(pairs, "cpu_times") == "1.10, 1.00-1.10"


def test_a_repeat_that_failed_on_either_side_is_left_out() -> None:
    pairs: list[tuple[RunResult | None, RunResult | None]] = [
        (result([1.5], [1.5]), None),
        (None, result([1.0], [1.0])),
        (result([0.9], [0.8]), result([1.0], [1.0])),
    ]
    assert paired_spread(pairs, "step_times") == "0.90, 0.90-0.90"
    assert paired_spread(pairs[:2], "cpu_times") == "n/a"
