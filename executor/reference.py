"""Single-process reference training on the same batches (the ground truth for the engine).

One process holds the whole model, runs every micro-batch slot of the global batch (slot m =
samples `[m*B//M, (m+1)*B//M)`, as in the Layout), accumulates gradients of
`sum(per-sample loss) / B`, and applies the same `adamw_update` unit by unit. Dropout uses the
placement-invariant RNG, so the reference sees exactly the masks any layout would draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from executor.model import ForwardContext, StageModel, per_sample_loss
from executor.rng import DropoutRng
from executor.trainer import TrainConfig, build_sampler
from executor.zero import adamw_update, assign_flat, flat_grads, flat_params
from planners.layout import slot_range


@dataclass
class ReferenceRun:
    losses: list[float]
    state: dict[str, Any]  # same shape as Trainer.gather_full_state(), for the whole model


def run_reference(cfg: TrainConfig, global_batch: int, num_micro_batches: int, steps: int) -> ReferenceRun:
    m = cfg.model
    model = StageModel(m, 0, m.num_layers)
    sampler = build_sampler(cfg, global_batch)
    rng = DropoutRng(cfg.rng_seed, "placement_invariant")
    moments = {n: (torch.zeros(flat_params(u).numel()), torch.zeros(flat_params(u).numel()))
               for n, u in model.units.items()}
    losses = []
    for step in range(steps):
        rng.begin_step(step)
        for p in model.parameters():
            p.grad = None
        per_sample: list[float] = []
        for slot in range(num_micro_batches):
            rows = slot_range(global_batch, num_micro_batches, slot)
            batch = sampler.rows(step, rows.start, rows.stop)
            if len(batch) == 0:
                continue
            loss = per_sample_loss(model(batch.inputs, ForwardContext(batch.sample_ids, rng)), batch.targets)
            (loss.sum() / global_batch).backward()
            per_sample.extend(float(v) for v in loss.detach())
        losses.append(math.fsum(per_sample) / global_batch)
        for name, unit in model.units.items():
            param = flat_params(unit).clone()
            adamw_update(param, flat_grads(unit), *moments[name], step + 1, cfg.optim)
            assign_flat(unit, param)
    state = {"step_count": steps,
             "units": {n: {"param": flat_params(u).clone(), "exp_avg": moments[n][0],
                           "exp_avg_sq": moments[n][1]} for n, u in model.units.items()}}
    return ReferenceRun(losses, state)
