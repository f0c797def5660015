"""The per-rank trainer: one stage's units, its ZeRO-1 shards and the 1F1B pipeline, built from a Layout.

The Layout (planners.layout) is the only description of the job: it says which units this rank's
stage holds (unit i of the user's model is layer i of the layout), which ranks share the stage
(DP order = ZeRO shard index), which global samples this rank runs in every micro-batch slot, how
ZeRO shards are owned and which RNG mode is on. The model, loss, data and optimizer are the
user's (`TrainSpec`); the engine knows no model.

The loss of a step is the sum of per-sample losses divided by the fixed global batch (ElasWave
§4.1), so neither the gradient scale nor the reported loss depends on how the batch is split.
The reported loss is assembled per sample and summed exactly (`math.fsum`) in sample order.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import Dataset

from executor.checkpoint import (
    CheckpointError,
    CheckpointMeta,
    CheckpointWriter,
    StagePayload,
    check_fits,
    latest_checkpoint,
    load_unit_state,
    read_meta,
)
from executor.devices import rank_device
from executor.dry_run import UnitProbe, discover_boundaries
from executor.engine_comm import EngineComm, dp_group_name
from executor.flat_units import copy_reusing, copy_runs, holds_flat_copy_of
from executor.optim import OptimizerConfig, UnitSlice, trainable_runs
from executor.pipeline import PipelineRunner
from executor.precision import LossScaler, PrecisionConfig
from executor.recompute import run_unit
from executor.rng import DropoutRng, UnitCall, mix64, unit_call
from executor.sampler import Collate, GlobalBatchSampler, Prefetcher
from executor.tied import TiedGradSync, align_tied_flats, follower_ranges, tie_stage
from executor.units import Activation, ActivationSpec, UnitModel
from executor.zero import (
    GradHook,
    ShardedOptimizer,
    ShardState,
    assign_flat,
    flat_params,
    unit_ownership,
)
from planners.layout import Layout

# (last unit's output, targets) -> per-sample losses. The arguments are Any, not Activation: a
# callable's parameters are contravariant, so a user's `(Tensor, Tensor) -> Tensor` (or
# elaswave.hf.token_loss) failed the user's own type check against `Tensor | tuple[Tensor, ...]`.
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(eq=False)
class TrainSpec:
    """Everything about a training job that is not its layout: the user's model as units, the
    per-sample loss, the data and the optimizer (docs/api.md)."""

    model: UnitModel
    loss_fn: LossFn
    dataset: Dataset[Any]
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    collate_fn: Collate | None = None
    data_seed: int = 0
    shuffle: bool = True
    rng_seed: int = 0
    loader_workers: int = 0  # loader processes per rank (0: one prefetch thread); executor.sampler
    # One probe per unit (parameters, output activation); discovered by a dry run if not given.
    probes: tuple[UnitProbe, ...] | None = None
    # Compute precision (executor.precision) and the device kind every rank runs on ("cpu",
    # "cuda", "npu"; executor.devices): each process uses its launcher-assigned device of it.
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    device_kind: str = "cpu"

    def local_device(self) -> torch.device:
        """This process's device of `device_kind` (DeviceUnavailable if it cannot see it)."""
        return rank_device(self.device_kind)

    def sampler(self, global_batch: int) -> GlobalBatchSampler:
        return GlobalBatchSampler(self.dataset, global_batch, self.data_seed, self.shuffle, self.collate_fn)

    def unit_probes(self) -> tuple[UnitProbe, ...]:
        """The dry run's findings (run once per process, then kept)."""
        if self.probes is None:
            first = self.sampler(1).rows(0, 0, 1)
            assert first.inputs is not None
            device = self.local_device()
            # Under the job's autocast: the boundary dtypes are the ones the steps will send.
            with self.precision.autocast(device):
                self.probes = discover_boundaries(self.model, _to_device(first.inputs, device), device)
        return self.probes

    @property
    def needs_world_group(self) -> bool:
        """Whether every step has a job-wide collective (clipping's norm, fp16's overflow vote, the
        tied pairs' gradient exchange and check of executor.tied)."""
        return self.optimizer.max_grad_norm is not None or self.precision.scales_loss or bool(self.model.tied)

    def unit_numels(self) -> tuple[int, ...]:
        return tuple(p.numel for p in self.unit_probes())


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float | None  # global-batch loss; known on last-stage ranks, None on the others
    samples_processed: int  # samples this rank ran through its stage in this step
    global_batch: int
    # Global sample ids of the batches this rank fed through its stage, in the order it ran
    # them (from the sampler's batches, not recomputed from the layout).
    sample_ids: tuple[int, ...] = ()
    skipped: bool = False  # fp16: the agreed overflow check skipped this step's update


class StepOverlay(Protocol):
    """Hooks through which one step's work is altered (non-blocking layer migration)."""

    def units_for_slot(
        self, slot: int, units: list[tuple[str, nn.Module]]
    ) -> list[tuple[str, nn.Module]]: ...

    def before_forward(self, slot: int) -> None: ...

    def after_backward(self, slot: int) -> None: ...

    def before_optimizer(self) -> None: ...

    def finish(self) -> None: ...


def check_layout(spec: TrainSpec, layout: Layout) -> None:
    """Raise ValueError if `layout` does not describe this model (the planners need true sizes)."""
    numel = spec.unit_numels()
    if layout.num_layers != len(numel):
        raise ValueError(
            f"layout has {layout.num_layers} layers, the model has {len(numel)} units "
            f"{list(spec.model.names)}"
        )
    if tuple(layout.layer_numel) != numel:
        raise ValueError(f"layout.layer_numel {layout.layer_numel} != the model's unit sizes {numel}")
    covered = [layer for s in layout.stages for layer in s.layers]
    if covered != list(range(len(numel))):
        raise ValueError(f"stages must hold units 0..{len(numel) - 1} in order, got {covered}")


class StageModel(nn.Module):
    """The units `[layer_start, layer_stop)` of one pipeline stage, by name, in forward order."""

    def __init__(
        self,
        model: UnitModel,
        layer_start: int,
        layer_stop: int,
        reuse: Mapping[str, nn.Module] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """Units named in `reuse` are taken as they are (a layout change keeps the modules it has)."""
        super().__init__()
        if not 0 <= layer_start < layer_stop <= len(model):
            raise ValueError(f"stage units [{layer_start}, {layer_stop}) invalid for {len(model)} units")
        self.layer_start, self.layer_stop = layer_start, layer_stop
        self.units = nn.ModuleDict()
        reuse = reuse or {}
        for i in range(layer_start, layer_stop):
            name = model.names[i]
            self.units[name] = reuse[name] if name in reuse else model.build(i, device)
        tie_stage(dict(self.units.items()), model.tied)  # a tied pair on one stage: one parameter
        model.check_sharing(dict(self.units.items()))

    def unit_names(self) -> list[str]:
        return list(self.units.keys())


class Trainer:
    """One rank of the hybrid-parallel job; every rank of the layout builds one."""

    def __init__(
        self,
        spec: TrainSpec,
        layout: Layout,
        rank: int,
        comm: EngineComm,
        device: torch.device | str = "cpu",
        prebuilt: Mapping[str, nn.Module] | None = None,
    ) -> None:
        """`prebuilt`: units already built on `device` (a warm spare's, `executor.spare_warmup`),
        taken for this rank's stage instead of building them again."""
        check_layout(spec, layout)
        stage = layout.stage_layout_of_rank(rank)  # raises if the rank is not in the layout
        self.spec, self.rank, self.comm, self.device = spec, rank, comm, torch.device(device)
        self.sampler = spec.sampler(layout.global_batch)
        self.data = Prefetcher(self.sampler, spec.loader_workers)
        # Weight-decay runs of every unit, from the dry run: the snapshot of a neighbour's shard
        # replays the update of units this rank may not even hold.
        self.segments = {
            name: spec.optimizer.decay_segments(probe.meta_parameters())
            for name, probe in zip(spec.model.names, spec.unit_probes(), strict=True)
        }
        self.model = StageModel(
            spec.model, stage.layer_start, stage.layer_stop, reuse=prebuilt, device=self.device
        )
        self.next_step = 0
        self.grad_hook: GradHook | None = None  # kept across layout changes; see executor.zero
        # Start the ZeRO-1 reduce-scatter of each unit during the backward (executor.grad_overlap);
        # off: after it (the same sums either way). A step that raises in the middle of an armed
        # backward, or a layout change, drops the armed hooks (`abandon_step`). On CPU only: on an
        # accelerator autograd runs the hooks on its device thread, unvalidated against the
        # collective's stream, so there it stays off until a device check covers it.
        self.overlap_exchange = self.device.type == "cpu"
        # An overlay armed for the next train_step (a non-blocking migration adopted between steps
        # through a plan): the loop that drives the trainer need not know a migration is in flight.
        self.armed_overlay: StepOverlay | None = None
        # fp16's loss scale: replicated, kept across layout changes like the hook (executor.precision)
        self.scaler = LossScaler.initial(spec.precision) if spec.precision.scales_loss else None
        self._install_layout(layout, step_count=0)

    @property
    def unit_names(self) -> tuple[str, ...]:
        """Every unit of the model, in order (unit i is layer i of the layout)."""
        return self.spec.model.names

    # ------------------------------------------------------------------------------ structure
    def _boundary(self, layer: int) -> ActivationSpec | None:
        """The activation leaving unit `layer - 1` (None before the first unit / after the last)."""
        probes = self.spec.unit_probes()
        return probes[layer - 1].output if 0 < layer < len(probes) else None

    def _install_layout(self, layout: Layout, step_count: int) -> None:
        """(Re)derive everything layout-dependent: pipeline program, routes, ZeRO ownership, RNG."""
        self.layout = layout
        self.stage_layout = layout.stage_layout_of_rank(self.rank)
        self.stage = self.stage_layout.stage
        self.dp_index = self.stage_layout.dp_index(self.rank)
        self.rng = DropoutRng(self.spec.rng_seed, layout.rng_mode, self.rank)
        self.runner = PipelineRunner(
            self.comm,
            layout,
            self.rank,
            self._boundary(self.stage_layout.layer_start),
            self._boundary(self.stage_layout.layer_stop),
            self.device,
        )
        units = dict(self.model.units.items())
        unit_stage = {self.unit_names[i]: s.stage for s in layout.stages for i in s.layers}
        self.tied = TiedGradSync(
            self.comm, self.spec.model.tied, unit_stage, [s.ranks for s in layout.stages], self.rank
        )
        previous = getattr(self, "optimizer", None)
        if previous is not None:  # its armed hooks would fire in this layout's backwards
            previous.abandon_step()
        self.optimizer = ShardedOptimizer(
            self.comm,
            dp_group_name(self.stage),
            units,
            unit_ownership(layout, self.stage_layout, self.unit_names),
            self.dp_index,
            self.spec.optimizer,
            step_count,
            self.grad_hook,
            self.device,
            self.segments,
            self.spec.precision,
            self.scaler,
        )
        self.optimizer.norm_skip = follower_ranges(units, self.spec.model.tied)
        self.model.train()

    def update_slice(
        self,
        unit: str,
        lo: int,
        param: torch.Tensor,
        grad: torch.Tensor,
        state1: torch.Tensor,
        state2: torch.Tensor,
        step: int,
        carried: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """The optimizer's update of elements `[lo, ...)` of `unit` (what a ring snapshot replays;
        `carried`: `grad` holds only these runs, `OptimizerConfig.update_slice`)."""
        self.spec.optimizer.update_slice(param, grad, state1, state2, step, self.segments[unit], lo, carried)

    def update_slices(self, slices: Sequence[UnitSlice], step: int) -> None:
        """`update_slice` of every one of `slices`, in one batch (what a snapshot holder replays
        for a protected shard each committed step, `executor.fabric.snapshot.UpdateFn`)."""
        self.spec.optimizer.update_slices(slices, self.segments, step)

    def trainable_runs(self, unit: str, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
        """The runs of elements `[lo, hi)` of `unit` that train (what a snapshot's gradient
        exchange carries; every unit's, from the dry run, held here or not)."""
        return trainable_runs(self.segments[unit], lo, hi)

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
        self.optimizer.zero_grads()  # flat units: backward accumulates into their gradient buffers
        sample_losses: list[tuple[int, torch.Tensor]] = []  # (first row, its slot's per-sample losses)
        fed: list[int] = []
        B = self.layout.global_batch
        loads_data = self.is_first or self.is_last

        def forward(slot: int, received: Activation | None) -> Activation:
            rows = self.layout.samples_of(self.rank, slot)
            if loads_data:
                batch = self.data.rows(step, rows.start, rows.stop)
                ids = batch.sample_ids
            else:
                ids = self.sampler.sample_ids(step, rows.start, rows.stop)
            fed.extend(ids)
            units = list(self.model.units.items())
            if overlay is not None:
                overlay.before_forward(slot)
                units = overlay.units_for_slot(slot, units)
            x = _to_device(batch.inputs, self.device) if received is None else received
            with self.spec.precision.autocast(self.device):
                x = self.forward_units(units, x, step, ids)
                if not self.is_last:
                    return x
                per_sample = self._per_sample_loss(x, _to_device(batch.targets, self.device), len(ids))
            per_sample = per_sample.float()  # the loss adds up in fp32 whatever the compute dtype
            sample_losses.append((rows.start, per_sample.detach()))
            loss = per_sample.sum() / B
            return loss if self.scaler is None else loss * self.scaler.scale

        # Each unit's reduce-scatter starts as its last backward finishes it, unless something
        # rewrites gradients after the backward (a cross-stage tie's sync, a migration overlay).
        overlap = overlay is None and not self.tied.active and self.overlap_exchange
        try:
            self.runner.run(
                forward,
                overlay.after_backward if overlay is not None else None,
                self.optimizer.overlap_backward if overlap else None,
            )
        except BaseException:
            self.optimizer.abandon_step()  # no armed hook may outlive the failed backward
            raise
        if overlay is not None:
            overlay.before_optimizer()
        if self.tied.active:  # Megatron-style: both copies of a cross-stage tie get the whole grad
            self.tied.sync(dict(self.model.units.items()))
        # The last stage's per-sample losses ride on the parameter all-gather of its DP group
        # (one round fewer per step); a skipped update (fp16 overflow) gathers them on their own.
        local_losses = self._local_losses(sample_losses) if self.is_last else None
        share = local_losses is not None and len(self.stage_layout.ranks) > 1
        try:
            applied = self.optimizer.step(local_losses if share else None)
        except BaseException:
            self.optimizer.abandon_step()  # receives it posted into the parameters moved off them
            raise
        if overlay is not None:
            overlay.finish()
        self.next_step = step + 1
        self.prefetch(step + 1)
        processed = sum(
            len(self.layout.samples_of(self.rank, m)) for m in range(self.layout.num_micro_batches)
        )
        loss = None if local_losses is None else self._global_loss(local_losses, self.optimizer.piggybacked)
        return StepResult(step, loss, processed, B, tuple(fed), skipped=not applied)

    def prefetch(self, step: int) -> None:
        """Start loading this rank's rows of `step` under the current layout (first and last
        stages; the others load nothing). After a layout change the rows differ from those
        prefetched under the old one: calling it during the edit keeps the first step's load
        off its critical path."""
        if self.is_first or self.is_last:
            slots = (self.layout.samples_of(self.rank, m) for m in range(self.layout.num_micro_batches))
            self.data.prefetch(step, [(r.start, r.stop) for r in slots])

    def forward_units(
        self, units: list[tuple[str, nn.Module]], x: Activation, step: int, samples: tuple[int, ...]
    ) -> Activation:
        """Run `units` in order on rows `samples` (a stage's own units, or that list with a
        migrating unit's shadow), each under its unit-call context (executor.rng)."""
        model = self.spec.model
        for name, unit in units:
            index = model.index(name)
            seed = mix64(self.spec.rng_seed, step, index, samples[0] if samples else 0)
            call = UnitCall(step, index, samples, self.rng)
            context = functools.partial(unit_call, call, seed)
            x = run_unit(unit, x, model.tuple_rule, name in model.recompute, context)
        return x

    def _per_sample_loss(self, output: Activation, targets: Any, rows: int) -> torch.Tensor:
        loss = self.spec.loss_fn(output, targets)
        if (
            not isinstance(loss, torch.Tensor)
            or tuple(loss.shape) != (rows,)
            or not loss.dtype.is_floating_point
        ):
            got = (
                f"{type(loss).__name__} {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else type(loss).__name__
            )
            raise ValueError(
                f"loss_fn must return one floating-point loss per sample, shape ({rows},); got {got} "
                "(use reduction='none' and average over the other dimensions yourself)"
            )
        return loss

    def _local_losses(self, mine: Sequence[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """This rank's per-sample losses at their rows of the global batch (zeros elsewhere), from
        each slot's (first row, losses): one write per slot, not one per sample."""
        local = torch.zeros(self.layout.global_batch, device=self.device)
        for start, values in mine:
            local[start : start + values.numel()] = values
        return local

    def _global_loss(self, local: torch.Tensor, gathered: list[torch.Tensor] | None = None) -> float:
        """Exact sum of all per-sample losses of the global batch / B, from the last stage's ranks:
        every rank's `_local_losses`, as `gathered` already (DP order) or all-gathered here."""
        B = self.layout.global_batch
        ranks = self.stage_layout.ranks
        if gathered is None:
            gathered = [torch.empty(B, device=self.device) for _ in ranks]
            if len(ranks) == 1:
                gathered[0] = local
            else:
                self.comm.all_gather(dp_group_name(self.stage), gathered, local)
        owner = [0] * B
        for m in range(self.layout.num_micro_batches):
            for j, rng in enumerate(self.stage_layout.split_slot(self.layout.slot_range(m))):
                owner[rng.start : rng.stop] = [j] * len(rng)
        values = [g.tolist() for g in gathered]  # one transfer per rank, not one per sample
        return math.fsum(values[owner[row]][row] for row in range(B)) / B

    def arm_overlay(self, overlay: StepOverlay) -> None:
        """Make the next `train_step` (called without an overlay) run with `overlay`."""
        if self.armed_overlay is not None:
            raise ValueError("an overlay is already armed for the next step")
        self.armed_overlay = overlay

    # ----------------------------------------------------------------------------------- state
    def unit_params(self) -> dict[str, torch.Tensor]:
        """Full flat parameters of this stage's units (a copy)."""
        return {n: flat_params(u) for n, u in self.model.units.items()}  # a copy (one clone of a flat buffer)

    def state_dict_for_rollback(self) -> dict[str, Any]:
        """Everything a rollback needs on this rank: parameters, optimizer shards, step counters."""
        return self.rollback_state_copier()()

    def rollback_state_copier(self, reuse: Mapping[str, Any] | None = None) -> Callable[[], dict[str, Any]]:
        """`state_dict_for_rollback` in two halves: the counters, layout and loss scale are read
        now; the returned function copies the tensors (parameters, optimizer shards). It may run
        later, on another thread, as long as nothing has written them in between: the next step
        writes them only in its optimizer update (after the gradient hook), so the copy of a
        committed step can overlap the next step's forward and backward. `reuse`: an earlier
        rollback state that nothing reads any more; its tensors are overwritten where they fit
        (the copy of every step then writes into the same memory, `flat_units.copy_reusing`)."""
        head = {
            "layout": self.layout,
            "next_step": self.next_step,
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
        }
        units = dict(self.model.units.items())
        optimizer_copy = self.optimizer.state_copier(None if reuse is None else reuse["optimizer"])
        old_params: Mapping[str, torch.Tensor] = {} if reuse is None else reuse["params"]
        # A frozen unit's parameters never change: the copy being reused still holds them, and
        # of a unit that trains in part only the trainable runs need copying again.
        exchange = self.optimizer.exchange
        in_part = exchange.frozen | set(exchange.partial_runs)
        reusable = {
            n
            for n in in_part
            if n in old_params and n in units and holds_flat_copy_of(old_params[n], units[n])
        }
        kept = {n: old_params[n] for n in exchange.frozen & reusable}
        runs = {n: r for n, r in exchange.partial_runs.items() if n in reusable}
        # A flat unit's buffer, looked up now (its module tree is not walked again per copy)
        views = {n: exchange.param_vector(n) for n in units}

        def copy_one(name: str, unit: nn.Module) -> torch.Tensor:
            if name in kept:
                return kept[name]
            if name in runs:
                return copy_runs(unit, old_params[name], runs[name])
            view = views[name]
            if view is not None:
                return copy_reusing(view, old_params.get(name))
            return flat_params(unit, old_params.get(name))

        def copy_tensors() -> dict[str, Any]:
            params = {n: copy_one(n, u) for n, u in units.items()}
            return {**head, "params": params, "optimizer": optimizer_copy()}

        return copy_tensors

    def load_rollback_state(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict_for_rollback()` taken under the current layout (local, no comms)."""
        if state["layout"] != self.layout:
            raise ValueError("rollback state was taken under another layout; remap it first (reset_layout)")
        params = state["params"]
        if set(params) != set(self.model.units.keys()):
            raise ValueError(
                f"rollback state has units {sorted(params)}, stage has {self.model.unit_names()}"
            )
        self.optimizer.load_state(state["optimizer"])
        for name, flat in params.items():
            assign_flat(self.model.units[name], flat)
        self.next_step = int(state["next_step"])
        self.load_scaler_state(state.get("scaler"))

    def load_scaler_state(self, state: Mapping[str, Any] | None) -> None:
        """Adopt a committed loss-scaler state (fp16; None: keep, or start a fresh scaler)."""
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)

    get_state = state_dict_for_rollback
    set_state = load_rollback_state

    def reset_layout(
        self,
        layout: Layout,
        comm: EngineComm,
        params: Mapping[str, torch.Tensor],
        shards: Mapping[str, ShardState],
        step_count: int,
        next_step: int,
    ) -> None:
        """Adopt `layout` with state already remapped for it: full parameters of the new stage's
        units and this rank's new optimizer slices (what a migration, a live remap or a rollback
        across layouts ends in). Checks everything first; on ValueError nothing has changed."""
        check_layout(self.spec, layout)
        if layout.global_batch != self.sampler.global_batch:
            raise ValueError(
                f"the global batch is fixed for a job ({self.sampler.global_batch}), "
                f"new layout says {layout.global_batch}"
            )
        stage = layout.stage_layout_of_rank(self.rank)
        model = StageModel(
            self.spec.model,
            stage.layer_start,
            stage.layer_stop,
            reuse=self._spare_units(stage.layer_start, stage.layer_stop),
            device=self.device,
        )
        if set(params) != set(model.unit_names()) or set(shards) != set(model.unit_names()):
            raise ValueError(
                f"state for units {sorted(params)} / {sorted(shards)}, new stage holds {model.unit_names()}"
            )
        numel = {n: sum(p.numel() for p in u.parameters()) for n, u in model.units.items()}
        owned = unit_ownership(layout, stage, self.unit_names)
        j = stage.dp_index(self.rank)
        for name, sh in shards.items():
            if (sh.lo, sh.hi) != owned[name][j] or sh.exp_avg.numel() != sh.hi - sh.lo:
                raise ValueError(
                    f"shard [{sh.lo}, {sh.hi}) of {name} given, rank {self.rank} owns "
                    f"{list(owned[name][j])} under the new layout"
                )
        if any(flat.numel() != numel[n] for n, flat in params.items()):
            raise ValueError(
                f"parameter sizes { {n: f.numel() for n, f in params.items()} } != units {numel}"
            )
        held = set(self.model.units.keys())
        aligned = align_tied_flats(params, dict(model.units.items()), self.spec.model.tied, held)
        for name, flat in aligned.items():
            assign_flat(model.units[name], flat)
        self.model, self.comm = model, comm
        self._install_layout(layout, step_count)
        for name, sh in self.optimizer.shards.items():
            sh.exp_avg.copy_(shards[name].exp_avg)
            sh.exp_avg_sq.copy_(shards[name].exp_avg_sq)
        self.next_step = next_step

    def restore_layout(
        self, layout: Layout, comm: EngineComm, checkpoint: Path | None
    ) -> CheckpointMeta | None:
        """Adopt `layout` with the state of durable checkpoint `checkpoint` (a directory as
        `latest_checkpoint` returns it), or the job's initial state (step 0) when None: what a
        RESTORE plan does in place when some state has no copy left in memory. Local reads only;
        the modules are rebuilt by name (`UnitModel.build`) so buffers come back too. Raises
        CheckpointError (changing nothing) if the checkpoint is not this model's."""
        stage = layout.stage_layout_of_rank(self.rank)
        meta = None
        if checkpoint is not None:
            meta = read_meta(checkpoint)
            check_fits(
                meta,
                self.unit_names,
                self.spec.unit_numels(),
                layout.global_batch,
                checkpoint,
                self.spec.optimizer.kind,
            )
        owned = unit_ownership(layout, stage, self.unit_names)
        j = stage.dp_index(self.rank)
        states: dict[str, dict[str, torch.Tensor]] = {}
        params: dict[str, torch.Tensor] = {}
        shards: dict[str, ShardState] = {}
        for index in range(stage.layer_start, stage.layer_stop):
            name = self.unit_names[index]
            unit = self.spec.model.build(index, self.device)
            lo, hi = owned[name][j]
            if checkpoint is not None:
                state, m, v = load_unit_state(checkpoint, name)
                try:
                    unit.load_state_dict(state, strict=True)
                except RuntimeError as exc:
                    raise CheckpointError(f"{checkpoint}: unit {name!r} does not fit: {exc}") from exc
                m, v = m[lo:hi].to(self.device).clone(), v[lo:hi].to(self.device).clone()
            else:
                m = torch.zeros(hi - lo, device=self.device)
                v = torch.zeros(hi - lo, device=self.device)
            states[name] = unit.state_dict()
            params[name] = flat_params(unit)
            shards[name] = ShardState(lo, hi, m, v)
        step_count = 0 if meta is None else meta.step_count
        next_step = 0 if meta is None else meta.next_step
        self.reset_layout(layout, comm, params, shards, step_count, next_step)
        for name, state in states.items():  # buffers (and parameters again, identical)
            self.model.units[name].load_state_dict(state, strict=True)
        if self.scaler is not None:  # the checkpoint's scale, or a fresh one (step 0)
            fresh = LossScaler.initial(self.spec.precision).state_dict()
            self.scaler.load_state_dict(meta.loss_scale if meta and meta.loss_scale else fresh)
        return meta

    def _spare_units(self, layer_start: int, layer_stop: int) -> dict[str, nn.Module]:
        """Current modules a new stage `[layer_start, layer_stop)` can keep (their parameters are
        overwritten by reset_layout anyway; re-initialising them would only cost time)."""
        keep = set(self.unit_names[layer_start:layer_stop])
        return {n: u for n, u in self.model.units.items() if n in keep}

    def gather_full_state(self) -> dict[str, Any]:
        """Full parameters and Adam moments of this stage's units (collective over the stage's DP
        group: every rank of the stage must call it)."""
        moments = self.optimizer.gather_moments()
        return {
            "step_count": self.optimizer.step_count,
            "units": {
                n: {"param": flat_params(u).clone(), "exp_avg": moments[n][0], "exp_avg_sq": moments[n][1]}
                for n, u in self.model.units.items()
            },
        }


def _to_device(x: Any, device: torch.device) -> Any:
    """Move a batch's tensors (a tensor, or tuples / lists / dicts of them) to `device`."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple | list):
        return type(x)(_to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to_device(v, device) for k, v in x.items()}
    return x


def _unit_host_copy(unit: nn.Module) -> nn.Module:
    return copy.deepcopy(unit).cpu()


def checkpoint_writer(spec: TrainSpec, root: Path, global_batch: int, run_id: str) -> CheckpointWriter:
    """A writer of this job's checkpoints under `root` (the model, batch and seeds go in meta.json);
    `run_id` is shared by every rank of this run (executor.checkpoint.CheckpointWriter)."""
    return CheckpointWriter(
        root,
        {
            "units": spec.model.names,
            "unit_numel": spec.unit_numels(),
            "global_batch": global_batch,
            "data_seed": spec.data_seed,
            "rng_seed": spec.rng_seed,
            "init_seed": spec.model.init_seed,
            "optimizer": spec.optimizer.kind,
            "tied": [list(p.keys) for p in spec.model.tied],
            "extra": spec.model.extra,
            "precision": spec.precision.precision,
        },
        run_id,
    )


def checkpoint_payload(trainer: Trainer) -> StagePayload | None:
    """This stage's units and full optimizer moments in host memory, on the stage's first rank
    (None on the others). Collective over the stage's DP group: every rank of it must call."""
    moments = trainer.optimizer.gather_moments()
    if trainer.dp_index != 0:
        return None
    return StagePayload(
        trainer.next_step,
        trainer.optimizer.step_count,
        trainer.stage,
        trainer.layout.num_stages,
        {n: _unit_host_copy(u) for n, u in trainer.model.units.items()},
        {n: (m.cpu(), v.cpu()) for n, (m, v) in moments.items()},
        None if trainer.scaler is None else trainer.scaler.state_dict(),
    )


def load_checkpoint(trainer: Trainer, path: str | Path) -> CheckpointMeta:
    """Load this rank's units and optimizer slices from a checkpoint written on any layout
    (local reads only). Raises CheckpointError, changing nothing, if it is not this model's."""
    ckpt = latest_checkpoint(path)
    meta = read_meta(ckpt)
    check_fits(
        meta,
        trainer.unit_names,
        trainer.spec.unit_numels(),
        trainer.layout.global_batch,
        ckpt,
        trainer.spec.optimizer.kind,
    )
    loaded = {n: load_unit_state(ckpt, n) for n in trainer.model.unit_names()}
    for name, (state, _m, _v) in loaded.items():
        try:
            trainer.model.units[name].load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise CheckpointError(f"{ckpt}: unit {name!r} does not fit: {exc}") from exc
    for name, sh in trainer.optimizer.shards.items():
        _state, m, v = loaded[name]
        sh.exp_avg.copy_(m[sh.lo : sh.hi])
        sh.exp_avg_sq.copy_(v[sh.lo : sh.hi])
    trainer.optimizer.step_count = meta.step_count
    trainer.next_step = meta.next_step
    trainer.load_scaler_state(meta.loss_scale)
    return meta
