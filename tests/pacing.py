"""Paced test jobs: slow steps while a test still has events to fire, full speed after.

A test that must fire faults into a running job slows the job's steps (a sleep in the workers'
`on_step`) so the job outlives the events on a loaded machine. Once the last event has had its
effect, the rest of the job need not crawl: `release(script)` creates a file beside the script
that the workers check each step, and they train on at full speed. The losses and the state do
not depend on the pace, so the comparison with the reference run is unchanged.
"""

from __future__ import annotations

from pathlib import Path

RELEASE_FILE = "unpaced"


def paced_on_step(sleep_s: float) -> str:
    """Source of an `on_step=` argument that sleeps `sleep_s` per step in a launched worker (not
    in the single-process reference) until the release file beside the script exists."""
    return (
        f"on_step=lambda step, loss: __import__('time').sleep({sleep_s})\n"
        "                        if __import__('os').environ.get('ELASWAVE_RANK')\n"
        f"                        and not __import__('pathlib').Path(__file__).with_name({RELEASE_FILE!r}).exists()\n"
        "                        else None"
    )


def release(script: Path) -> None:
    """Let the job of `script` train on at full speed from its next step."""
    script.with_name(RELEASE_FILE).touch()
