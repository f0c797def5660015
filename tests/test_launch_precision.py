"""`elaswave run` of a script that asks for fp16 on device "auto" (the CPU here): the launched
workers train in fp16 with the loss scaler agreed over the world group the worker builds for it,
every rank log starts with where and how it trains, the job follows the one-process fp16 run,
and the checkpoint records the precision and the loss-scaler state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_launcher import _env, _job_losses, elaswave_run, tiny_variant

pytestmark = pytest.mark.multiproc

FP16 = tiny_variant(
    "optimizer=elaswave.AdamW(lr=1e-2))",
    "optimizer=elaswave.AdamW(lr=1e-2), precision='fp16', device='auto')",
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="device='auto' must pick the CPU for this check")
@pytest.mark.timeout(240)
def test_a_launched_fp16_job_trains_like_one_process_and_checkpoints_its_scale(tmp_path: Path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(FP16)
    ckpt = tmp_path / "ckpt"
    run = elaswave_run(
        "--nproc-per-node", "3", "--pp", "2", "--checkpoint-dir", ckpt, script, cwd=tmp_path, timeout_s=200
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    run_dir = tmp_path / "elaswave-run" / "tiny"
    for rank in range(3):
        first = (run_dir / f"rank-{rank}.log").read_text().splitlines()[0]
        assert (
            first.startswith(f"elaswave: rank {rank} on cpu") and "fp16 (device='auto' picked cpu)" in first
        )
    reference = script.with_name("reference.json")
    subprocess.run(
        [sys.executable, str(script), "--losses-out", str(reference)],
        check=True,
        timeout=120,
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
    )
    expected = {int(k): v for k, v in json.loads(reference.read_text()).items()}
    losses = _job_losses(run_dir, [0, 1, 2])
    assert sorted(losses) == list(range(8))
    # fp16 rounds each DP rank's gradients on their own (docs/accelerators.md): close, not round-off
    for step in range(8):
        assert losses[step] == pytest.approx(expected[step], rel=5e-2), (step, losses, expected)
    meta = json.loads((ckpt / (ckpt / "latest").read_text().strip() / "meta.json").read_text())
    assert meta["precision"] == "fp16" and meta["next_step"] == 8
    assert meta["loss_scale"]["scale"] == 2.0**16 and meta["loss_scale"]["skipped"] == 0
