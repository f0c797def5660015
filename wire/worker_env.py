"""What a launcher tells a training process, and what the process tells back (stdlib only).

`elaswave run` (the launcher) starts one agent per worker; the agent starts the user's script.
The script calls `elaswave.train(...)`, which reads its place in the job from the environment
variables below. Nothing here imports torch, grpc or the agent, so the launcher, the agent and
the engine can all share it.

Two modes of one script:

- **describe** (`ELASWAVE_DESCRIBE_FILE` set): `elaswave.train` builds every unit once, one at a
  time, runs one sample through them (the dry run that discovers activation shapes), times each
  unit's forward and backward, writes a `ModelDescription` JSON to that path and exits 0 without
  training. The launcher runs this once, before any worker, and builds the initial layout from
  the units' sizes and measured costs. A script that exits without writing the file never called
  the API: the launcher says so.
- **train** (`ELASWAVE_RANK` and the rest set): the process is rank `ELASWAVE_RANK` of the job
  laid out by `ELASWAVE_LAYOUT_FILE`, builds its groups over the store at `ELASWAVE_STORE`,
  takes plans from the Core at `ELASWAVE_CORE`, and trains.

Without either, `elaswave.train` runs the whole model in this one process (PP=1, DP=1): the same
script, no launcher, the reference every layout must match.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

JOB_ENV = "ELASWAVE_JOB"
WORKER_ID_ENV = "ELASWAVE_WORKER_ID"
RANK_ENV = "ELASWAVE_RANK"  # the rank, or "spare": a worker joining a running job (growth)
SPARE = "spare"
SPARE_WAIT_ENV = "ELASWAVE_SPARE_WAIT_S"  # how long a spare waits to be taken in (default: a day)
CORE_ENV = "ELASWAVE_CORE"  # HOST:PORT[,HOST:PORT...], the Core's gRPC address(es)
STORE_ENV = "ELASWAVE_STORE"  # HOST:PORT of the rendezvous store[,HOST:PORT of a standby...]
LAYOUT_ENV = "ELASWAVE_LAYOUT_FILE"  # the job's initial layout (planners.Layout JSON)
TOKEN_ENV = "ELASWAVE_JOB_TOKEN"  # the job's token (never on a command line)
# A file holding the worker's own credential (the Core issues it to the agent at registration; the
# agent writes it here, mode 0600): the executor acks plans and reports failures with it.
WORKER_TOKEN_FILE_ENV = "ELASWAVE_WORKER_TOKEN_FILE"
TIMEOUT_ENV = "ELASWAVE_TIMEOUT_S"  # bound on every collective, vote and plan wait (seconds)
RESULTS_ENV = "ELASWAVE_RESULTS_FILE"  # optional: the worker writes its per-step record here
CHECKPOINT_DIR_ENV = "ELASWAVE_CHECKPOINT_DIR"  # where checkpoints go (overrides the script's)
CHECKPOINT_EVERY_ENV = "ELASWAVE_CHECKPOINT_EVERY"  # steps between checkpoints (overrides)
RESUME_ENV = "ELASWAVE_RESUME_DIR"  # resume from the latest checkpoint in this directory
DESCRIBE_ENV = "ELASWAVE_DESCRIBE_FILE"  # describe mode: write a ModelDescription here and exit
STOP_FILE_ENV = "ELASWAVE_STOP_FILE"  # launcher's stop request: checkpoint and leave at a boundary
DESCRIPTION_ENV = "ELASWAVE_DESCRIPTION_FILE"  # the describe run's ModelDescription (unit fingerprints)
# The launcher's device mapping (elaswave.device_map), read by executor.devices: the device ordinal
# (as the process sees it) of the worker's local rank, and "1" when several ranks share one device
# (their collectives then run over gloo); the visibility variable of each accelerator kind.
DEVICE_INDEX_ENV = "ELASWAVE_DEVICE_INDEX"
DEVICE_SHARED_ENV = "ELASWAVE_DEVICE_SHARED"
# torch's intra-op threads for a worker on an accelerator: the node's CPUs split among its ranks
# (the backups' host replay of every step's update runs on them, ElasWave §5.1); set by the
# launcher where the user's environment does not. A CPU worker keeps one thread.
HOST_THREADS_ENV = "ELASWAVE_HOST_THREADS"
VISIBLE_ENV: dict[str, str] = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
# Fault injection for chaos tests and drills: "collective@STEP" makes this worker's first attempt
# at step STEP fail as a collective would with every process alive (the Core then replays the
# step on the same layout). Never set by the launcher.
INJECT_FAULT_ENV = "ELASWAVE_INJECT_FAULT"
# A file that, once it holds {"slowdown": S}, makes this rank a straggler (`executor.slow_injection`).
INJECT_SLOW_FILE_ENV = "ELASWAVE_INJECT_SLOW_FILE"
# After a plan, the backup copies its layout moved are re-seeded in the background and in place
# by the commit of this many steps on the new layout (0: all before the first step; default 2).
REPROTECT_STEPS_ENV = "ELASWAVE_REPROTECT_STEPS"
REPROTECT_STEPS_DEFAULT = 2

EXIT_OK = 0
EXIT_TERMINATED = 128 + signal.SIGTERM  # what a shell reports for a SIGTERM'd process
EXIT_NO_PLAN = 75  # EX_TEMPFAIL: a step aborted and no plan came; the agent reports a failure
EXIT_USAGE = 64  # EX_USAGE: the script's model, data or settings cannot train (message on stderr)
# EX_UNAVAILABLE: the Core's plan cannot be applied in place; the job's state is in its latest
# checkpoint and resumes from it (`elaswave run --resume DIR`) on the layout the cluster has now.
EXIT_PLAN_NOT_APPLICABLE = 69

DESCRIPTION_VERSION = 1

# A request that every worker must act on at the same step boundary (checkpoint, stop) names a
# step this far ahead in time, so that it reaches every worker, through the Core and its agent or
# a file, before any of them gets there; a worker never runs more than a step ahead of another.
REQUEST_MARGIN_S = 2.0
MIN_STEPS_AHEAD = 2


def steps_ahead(step_time_s: float | None, margin_s: float = REQUEST_MARGIN_S) -> int:
    """How many steps past the furthest committed one such a request must name (module note above)."""
    if step_time_s is None or not step_time_s > 0 or step_time_s != step_time_s:
        return MIN_STEPS_AHEAD + int(margin_s / 0.01)  # unknown pace: assume fast (10 ms) steps
    return MIN_STEPS_AHEAD + int(margin_s / step_time_s) + 1


@dataclass(frozen=True)
class UnitDescription:
    """One unit as the dry run found it: parameters (elements, bytes), measured forward and
    backward seconds per sample (on the describing machine), and the activation it emits."""

    name: str
    numel: int
    param_bytes: int
    forward_s_per_sample: float
    backward_s_per_sample: float
    activation_bytes_per_sample: int


@dataclass(frozen=True)
class ModelDescription:
    """What a launcher needs to lay a job out before any worker starts."""

    units: tuple[UnitDescription, ...]
    global_batch: int
    micro_batches: int
    dataset_len: int
    steps: int
    fingerprints: dict[str, str] = field(default_factory=dict)  # unit -> digest of its initial weights
    version: int = DESCRIPTION_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> ModelDescription:
        raw: dict[str, Any] = json.loads(text)
        if raw.get("version") != DESCRIPTION_VERSION:
            raise ValueError(
                f"model description version {raw.get('version')!r}, expected {DESCRIPTION_VERSION}"
            )
        units = tuple(UnitDescription(**u) for u in raw.pop("units"))
        raw.pop("version")
        return ModelDescription(units=units, **raw)


@dataclass(frozen=True)
class WorkerPlace:
    """A launched worker's place in the job, read from the environment."""

    job: str
    worker_id: str
    rank: int
    core: tuple[str, ...]
    store: str
    layout_file: Path
    token: str
    timeout_s: float = 20.0
    results_file: Path | None = None
    collective_fault_at: int | None = None  # INJECT_FAULT_ENV: the step whose first attempt fails here
    spare_wait_s: float = 86400.0  # a spare's bound on waiting for the plan that takes it in
    slow_file: Path | None = None  # INJECT_SLOW_FILE_ENV: a slowdown to inject, once it exists
    # A spare (`ELASWAVE_RANK=spare`, rank -1 until then): its rank comes with the plan that takes
    # it in (`planners.layout.Plan.joiners`), found there by its worker id.
    joining: bool = False
    reprotect_steps: int = REPROTECT_STEPS_DEFAULT  # REPROTECT_STEPS_ENV


def _required(name: str) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        raise ValueError(f"${name} is not set: launch this script with `elaswave run`")
    return value


def worker_place_from_env() -> WorkerPlace | None:
    """The worker's place if a launcher started this process, None for a plain `python script.py`.

    Raises ValueError naming the variable when the environment is set only in part."""
    if not os.environ.get(RANK_ENV):
        return None
    raw_rank = _required(RANK_ENV)
    rank = -1 if raw_rank == SPARE else int(raw_rank)
    timeout = float(os.environ.get(TIMEOUT_ENV) or 20.0)
    spare_wait = float(os.environ.get(SPARE_WAIT_ENV) or 86400.0)
    if (rank < 0 and raw_rank != SPARE) or timeout <= 0 or spare_wait <= 0:
        raise ValueError(
            f"${RANK_ENV} must be >= 0 or {SPARE!r}, ${TIMEOUT_ENV} and ${SPARE_WAIT_ENV} positive, "
            f"got {raw_rank!r}, {timeout}, {spare_wait}"
        )
    results = os.environ.get(RESULTS_ENV)
    reprotect = os.environ.get(REPROTECT_STEPS_ENV, "").strip() or str(REPROTECT_STEPS_DEFAULT)
    if not reprotect.isdigit():
        raise ValueError(f"${REPROTECT_STEPS_ENV} must be a step count >= 0, got {reprotect!r}")
    fault = os.environ.get(INJECT_FAULT_ENV, "").strip()
    kind, _, at = fault.partition("@")
    if fault and (kind != "collective" or not at.isdigit()):
        raise ValueError(f"${INJECT_FAULT_ENV} must be 'collective@STEP', got {fault!r}")
    return WorkerPlace(
        job=_required(JOB_ENV),
        worker_id=_required(WORKER_ID_ENV),
        rank=rank,
        core=tuple(_required(CORE_ENV).split(",")),
        store=_required(STORE_ENV),
        # a spare's layout comes with the plan that takes it in
        layout_file=Path(os.environ.get(LAYOUT_ENV, "") if rank < 0 else _required(LAYOUT_ENV)),
        token=os.environ.get(TOKEN_ENV, ""),
        timeout_s=timeout,
        results_file=Path(results) if results else None,
        collective_fault_at=int(at) if fault else None,
        spare_wait_s=spare_wait,
        slow_file=Path(os.environ[INJECT_SLOW_FILE_ENV]) if os.environ.get(INJECT_SLOW_FILE_ENV) else None,
        joining=raw_rank == SPARE,
        reprotect_steps=int(reprotect),
    )
