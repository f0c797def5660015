"""A helper process forked by the node's zygote (`agent.zygote_client.ZygoteChild`): a
rendezvous store started through `executor.store_process.launch` serves like a cold one, its
exit status comes back as Popen's would, it never outlives the process that asked for it or the
zygote, and a fork the zygote declines falls back to a cold store.

Every test runs a real zygote (torch preloaded) and real store processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from torch.distributed import TCPStore

from agent.zygote_client import ZygoteChild
from executor.child_process import Spawn
from executor.store_process import launch
from wire.local_protocol import EXIT_CODE_UNKNOWN

pytestmark = [pytest.mark.timeout(90), pytest.mark.multiproc]
REPO = Path(__file__).resolve().parents[2]
SLEEP = "import sys, time\ntime.sleep(120)\n"
EXIT_3 = "import sys\nsys.exit(3)\n"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.update(extra)
    return env


def _start_zygote(where: Path) -> tuple[Path, subprocess.Popen[bytes]]:
    sock = where / "z.sock"
    log = where / "zygote.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent.zygote", "--socket", str(sock)],
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    deadline = time.monotonic() + 30
    while not sock.exists():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the zygote did not listen within 30 s"
        time.sleep(0.05)
    return sock, proc


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    sock, proc = _start_zygote(tmp_path_factory.mktemp("zygote"))
    yield sock, proc
    proc.terminate()
    proc.wait(10)


def _spawn_from(sock: Path) -> Spawn:
    def spawn(argv: Sequence[str], env: Mapping[str, str], stdio: tuple[int, int, int]) -> ZygoteChild | None:
        return ZygoteChild.fork(sock, argv, env, stdio)

    return spawn


def _client(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


def test_a_forked_store_serves_and_its_exit_comes_back_as_popens_would(
    zygote: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    sock, zygote_proc = zygote
    store, port = launch(["--host", "127.0.0.1"], 30.0, _env(), spawn=_spawn_from(sock))
    assert isinstance(store, ZygoteChild)
    assert psutil.Process(store.pid).ppid() == zygote_proc.pid  # forked, not this process's child
    client = _client(port)
    client.set("key", "value")
    assert client.get("key") == b"value"
    assert store.poll() is None and store.returncode is None
    with pytest.raises(subprocess.TimeoutExpired):
        store.wait(timeout=0.2)
    store.terminate()
    assert store.wait(timeout=10) == 0  # a store exits 0 on SIGTERM, forked or not
    assert store.poll() == 0 and store.returncode == 0
    store.kill()  # nothing to signal any more: no error, as with Popen
    assert not psutil.pid_exists(store.pid) or psutil.Process(store.pid).status() == psutil.STATUS_ZOMBIE


def _script(where: Path, text: str) -> str:
    path = where / f"script-{abs(hash(text))}.py"
    path.write_text(text)
    return str(path)


def test_an_exit_code_and_a_killing_signal_come_back(
    zygote: tuple[Path, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    sock, _ = zygote
    child = ZygoteChild.fork(sock, [sys.executable, _script(tmp_path, EXIT_3)], _env())
    assert child is not None and child.wait(timeout=30) == 3
    child = ZygoteChild.fork(sock, [sys.executable, _script(tmp_path, SLEEP)], _env())
    assert child is not None
    child.kill()
    assert child.wait(timeout=10) == -signal.SIGKILL


def test_a_fork_the_zygote_declines_falls_back_to_a_cold_store(
    zygote: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    sock, _ = zygote
    env = _env(PYTHONHASHSEED="1234")  # read at interpreter start: the zygote's differs
    assert ZygoteChild.fork(sock, [sys.executable, "-m", "executor.store_server"], env) is None
    store, port = launch(["--host", "127.0.0.1"], 60.0, env, spawn=_spawn_from(sock))
    try:
        assert isinstance(store, subprocess.Popen)
        assert psutil.Process(store.pid).ppid() == os.getpid()
        _client(port).set("key", "cold")
    finally:
        store.terminate()
        assert store.wait(timeout=10) == 0


def test_a_forked_child_dies_with_its_zygote_and_its_status_is_unknown(tmp_path: Path) -> None:
    sock, zygote_proc = _start_zygote(tmp_path)
    try:
        child = ZygoteChild.fork(sock, [sys.executable, _script(tmp_path, SLEEP)], _env())
        assert child is not None and child.poll() is None
        zygote_proc.kill()
        assert child.wait(timeout=10) == EXIT_CODE_UNKNOWN
        assert not psutil.pid_exists(child.pid) or psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
    finally:
        zygote_proc.kill()
        zygote_proc.wait(10)


OWNER = """\
import sys
from pathlib import Path
from agent.zygote_client import ZygoteChild
child = ZygoteChild.fork(Path(sys.argv[1]), [sys.executable, sys.argv[2]], {env!r})
print(child.pid, flush=True)
sys.stdin.readline()
"""


def test_a_forked_child_never_outlives_the_process_that_asked_for_it(
    zygote: tuple[Path, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    sock, _ = zygote
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER.format(env=_env()), str(sock), _script(tmp_path, SLEEP)],
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout is not None
    pid = int(owner.stdout.readline())
    assert psutil.Process(pid).is_running()
    owner.kill()  # SIGKILL: no clean-up of its own; its connection to the zygote closes
    owner.wait(10)
    gone, _ = psutil.wait_procs([psutil.Process(pid)], timeout=10)
    assert gone, "the forked child outlived its owner"
