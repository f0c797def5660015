"""A deterministic ZeRO-1 workload for the fabric tests: interleaved shards of a few flat layers,
AdamW through the optimizer's slice update (the function the snapshots apply), gradients that
depend only on (step, layer). Each layer's flat vector mixes runs with and without weight decay,
so a shard that starts mid-vector must find its own decay runs (`update_slice(..., lo)`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from executor.fabric.state import ShardState, UnitShard
from executor.optim import OptimizerConfig, Segments, UnitSlice
from planners.layout import Layout, make_uniform_layout
from planners.zero import stage_ownership

if TYPE_CHECKING:
    from executor.fabric.snapshot import RingSnapshot, UpdateFn

LAYER_NUMEL = (37, 50, 23)
HYPER = OptimizerConfig("adamw", lr=1e-2, weight_decay=0.1)
# Per layer: decay on the first part, none on the rest (a "weight" then a "bias", say).
SEGMENTS: dict[str, Segments] = {
    f"block_{k}": ((0, n - n // 3, HYPER.weight_decay), (n - n // 3, n, 0.0))
    for k, n in enumerate(LAYER_NUMEL)
}


def update_fn(slices: Sequence[UnitSlice], step: int) -> None:
    """The live optimizer's update of the slices (what a snapshot replays, `UpdateFn`)."""
    HYPER.update_slices(slices, SEGMENTS, step)


def layout_for(dp_workers: tuple[int, ...]) -> Layout:
    base = make_uniform_layout(
        len(LAYER_NUMEL),
        1,
        len(dp_workers),
        global_batch=6,
        num_micro_batches=1,
        layer_numel=LAYER_NUMEL,
        zero_layout="interleaved",
    )
    stage = base.stages[0]
    return base.replace(
        stages=(stage.__class__(stage.stage, stage.layer_start, stage.layer_stop, tuple(dp_workers)),)
    )


def full_vector(layer: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + layer)
    return torch.randn(LAYER_NUMEL[layer], generator=g)


def initial_state(layout: Layout, worker: int) -> ShardState:
    state = ShardState(step=0)
    for iv in stage_ownership(layout, layout.stages[0]):
        if iv.rank == worker:
            n = iv.stop - iv.start
            state.units[unit_name(iv.layer)] = UnitShard(
                iv.start,
                iv.stop,
                full_vector(iv.layer, 0)[iv.start : iv.stop].clone(),
                torch.zeros(n),
                torch.zeros(n),
            )
    return state


def unit_name(layer: int) -> str:
    return f"block_{layer}"


def layer_of(unit: str) -> int:
    return int(unit.split("_")[1])


def grads_for(state: ShardState, step: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {k: full_vector(layer_of(k), step)[s.start : s.stop] * scale for k, s in state.units.items()}


def live_update(state: ShardState, step: int, grads: dict[str, torch.Tensor]) -> None:
    # One unit at a time, as the owner updates a bucket of one: the snapshot's batched replay
    # (`update_fn`) must give the same bits.
    for k, s in state.units.items():
        HYPER.update_slice(s.param, grads[k], s.exp_avg, s.exp_avg_sq, step, SEGMENTS[k], s.start)
    state.step = step


def seeded_ring(
    worker: int, port: int, workers: tuple[int, ...], update: UpdateFn = update_fn, **kwargs: Any
) -> tuple[RingSnapshot, ShardState]:
    """This worker's `RingSnapshot` over one DP group of `workers` on the store at `port`, seeded
    with its initial shard (`kwargs` go to the snapshot), and that live shard."""
    from executor.comm import Communicator  # noqa: PLC0415 - the pure helpers above need no store
    from executor.fabric.snapshot import RingSnapshot  # noqa: PLC0415
    from executor.store_server import connect_store  # noqa: PLC0415

    comm = Communicator(connect_store("127.0.0.1", port), worker, {"dp/0": workers}, timeout_s=30.0)
    live = initial_state(layout_for(workers), worker)
    snap = RingSnapshot(comm, "dp/0", update, **kwargs)
    snap.seed(live)
    return snap, live
