"""One rank of the demo's job: the user's script, run unchanged, with the demo's instrumentation.

`python -m harness.demo_worker SCRIPT ARGS...` runs SCRIPT as `__main__` (exactly what
`python SCRIPT ARGS...` does) after installing two things in this process:

- **Own compute time.** The engine reports each committed step's wall time to its agent, which
  in a synchronous PP x DP job is the same on every rank (each waits for the slowest at the
  collectives and the commit vote), so the Core's fail-slow detector (`core_service.failslow`,
  stage peers' median) could never single out a straggler. Here every step's report carries the
  rank's own compute: the time in `Trainer.train_step` minus the time the main thread spent
  blocked in the communicator (`Communicator._wait`, the one place every op is waited on). That
  is what a real device's straggler shows: its peers wait, it computes.
- **A simulated straggler** (CPU runs have no clock to lower): once the file named by
  `ELASWAVE_DEMO_SLOW_FILE` holds `{"slowdown": S}`, each step's compute is stretched to
  `S / f` times its measured length by a sleep, where `f` is the clock factor the agent's
  *simulated* frequency controller publishes in the control file (`agent.frequency`,
  `elaswave.local_protocol`: mhz / nominal). An up-clock from the Core's DVFS plan (ElasWave
  §4.3) thus shortens the straggler's steps as it would on an NPU; migrating layers off its
  stage (§4.2) shortens them because there is less compute to stretch. The rank appends
  `{"step", "compute_s", "slowed_s", "factor"}` per committed step to `ELASWAVE_DEMO_TRACE_FILE`.

Both belong in the engine (a compute time beside the step time, and a fault-injection knob like
`ELASWAVE_INJECT_FAULT`); until then the demo keeps them here, out of the engine's code path.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SLOW_FILE_ENV = "ELASWAVE_DEMO_SLOW_FILE"
TRACE_FILE_ENV = "ELASWAVE_DEMO_TRACE_FILE"


class _Meter:
    """Main-thread time blocked in communication, and the last step's own compute."""

    def __init__(self, slow_file: Path | None, trace_file: Path | None) -> None:
        self.main = threading.get_ident()
        self.blocked_s = 0.0
        self.last_compute_s: float | None = None
        self.slow_file = slow_file
        self.trace = trace_file.open("a", buffering=1) if trace_file is not None else None
        self._slow_stamp: tuple[int, int] | None = None
        self.slowdown = 1.0
        self.control: Any = None

    def slowdown_now(self) -> float:
        """The injected slowdown (1.0 until the harness writes the file); one stat per step."""
        if self.slow_file is None:
            return 1.0
        try:
            stat = self.slow_file.stat()
        except FileNotFoundError:
            return self.slowdown
        stamp = (stat.st_ino, stat.st_mtime_ns)
        if stamp != self._slow_stamp:
            self._slow_stamp = stamp
            self.slowdown = float(json.loads(self.slow_file.read_text())["slowdown"])
        return self.slowdown

    def clock_factor(self) -> float:
        if self.control is None:
            from elaswave.local_protocol import ControlReader  # noqa: PLC0415

            self.control = ControlReader.from_env() or False
        return float(self.control.factor) if self.control else 1.0


def install(meter: _Meter) -> None:
    """Wrap the communicator's wait, the trainer's step and the step report (module docstring)."""
    from elaswave.local_protocol import StepMetricsClient  # noqa: PLC0415
    from executor.comm.communicator import Communicator  # noqa: PLC0415
    from executor.trainer import Trainer  # noqa: PLC0415

    for cls, name in ((Communicator, "_wait"), (Trainer, "train_step"), (StepMetricsClient, "send")):
        if not callable(getattr(cls, name, None)):
            raise RuntimeError(f"harness.demo_worker: {cls.__name__}.{name} is gone; update the demo's probe")
    wait: Callable[..., None] = Communicator._wait
    train_step: Callable[..., Any] = Trainer.train_step
    send: Callable[..., bool] = StepMetricsClient.send

    def timed_wait(self: Any, *args: Any, **kwargs: Any) -> None:
        if threading.get_ident() != meter.main:  # a helper thread's wait blocks nobody's compute
            return wait(self, *args, **kwargs)
        t0 = time.perf_counter()
        try:
            return wait(self, *args, **kwargs)
        finally:
            meter.blocked_s += time.perf_counter() - t0

    def slowed_step(self: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        t0, blocked0 = time.perf_counter(), meter.blocked_s
        result = train_step(self, step, *args, **kwargs)
        compute = time.perf_counter() - t0 - (meter.blocked_s - blocked0)
        slowdown, factor = meter.slowdown_now(), meter.clock_factor()
        extra = max(0.0, compute * (slowdown / factor - 1.0))
        if extra > 0.0:
            time.sleep(extra)  # the slower device: its compute, stretched, before it votes
        meter.last_compute_s = compute + extra
        if meter.trace is not None:
            record = {"step": step, "compute_s": compute, "slowed_s": extra, "factor": factor}
            meter.trace.write(json.dumps(record) + "\n")
        return result

    def own_time_send(self: Any, **record: Any) -> bool:
        if meter.last_compute_s is not None:
            record["step_time_s"] = record["compute_time_s"] = meter.last_compute_s
        return send(self, **record)

    Communicator._wait = timed_wait  # type: ignore[method-assign]
    Trainer.train_step = slowed_step  # type: ignore[method-assign]
    StepMetricsClient.send = own_time_send  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m harness.demo_worker SCRIPT [ARGS...]")
    slow, trace = os.environ.get(SLOW_FILE_ENV), os.environ.get(TRACE_FILE_ENV)
    install(_Meter(Path(slow) if slow else None, Path(trace) if trace else None))
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))  # as `python SCRIPT` would
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
