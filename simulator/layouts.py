"""The simulated job's layouts: the healthy one, their pricing (`planners.layout_pricing`, shared
with `elaswave plan`) and the state a rank holds (what a join receives or a RESTORE reloads)."""

from __future__ import annotations

from planners.chameleon.state import Candidate, ClusterState
from planners.elaswave_model import JobModel, registered_model
from planners.layout import Layout
from planners.layout_pricing import healthy_layout
from planners.layout_pricing import layout_candidate as price_layout
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
