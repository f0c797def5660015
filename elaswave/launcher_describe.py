"""The launcher's describe phase: run the user's script once to learn its model (stdlib only).

The script runs as `python script.py args` with `ELASWAVE_DESCRIBE_FILE` set; its
`elaswave.train(...)` writes a `ModelDescription` there and exits 0 without training
(`wire.worker_env`). Everything else about the run (the units' costs, the batch, the steps)
comes from that file, so the launcher never imports torch or the script. Under `elaswave run`
the node's zygote forks it (torch imported once per node, not once more for the describe run).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from executor.child_process import Spawn
from wire import core_tls
from wire.worker_env import (
    CHECKPOINT_DIR_ENV,
    CHECKPOINT_EVERY_ENV,
    CORE_ENV,
    DESCRIBE_ENV,
    DESCRIPTION_ENV,
    JOB_ENV,
    LAYOUT_ENV,
    RANK_ENV,
    RESULTS_ENV,
    RESUME_ENV,
    STOP_FILE_ENV,
    STORE_ENV,
    TIMEOUT_ENV,
    TOKEN_ENV,
    WORKER_ID_ENV,
    ModelDescription,
)

# What a launcher or agent sets for a worker. A launcher started from inside another job's
# worker (a test, a notebook) must not pass its own place on, or the child would think it is
# that rank of that job.
WORKER_CONTRACT_ENV: tuple[str, ...] = (
    JOB_ENV,
    WORKER_ID_ENV,
    RANK_ENV,
    CORE_ENV,
    STORE_ENV,
    LAYOUT_ENV,
    TOKEN_ENV,
    TIMEOUT_ENV,
    RESULTS_ENV,
    CHECKPOINT_DIR_ENV,
    CHECKPOINT_EVERY_ENV,
    RESUME_ENV,
    DESCRIBE_ENV,
    STOP_FILE_ENV,
    DESCRIPTION_ENV,
    "ELASWAVE_METRICS_SOCKET",
    core_tls.CA_ENV,  # given again, explicitly, to the workers of a node joined to a TLS Core
    core_tls.CERT_ENV,
    core_tls.KEY_ENV,
    "ELASWAVE_CONTROL_FILE",
    "ELASWAVE_FINISHED_FILE",
)
STDERR_TAIL_LINES = 30


class DescribeError(RuntimeError):
    """The describe run failed; the message says why and what to fix."""


def clean_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default os.environ) without any worker-contract variable."""
    env = dict(os.environ if base is None else base)
    for name in WORKER_CONTRACT_ENV:
        env.pop(name, None)
    return env


def describe(
    script: Path,
    script_args: Sequence[str],
    timeout_s: float,
    extra_env: Mapping[str, str] | None = None,
    spawn: Spawn | None = None,
) -> ModelDescription:
    """Run the script in describe mode; blocks until it exits, at most `timeout_s` seconds.
    `spawn`: the node's zygote (`WarmWorkers.fork`), which runs it without a second import of
    torch; where it declines, or without one, the script runs as this process's child.

    Raises DescribeError when it exits non-zero (with its stderr's tail), times out, never calls
    `elaswave.train()` (exits without writing the file) or writes a file that cannot be read."""
    with tempfile.TemporaryDirectory(prefix="elaswave-describe-") as tmp:
        out = Path(tmp) / "description.json"
        env = clean_env() | dict(extra_env or {}) | {DESCRIBE_ENV: str(out), "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, str(script), *script_args]
        ran = _run_forked(spawn, cmd, env, Path(tmp) / "stderr", timeout_s) if spawn is not None else None
        code, stderr = ran if ran is not None else _run_cold(cmd, env, timeout_s)
        if code is None:
            raise DescribeError(
                f"{script.name} did not finish describing its model within {timeout_s:g} s "
                "(raise --describe-timeout if building the units is that slow)"
            )
        if code != 0:
            raise DescribeError(
                f"{script.name} exited with {_status(code)} while describing its model "
                f"(`python {script.name}` with {DESCRIBE_ENV} set); its stderr ends with:\n"
                + tail(stderr, STDERR_TAIL_LINES)
            )
        if not out.exists():
            raise DescribeError(
                f"{script.name} never called elaswave.train(): it exited 0 without describing a "
                "model. Call elaswave.train(units=..., loss_fn=..., dataset=..., ...) in the script"
            )
        try:
            return ModelDescription.from_json(out.read_text())
        except (ValueError, TypeError, KeyError) as exc:
            raise DescribeError(
                f"{script.name} wrote a model description the launcher cannot read ({exc}); "
                "are the launcher and the script's elaswave the same version?"
            ) from None


def _run_cold(cmd: list[str], env: Mapping[str, str], timeout_s: float) -> tuple[int | None, str]:
    """(exit code, stderr) of `cmd` as this process's child; code None when it timed out (killed)."""
    # Own session: a Ctrl-C at the terminal reaches the launcher, which ends this run itself.
    proc = subprocess.Popen(
        cmd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return None, ""
    except BaseException:  # KeyboardInterrupt, the launcher's stop: take the child with us
        _kill_group(proc)
        raise
    return proc.returncode, stderr


def _run_forked(
    spawn: Spawn, cmd: list[str], env: Mapping[str, str], stderr_file: Path, timeout_s: float
) -> tuple[int | None, str] | None:
    """As `_run_cold`, forked by `spawn` (its stderr through `stderr_file`); None if it declined."""
    with open(os.devnull, "r+b") as null, stderr_file.open("w+b") as err:
        child = spawn(cmd, env, (null.fileno(), null.fileno(), err.fileno()))
        if child is None:
            return None
        try:
            code: int | None = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # a timeout, the launcher's stop: take the child with us
            if child.poll() is None:
                child.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=10)
    return code, stderr_file.read_text(errors="replace")


def tail(text: str, lines: int) -> str:
    kept = text.rstrip().splitlines()[-lines:]
    return "\n".join("    " + line for line in kept) if kept else "    (nothing on stderr)"


def _status(code: int) -> str:
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)
