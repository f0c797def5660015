"""Single-process training of a `TrainSpec` on the same batches (the ground truth for the engine).

This is the engine itself on a one-rank layout (PP=1, DP=1, every unit on rank 0): the same
sampler, the same slot split of the global batch, the same per-sample loss and optimizer update,
in one process with no peers. It is what `elaswave.train` runs for a plain `python script.py`, and
what every multi-rank layout must match to fp32 round-off (the DP reduction adds in another
order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed import HashStore

from executor.engine_comm import StaticComm, groups_for_stage_ranks
from executor.trainer import Trainer, TrainSpec
from planners.layout import Layout, make_uniform_layout


@dataclass
class ReferenceRun:
    losses: list[float]
    state: dict[str, Any]  # same shape as Trainer.gather_full_state(), for the whole model


def single_rank_layout(spec: TrainSpec, global_batch: int, num_micro_batches: int) -> Layout:
    numel = spec.unit_numels()
    return make_uniform_layout(len(numel), 1, 1, global_batch, num_micro_batches, numel)


def single_rank_trainer(spec: TrainSpec, global_batch: int, num_micro_batches: int) -> Trainer:
    layout = single_rank_layout(spec, global_batch, num_micro_batches)
    comm = StaticComm(HashStore(), 0, groups_for_stage_ranks([(0,)], world=True), timeout_s=60.0)
    return Trainer(spec, layout, 0, comm, spec.local_device())


def run_reference(spec: TrainSpec, global_batch: int, num_micro_batches: int, steps: int) -> ReferenceRun:
    trainer = single_rank_trainer(spec, global_batch, num_micro_batches)
    losses = []
    for step in range(steps):
        loss = trainer.train_step(step).loss
        assert loss is not None
        losses.append(loss)
    return ReferenceRun(losses, trainer.gather_full_state())
