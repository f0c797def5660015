"""Spawn a multi-process gloo job on CPU (tests, demo, benchmarks).

The parent hosts the TCPStore (a store that lived in a training rank would die with it), starts one
process per rank of the layout (forked from a `forkserver` that has imported torch once), and
collects one result per rank through a queue. Every wait is bounded: the groups carry a timeout,
the parent waits at most `timeout_s` for results and joins, and kills whatever is left.
"""

from __future__ import annotations

import dataclasses
import io
import queue
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed import TCPStore

from executor.checkpoint import CheckpointWriter
from executor.devices import device_count, rank_device
from executor.engine_comm import BACKENDS, EngineComm, StaticComm, groups_for_stage_ranks
from executor.migration import migrate
from executor.nonblocking_migration import NonBlockingMigration
from executor.store_server import master_store
from executor.trainer import Trainer, TrainSpec, checkpoint_payload, checkpoint_writer, load_checkpoint
from executor.warm_runtime import warm_forkserver
from planners.layout import Layout


@dataclass(frozen=True)
class JobSpec:
    cfg: TrainSpec  # the model, loss, data and optimizer (picklable: it crosses into the rank processes)
    layout: Layout
    steps: int
    # (step, layout): switch to `layout` (same ranks per stage) before running `step`.
    relayouts: tuple[tuple[int, Layout], ...] = ()
    migration: str = "blocking"  # or "nonblocking" (shadow layer + gradient payback)
    shadow_slots: int = 1  # non-blocking: slots the source still runs a moving block for
    # Steps each rank runs twice: snapshot, run, roll back, run again (exercises the rollback API).
    replay_steps: tuple[int, ...] = ()
    # "static": executor.engine_comm.StaticComm; "dynamic": executor.comm.Communicator (the
    # fault-tolerant dynamic communicator; same engine code path).
    comm_kind: str = "static"
    # "gloo" (CPU), "nccl" (rank r on cuda:r % n), "hccl" (npu:r % n, torch_npu), for either comm_kind
    # (the dynamic communicator shrinks NCCL groups in place where the installed build can).
    backend: str = "gloo"
    timeout_s: float = 60.0
    # Layout-independent checkpoints (executor.checkpoint): written into `checkpoint_dir` after
    # each step in `checkpoint_steps`; `resume_dir`: start from its latest checkpoint instead of
    # step 0 (losses then cover the steps run from there).
    checkpoint_dir: str | None = None
    checkpoint_steps: tuple[int, ...] = ()
    resume_dir: str | None = None
    run_id: str = "run"  # names this run's temporary checkpoint directories (run_job draws one)


@dataclass
class RankResult:
    rank: int
    stage: int
    dp_index: int
    losses: list[float | None]
    samples_processed: list[int]
    full_state: dict[str, Any] | None  # gather_full_state() at the end, from DP index 0 of each stage
    migrations: list[dict[str, Any]] = field(default_factory=list)
    replayed_losses: dict[int, float | None] = field(default_factory=dict)  # loss of the first run
    skipped: list[int] = field(default_factory=list)  # fp16: steps whose update an overflow skipped
    loss_scale: dict[str, float] | None = None  # fp16: the loss scaler at the end


def _membership(spec: JobSpec) -> dict[str, tuple[int, ...]]:
    layouts = [spec.layout] + [lay for _, lay in spec.relayouts]
    stage_ranks = [s.ranks for s in spec.layout.stages]
    for lay in layouts[1:]:
        if [s.ranks for s in lay.stages] != stage_ranks:
            raise ValueError("relayouts must keep every stage's ranks (pipeline-only changes)")
    return groups_for_stage_ranks(stage_ranks, world=spec.cfg.needs_world_group)


def _checkpoint_writer(spec: JobSpec) -> CheckpointWriter | None:
    if spec.checkpoint_dir is None:
        return None
    return checkpoint_writer(spec.cfg, Path(spec.checkpoint_dir), spec.layout.global_batch, spec.run_id)


def _run_rank(spec: JobSpec, rank: int, trainer: Trainer) -> RankResult:
    relayouts = dict(spec.relayouts)
    losses, processed, reports, replayed, skipped = [], [], [], {}, []
    start = load_checkpoint(trainer, spec.resume_dir).next_step if spec.resume_dir is not None else 0
    writer = _checkpoint_writer(spec)
    for step in range(start, spec.steps):
        overlay = None
        if step in relayouts and spec.migration == "nonblocking":
            overlay = NonBlockingMigration(trainer, relayouts[step], spec.shadow_slots)
        elif step in relayouts:
            reports.append(migrate(trainer, relayouts[step], spec.migration).as_dict())
        if step in spec.replay_steps and overlay is None:
            snapshot = trainer.state_dict_for_rollback()
            replayed[step] = trainer.train_step(step).loss
            trainer.load_rollback_state(snapshot)
        result = trainer.train_step(step, overlay)
        if overlay is not None:
            reports.append(overlay.report().as_dict())
        losses.append(result.loss)
        processed.append(result.samples_processed)
        if result.skipped:
            skipped.append(step)
        if writer is not None and step in spec.checkpoint_steps:
            payload = checkpoint_payload(trainer)
            if payload is not None:
                writer.submit(payload)
    if writer is not None:
        writer.wait(120.0)
        if writer.errors:
            raise RuntimeError(f"rank {rank}: checkpoint write failed: {writer.errors[0]!r}")
    state = trainer.gather_full_state()
    return RankResult(
        rank,
        trainer.stage,
        trainer.dp_index,
        losses,
        processed,
        _host(state) if trainer.dp_index == 0 else None,
        reports,
        replayed,
        skipped,
        None if trainer.scaler is None else trainer.scaler.state_dict(),
    )


def _host(state: dict[str, Any]) -> dict[str, Any]:
    """`gather_full_state()` in host memory (a device rank's result crosses to the parent)."""
    return {
        "step_count": state["step_count"],
        "units": {n: {k: t.cpu() for k, t in d.items()} for n, d in state["units"].items()},
    }


def _make_comm(spec: JobSpec, store: TCPStore, rank: int) -> EngineComm:
    if spec.comm_kind == "dynamic":
        from executor.comm import Communicator  # noqa: PLC0415 - only the dynamic runs need it

        return Communicator(store, rank, _membership(spec), timeout_s=spec.timeout_s, backend=spec.backend)
    return StaticComm(store, rank, _membership(spec), timeout_s=spec.timeout_s, backend=spec.backend)


def _device(spec: JobSpec, rank: int) -> torch.device:
    """Rank r's device: cuda/npu r mod count under nccl/hccl; under gloo the spec's device kind
    (ranks sharing one accelerator, their collectives over gloo: staged through host memory)."""
    kind = {"nccl": "cuda", "hccl": "npu"}.get(spec.backend, spec.cfg.device_kind)
    if kind == "cpu":
        return torch.device("cpu")
    return rank_device(kind, rank % max(1, device_count(kind)))


def _worker(rank: int, spec: JobSpec, port: int, results: Any) -> None:
    torch.set_num_threads(1)
    try:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=spec.timeout_s))
        comm = _make_comm(spec, store, rank)
        trainer = Trainer(spec.cfg, spec.layout, rank, comm, _device(spec, rank))
        buf = io.BytesIO()
        torch.save(_run_rank(spec, rank, trainer), buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, "error", traceback.format_exc()))


def run_job(spec: JobSpec) -> dict[int, RankResult]:
    """Run `spec` on one process per rank; returns each rank's result or raises RuntimeError."""
    _membership(spec)
    if spec.run_id == "run":  # each call is a run of its own (its temporary checkpoint directories)
        spec = dataclasses.replace(spec, run_id=uuid.uuid4().hex[:16])
    if spec.migration not in ("blocking", "nonblocking"):
        raise ValueError(f"migration must be 'blocking' or 'nonblocking', got {spec.migration!r}")
    if spec.comm_kind not in ("static", "dynamic"):
        raise ValueError(f"comm_kind must be 'static' or 'dynamic', got {spec.comm_kind!r}")
    if spec.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {spec.backend!r}")
    ranks = spec.layout.ranks()
    if sorted(ranks) != list(range(len(ranks))):
        raise ValueError(f"launch needs ranks 0..N-1, layout has {sorted(ranks)}")
    store = master_store("127.0.0.1", 0, spec.timeout_s)  # no DNS query per accepted rank
    # The fork server imports torch and the engine once and warms the runtime; each rank is then
    # a cheap fork of it.
    ctx = warm_forkserver(["torch", "executor.launch"])
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, spec, store.port, results), daemon=True) for r in ranks]
    for p in procs:
        p.start()
    out: dict[int, RankResult] = {}
    errors: list[str] = []
    try:
        while len(out) + len(errors) < len(procs):
            try:
                rank, status, payload = results.get(timeout=spec.timeout_s)
            except queue.Empty:
                errors.append(
                    f"no result within {spec.timeout_s}s from ranks {sorted(set(ranks) - set(out))}"
                )
                break
            if status == "ok":
                out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5.0 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    if errors:
        raise RuntimeError("job failed: " + "\n".join(errors))
    return out


def merged_state(results: dict[int, RankResult]) -> dict[str, Any]:
    """Whole-model state from the per-stage `full_state`s, shaped like the reference's."""
    units: dict[str, Any] = {}
    step_counts = set()
    for res in results.values():
        if res.full_state is not None:
            units.update(res.full_state["units"])
            step_counts.add(res.full_state["step_count"])
    if len(step_counts) != 1:
        raise ValueError(f"stages disagree on the optimizer step count: {sorted(step_counts)}")
    return {"step_count": step_counts.pop(), "units": units}


def job_losses(results: dict[int, RankResult]) -> list[float]:
    """The per-step loss as reported by the last stage (every last-stage rank must agree)."""
    reported = [res.losses for res in results.values() if res.losses and res.losses[0] is not None]
    if not reported or any(r != reported[0] for r in reported):
        raise ValueError(f"last-stage ranks disagree on the losses: {reported}")
    return [float(x) for x in reported[0] if x is not None]
