"""`bench.vs_ddp`'s options that change what every configuration trains: `--seq-len` (the
tokens a step computes on) and `--max-grad-norm` (clipping by the global norm).

Each must reach every worker, the engine's as well as the baselines', and leave the
configurations training the same thing. The check is on the losses the benchmark's table
prints: the option moves them, and the configurations still agree (the benchmark itself refuses
a run whose losses disagree beyond its tolerances).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import vs_ddp

pytestmark = pytest.mark.timeout(360)
RUN_TIMEOUT_S = 150  # a run takes 10-35 s on 2 loaded cores; two runs a test, inside the mark
ROOT = Path(__file__).resolve().parents[1]
PIPELINES = ("ddp-dp2", "ft-dp2", "pipe-pp2dp2", "ft-pp2dp2")
MAX_NORM = 0.05  # far below this model's gradient norm: every step is clipped


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq-len", "1"], "--seq-len must be at least 2"),
        (["--max-grad-norm", "0"], "--max-grad-norm must be positive and finite"),
        (["--max-grad-norm", "inf"], "--max-grad-norm must be positive and finite"),
    ],
)
def test_an_option_out_of_range_is_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [k for k in os.environ if k.startswith("VS_DDP_")] + [vs_ddp.FREEZE_ENV, vs_ddp.BITFIT_ENV]:
        monkeypatch.delenv(name, raising=False)  # restored afterwards: main() sets some before refusing
    with pytest.raises(SystemExit) as exc:
        vs_ddp.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def table_losses(out: str, column: int) -> dict[str, float]:
    """configuration -> a loss column of its table row (-3: the first step's, -2: the last's)."""
    rows = [line.split("|") for line in out.splitlines() if re.match(r"^\| (ddp|ft|pipe)-", line)]
    return {cells[1].split(":")[0].strip(): float(cells[column]) for cells in rows}


def run(configs: tuple[str, ...], *extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VS_DDP_")}
    cmd = [sys.executable, "-m", "bench.vs_ddp", "--configs", *configs, "--hidden", "16"]
    cmd += ["--repeats", "1", "--profile", "none", *extra]
    done = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_workers_train_the_length_the_header_names() -> None:
    configs = ("ddp-dp2", "ft-dp2")
    short, long = (
        run(configs, "--steps", "1", "--seq-len", "8"),
        run(configs, "--steps", "1", "--seq-len", "24"),
    )
    assert "seq 8," in short and "256 tokens a step" in short
    assert "seq 24," in long and "768 tokens a step" in long
    a, b = table_losses(short, -3), table_losses(long, -3)
    assert set(a) == set(b) == set(configs)
    # the engine's workers read the length as DDP's do (else their losses would disagree, which
    # the benchmark refuses), and it is the length asked for (else both runs would match)
    assert a["ddp-dp2"] != b["ddp-dp2"]
    assert a["ft-dp2"] == pytest.approx(a["ddp-dp2"], rel=1e-5)
    assert b["ft-dp2"] == pytest.approx(b["ddp-dp2"], rel=1e-5)


def test_every_configuration_clips_by_the_global_norm() -> None:
    # Clipping changes what AdamW does only where the coefficient changes from step to step, so
    # the check is on the last step's loss after a few clipped updates. A pipeline that clipped
    # each stage by its own norm ends 1.9e-4 away from DDP here.
    steps = ("--steps", "6", "--last-loss-rtol", "1e-5")
    plain, clipped = run(PIPELINES, *steps), run(PIPELINES, *steps, "--max-grad-norm", str(MAX_NORM))
    assert f"clipped at global norm {MAX_NORM:g}" in clipped
    a, b = table_losses(plain, -2), table_losses(clipped, -2)
    assert set(a) == set(b) == set(PIPELINES)
    for name in PIPELINES:
        assert b[name] != pytest.approx(a[name], rel=1e-4), name  # the clip reached its workers
        assert b[name] == pytest.approx(b["ddp-dp2"], rel=1e-5), name  # by the global norm
