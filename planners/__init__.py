"""Pure planners: functions over small frozen dataclasses (no I/O, no clocks, no torch).

`planners.layout` holds the Layout / Plan types; validation, diffs and ZeRO ownership live in
their own modules and are re-exported here, so `from planners import Layout, validate` works.
The numpy-based cost model, partitioner, DVFS and RNG planners are imported from their modules.
"""

from planners.dataflow import DataflowResult, StageEmptied, drop_stage, resize_after_join, resize_after_loss
from planners.diff import LayerMove, LayoutDiff, diff_layouts
from planners.layout import (
    Layout,
    Plan,
    SampleRange,
    StageLayout,
    make_uniform_layout,
    slot_range,
    split_evenly,
    split_weighted,
)
from planners.validation import InvalidLayout, MemoryModel, ValidationReport, ensure_valid, validate
from planners.zero import MigrationCost, OwnedInterval, ShardTransfer, migration_cost, shard_transfers

__all__ = [
    "DataflowResult",
    "StageEmptied",
    "drop_stage",
    "resize_after_join",
    "resize_after_loss",
    "InvalidLayout",
    "LayerMove",
    "Layout",
    "LayoutDiff",
    "MemoryModel",
    "MigrationCost",
    "OwnedInterval",
    "Plan",
    "SampleRange",
    "ShardTransfer",
    "StageLayout",
    "ValidationReport",
    "diff_layouts",
    "ensure_valid",
    "make_uniform_layout",
    "migration_cost",
    "shard_transfers",
    "slot_range",
    "split_evenly",
    "split_weighted",
    "validate",
]
