"""A stand-in for `elaswave run` and its agents, to test docker/preemptible.py's signal routing
(the agents' own SIGTERM handling is tested with real agents in tests/agent). Each process
appends what it received to OUT. Roles: `launcher N OUT` starts N agents (`... elaswave.cli
agent OUT`, the argv shape of the launcher's agents) after `delay` seconds and exits once they
are gone; an agent exits on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType


def note(out: Path, what: str) -> None:
    with out.open("a") as f:
        f.write(what + "\n")


def launcher(agents: int, out: Path, delay_s: float, linger_s: float) -> int:
    stopped: list[int] = []

    def on_term(signum: int, frame: FrameType | None) -> None:
        note(out, f"launcher {signal.Signals(signum).name}")
        stopped.append(signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    note(out, "launcher ready")
    deadline = time.monotonic() + delay_s
    while time.monotonic() < deadline and not stopped:
        time.sleep(0.02)
    if stopped:
        return 3
    procs = [
        subprocess.Popen([sys.executable, __file__, "elaswave.cli", "agent", str(out), str(i), str(linger_s)])
        for i in range(agents)
    ]
    note(out, "agents started")
    while any(p.poll() is None for p in procs):
        time.sleep(0.02)
    note(out, "launcher done")
    return 0


def agent(out: Path, index: str, linger_s: float) -> int:
    def on_term(signum: int, frame: FrameType | None) -> None:
        note(out, f"agent {index} SIGTERM")
        time.sleep(linger_s)  # a worker finishing its step
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    note(out, f"agent {index} ready")
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    if sys.argv[1] == "launcher":
        sys.exit(launcher(int(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])))
    sys.exit(agent(Path(sys.argv[3]), sys.argv[4], float(sys.argv[5])))
