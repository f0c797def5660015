"""Where a worker's steps go, kept for the steps right after each plan (issue 23, item 3).

The first step on a new layout has costs no other step has (new groups' first use, caches and
buffers built lazily, acknowledgements to the Core); to find and keep them off it, the worker
times each step's phases (`mark`) and keeps the records of the first `KEPT` steps after every
plan it applied, the later ones being the same layout's steady state to compare with. Bounded:
`KEPT` records per plan, whatever the job's length.
"""

from __future__ import annotations

import time
from typing import Any

KEPT = 6  # steps recorded after each plan: the first, and steady ones on the same layout


class StepPhases:
    """Per-phase wall seconds of the step in flight; kept per plan in `after_plan` (JSON-ready)."""

    def __init__(self) -> None:
        self.after_plan: dict[str, list[dict[str, Any]]] = {}  # plan epoch -> step records
        self._epoch: int | None = None  # the plan whose first steps are being kept
        self._current: dict[str, float] = {}
        self._last = 0.0

    def plan_applied(self, epoch: int) -> None:
        """Keep the next `KEPT` committed steps under `epoch`."""
        self._epoch = epoch
        self.after_plan[str(epoch)] = []

    def begin(self) -> None:
        self._current = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """The time since the previous mark (or `begin`) went to `phase`."""
        now = time.perf_counter()
        self._current[phase] = self._current.get(phase, 0.0) + now - self._last
        self._last = now

    def committed(self, step: int) -> None:
        """The step committed: keep its record while the plan's first steps are being kept."""
        if self._epoch is None:
            return
        kept = self.after_plan[str(self._epoch)]
        kept.append({"step": step, **{k: round(v, 6) for k, v in self._current.items()}})
        if len(kept) >= KEPT:
            self._epoch = None
