"""Run every benchmark in turn and keep a record of the results (what `make bench` calls).

Each benchmark runs as its own process (`python -m bench.<name> <args>`) with sizes chosen for a
small machine (two cores is enough; `--quick` shrinks them further for a smoke run). Output is
streamed as it comes and also written, with a header describing the machine, to
`bench/results/latest.md`. Exits non-zero, naming them, if any benchmark fails.

    python -m bench.run_all [--only migration_cost plan_latency] [--quick]
    python -m bench.run_all --only vs_ddp mttr join    # issue 23's figures, side by side
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

import psutil

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "latest.md"

# name -> (default args, --quick args)
BENCHMARKS: dict[str, tuple[list[str], list[str]]] = {
    # The defaults are the commands whose results the README reports.
    "plan_latency": (
        ["--devices", "1000", "10000", "100000", "--repeats", "5"],
        ["--layers", "32", "--stages", "4", "16", "--devices", "1000", "10000", "--repeats", "2"],
    ),
    "comm_recovery": (["--ranks", "8", "16", "32"], ["--ranks", "8"]),
    "snapshot_overhead": (
        ["--hidden", "64", "256", "--steps", "20", "--repeats", "3"],
        ["--hidden", "64", "--steps", "3", "--repeats", "1"],
    ),
    "migration_cost": ([], ["--dp", "2", "--hidden", "64", "--migrations", "2"]),
    "checkpoint_cost": (
        ["--hidden", "256", "--steps", "12", "--every", "3"],
        ["--hidden", "64", "--steps", "6", "--every", "2"],
    ),
    "agent_fanin": (
        ["--agents", "1000", "3000", "10000", "--window", "20", "--kills", "50"],
        ["--agents", "200", "--window", "5", "--warmup", "2", "--kills", "5"],
    ),
    "vs_ddp": ([], ["--configs", "ddp-dp2", "static-dp2", "ft-dp2", "--steps", "2", "--repeats", "1"]),
    "mttr": (["--quick"], ["--quick", "--case", "one kill"]),
    # A join with a warm spare and with a cold one, side by side (executor.spare_warmup).
    "join": (["--steps", "200", "--spare", "warm", "cold"], ["--steps", "150"]),
    # Starting a small job: `elaswave run` against torchrun + DDP, alternately.
    "launch": (["--repeats", "5"], ["--repeats", "1"]),
    # The backups' periodic check under `elaswave run`, every 2 steps against every 50.
    "verify_interval": (["--repeats", "3"], ["--repeats", "1", "--hidden", "64", "--steps", "12"]),
    # The fused, padded AdamW against the single-tensor arithmetic it replaced, on one core.
    "optim_update": (["--repeats", "5"], ["--repeats", "1"]),
    # Clipping's sum of squares: cache-sized fp64 pieces against the whole slice, on one core.
    "clip_norm": ([], ["--elements", "100000", "--repeats", "1"]),
    # How late a waiting voter reads the commit decision: the store's wait against polling.
    "vote_latency": (["--steps", "300"], ["--steps", "30"]),
}


class Tee:
    """Writes every line to the terminal and to the results file as it arrives."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def line(self, text: str = "") -> None:
        for stream in (sys.stdout, self.out):
            stream.write(text + "\n")
            stream.flush()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def machine_header(quick: bool) -> list[str]:
    mem = psutil.virtual_memory().total / 2**30
    return [
        "# ElasWave benchmarks" + (" (--quick sizes)" if quick else ""),
        "",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- commit: {git_commit()}",
        f"- CPU: {cpu_model()}, {os.cpu_count()} logical cores "
        f"({psutil.cpu_count(logical=False) or '?'} physical)",
        f"- memory: {mem:.1f} GiB",
        f"- {platform.system()} {platform.release()}, Python {platform.python_version()}, "
        f"torch {importlib.metadata.version('torch')}",
    ]


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (the benchmark's own processes count too)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def kill_group(pid: int) -> None:
    """Kill the benchmark's process group (its session was started for it alone)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def run_one(name: str, args: list[str], tee: Tee, timeout_s: float) -> int:
    """Run one benchmark, streaming its output; returns its exit status (-9 when timed out)."""
    cmd = [sys.executable, "-m", f"bench.{name}", *args]
    tee.line(f"\n## {name}\n\n`{shlex.join(['python', *cmd[1:]])}`\n")
    # The machines are shared: the load says how much of them the figures below had.
    tee.line(f"machine load average before: {load_average()}\n")
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,
    )
    timer = threading.Timer(timeout_s, kill_group, args=(proc.pid,))
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            tee.line(line.rstrip("\n"))
        rc = proc.wait()
    finally:
        timer.cancel()
    status = "ok" if rc == 0 else f"FAILED (exit {rc}{', timed out' if rc == -signal.SIGKILL else ''})"
    tee.line(
        f"\n_{name}: {status} in {time.monotonic() - start:.1f} s; load average after: {load_average()}_"
    )
    return rc


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(BENCHMARKS),
        metavar="NAME",
        help=f"run only these benchmarks (of {', '.join(BENCHMARKS)})",
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per benchmark")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = args.only or list(BENCHMARKS)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    failed: list[str] = []
    with RESULTS.open("w") as out:
        tee = Tee(out)
        for line in machine_header(args.quick):
            tee.line(line)
        for name in names:
            default, quick = BENCHMARKS[name]
            if run_one(name, quick if args.quick else default, tee, args.timeout) != 0:
                failed.append(name)
        tee.line(f"\n{'failed: ' + ', '.join(failed) if failed else 'all benchmarks passed'}")
    print(f"results written to {RESULTS.relative_to(ROOT)}")
    if failed:
        print(f"benchmarks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
