#!/usr/bin/env python3
"""Runs a worker node's launcher so that SIGTERM is a preemption of this node, not a stop of the job.

`elaswave run` treats SIGTERM as "stop the job at a step boundary" (with `--core`, for every
node). In a container, SIGTERM means this node is being taken away (an eviction, a spot
reclaim, `docker stop`): the right answer is the agent's, which reports the preemption to the
Core, forwards SIGTERM to its worker and waits up to its grace (`elaswave agent --grace`, 30 s),
while the Core plans the job around the leaving ranks. So the first SIGTERM goes to every agent
under the launcher; the launcher ends by itself once its agents are gone. A SIGTERM before any
agent runs (still joining), a second SIGTERM, and SIGINT go to the launcher: its own stop.

usage: preemptible.py COMMAND [ARGS...]  (exits with COMMAND's status; 128+N when killed by N)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])  # the command may contain spaces and ')'
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def is_agent(pid: int) -> bool:
    """`python -m elaswave.cli agent ...` (how the launcher starts agents) or `elaswave agent`."""
    try:
        argv = [
            a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a
        ]
    except OSError:
        return False
    for i, arg in enumerate(argv[:-1]):
        if (arg == "elaswave.cli" or arg.endswith("/elaswave")) and argv[i + 1] == "agent":
            return True
    return False


class Preemption:
    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.pending: list[int] = []  # signals that came before the child existed
        self.preempting = False

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.child is None:
            self.pending.append(signum)
            return
        agents = [p for p in descendants(self.child.pid) if is_agent(p)] if signum == signal.SIGTERM else []
        if agents and not self.preempting:
            self.preempting = True
            print(
                f"[preemptible] SIGTERM: preempting this node's {len(agents)} agents",
                file=sys.stderr,
                flush=True,
            )
            for pid in agents:
                with contextlib.suppress(ProcessLookupError):  # it left already
                    os.kill(pid, signal.SIGTERM)
            return
        with contextlib.suppress(ProcessLookupError):
            self.child.send_signal(signum)

    def start(self, argv: list[str]) -> subprocess.Popen[bytes]:
        self.child = subprocess.Popen(argv)
        for signum in self.pending:
            self.on_signal(signum, None)
        return self.child


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    handler = Preemption()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler.on_signal)
    child = handler.start(argv[1:])
    code = child.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
