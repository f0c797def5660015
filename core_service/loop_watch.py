"""Where the Core's event loop is when it stops turning: the answer to "why was the Core silent".

The Core marks every turn of its loop (`Core._turn_loop`, every `LOOP_BEAT_S`). Everything the
Core does for agents, executors and operators runs on that loop, so a loop that does not turn
for seconds shows up elsewhere as heartbeats judged late, agents waiting on a silent Core and REST
requests timing out, with no cause given. A daemon thread (`LoopWatch`) reads the mark every
`poll_s`; once the loop has been silent for `report_after_s` it logs, once per stall, the stack
of every thread, the loop's first:

- the loop thread inside the Core's own code: the call that blocks it;
- the loop thread waiting for the GIL: the stack of the thread that holds it;
- the loop thread in its selector: the process was not scheduled (a starved machine).

When the loop turns again the stall's length is logged too. The lateness of every turn is the
histogram `elaswave_core_loop_lag_seconds` (core_service.metrics), observed on the loop itself.
"""

from __future__ import annotations

import linecache
import logging
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

log = logging.getLogger("elaswave.core.loop")

REPORT_AFTER_S = 1.0
POLL_S = 0.25
STACK_FRAMES = 12  # innermost frames per thread: enough to name the call, short enough to read


class LoopWatch:
    """Logs the threads' stacks when the loop thread `loop_thread` (an ident) has not marked a
    turn (`last_turn()`, a `time.monotonic` reading) for `report_after_s`."""

    def __init__(
        self,
        last_turn: Callable[[], float],
        loop_thread: int,
        name: str,
        report_after_s: float = REPORT_AFTER_S,
        poll_s: float = POLL_S,
    ) -> None:
        if report_after_s <= 0 or poll_s <= 0:
            raise ValueError(f"report_after_s and poll_s must be > 0, got {report_after_s}, {poll_s}")
        self.last_turn, self.loop_thread, self.name = last_turn, loop_thread, name
        self.report_after_s, self.poll_s = report_after_s, poll_s
        self.reports = 0  # stalls reported
        self._reported_turn: float | None = None  # the last turn before the stall reported
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the watching thread (a daemon; returns at once)."""
        self._thread = threading.Thread(target=self._run, name=f"loop-watch-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread; blocks up to `timeout_s` for it to end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.check(time.monotonic())

    def check(self, now: float) -> str | None:
        """One look at the loop at `now`: the report logged, if this look makes one."""
        turned = self.last_turn()
        if self._reported_turn is not None and turned != self._reported_turn:
            log.warning(
                "core %s: event loop turned again after %.2f s", self.name, turned - self._reported_turn
            )
            self._reported_turn = None
        silent = now - turned
        if silent < self.report_after_s or self._reported_turn is not None:
            return None
        self._reported_turn = turned
        self.reports += 1
        report = f"core {self.name}: event loop silent for {silent:.2f} s; threads, the loop's first:\n"
        report += thread_stacks(self.loop_thread)
        log.warning("%s", report)
        return report


def thread_stacks(first: int) -> str:
    """The innermost frames of every thread of this process, thread `first` (an ident) first."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    order = sorted(frames, key=lambda ident: (ident != first, names.get(ident, "")))
    parts = []
    for ident in order:
        mark = " (event loop)" if ident == first else ""
        parts.append(f'thread "{names.get(ident, ident)}"{mark}, innermost frame first:\n')
        parts.extend(_frame_lines(frames[ident]))
    return "".join(parts)


def _frame_lines(frame: FrameType | None) -> list[str]:
    # Written out by hand: CPython 3.11's traceback formatting parses source lines with the ast
    # module, whose state another thread's ast.parse may be using (it then raises SystemError).
    lines: list[str] = []
    while frame is not None and len(lines) < STACK_FRAMES:
        code = frame.f_code
        source = linecache.getline(code.co_filename, frame.f_lineno).strip()
        lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}\n    {source}\n')
        frame = frame.f_back
    return lines
