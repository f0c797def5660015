"""The simulated job's layouts: the healthy one, their pricing (`planners.layout_pricing`, shared
with `elaswave plan`) and the state a rank holds (what a join receives or a RESTORE reloads)."""

from __future__ import annotations

from planners.backup import BACKUP_ROWS, FLOAT_BYTES, shard_elements, snapshot_rank_bytes
from planners.chameleon.state import Candidate, ClusterState
from planners.elaswave_model import JobModel, registered_model
from planners.layout import Layout
from planners.layout_pricing import healthy_layout
from planners.layout_pricing import layout_candidate as price_layout
from planners.reprotect import backup_pairs, reseed_pairs
from simulator.jobs import JobSpec, node_of_rank


def initial_layout(spec: JobSpec) -> Layout:
    """The healthy Table-2 layout (Algorithm 1's balanced boundaries), memory-capped, with every
    rank's node (a rank's TP group lies on one node; `planners.backup` keeps copies off it)."""
    layout = healthy_layout(ClusterState(spec.shape, spec.profile()))
    return layout.replace(rank_nodes=tuple((r, node_of_rank(spec, r)[0]) for r in layout.ranks()))


def layout_model(spec: JobSpec, layout: Layout) -> JobModel:
    return registered_model(spec.profile(), layout)


def layout_candidate(spec: JobSpec, layout: Layout, policy: str, reason: str) -> Candidate:
    return price_layout(ClusterState(spec.shape, spec.profile()), layout, policy, reason)


def rank_state_bytes(spec: JobSpec, layout: Layout, rank: int) -> float:
    """What one device of `rank` holds: its stage's bf16 weights and its ZeRO-1 optimizer shard
    (the state a joining rank receives, or a RESTORE reloads)."""
    prof = spec.profile()
    stage = layout.stage_layout_of_rank(rank)
    weights = sum(prof.layer_param_bytes[stage.layer_start : stage.layer_stop])
    return weights * (1 + prof.optimizer_bytes_per_param_byte / stage.dp_size)


def busiest_state_bytes(spec: JobSpec, layout: Layout) -> float:
    return max(rank_state_bytes(spec, layout, r) for r in layout.ranks())


def extra_copy_traffic_s(spec: JobSpec, layout: Layout) -> float:
    """Seconds per step the copies beyond each shard's first add: their gradient exchange
    (`executor.fabric.snapshot` sends every owner's gradient shard to each holder every step),
    the busiest rank's bytes out or in, priced as the step model prices the gradient all-reduce
    (`planners.chameleon.stepmodel.sync_time`: the bytes per parameter of the profile, bf16, at
    `JobProfile.allreduce_bytes_per_s` per device). Charged in full, none of it
    hidden behind the optimizer step; the first copy's exchange is not charged (ElasWave §5.1,
    Fig. 6b: it overlaps the optimizer update and the all-gather), as before issue 25."""
    if layout.backup_copies <= 1:
        return 0.0
    prof = spec.profile()
    grad_bytes = sum(prof.layer_param_bytes) / sum(layout.layer_numel)
    traffic = snapshot_rank_bytes(layout, from_copy=1, grad_bytes=grad_bytes)
    busiest = max((max(o, i) for o, i in traffic.values()), default=0.0)
    return busiest / prof.allreduce_bytes_per_s


def reseed_bytes(old: Layout | None, new: Layout, lost: frozenset[int] = frozenset()) -> float:
    """Bytes into the busiest holder of the copies `new` must re-seed after a plan from `old`
    (`planners.reprotect.reseed_pairs`: every copy whose owner's shard or holder changed; all of
    them after a RESTORE, `old` None), and every copy a `lost` rank kept or owned (in the
    simulator a swapped node's ranks keep their ids but not their state): the parameters and
    both Adam moments of each such shard (`planners.backup.backup_cost`'s bytes per element)."""
    elements = shard_elements(new)
    into: dict[int, float] = {}
    pairs = reseed_pairs(old, new) | {(o, h) for o, h in backup_pairs(new) if o in lost or h in lost}
    for owner, holder in pairs:
        into[holder] = into.get(holder, 0.0) + BACKUP_ROWS * FLOAT_BYTES * elements.get(owner, 0)
    return max(into.values(), default=0.0)
