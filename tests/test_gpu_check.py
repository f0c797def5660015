"""`make gpu-check` on a machine without CUDA (CI): it must say so on every check line, end with
FAIL and exit non-zero, having checked nothing; its arguments are validated; a check's child
process reports its failure as a result line. The checks themselves need a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: run make gpu-check")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_without_cuda_every_line_says_so_and_it_fails(tmp_path: Path) -> None:
    run = _run("--out", str(tmp_path))
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 2
    assert [line[:3] for line in lines[1:6]] == ["(a)", "(b)", "(c)", "(d)", "(e)"]
    assert all(": SKIP - no CUDA device visible to torch" in line for line in lines[1:6])
    assert lines[-1].startswith("FAIL: nothing checked: no CUDA device")


def test_arguments_are_checked() -> None:
    assert "--only takes some of a,b,c,d,e" in _run("--only", "a,x").stderr
    assert "--budget-s must be positive" in _run("--budget-s", "0").stderr


def test_a_check_that_cannot_run_reports_a_fail_result() -> None:
    run = _run("--child", "a")
    assert run.returncode == 0
    assert run.stdout.strip().splitlines()[-1].startswith('GPU-CHECK-RESULT {"status": "FAIL"')


def test_a_workers_failure_is_summarised_by_its_last_line() -> None:
    """A failed rank's traceback arrives inside the harness's AssertionError: the check's line
    keeps its first line and the worker's own error (the H200 run's first report said only
    "worker 3 failed:")."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gpu_check import failure_summary
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    worker_traceback = 'Traceback (most recent call last):\n  File "x.py", line 1\nRuntimeError: CUDA error: initialization error\n'
    exc = AssertionError(f"worker 3 failed:\n{worker_traceback}")
    assert (
        failure_summary(exc)
        == "AssertionError: worker 3 failed: ... RuntimeError: CUDA error: initialization error"
    )
    assert failure_summary(ValueError("")) == "ValueError: "


@pytest.mark.timeout(120)
def test_check_d_runs_its_code_small_on_the_cpu() -> None:
    """(d)'s benchmark with a tiny model on the CPU, where nothing is staged: its loops, the
    updater thread and its report run as on the GPU, so the GPU run does not find a typo."""
    from bench.precision_cost import bench_300m
    from examples.gpt.model import ModelConfig

    tiny = ModelConfig(vocab_size=64, seq_len=16, hidden=32, num_heads=2, num_layers=2)
    r = bench_300m(steps=2, batch=4, cfg=tiny, device_kind="cpu")
    assert r["params"] > 0 and r["plain_step_s"] > 0 and r["engine_step_s"] > 0
    assert r["snapshot_staging_overhead"] >= 0 and r["staging_awaited_overhead"] >= 0
    assert r["staged_bytes"] == 4 * r["params"]  # every gradient, fp32, once
    assert r["host_replay_s"] > 0 and r["host_threads"] >= 1
