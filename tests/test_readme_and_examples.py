"""The README's quick start and every example run as documented (shortened), through the public
path: the script in one process, then under `elaswave run` as PP=2 x DP=2, whose losses must be
the single process's to fp32 round-off."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import elaswave

ROOT = Path(__file__).resolve().parents[1]
ELASWAVE = [sys.executable, "-m", "elaswave.cli"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASWAVE_")}
    return env | {"PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], cwd: Path, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, (
        f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def _launched_losses(run_dir: Path) -> dict[int, float]:
    losses: dict[int, float] = {}
    for f in run_dir.glob("rank-*.json"):
        for step, loss in json.loads(f.read_text())["losses"].items():
            losses.setdefault(int(step), loss)
    return losses


def readme_script(steps: int) -> str:
    """The README's train.py, shortened to `steps` (its schedule and checkpoint period with it)."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"```python\n(# train\.py\n.*?)```", text, re.S)
    assert match, "README.md has no '# train.py' quick-start block"
    script = match.group(1)
    for old, new in (
        ("steps=500", f"steps={steps}"),
        ("warmup_cosine(50, 500)", f"warmup_cosine(2, {steps})"),
        ("checkpoint_every=100", "checkpoint_every=4"),
        ("log_every=100", "log_every=4"),
    ):
        assert old in script, f"the README's script no longer has {old!r}: update this test with it"
        script = script.replace(old, new)
    return script + (
        "\nimport json, sys\nif result.losses:\n"
        "    json.dump({str(k): v for k, v in result.losses.items()}, open('losses.json', 'w'))\n"
    )


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_readme_quick_start(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(readme_script(8))
    _run([sys.executable, "train.py"], tmp_path)
    single = {int(k): v for k, v in json.loads((tmp_path / "losses.json").read_text()).items()}
    assert sorted(single) == list(range(8)) and elaswave.load_model_state(tmp_path / "ckpt")
    out = _run(
        [
            *ELASWAVE,
            "run",
            "--nproc-per-node",
            "4",
            "--pp",
            "2",
            "--checkpoint-dir",
            "ck",
            "--checkpoint-every",
            "4",
            "train.py",
        ],
        tmp_path,
    )
    assert "job 'train' finished: 8/8 steps, 4 of 4 workers finished" in out.stdout, out.stdout[-2000:]
    launched = _launched_losses(tmp_path / "elaswave-run" / "train")
    assert sorted(launched) == list(range(8))
    for step in range(8):
        assert launched[step] == pytest.approx(single[step], rel=1e-5), step
    assert (
        elaswave.load_model_state(tmp_path / "ck").keys()
        == elaswave.load_model_state(tmp_path / "ckpt").keys()
    )


@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "example, args, out_flag",
    [
        ("gpt", ["--steps", "6"], "--losses-out"),
        ("digits", ["--steps", "12", "--global-batch", "32"], "--accuracy-out"),
    ],
)
def test_example_runs_as_documented(tmp_path: Path, example: str, args: list[str], out_flag: str) -> None:
    script = str(ROOT / "examples" / example / "train.py")
    _run([sys.executable, script, *args, out_flag, str(tmp_path / "single.json")], tmp_path)
    single = json.loads((tmp_path / "single.json").read_text())
    out = _run(
        [*ELASWAVE, "run", "--nproc-per-node", "4", "--pp", "2", "--checkpoint-dir", "ck", script, *args],
        tmp_path,
    )
    steps = int(args[1])
    assert f"{steps}/{steps} steps, 4 of 4 workers finished" in out.stdout, out.stdout[-2000:]
    launched = _launched_losses(tmp_path / "elaswave-run" / "train")
    assert sorted(launched) == list(range(steps))
    if example == "gpt":
        for step in range(steps):
            assert launched[step] == pytest.approx(single[str(step)], rel=1e-5), step
    else:
        assert launched[steps - 1] == pytest.approx(single["final_loss"], rel=1e-4)
        assert 0.0 <= single["accuracy"] <= 1.0
