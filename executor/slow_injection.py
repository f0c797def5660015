"""A straggler on demand (drills, the demo, tests): `ELASWAVE_INJECT_SLOW_FILE`.

Once the file holds `{"slowdown": S}` (S >= 1), every later step's own compute on this rank is
stretched to `S / f` times its measured length by a sleep before the commit vote, where `f` is the
clock factor the agent's frequency controller publishes in the control file (mhz / nominal,
`wire.local_protocol`; 1.0 without one). So an up-clock from the Core's DVFS plan (ElasWave
§4.3) shortens the straggler's steps as a faster clock would on a device, and migrating layers off
its stage (§4.2) shortens them because there is less compute to stretch. On CPU, where no clock can
be lowered, this is how a slow device is simulated; the file is re-read only when it changes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class SlowInjection:
    """Reads the slowdown file and the clock factor; says how long to stretch a step."""

    def __init__(self, path: Path, control: Any = None) -> None:
        """`control`: an `wire.local_protocol.ControlReader` (its `factor`), or None."""
        self.path, self.control = path, control
        self.slowdown = 1.0
        self._stamp: tuple[int, int] | None = None

    def slowdown_now(self) -> float:
        """The injected slowdown (1.0 until the file exists); a malformed file is an error."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return self.slowdown
        stamp = (stat.st_ino, stat.st_mtime_ns)
        if stamp != self._stamp:
            said = json.loads(self.path.read_text())
            slowdown = float(said["slowdown"]) if isinstance(said, dict) else float("nan")
            if not slowdown >= 1.0:
                raise ValueError(f"{self.path}: slowdown must be a number >= 1, got {said!r}")
            self._stamp, self.slowdown = stamp, slowdown
        return self.slowdown

    def factor(self) -> float:
        return float(self.control.factor) if self.control is not None else 1.0

    def extra_s(self, compute_s: float) -> tuple[float, float]:
        """(seconds to sleep after a step that computed `compute_s`, the clock factor used)."""
        factor = self.factor()
        return max(0.0, compute_s * (self.slowdown_now() / factor - 1.0)), factor
