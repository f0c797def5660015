"""`WarmWorkers.ready`: a zygote still importing is waited for (a cold start would import the same
modules on the same cores), one that exited is not, and one that never comes up is given up on
once, said on stderr, and not waited for again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elaswave.launcher_procs import WarmWorkers, spawn, stop_process

pytestmark = pytest.mark.multiproc

SLOW_IMPORT_S = 1.5


def _slow_zygote(tmp_path: Path) -> tuple[WarmWorkers, dict[str, str]]:
    """A real `agent.zygote` whose preload takes SLOW_IMPORT_S, as torch's does on a loaded
    machine, and its environment (a child whose import-time variables differ is not forked)."""
    (tmp_path / "slow_preload.py").write_text(f"import time\ntime.sleep({SLOW_IMPORT_S})\n")
    env = dict(os.environ) | {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    sock = tmp_path / "zygote.sock"
    cmd = [sys.executable, "-m", "agent.zygote", "--socket", str(sock), "--preload", "slow_preload"]
    return WarmWorkers(spawn(cmd, env, tmp_path / "zygote.log", signal.SIGTERM), sock), env


@pytest.mark.timeout(60)
def test_a_zygote_still_importing_is_waited_for_and_forks(tmp_path: Path) -> None:
    warm, env = _slow_zygote(tmp_path)
    try:
        start = time.monotonic()
        assert warm.ready(timeout_s=30.0) == warm.socket
        assert time.monotonic() - start >= SLOW_IMPORT_S * 0.9  # it waited through the import
        out, script = tmp_path / "child.txt", tmp_path / "child.py"
        script.write_text("print('forked')\n")
        with open(os.devnull, "rb") as stdin, out.open("wb") as stdout:
            stdio = (stdin.fileno(), stdout.fileno(), stdout.fileno())
            child = warm.fork([sys.executable, str(script)], env, stdio)
        assert child is not None
        assert child.wait(timeout=20) == 0
        assert out.read_text().strip() == "forked"
        assert not warm.gave_up
    finally:
        stop_process(warm.process, signal.SIGTERM, 5.0)


@pytest.mark.timeout(30)
def test_a_zygote_that_never_comes_up_is_given_up_on_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    warm = WarmWorkers(stuck, tmp_path / "zygote.sock")
    try:
        start = time.monotonic()
        assert warm.ready(timeout_s=0.5) is None
        assert 0.5 <= time.monotonic() - start < 5.0
        assert capsys.readouterr().err.count("not ready within 0.5 s: processes start cold") == 1
        start = time.monotonic()
        assert warm.fork([sys.executable, "-c", "pass"], dict(os.environ), (0, 1, 2)) is None
        assert time.monotonic() - start < 0.2, "a zygote already given up on was waited for again"
        assert capsys.readouterr().err == ""  # said once
    finally:
        stop_process(stuck, signal.SIGTERM, 5.0)


@pytest.mark.timeout(30)
def test_a_zygote_that_exited_is_not_waited_for(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    gone.wait(timeout=20)
    warm = WarmWorkers(gone, tmp_path / "zygote.sock")
    start = time.monotonic()
    assert warm.ready(timeout_s=30.0) is None
    assert time.monotonic() - start < 0.5
    assert not warm.gave_up
