"""The per-rank trainer: one stage's model, its ZeRO-1 shards and the 1F1B pipeline, built from a Layout.

The Layout (planners.layout) is the only description of the job: it says which blocks this rank's
stage holds, which ranks share the stage (DP order = ZeRO shard index), which global samples this
rank runs in every micro-batch slot, how ZeRO shards are owned and which RNG mode is on.

The loss of a step is the sum of per-sample losses divided by the fixed global batch (ElasWave
§4.1), so neither the gradient scale nor the reported loss depends on how the batch is split.
The reported loss is assembled per sample and summed exactly (`math.fsum`) in sample order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from executor.data import GlobalBatchSampler, generate_corpus
from executor.engine_comm import EngineComm, dp_group_name
from executor.model import (
    ForwardContext,
    ModelConfig,
    StageModel,
    block_numel,
    forward_units,
    per_sample_loss,
    unit_order,
)
from executor.pipeline import PipelineRunner
from executor.rng import DropoutRng
from executor.zero import (
    AdamWConfig,
    GradHook,
    ShardedAdamW,
    ShardState,
    assign_flat,
    flat_params,
    unit_ownership,
)
from planners.layout import Layout


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: AdamWConfig = field(default_factory=AdamWConfig)
    data_seed: int = 0
    rng_seed: int = 0
    corpus_tokens: int = 1 << 14


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float | None  # global-batch loss; known on last-stage ranks, None on the others
    samples_processed: int  # samples this rank ran through its stage in this step
    global_batch: int
    # Global sample ids of the batches this rank fed through its stage, in the order it ran
    # them (from the sampler's batches, not recomputed from the layout).
    sample_ids: tuple[int, ...] = ()


class StepOverlay(Protocol):
    """Hooks through which one step's work is altered (non-blocking layer migration)."""

    def units_for_slot(self, slot: int, units: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]: ...

    def before_forward(self, slot: int) -> None: ...

    def after_backward(self, slot: int) -> None: ...

    def before_optimizer(self) -> None: ...

    def finish(self) -> None: ...


def check_layout(cfg: TrainConfig, layout: Layout) -> None:
    """Raise ValueError if `layout` does not describe this model (the planners need true sizes)."""
    m = cfg.model
    if layout.num_layers != m.num_layers:
        raise ValueError(f"layout has {layout.num_layers} layers, model has {m.num_layers}")
    expected = (block_numel(m),) * m.num_layers
    if tuple(layout.layer_numel) != expected:
        raise ValueError(f"layout.layer_numel {layout.layer_numel} != this model's block sizes {expected}")
    covered = [layer for s in layout.stages for layer in s.layers]
    if covered != list(range(m.num_layers)):
        raise ValueError(f"stages must hold layers 0..{m.num_layers - 1} in order, got {covered}")


def build_sampler(cfg: TrainConfig, global_batch: int) -> GlobalBatchSampler:
    corpus = generate_corpus(cfg.model.vocab_size, cfg.corpus_tokens, cfg.data_seed)
    return GlobalBatchSampler(corpus, cfg.model.seq_len, global_batch, cfg.data_seed)


class Trainer:
    """One rank of the hybrid-parallel job; every rank of the layout builds one."""

    def __init__(self, cfg: TrainConfig, layout: Layout, rank: int, comm: EngineComm,
                 device: torch.device | str = "cpu") -> None:
        check_layout(cfg, layout)
        stage = layout.stage_layout_of_rank(rank)  # raises if the rank is not in the layout
        self.cfg, self.rank, self.comm, self.device = cfg, rank, comm, torch.device(device)
        self.sampler = build_sampler(cfg, layout.global_batch)
        self.model = StageModel(cfg.model, stage.layer_start, stage.layer_stop).to(self.device)
        self.next_step = 0
        self.grad_hook: GradHook | None = None  # kept across layout changes; see executor.zero
        # An overlay armed for the next train_step (a non-blocking migration adopted between steps
        # through a plan): the loop that drives the trainer need not know a migration is in flight.
        self.armed_overlay: StepOverlay | None = None
        self._install_layout(layout, step_count=0)

    # ------------------------------------------------------------------------------ structure
    def _install_layout(self, layout: Layout, step_count: int) -> None:
        """(Re)derive everything layout-dependent: pipeline program, routes, ZeRO ownership, RNG."""
        self.layout = layout
        self.stage_layout = layout.stage_layout_of_rank(self.rank)
        self.stage = self.stage_layout.stage
        self.dp_index = self.stage_layout.dp_index(self.rank)
        self.rng = DropoutRng(self.cfg.rng_seed, layout.rng_mode, self.rank)
        self.runner = PipelineRunner(self.comm, layout, self.rank, (self.cfg.model.seq_len, self.cfg.model.hidden),
                                     self.device)
        units = dict(self.model.units.items())
        numel = {n: sum(p.numel() for p in u.parameters()) for n, u in units.items()}
        self.optimizer = ShardedAdamW(self.comm, dp_group_name(self.stage), units,
                                      unit_ownership(layout, self.stage_layout, numel), self.dp_index,
                                      self.cfg.optim, step_count, self.grad_hook, self.device)

    def set_grad_hook(self, hook: GradHook | None) -> None:
        """Observe every step's reduced gradient slices (now and after any layout change)."""
        self.grad_hook = hook
        self.optimizer.grad_hook = hook

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.layout.num_stages - 1

    # -------------------------------------------------------------------------------- training
    def train_step(self, step: int, overlay: StepOverlay | None = None) -> StepResult:
        """Run global batch `step` through the pipeline and apply one optimizer update.

        `overlay` lets a non-blocking layer migration (executor.nonblocking_migration) take part in this one
        step: run a shadow block for the first slots, load a block when it arrives, pay back
        gradients. Without one, the overlay armed by `arm_overlay` (if any) runs, once."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if overlay is None:
            overlay, self.armed_overlay = self.armed_overlay, None
        self.rng.begin_step(step)
        for p in self.model.parameters():
            p.grad = None
        sample_losses: dict[int, torch.Tensor] = {}
        fed: list[int] = []
        B = self.layout.global_batch

        def forward(slot: int, received: torch.Tensor | None) -> torch.Tensor:
            rows = self.layout.samples_of(self.rank, slot)
            batch = self.sampler.rows(step, rows.start, rows.stop)
            fed.extend(batch.sample_ids)
            units = list(self.model.units.items())
            if overlay is not None:
                overlay.before_forward(slot)
                units = overlay.units_for_slot(slot, units)
            x = forward_units(units, batch.inputs.to(self.device) if received is None else received,
                              ForwardContext(batch.sample_ids, self.rng))
            if not self.is_last:
                return x
            per_sample = per_sample_loss(x, batch.targets.to(self.device))
            for row, value in zip(range(rows.start, rows.stop), per_sample.detach(), strict=True):
                sample_losses[row] = value
            return per_sample.sum() / B

        self.runner.run(forward, overlay.after_backward if overlay is not None else None)
        if overlay is not None:
            overlay.before_optimizer()
        self.optimizer.step()
        if overlay is not None:
            overlay.finish()
        self.next_step = step + 1
        processed = sum(len(self.layout.samples_of(self.rank, m)) for m in range(self.layout.num_micro_batches))
        loss = self._global_loss(sample_losses) if self.is_last else None
        return StepResult(step, loss, processed, B, tuple(fed))

    def _global_loss(self, mine: Mapping[int, torch.Tensor]) -> float:
        """Exact sum of all per-sample losses of the global batch / B, from the last stage's ranks."""
        B = self.layout.global_batch
        local = torch.zeros(B, device=self.device)
        for row, value in mine.items():
            local[row] = value
        ranks = self.stage_layout.ranks
        gathered = [torch.empty(B, device=self.device) for _ in ranks]
        if len(ranks) == 1:
            gathered[0] = local
        else:
            self.comm.all_gather(dp_group_name(self.stage), gathered, local)
        owner = {}
        for m in range(self.layout.num_micro_batches):
            for j, rng in enumerate(self.stage_layout.split_slot(self.layout.slot_range(m))):
                owner.update({row: j for row in range(rng.start, rng.stop)})
        values = [g.cpu() for g in gathered]
        return math.fsum(float(values[owner[row]][row]) for row in range(B)) / B

    def arm_overlay(self, overlay: StepOverlay) -> None:
        """Make the next `train_step` (called without an overlay) run with `overlay`."""
        if self.armed_overlay is not None:
            raise ValueError("an overlay is already armed for the next step")
        self.armed_overlay = overlay

    # ----------------------------------------------------------------------------------- state
    def unit_params(self) -> dict[str, torch.Tensor]:
        """Full flat parameters of this stage's units (a copy)."""
        return {n: flat_params(u).clone() for n, u in self.model.units.items()}

    def state_dict_for_rollback(self) -> dict[str, Any]:
        """Everything a rollback needs on this rank: parameters, optimizer shards, step counters."""
        return {"layout": self.layout, "next_step": self.next_step, "params": self.unit_params(),
                "optimizer": self.optimizer.state()}

    def load_rollback_state(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict_for_rollback()` taken under the current layout (local, no comms)."""
        if state["layout"] != self.layout:
            raise ValueError("rollback state was taken under another layout; remap it first (reset_layout)")
        params = state["params"]
        if set(params) != set(self.model.units.keys()):
            raise ValueError(f"rollback state has units {sorted(params)}, stage has {self.model.unit_names()}")
        self.optimizer.load_state(state["optimizer"])
        for name, flat in params.items():
            assign_flat(self.model.units[name], flat)
        self.next_step = int(state["next_step"])

    get_state = state_dict_for_rollback
    set_state = load_rollback_state

    def reset_layout(self, layout: Layout, comm: EngineComm, params: Mapping[str, torch.Tensor],
                     shards: Mapping[str, ShardState], step_count: int, next_step: int) -> None:
        """Adopt `layout` with state already remapped for it: full parameters of the new stage's
        units and this rank's new optimizer slices (what a migration, a live remap or a rollback
        across layouts ends in). Checks everything first; on ValueError nothing has changed."""
        check_layout(self.cfg, layout)
        if layout.global_batch != self.sampler.global_batch:
            raise ValueError(f"the global batch is fixed for a job ({self.sampler.global_batch}), "
                             f"new layout says {layout.global_batch}")
        stage = layout.stage_layout_of_rank(self.rank)
        model = StageModel(self.cfg.model, stage.layer_start, stage.layer_stop,
                           reuse=self._spare_units(stage.layer_start, stage.layer_stop)).to(self.device)
        if set(params) != set(model.unit_names()) or set(shards) != set(model.unit_names()):
            raise ValueError(f"state for units {sorted(params)} / {sorted(shards)}, new stage holds {model.unit_names()}")
        numel = {n: sum(p.numel() for p in u.parameters()) for n, u in model.units.items()}
        owned = unit_ownership(layout, stage, numel)
        j = stage.dp_index(self.rank)
        for name, sh in shards.items():
            if (sh.lo, sh.hi) != owned[name][j] or sh.exp_avg.numel() != sh.hi - sh.lo:
                raise ValueError(f"shard [{sh.lo}, {sh.hi}) of {name} given, rank {self.rank} owns "
                                 f"{list(owned[name][j])} under the new layout")
        if any(flat.numel() != numel[n] for n, flat in params.items()):
            raise ValueError(f"parameter sizes { {n: f.numel() for n, f in params.items()} } != units {numel}")
        for name, flat in params.items():
            assign_flat(model.units[name], flat)
        self.model, self.comm = model, comm
        self._install_layout(layout, step_count)
        for name, sh in self.optimizer.shards.items():
            sh.exp_avg.copy_(shards[name].exp_avg)
            sh.exp_avg_sq.copy_(shards[name].exp_avg_sq)
        self.next_step = next_step

    def _spare_units(self, layer_start: int, layer_stop: int) -> dict[str, nn.Module]:
        """Current modules a new stage `[layer_start, layer_stop)` can keep (their parameters are
        overwritten by reset_layout anyway; re-initialising them would only cost time)."""
        keep = set(unit_order(self.cfg.model.num_layers, layer_start, layer_stop))
        return {n: u for n, u in self.model.units.items() if n in keep}

    def gather_full_state(self) -> dict[str, Any]:
        """Full parameters and Adam moments of this stage's units (collective over the stage's DP
        group: every rank of the stage must call it)."""
        moments = self.optimizer.gather_moments()
        return {"step_count": self.optimizer.step_count,
                "units": {n: {"param": flat_params(u).clone(), "exp_avg": moments[n][0],
                              "exp_avg_sq": moments[n][1]} for n, u in self.model.units.items()}}
