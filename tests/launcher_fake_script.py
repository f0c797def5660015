"""A stand-in for a script that calls `elaswave.train`, for the launcher's tests (not a test module).

Describe mode (`ELASWAVE_DESCRIBE_FILE` set): writes a ModelDescription of five units and exits.
Train mode (`elaswave run` set `ELASWAVE_RANK` and the rest): checks its environment against the
worker contract, "steps" every `--step-time` seconds reporting metrics to its agent, honours the
launcher's stop file at step boundaries, marks itself finished after the last step and writes its
results file. It trains nothing and talks to no peer: it exercises the launcher alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from wire import worker_env as we
from wire.local_protocol import StepMetricsClient, mark_finished

STEPS = 6
GLOBAL_BATCH = 8


def describe(path: Path, steps: int) -> None:
    units = tuple(
        we.UnitDescription(name, numel, 4 * numel, cost, 2 * cost, 64)
        for name, numel, cost in [
            ("embed", 4096, 1e-5),
            ("block0", 1024, 1e-4),
            ("block1", 1024, 1e-4),
            ("block2", 1024, 1e-4),
            ("head", 4096, 2e-5),
        ]
    )
    desc = we.ModelDescription(
        units=units, global_batch=GLOBAL_BATCH, micro_batches=2, dataset_len=64, steps=steps
    )
    path.write_text(desc.to_json())


def stop_after() -> int | None:
    path = os.environ.get(we.STOP_FILE_ENV)
    if path and Path(path).exists():
        return int(json.loads(Path(path).read_text())["stop_after_step"])
    return None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    if os.environ.get(we.DESCRIBE_ENV):
        describe(Path(os.environ[we.DESCRIBE_ENV]), args.steps)
        return 0
    place = we.worker_place_from_env()
    if place is None:
        print("run me with elaswave run", file=sys.stderr)
        return 2
    layout = json.loads(place.layout_file.read_text())
    stage = next(s for s in layout["stages"] if place.rank in s["ranks"])
    client = StepMetricsClient.from_env()
    env = {
        name: os.environ.get(name) for name in (we.CHECKPOINT_DIR_ENV, we.CHECKPOINT_EVERY_ENV, we.RESUME_ENV)
    }
    step = 0
    while step < args.steps:
        limit = stop_after()
        if limit is not None and step > limit:
            break
        time.sleep(args.step_time)
        if client is not None:
            client.send(
                step=step,
                step_time_s=args.step_time,
                compute_time_s=args.step_time,
                loss=5.0 / (step + 1) if stage["stage"] == len(layout["stages"]) - 1 else None,
                samples=GLOBAL_BATCH // len(stage["ranks"]),
                stage=stage["stage"],
                dp_rank=stage["ranks"].index(place.rank),
            )
        step += 1
    if step == args.steps:
        mark_finished()
    assert place.results_file is not None
    place.results_file.write_text(
        json.dumps(
            {
                "rank": place.rank,
                "worker_id": place.worker_id,
                "job": place.job,
                "committed_steps": step,
                "store": place.store,
                "core": list(place.core),
                "timeout_s": place.timeout_s,
                "token_set": bool(place.token),
                "stage": stage["stage"],
                "env": env,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
