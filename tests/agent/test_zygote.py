"""The node's worker zygote (agent.zygote): a forked worker behaves as `python script.py` would.

Each test starts a real zygote (torch preloaded) and real agent-side clients
(`zygote_client.py`, through `agent.worker.ForkedWorker`), and compares a forked worker's output
and exit status with the same command run cold by the interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from wire.local_protocol import EXIT_CODE_UNKNOWN

pytestmark = pytest.mark.timeout(90)
CLIENT = Path(__file__).with_name("zygote_client.py")
REPO = Path(__file__).resolve().parents[2]

SCRIPT = """\
import os, sys
import json
print(json.dumps({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
                  "x": os.environ.get("ZYGOTE_TEST_X"), "file": __file__}), flush=True)
print("to stderr", file=sys.stderr)
mode = sys.argv[1]
if mode == "raise":
    def inner():
        raise ValueError("boom")
    inner()
if mode == "sleep":
    import time
    time.sleep(60)
sys.exit(int(mode) if mode.isdigit() else 0)
"""


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), ZYGOTE_TEST_X="seen")
    env.pop("PYTHONUNBUFFERED", None)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    where = tmp_path_factory.mktemp("zygote")
    sock = where / "z.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.zygote", "--socket", str(sock)],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=(where / "zygote.log").open("wb"),
    )
    deadline = time.monotonic() + 30
    while not sock.exists():
        assert proc.poll() is None, (where / "zygote.log").read_text()
        assert time.monotonic() < deadline, "the zygote did not listen within 30 s"
        time.sleep(0.05)
    yield sock, proc
    proc.terminate()
    proc.wait(10)


def _client(
    sock: Path, command: list[str], cwd: Path, *extra: str, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CLIENT), str(sock), *extra, "--", *command],
        env=_env(**env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _split(stdout: str) -> tuple[list[str], list[str]]:
    """The client's PID line apart from the rest (the worker prints on the same stream meanwhile)."""
    lines = stdout.splitlines()
    return [x for x in lines if x.startswith("PID ")], [x for x in lines if not x.startswith("PID ")]


def _cold(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, env=_env(), cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("mode", ["0", "3", "raise"])
def test_a_forked_worker_runs_as_the_interpreter_would(
    zygote: tuple[Path, subprocess.Popen[bytes]], tmp_path: Path, mode: str
) -> None:
    script = tmp_path / "scripts" / "w.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    command = [sys.executable, str(script), mode]
    forked = _client(zygote[0], command, tmp_path)
    cold = _cold(command, tmp_path)
    pids, worker_lines = _split(forked.stdout)
    assert len(pids) == 1, forked.stdout + forked.stderr
    assert worker_lines[-1] == f"RESULT {cold.returncode}"
    assert worker_lines[:-1] == cold.stdout.splitlines()  # argv, __name__, cwd, sys.path[0], env, __file__
    if mode == "raise":
        assert cold.returncode == 1
        # The same traceback, without the zygote's own frames.
        assert forked.stderr.splitlines()[1:] == cold.stderr.splitlines()[1:], forked.stderr
        assert "zygote" not in forked.stderr
    else:
        assert forked.stderr == cold.stderr == "to stderr\n"


def test_a_module_worker_and_a_signal_report_as_the_interpreter_would(
    zygote: tuple[Path, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    (tmp_path / "wmod.py").write_text(SCRIPT)
    command = [sys.executable, "-m", "wmod", "sleep"]
    forked = _client(zygote[0], command, tmp_path, "--signal-after", "1.0", str(int(signal.SIGTERM)))
    pids, lines = _split(forked.stdout)
    assert len(pids) == 1 and lines[-1] == f"RESULT {-signal.SIGTERM}", forked.stdout
    assert '"name": "__main__"' in lines[0] and '"x": "seen"' in lines[0]


@pytest.mark.parametrize(
    ("command", "env"),
    [
        (["{python}", "-u", "{script}", "0"], {}),  # interpreter options
        (["{python}", "{script}", "0"], {"OMP_NUM_THREADS": "3"}),  # read when torch loads
        (["/bin/sh", "-c", "exit 0"], {}),  # not a Python worker
        (["{venv}/bin/python", "{script}", "0"], {}),  # the same interpreter in another environment
    ],
)
def test_what_the_zygote_cannot_fork_it_declines_and_keeps_serving(
    zygote: tuple[Path, subprocess.Popen[bytes]], tmp_path: Path, command: list[str], env: dict[str, str]
) -> None:
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    venv = tmp_path / "other-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    filled = [c.format(python=sys.executable, script=script, venv=venv) for c in command]
    declined = _client(zygote[0], filled, tmp_path, **env)
    assert declined.stdout.strip() == "COLD", declined.stdout + declined.stderr
    served = _client(zygote[0], [sys.executable, str(script), "0"], tmp_path)
    assert served.stdout.splitlines()[-1] == "RESULT 0"


def test_a_malformed_request_is_refused_and_the_zygote_keeps_serving(
    zygote: tuple[Path, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    import socket

    for garbage in (b"\x00\x00\x00\x05nope!", b"\xff\xff\xff\xff"):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(10)
        conn.connect(str(zygote[0]))
        socket.send_fds(conn, [garbage], [0, 1, 2])
        assert conn.recv(256).startswith(b"NO bad request")
        conn.close()
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    assert (
        _client(zygote[0], [sys.executable, str(script), "0"], tmp_path).stdout.splitlines()[-1] == "RESULT 0"
    )


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _start_sleeper(sock: Path, tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    client = subprocess.Popen(
        [sys.executable, str(CLIENT), str(sock), "--", sys.executable, str(script), "sleep"],
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdout is not None
    for line in client.stdout:  # the worker prints on the same stream, maybe first
        if line.startswith("PID "):
            return client, int(line.split()[1])
    raise AssertionError("the client ended without starting a worker")


def test_a_worker_dies_with_its_agent(zygote: tuple[Path, subprocess.Popen[bytes]], tmp_path: Path) -> None:
    client, pid = _start_sleeper(zygote[0], tmp_path)
    # `ps` shows the worker's own command (its title, set as the fork begins the script).
    want = f"{sys.executable} {tmp_path / 'w.py'} sleep"
    deadline = time.monotonic() + 10
    while (title := Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode()) != want:
        assert time.monotonic() < deadline, title
        time.sleep(0.02)
    client.kill()  # the agent's kill -9: its connection closes
    client.wait(10)
    assert _wait_gone(pid, 5.0), f"worker {pid} outlived its agent"


def test_workers_die_with_the_zygote_and_their_agents_hear_of_it(tmp_path: Path) -> None:
    sock = tmp_path / "z.sock"
    zygote = subprocess.Popen(
        [sys.executable, "-m", "agent.zygote", "--socket", str(sock), "--preload", ""], env=_env()
    )
    deadline = time.monotonic() + 30
    while not sock.exists():
        assert time.monotonic() < deadline and zygote.poll() is None
        time.sleep(0.05)
    client, pid = _start_sleeper(sock, tmp_path)
    zygote.kill()
    zygote.wait(10)
    assert _wait_gone(pid, 5.0), f"worker {pid} outlived the zygote"
    out, _ = client.communicate(timeout=20)
    assert out.strip().splitlines()[-1] == f"RESULT {EXIT_CODE_UNKNOWN}"


HOOKED = """\
calls = []
def prepare_zygote():
    calls.append(len(calls) + 1)
"""
BROKEN = "def prepare_zygote():\n    raise RuntimeError('nope')\n"
PROBE = """\
import gc, json, sys
hooked = sys.modules.get("hooked")
print(json.dumps({"calls": hooked.calls if hooked else None, "frozen": gc.get_freeze_count(),
                  "symbolic_shapes": "torch.fx.experimental.symbolic_shapes" in sys.modules}), flush=True)
"""


def test_preloaded_modules_prepare_once_before_the_forks_and_a_failing_hook_is_only_reported(
    tmp_path: Path,
) -> None:
    (tmp_path / "hooked.py").write_text(HOOKED)
    (tmp_path / "broken.py").write_text(BROKEN)
    (tmp_path / "probe.py").write_text(PROBE)
    sock, log = tmp_path / "z.sock", tmp_path / "zygote.log"
    preload = "hooked,broken,executor.warm_runtime"
    env = _env(PYTHONPATH=f"{REPO}:{tmp_path}")
    zygote = subprocess.Popen(
        [sys.executable, "-m", "agent.zygote", "--socket", str(sock), "--preload", preload],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
    )
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert zygote.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        seen = []
        for _ in range(2):
            forked = subprocess.run(
                [sys.executable, str(CLIENT), str(sock), "--", sys.executable, str(tmp_path / "probe.py")],
                env=env,
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=60,
            )
            pids, lines = _split(forked.stdout)
            assert len(pids) == 1 and lines[-1] == "RESULT 0", forked.stdout + forked.stderr
            seen.append(json.loads(lines[0]))
    finally:
        zygote.terminate()
        zygote.wait(10)
    # Both workers were forked after the hooks ran, once: torch's lazy import done, heap frozen.
    for probe in seen:
        assert probe["calls"] == [1]
        assert probe["symbolic_shapes"] is True
        assert probe["frozen"] > 10_000
    assert "zygote: broken.prepare_zygote() failed (nope)" in log.read_text()
