"""`bench.vs_ddp`'s ratios to the baseline: the ratio of the medians over every repeat, and each
repeat paired with the baseline's run of the same repeat, reported as their median with the
smallest and the largest, so that a reader sees the run-to-run noise an effect of a few per cent
has to stand out from."""

from __future__ import annotations

import argparse

import pytest

from bench.vs_ddp import CONFIGS, WARMUP, RunResult, paired_spread, report


def result(step_s: list[float], cpu_s: list[float]) -> RunResult:
    losses = {0: 4.0, WARMUP + 1: 3.0}  # the report's first and last step (--steps 2)
    return RunResult(step_times=step_s, cpu_times=cpu_s, losses=losses, profile_ms={})


def test_each_repeat_is_divided_by_the_baseline_of_its_own_repeat() -> None:
    # The baseline drifts (a machine getting loaded, then idle again), and not in the same order
    # as the configuration's own times: paired by repeat the configuration is 1.2x, 1.05x and
    # 1.1x of it. Sorting either side before pairing would give 1.09x, 1.1x and 1.155x.
    pairs: list[tuple[RunResult | None, RunResult | None]] = [
        (result([2.4, 2.4, 9.0], [2.2]), result([2.0, 2.0, 0.1], [2.0])),
        (result([2.31], [3.3]), result([2.2], [3.0])),
        (result([1.1], [4.0]), result([1.0], [4.0])),
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


def test_the_table_gives_each_configuration_its_wall_and_cpu_ratios_to_its_baseline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = argparse.Namespace(
        steps=2, loss_rtol=1e-5, last_loss_rtol=1e-4, profile="none", pipe_schedule="1f1b"
    )
    chosen = [CONFIGS["ddp-dp2"], CONFIGS["ft-dp2"]]
    runs: dict[str, list[RunResult | None]] = {
        "ddp-dp2": [result([1.0], [2.0]), result([2.0], [2.0]), result([4.0], [2.0])],
        "ft-dp2": [result([1.1], [2.2]), result([2.1], [2.6]), result([4.8], [2.4])],
    }
    assert report(args, chosen, runs, {}) == 0
    rows = {
        line.split("|")[1].split(":")[0].strip(): [c.strip() for c in line.split("|")[1:-1]]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ddp-") or line.startswith("| ft-")
    }
    # wall: medians over every step of every repeat 2.1 / 2.0; per repeat 1.10, 1.05 and 1.20
    assert rows["ft-dp2"][4] == "1.050; 1.10, 1.05-1.20"
    # CPU: 2.4 / 2.0; per repeat 1.10, 1.30 and 1.20
    assert rows["ft-dp2"][6] == "1.200; 1.20, 1.10-1.30"
    assert rows["ddp-dp2"][4] == "1.000; 1.00, 1.00-1.00"
