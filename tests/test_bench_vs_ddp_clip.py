"""`bench.vs_ddp --max-grad-norm`: every configuration clips by the whole model's gradient norm.

Clipping changes what AdamW does only where the coefficient changes from step to step, so the
check is on the last step's loss after a few clipped updates: each configuration's moves away
from its unclipped run's, and all of them still agree (the benchmark itself refuses a run whose
losses disagree). A pipeline that clipped each stage by its own norm would disagree.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import vs_ddp

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("ddp-dp2", "ft-dp2", "pipe-pp2dp2", "ft-pp2dp2")
MAX_NORM = 0.05  # far below this model's gradient norm: every step is clipped


def test_a_max_grad_norm_that_is_not_positive_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        vs_ddp.main(["--max-grad-norm", "0"])
    assert exc.value.code == 2
    assert "--max-grad-norm must be positive" in capsys.readouterr().err


def last_losses(out: str) -> dict[str, float]:
    """configuration -> its last step's loss, from the table's rows."""
    rows = [line.split("|") for line in out.splitlines() if re.match(r"^\| (ddp|ft|pipe)-", line)]
    return {cells[1].split(":")[0].strip(): float(cells[-2]) for cells in rows}


def run(*extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VS_DDP_")}
    cmd = [sys.executable, "-m", "bench.vs_ddp", "--configs", *CONFIGS, "--hidden", "16"]
    cmd += ["--repeats", "1", "--steps", "6", "--profile", "none", "--last-loss-rtol", "1e-5", *extra]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_every_configuration_clips_by_the_global_norm() -> None:
    plain, clipped = run(), run("--max-grad-norm", str(MAX_NORM))
    assert f"clipped at global norm {MAX_NORM:g}" in clipped
    a, b = last_losses(plain), last_losses(clipped)
    assert set(a) == set(b) == set(CONFIGS)
    for name in CONFIGS:
        assert b[name] != pytest.approx(a[name], rel=1e-4), name  # the clip reached its workers
        assert b[name] == pytest.approx(b["ddp-dp2"], rel=1e-5), name  # by the global norm
