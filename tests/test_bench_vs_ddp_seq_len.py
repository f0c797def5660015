"""`bench.vs_ddp --seq-len`: how the fault-tolerant path's per-parameter work weighs against a step
that computes on more tokens. The workers must train the length the header names: the step's loss
of a longer sample differs, and every configuration must still agree on it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import vs_ddp

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[1]


def test_a_sample_shorter_than_two_tokens_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        vs_ddp.main(["--seq-len", "1"])
    assert exc.value.code == 2
    assert "--seq-len must be at least 2" in capsys.readouterr().err


def first_losses(out: str) -> dict[str, float]:
    """configuration -> its first step's loss, from the table's rows."""
    rows = [line.split("|") for line in out.splitlines() if re.match(r"^\| (ddp|ft)-dp2", line)]
    return {cells[1].split(":")[0].strip(): float(cells[-3]) for cells in rows}


def run(seq_len: int) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VS_DDP_")}
    cmd = [sys.executable, "-m", "bench.vs_ddp", "--configs", "ddp-dp2", "ft-dp2", "--hidden", "16"]
    cmd += ["--repeats", "1", "--steps", "1", "--profile", "none", "--seq-len", str(seq_len)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_workers_train_the_length_the_header_names() -> None:
    short, long = run(8), run(24)
    assert "seq 8," in short and "256 tokens a step" in short
    assert "seq 24," in long and "768 tokens a step" in long
    a, b = first_losses(short), first_losses(long)
    assert set(a) == set(b) == {"ddp-dp2", "ft-dp2"}
    # the engine's workers read the length as DDP's do (else their losses would disagree, which
    # the benchmark refuses), and it is the length asked for (else both runs would match)
    assert a["ddp-dp2"] != b["ddp-dp2"]
    assert a["ft-dp2"] == pytest.approx(a["ddp-dp2"], rel=1e-5)
    assert b["ft-dp2"] == pytest.approx(b["ddp-dp2"], rel=1e-5)
