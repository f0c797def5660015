"""A stand-in training process for the control-plane demo: it 'steps' at a fixed rate and reports
each step to its agent over the local metrics socket, exactly as the executor does."""

from __future__ import annotations

import argparse
import math
import os
import time

from agent.local_metrics import StepMetricsClient


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--step-time", type=float, default=0.2, help="seconds per step")
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--dp-rank", type=int, default=0)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps; 0 = never")
    args = parser.parse_args()
    client = StepMetricsClient.from_env()
    step = 0
    while args.steps == 0 or step < args.steps:
        started = time.perf_counter()
        time.sleep(args.step_time)
        elapsed = time.perf_counter() - started
        loss = 4.0 * math.exp(-step / 200.0) + 0.5
        if client is not None:
            client.send(step=step, step_time_s=elapsed, compute_time_s=elapsed, loss=loss, samples=8,
                        stage=args.stage, dp_rank=args.dp_rank)
        step += 1
    print(f"dummy worker {os.getpid()} finished {step} steps", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
