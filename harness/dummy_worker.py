"""A stand-in training process for the control-plane demo: it 'steps' at a fixed rate and reports
each step to its agent over the local metrics socket, exactly as the executor does.

It is also the reference reader of the agent's control file (``wire.local_protocol``): at every step
boundary it reads the simulated clock factor (a step takes ``--step-time / factor``: a lower
clock is a slower step, as the simulated DVFS controller intends) and the drain notice (it stops
there and exits 0). SIGTERM likewise stops it at the next step boundary with exit 0."""

from __future__ import annotations

import argparse
import math
import os
import signal
import time
from types import FrameType

from wire.local_protocol import ControlReader, StepMetricsClient


class _StopFlag:
    """Set by SIGTERM; checked at step boundaries so a step is never cut in half."""

    def __init__(self) -> None:
        self.reason = ""

    def on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.reason = "SIGTERM"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--step-time", type=float, default=0.2, help="seconds per step at the nominal clock")
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--dp-rank", type=int, default=0)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps; 0 = never")
    args = parser.parse_args()
    stop = _StopFlag()
    signal.signal(signal.SIGTERM, stop.on_sigterm)
    client = StepMetricsClient.from_env()
    control = ControlReader.from_env()
    step = 0
    while args.steps == 0 or step < args.steps:
        if control is not None and control.draining is not None:
            stop.reason = f"drain ({control.draining.reason})"
        if stop.reason:
            break
        factor = control.factor if control is not None else 1.0
        started = time.perf_counter()
        time.sleep(args.step_time / factor)
        elapsed = time.perf_counter() - started
        loss = 4.0 * math.exp(-step / 200.0) + 0.5
        if client is not None:
            client.send(
                step=step,
                step_time_s=elapsed,
                compute_time_s=elapsed,
                loss=loss,
                samples=8,
                stage=args.stage,
                dp_rank=args.dp_rank,
            )
        step += 1
    why = f", stopped by {stop.reason}" if stop.reason else ""
    print(f"dummy worker {os.getpid()} finished {step} steps{why}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
