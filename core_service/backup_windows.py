"""The re-protection windows the workers report, and what the Core plans from them (issue 23,
item 2: resume first, re-protect after; `planners.reprotect`).

After a plan the executors resume training before the backup copies its layout moved are
re-seeded; they report the window with the plan's APPLIED acknowledgement (which copies, from
which step until the commit of which step) and its end with a REPROTECTED one. Every worker
computes the same window from the same layouts; the Core merges what they say (a joiner does
not know the copies the survivors were still re-seeding, so the union is kept).

While the window of the committed epoch is open, a loss whose only surviving copy is one of
those copies cannot be recovered in place: `unprotected_pairs` is what `choose_mode` hands
`planners.applicability.judge`, so such a plan is published as the RESTORE it is. A window is
open until a REPROTECTED report arrives: a report still in flight makes the Core plan a RESTORE
that might have gone in place, never the reverse. The executors apply the same rule to every
plan they receive, so a Core that never heard of a window (a new leader: windows are kept in
memory only) still ends in a RESTORE, one refused plan later.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from core_service.jobs import Job
from planners.reprotect import Pair, ReprotectWindow

KEPT_WINDOWS = 16  # windows kept per job (the newest epochs): the job view's history


def record_window(job: Job, epoch: int, window: ReprotectWindow, closed: bool) -> ReprotectWindow:
    """Merge one worker's report of plan `epoch`'s window (`closed`: a REPROTECTED report)."""
    window = replace(window, epoch=epoch)
    known = job.backup_windows.get(epoch)
    if known is not None:
        closed_step = window.closed_step if closed else known.closed_step
        window = ReprotectWindow(
            epoch,
            tuple(sorted(set(known.pairs) | set(window.pairs))),
            min(known.from_step, window.from_step),
            max(known.until_step, window.until_step),
            closed_step if closed_step is not None else known.closed_step,
        )
    elif not closed:
        window = replace(window, closed_step=None)
    job.backup_windows[epoch] = window
    for old in sorted(job.backup_windows)[:-KEPT_WINDOWS]:
        del job.backup_windows[old]
    return window


def unprotected_pairs(job: Job) -> frozenset[Pair]:
    """The copies of the committed layout still being re-seeded (its epoch's window, while no
    worker has reported it closed): a plan from that layout treats them as missing."""
    window = job.backup_windows.get(job.committed_epoch)
    if window is None or window.closed_step is not None:
        return frozenset()
    return frozenset(window.pairs)


def windows_view(job: Job) -> dict[str, Any]:
    """The job view's fields: the committed layout's open window (None when every copy is in
    place) and the recorded windows, newest first, each with its state."""
    history = []
    for epoch in sorted(job.backup_windows, reverse=True):
        window = job.backup_windows[epoch]
        if window.closed_step is not None:
            state = "closed"
        elif epoch == job.committed_epoch:
            state = "open"
        elif epoch < job.committed_epoch:
            state = "superseded"  # a later layout committed before this one's seeds were reported
        else:
            state = "pending"  # its plan has not committed a step yet
        history.append({**window.as_dict(), "state": state})
    current = next((w for w in history if w["state"] == "open"), None)
    return {"backup_window": current, "backup_windows": history}
