"""`elaswave.train`: the one call a training script makes (docs/api.md).

The same script runs three ways, chosen by the environment (wire.worker_env):

- `python script.py`: the whole model in this process (PP=1, DP=1), the reference every layout
  matches to fp32 round-off;
- `elaswave run ... script.py`: first once in describe mode (the launcher lays the job out from
  what it learns), then once per rank, each process training its part under the Core;
- with checkpoints and `--resume`, on any layout and any number of workers.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from executor.checkpoint import load_model_state, scheduled
from executor.devices import describe_device, resolve_kind
from executor.optim import OptimizerConfig
from executor.precision import PrecisionConfig
from executor.sampler import Collate
from executor.trainer import LossFn, TrainSpec, checkpoint_payload, checkpoint_writer, load_checkpoint
from executor.units import UnitModel
from planners.backup import DEFAULT_VERIFY_EVERY
from wire import worker_env

ModelLike = UnitModel | nn.Sequential | Sequence[nn.Module] | Mapping[str, nn.Module]


@dataclass
class TrainResult:
    """What `train` returns: the loss of every step this process saw (last-stage ranks and the
    single process know them), where it stopped, the checkpoints written, and the whole model's
    final `state_dict` when this process holds it (the single process), else None: read it
    from the final checkpoint with `elaswave.load_model_state(checkpoint_dir)`."""

    losses: dict[int, float]
    committed_steps: int
    start_step: int = 0
    checkpoints: list[str] = field(default_factory=list)
    state_dict: dict[str, torch.Tensor] | None = None
    rank: int = 0
    exit_code: int = 0
    details: dict[str, Any] = field(default_factory=dict)


def as_units(
    model: ModelLike, init_seed: int = 0, state_dict: Mapping[str, torch.Tensor] | None = None
) -> UnitModel:
    """A `UnitModel` from what a script may hand over (see `elaswave.Units`)."""
    if isinstance(model, UnitModel):
        return model if state_dict is None else model.replace(state_dict=state_dict)
    return UnitModel.from_modules(model).replace(init_seed=init_seed, state_dict=state_dict)


def train(
    model: ModelLike,
    loss_fn: LossFn,
    dataset: Dataset[Any],
    *,
    global_batch: int,
    steps: int,
    micro_batches: int = 1,
    optimizer: OptimizerConfig | None = None,
    collate_fn: Collate | None = None,
    loader_workers: int = 0,
    data_seed: int = 0,
    shuffle: bool = True,
    seed: int = 0,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 0,
    resume: str | Path | None = None,
    log_every: int = 0,
    on_step: Callable[[int, float | None], None] | None = None,
    device: str = "cpu",
    precision: str = "fp32",
    reduce_dtype: str = "fp32",
    verify_every: int = DEFAULT_VERIFY_EVERY,
) -> TrainResult:
    """Train `model` on `dataset` for `steps` global batches; call it once in every process.

    - `model`: `elaswave.Units(names, build_unit)`, an `nn.Sequential`, a list or a dict of
      modules (units may differ in size and kind; see `Units`).
    - `loss_fn(output, targets)` returns one loss per sample (shape `(rows,)`); the step's loss
      is their sum over the global batch divided by `global_batch`, whatever the layout.
    - `dataset[i]` returns `(input, target)` (or `collate_fn` turns a list of items into
      `(inputs, targets)`); inputs a tensor or a tuple of tensors, first dimension the sample.
      Global batch `s` is samples `s*B .. s*B+B-1` of a seeded per-epoch permutation
      (`data_seed`, `shuffle`), crossing epochs without dropping a sample. Loading overlaps
      compute: a prefetch thread, or `loader_workers` spawned processes per rank (the dataset and
      `collate_fn` must then be picklable).
    - `micro_batches` per step (the pipeline's M); `optimizer`: `elaswave.AdamW/Adam/SGD(...)`.
    - `checkpoint_dir`, `checkpoint_every`: layout-independent checkpoints every N steps and at
      the end (the launcher's `--checkpoint-dir` / `--checkpoint-every` override them);
      `resume`: a checkpoint directory to continue from (any layout wrote it).
    - `device`: "auto" (CUDA, else Ascend when torch_npu is installed, else the CPU), "cuda",
      "npu" or "cpu"; each rank uses the device the launcher gave it (`--devices-per-node`).
    - `precision`: "fp32", "bf16" (autocast, fp32 master weights and optimizer state) or "fp16"
      (the same with a dynamic loss scale); `reduce_dtype`: the gradient slices' dtype on the
      wire ("fp32" by default; the owner always adds them in fp32). See docs/accelerators.md.
    - `verify_every`: committed steps between two checks of every shard's backup against the
      live shard (a digest exchange on the critical path, about a quarter of a step's time;
      50 by default). A backup found wrong is re-sent whole. Under a launcher only.

    Blocks until the job is trained (or this rank leaves the job, or the launcher stops it): one
    step at a time, each collective bounded by the launcher's timeout. Under a launcher, a
    worker that cannot go on (no plan after a failure) exits the process with a non-zero status
    after writing its results; a script error (bad model, data or settings) raises ValueError or
    TypeError saying what to fix, before any training.
    """
    if (
        steps < 1
        or global_batch < 1
        or micro_batches < 1
        or micro_batches > global_batch
        or checkpoint_every < 0
        or verify_every < 1
    ):
        raise ValueError(
            f"need steps >= 1, 1 <= micro_batches <= global_batch, checkpoint_every >= 0 and "
            f"verify_every >= 1; got steps={steps}, global_batch={global_batch}, "
            f"micro_batches={micro_batches}, checkpoint_every={checkpoint_every}, "
            f"verify_every={verify_every}"
        )
    kind = resolve_kind(device)  # ValueError on an unknown name
    mixed = PrecisionConfig(precision, reduce_dtype)  # type: ignore[arg-type]  # checked in __post_init__
    spec = TrainSpec(
        as_units(model, seed, state_dict),
        loss_fn,
        dataset,
        optimizer or OptimizerConfig(),
        collate_fn,
        data_seed,
        shuffle,
        rng_seed=seed,
        loader_workers=loader_workers,
        precision=mixed,
        device_kind=kind,
    )
    here = spec.local_device()  # DeviceUnavailable (naming the device) before anything runs
    print(
        f"elaswave: {'rank ' + os.environ[worker_env.RANK_ENV] if os.environ.get(worker_env.RANK_ENV) else 'training'}"
        f" on {describe_device(here)}, {precision}"
        + (f" (device='auto' picked {kind})" if device == "auto" else ""),
        flush=True,
    )
    if loader_workers < 0:
        raise ValueError(f"loader_workers must be >= 0, got {loader_workers}")
    spec.sampler(global_batch)  # a dataset smaller than a global batch is refused here, with the sizes
    ckpt_dir, every, resume_dir = _checkpoint_settings(checkpoint_dir, checkpoint_every, resume)
    describe_to = os.environ.get(worker_env.DESCRIBE_ENV)
    if describe_to:
        from elaswave.describe import describe  # noqa: PLC0415

        Path(describe_to).write_text(describe(spec, global_batch, micro_batches, steps).to_json())
        sys.stdout.flush()
        os._exit(0)  # describe mode: the launcher only wanted the description
    place = worker_env.worker_place_from_env()
    if place is None:
        return _train_single_process(
            spec, global_batch, micro_batches, steps, ckpt_dir, every, resume_dir, log_every, on_step
        )
    return _train_as_worker(spec, place, steps, ckpt_dir, every, resume_dir, log_every, on_step, verify_every)


def _checkpoint_settings(
    checkpoint_dir: str | Path | None, every: int, resume: str | Path | None
) -> tuple[Path | None, int, Path | None]:
    env_dir = os.environ.get(worker_env.CHECKPOINT_DIR_ENV)
    env_every = os.environ.get(worker_env.CHECKPOINT_EVERY_ENV)
    env_resume = os.environ.get(worker_env.RESUME_ENV)
    directory = Path(env_dir) if env_dir else (Path(checkpoint_dir) if checkpoint_dir else None)
    resume_dir = Path(env_resume) if env_resume else (Path(resume) if resume else None)
    if resume_dir is not None:
        from executor.checkpoint import latest_checkpoint  # noqa: PLC0415

        latest_checkpoint(resume_dir)  # CheckpointError naming what is missing
    return directory, int(env_every) if env_every else every, resume_dir


def _train_single_process(
    spec: TrainSpec,
    global_batch: int,
    micro_batches: int,
    steps: int,
    ckpt_dir: Path | None,
    every: int,
    resume: Path | None,
    log_every: int,
    on_step: Callable[[int, float | None], None] | None,
) -> TrainResult:
    from executor.reference import single_rank_trainer  # noqa: PLC0415

    trainer = single_rank_trainer(spec, global_batch, micro_batches)
    start = load_checkpoint(trainer, resume).next_step if resume is not None else 0
    writer = None
    if ckpt_dir is not None:
        writer = checkpoint_writer(spec, ckpt_dir, global_batch, uuid.uuid4().hex[:16])
    losses: dict[int, float] = {}
    t0 = time.perf_counter()
    for step in range(start, steps):
        loss = trainer.train_step(step).loss
        assert loss is not None
        losses[step] = loss
        if writer is not None and scheduled(step, steps, every):
            payload = checkpoint_payload(trainer)
            assert payload is not None
            writer.submit(payload)
        if on_step is not None:
            on_step(step, loss)
        if log_every and (step + 1) % log_every == 0:
            rate = (step + 1 - start) * global_batch / (time.perf_counter() - t0)
            print(f"step {step:>6}  loss {loss:.6f}  {rate:,.0f} samples/s", flush=True)
    trainer.data.close()
    written: list[str] = []
    if writer is not None:
        writer.wait(600.0)
        if writer.errors:
            raise RuntimeError(f"writing a checkpoint failed: {writer.errors[0]!r}")
        written = [str(p) for p in writer.written]
    state = {  # host copies: loadable by plain torch anywhere
        f"{n}.{k}": v.detach().to("cpu", copy=True)
        for n, u in trainer.model.units.items()
        for k, v in u.state_dict().items()
    }
    return TrainResult(losses, steps, start, written, state)


def _train_as_worker(
    spec: TrainSpec,
    place: worker_env.WorkerPlace,
    steps: int,
    ckpt_dir: Path | None,
    every: int,
    resume: Path | None,
    log_every: int,
    on_step: Callable[[int, float | None], None] | None,
    verify_every: int,
) -> TrainResult:
    from executor.worker import ModelMismatch, WorkerSettings, run_worker  # noqa: PLC0415

    stop = os.environ.get(worker_env.STOP_FILE_ENV)
    described = os.environ.get(worker_env.DESCRIPTION_ENV)
    prints = (
        worker_env.ModelDescription.from_json(Path(described).read_text()).fingerprints if described else None
    )
    settings = WorkerSettings(
        place,
        steps,
        checkpoint_dir=ckpt_dir,
        checkpoint_every=every,
        resume=resume,
        stop_file=Path(stop) if stop else None,
        fingerprints=prints,
        on_step=on_step,
        log_every=log_every,
        verify_every=verify_every,
    )
    try:
        code, results = run_worker(spec, settings)
    except ModelMismatch as exc:
        print(f"elaswave: rank {place.rank}: {exc}", file=sys.stderr, flush=True)
        os._exit(worker_env.EXIT_USAGE)
    if code != 0:
        os._exit(code)
    # Skip interpreter teardown once the script is done: a gloo group with an abandoned op (a
    # dead peer's) would block its destructor until the group timeout.
    atexit.register(lambda: (sys.stdout.flush(), sys.stderr.flush(), os._exit(0)))
    return TrainResult(
        {int(k): v for k, v in results["losses"].items()},
        results["committed_steps"],
        results.get("start_step", 0),
        results.get("checkpoints_written", []),
        None,
        int(results.get("rank", place.rank)),  # a spare's rank came with the plan that took it in
        code,
        results,
    )


__all__ = ["TrainResult", "as_units", "load_model_state", "train"]
