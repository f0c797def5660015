"""Parameter fabric (ElasWave §5): per-step ring snapshots and live remap of ZeRO-1 state."""

from __future__ import annotations

from executor.fabric.overlap import (
    RemapTransfer,
    UnrecoverableLoss,
    block_ownership,
    overlap_transfers,
    remap_plan,
    snapshot_holders,
)
from executor.fabric.remap import RemapError, live_remap
from executor.fabric.snapshot import RingSnapshot, SnapshotError, ring_holder, ring_protected
from executor.fabric.state import ShardState, UnitShard

__all__ = [
    "UnitShard",
    "RemapError",
    "RemapTransfer",
    "RingSnapshot",
    "ShardState",
    "SnapshotError",
    "UnrecoverableLoss",
    "block_ownership",
    "overlap_transfers",
    "live_remap",
    "remap_plan",
    "ring_holder",
    "ring_protected",
    "snapshot_holders",
]
