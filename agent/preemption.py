"""Preemption signals the agent relays to the Core (docs/architecture.md ("Promises and rules"), ElasWave §3.2 Agent).

Kubernetes, Slurm, Kueue and Volcano announce a preemption only by SIGTERM followed by a grace
period (30 s by default); some clouds instead drop a notice file. Either becomes a
``PreemptionNotice`` with the time by which the worker will be gone.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from pathlib import Path

from agent.logs import log_event
from wire.v1 import agent_pb2


def notice(source: str, deadline_unix: float) -> agent_pb2.ConnectRequest:
    return agent_pb2.ConnectRequest(
        preemption=agent_pb2.PreemptionNotice(source=source, deadline_unix=deadline_unix)
    )


def parse_notice_deadline(content: str, now_unix: float, grace_s: float) -> tuple[float, str]:
    """(deadline, note) from a notice file: a unix time in seconds, or empty for now + grace.

    A file that says something else still means "preempted": the default grace applies and the
    note says why, so a malformed notice never delays the report.
    """
    text = content.strip()
    if not text:
        return now_unix + grace_s, f"no deadline in file; default grace {grace_s:g} s"
    try:
        deadline = float(text.split()[0])
    except ValueError:
        return now_unix + grace_s, f"unreadable deadline {text[:40]!r}; default grace {grace_s:g} s"
    if not math.isfinite(deadline):
        return now_unix + grace_s, f"non-finite deadline {text[:40]!r}; default grace {grace_s:g} s"
    if deadline < now_unix:
        return deadline, "deadline already passed"
    return deadline, "deadline from file"


async def watch_notice_file(
    path: Path,
    poll_s: float,
    grace_s: float,
    clock: Callable[[], float],
    on_notice: Callable[[float], None],
) -> None:
    """Wait for ``path`` to appear (stat every ``poll_s``), report once, return."""
    while not path.exists():
        await asyncio.sleep(poll_s)
    try:
        content = path.read_text(errors="replace")
    except OSError as exc:
        content = ""
        log_event(logging.WARNING, "notice_file_unreadable", path=path, error=exc.strerror or str(exc))
    deadline, note = parse_notice_deadline(content, clock(), grace_s)
    log_event(
        logging.WARNING,
        "preemption_notice",
        source="notice-file",
        path=path,
        deadline_unix=deadline,
        note=note,
    )
    on_notice(deadline)
