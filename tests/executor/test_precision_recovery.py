"""kill -9 under mixed precision (docs/accelerators.md): the fail-stop job of test_failstop.py (GPT,
PP=2 x DP=3 on gloo, a worker SIGKILLed inside step 4) in bf16 and in fp16 with forced overflows.

bf16: the survivors recover in place exactly as in fp32 — the recovered parameters and fp32
optimizer state are bitwise the fault-free run's at the last committed step, the ring snapshots
equal the live shards at the end — and the later losses follow the fault-free run. Their bound,
1e-3 (measured 5e-6 bf16, 2e-7 fp16), is wider than fp32's 1e-4: after the loss the stage has two
DP ranks where it had three, and under autocast each rank's weight gradients are rounded to 16
bits before the fp32 sum (tests/api/test_precision.py), so a different DP split changes each
step by up to that rounding, where fp32 changes by round-off.

fp16: block_1 overflows at the failed step itself and at a later step. The failed step, rolled
back and replayed on the new layout, overflows again and is skipped on every survivor; the later
one too; the loss scale and the number of applied updates end as in the fault-free run.
"""

from __future__ import annotations

import pytest

from tests.executor.test_failstop import FAIL_STEP, STEPS, Scenario, _check_kill_recovery, _clean

BF16_LOSS_REL = 1e-3  # mean relative deviation after the recovery (module docstring)
FP16_LOSS_REL = 1e-3
OVERFLOWS = (FAIL_STEP, FAIL_STEP + 2)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_bf16_kill9_mid_step_recovers_in_place() -> None:
    faulty = _check_kill_recovery(Scenario(kill_at_op=5, victim=4, precision="bf16"), BF16_LOSS_REL)
    assert all(r["loss_scale"] is None and not r["skipped"] for r in faulty.values())


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_fp16_overflow_in_the_replayed_step_is_skipped_on_every_survivor() -> None:
    sc = Scenario(kill_at_op=5, victim=4, precision="fp16", overflow_steps=OVERFLOWS)
    faulty = _check_kill_recovery(sc, FP16_LOSS_REL)
    clean = _clean(sc.rng_mode, like=sc)
    for results in (clean, faulty):
        for w, r in results.items():
            assert r["skipped"] == list(OVERFLOWS), (w, r["skipped"])
            assert r["loss_scale"]["skipped"] == len(OVERFLOWS), w
            assert r["loss_scale"]["scale"] == 2.0**16 / 4, w
            assert r["final_state"]["step_count"] == STEPS - len(OVERFLOWS), w
    # the replayed step was a failure first: the victim died in it, the survivors rolled it back
    assert all(any(step == FAIL_STEP for step, _ in r["failures"]) for r in faulty.values())
