"""The parameter fabric wired to the engine's Trainer: its step participant for the step protocol.

Per step: the trainer's ZeRO-1 optimizer reduce-scatters gradients; right then this participant
sends the worker's gradient shards around the DP ring (`RingSnapshot`), and the holder applies
`executor.zero.adamw_update` — the engine's own update function — to its host copy once the step
commits. Every `verify_every` steps the ring compares checksums of snapshot and live shard.
On a plan it live-remaps the committed optimizer shards (lost ones from snapshots) and hands them
to `Trainer.reset_layout`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from executor.comm.communicator import Communicator
from executor.engine_comm import dp_group_name
from executor.fabric.remap import RemapError, live_remap
from executor.fabric.snapshot import RingSnapshot
from executor.fabric.state import ShardState, UnitShard
from executor.model import EMBED, HEAD, ModelConfig, block_numel, build_unit, unit_order
from executor.trainer import Trainer
from executor.zero import ShardState as ZeroShard
from executor.zero import adamw_update, flat_params, unit_ownership
from planners.layout import Layout, Plan


def unit_numels(cfg: ModelConfig) -> dict[str, int]:
    numel = {f"block_{k}": block_numel(cfg) for k in range(cfg.num_layers)}
    for name in (EMBED, HEAD):
        numel[name] = sum(p.numel() for p in build_unit(cfg, name).parameters())
    return numel


def engine_ownership(cfg: ModelConfig, layout: Layout) -> dict[str, list[tuple[int, int, int]]]:
    """unit -> (worker, lo, hi) of the engine's ZeRO shards (blocks per the planners, embedding
    and head split evenly), empty intervals left out."""
    numel = unit_numels(cfg)
    own: dict[str, list[tuple[int, int, int]]] = {}
    for stage in layout.stages:
        names = unit_order(layout.num_layers, stage.layer_start, stage.layer_stop)
        for name, ivs in unit_ownership(layout, stage, {n: numel[n] for n in names}).items():
            own[name] = sorted((stage.ranks[k], lo, hi) for k, (lo, hi) in enumerate(ivs) if hi > lo)
            own[name].sort(key=lambda t: t[1])
    return own


def shard_state_of(trainer: Trainer) -> ShardState:
    """This worker's owned parameter slices and Adam moments (copies)."""
    opt = trainer.optimizer
    state = ShardState(step=opt.step_count)
    for name, sh in opt.shards.items():
        param = flat_params(trainer.model.units[name])[sh.lo: sh.hi].clone()
        state.units[name] = UnitShard(sh.lo, sh.hi, param, sh.exp_avg.clone(), sh.exp_avg_sq.clone())
    return state


class FabricParticipant:
    """`StepParticipant` for the engine: rollback copies, ring snapshots, live remap.

    Constructing it is collective over the worker's DP group (the ring is seeded)."""

    def __init__(self, trainer: Trainer, comm: Communicator, snapshots: bool = True, verify_every: int = 50) -> None:
        if verify_every < 1:
            raise ValueError(f"verify_every must be >= 1, got {verify_every}")
        self.trainer, self.comm = trainer, comm
        self.snapshots, self.verify_every = snapshots, verify_every
        self.snapshot: RingSnapshot | None = None
        self.checksum_mismatches = 0
        self.verified_steps: list[int] = []
        self._committed: dict[str, Any] = trainer.get_state()
        self._install_snapshot()

    # ----- StepParticipant -----------------------------------------------------------------
    def before_vote(self) -> None:
        if self.snapshot is not None:
            self.snapshot.finish_exchange()

    def on_commit(self, step: int) -> None:
        self._committed = self.trainer.get_state()
        if self.snapshot is not None:
            self.snapshot.commit(self.trainer.optimizer.step_count)

    def on_rollback(self) -> None:
        self.trainer.set_state(self._committed)
        if self.snapshot is not None:
            self.snapshot.discard()

    def on_plan(self, plan: Plan, lost: frozenset[int], committed_step: int) -> None:
        """Live remap of the committed optimizer shards to `plan.new` (§5.2), then reset the trainer."""
        assert plan.old is not None
        cfg = self.trainer.cfg.model
        new_stage = plan.new.stage_layout_of_rank(self.comm.worker)
        units = unit_order(plan.new.num_layers, new_stage.layer_start, new_stage.layer_stop)
        if sorted(units) != sorted(self.trainer.model.unit_names()):
            raise RemapError(f"plan {plan.epoch} moves layers to or from worker {self.comm.worker}: "
                             "migrate layers (executor.migration) after the remap, not in it")
        mine = shard_state_of(self.trainer)
        snap = self.snapshot.state() if self.snapshot is not None else None
        remapped = live_remap(self.comm, plan.old, plan.new, lost, mine, snap, step=mine.step,
                              old_own=engine_ownership(cfg, plan.old), new_own=engine_ownership(cfg, plan.new))
        params = self.trainer.unit_params()
        _check_params_agree(remapped, params, self.comm.worker)
        shards = {name: ZeroShard(0, 0, torch.zeros(0), torch.zeros(0)) for name in units}
        for name, sh in remapped.units.items():
            shards[name] = ZeroShard(sh.start, sh.stop, sh.exp_avg.clone(), sh.exp_avg_sq.clone())
        self.trainer.reset_layout(plan.new, self.comm, params, shards, step_count=mine.step,
                                  next_step=self.trainer.next_step)
        self._committed = self.trainer.get_state()
        self._install_snapshot()

    # ----- snapshot ring -------------------------------------------------------------------
    def _install_snapshot(self) -> None:
        group = dp_group_name(self.trainer.stage)
        self.snapshot = None
        if self.snapshots and len(self.comm.workers(group)) >= 2:
            self.snapshot = RingSnapshot(self.comm, group, self.trainer.cfg.optim, update_fn=adamw_update)
            self.snapshot.seed(shard_state_of(self.trainer))
        opt = self.trainer.optimizer
        opt.reduce_scatter_grads = self._hooked(opt.reduce_scatter_grads)  # type: ignore[method-assign]

    def _hooked(self, reduce_scatter: Callable[[], dict[str, torch.Tensor]]) -> Callable[[], dict[str, torch.Tensor]]:
        """Wrap the optimizer's reduce-scatter: verify (periodically) and snapshot its output.

        Runs inside the step, so a peer failure here rolls the step back like any other."""
        def hooked() -> dict[str, torch.Tensor]:
            grads = reduce_scatter()
            snap, step = self.snapshot, self.trainer.optimizer.step_count
            if snap is not None:
                if step > 0 and step % self.verify_every == 0 and step not in self.verified_steps:
                    # the live shard is still the committed one here: compare it with the snapshot
                    if not snap.verify(shard_state_of(self.trainer)):
                        self.checksum_mismatches += 1
                        snap.seed(shard_state_of(self.trainer))
                    self.verified_steps.append(step)
                snap.exchange_grads(step + 1, grads)
            return grads
        return hooked


def _check_params_agree(remapped: ShardState, params: dict[str, torch.Tensor], worker: int) -> None:
    """Integrity: the parameter slices that came from snapshots and peers equal the replicated
    parameters this worker already holds (ZeRO-1 keeps full parameters on every DP rank)."""
    for name, sh in remapped.units.items():
        if not torch.equal(sh.param, params[name][sh.start: sh.stop]):
            raise RemapError(f"worker {worker}: remapped parameters of {name} [{sh.start}, {sh.stop}) "
                             "differ from the replicated copy")
