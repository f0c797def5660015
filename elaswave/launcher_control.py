"""How a launcher run is named, stopped and resumed: the job's name, the signal handler that turns
Ctrl-C into a stop at a step boundary, and the command that resumes a run from its checkpoint.
`elaswave.launcher` and `elaswave.launcher_session` both use these; neither imports the other's
module for them.
"""

from __future__ import annotations

import argparse
import re
import shlex
import signal
import sys
from pathlib import Path
from types import FrameType

# Seconds any collective, vote or plan wait may take unless --timeout says otherwise.
DEFAULT_WORKER_TIMEOUT_S = 20.0


def job_name(args: argparse.Namespace) -> str:
    if args.job:
        return str(args.job)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", args.script.stem).strip("-._") or "job"
    return name[:63]


class StopRequest:
    """SIGINT/SIGTERM handler. Before the workers start (`graceful` False) any signal ends the
    launcher at once; once they run, the first asks for a clean stop, the second for an immediate one."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.graceful = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None or not self.graceful:
            self.signum = self.signum or signum
            raise KeyboardInterrupt  # out of any wait: tear down now
        self.signum = signum
        print(
            f"\n[elaswave] {signal.Signals(signum).name}: stopping the job at a step boundary "
            "(again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self)


def next_job_name(name: str) -> str:
    """`name-2` for `name`, `name-3` for `name-2`: a name the Core has not seen for the resumed job."""
    match = re.fullmatch(r"(.*)-(\d+)", name)
    return f"{match[1]}-{int(match[2]) + 1}" if match else f"{name[:61]}-2"


def resume_command(args: argparse.Namespace, checkpoint_dir: Path) -> str:
    """The command that resumes this run from `checkpoint_dir` (same flags, same script)."""
    cmd = [
        "elaswave",
        "run",
        "--nnodes",
        str(args.nnodes),
        "--nproc-per-node",
        str(args.nproc_per_node),
        "--pp",
        str(args.pp),
        "--resume",
        str(checkpoint_dir),
    ]
    if getattr(args, "core", None):  # on every node again, as a new job: the Core keeps the old name
        cmd += ["--core", args.core, "--job", next_job_name(job_name(args))]
        for flag in ("core_tls_ca", "core_tls_cert", "core_tls_key"):  # the same way to the Core
            if getattr(args, flag, None) is not None:
                cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    elif args.job:
        cmd += ["--job", args.job]
    if args.checkpoint_dir:
        cmd += ["--checkpoint-dir", str(args.checkpoint_dir)]
    if args.checkpoint_every:
        cmd += ["--checkpoint-every", str(args.checkpoint_every)]
    if args.timeout != DEFAULT_WORKER_TIMEOUT_S:
        cmd += ["--timeout", f"{args.timeout:g}"]
    if getattr(args, "devices_per_node", None):
        cmd += ["--devices-per-node", str(args.devices_per_node)]
    if getattr(args, "share_devices", False):
        cmd += ["--share-devices"]
    return shlex.join([*cmd, str(args.script), *args.script_args])
