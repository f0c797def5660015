"""A described model as the planners see it: its units' costs, what must match across nodes, and
the model a launcher registers with its job (its describe run as FlexTrain's profile).

The describe run (`wire.worker_env.ModelDescription`) is plain data; the launcher, the Core's
rendezvous and the harness all turn it into placement inputs and compare two nodes' descriptions
the same way, so those rules live here, below all three.

Registered with the job (the `model` of `POST /api/v1/jobs`, the `elaswave plan` state.json), the
description gives the Core a scale table (FlexTrain §4.4), so `OfferResources` judges offers to
launcher jobs by eq. 16 as it does for any job with a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from planners.chameleon.schema import state_from_dict
from planners.placement import UnitCost
from wire.worker_env import ModelDescription

if TYPE_CHECKING:
    from planners.layout import Layout


def unit_costs(description: ModelDescription) -> tuple[UnitCost, ...]:
    return tuple(
        UnitCost(
            u.name,
            u.numel,
            u.param_bytes,
            u.forward_s_per_sample + u.backward_s_per_sample,
            u.activation_bytes_per_sample,
        )
        for u in description.units
    )


def model_identity(desc: ModelDescription) -> dict[str, Any]:
    """What must be the same on every node of a multi-node job (core_service.rendezvous): the units (not their measured times), the batch, the
    data, the steps and the initial weights' fingerprints."""
    return {
        "units": [(u.name, u.numel, u.param_bytes, u.activation_bytes_per_sample) for u in desc.units],
        "global_batch": desc.global_batch,
        "micro_batches": desc.micro_batches,
        "dataset_len": desc.dataset_len,
        "steps": desc.steps,
        "fingerprints": desc.fingerprints,
    }


def model_difference(mine: ModelDescription, first: ModelDescription, first_id: str) -> str | None:
    """The first difference between two descriptions, in words (None: the same model)."""
    a, b = model_identity(mine), model_identity(first)
    if len(a["units"]) != len(b["units"]):
        return f"this node's model has {len(a['units'])} units, node {first_id!r}'s has {len(b['units'])}"
    for i, (u, v) in enumerate(zip(a["units"], b["units"], strict=True)):
        if u != v:
            return (
                f"unit {i} is {u[0]!r} with {u[1]} parameters here but {v[0]!r} with {v[1]} parameters on node "
                f"{first_id!r} (name, parameters, bytes, activation bytes: {list(u)} vs {list(v)})"
            )
    for key in ("global_batch", "micro_batches", "dataset_len", "steps"):
        if a[key] != b[key]:
            return f"{key} is {a[key]} here but {b[key]} on node {first_id!r}"
    if a["fingerprints"] != b["fingerprints"]:
        units = sorted(
            k
            for k in a["fingerprints"].keys() | b["fingerprints"].keys()
            if a["fingerprints"].get(k) != b["fingerprints"].get(k)
        )
        return (
            f"the initial weights of units {units[:5]} differ from node {first_id!r}'s: every node must build "
            "the same model (seed it the same way)"
        )
    return None


# The most devices any scale-table row may use (core_service.limits.MAX_DEVICES).
MAX_DEVICES = 65_536
# Memory cap per device when the launcher was given none (--mem-per-worker): 1 TiB, no bound.
UNBOUNDED_MEM_BYTES = float(2**40)
MAX_LAYERS = 4_096  # core_service.limits.MAX_LAYERS: a larger model is not registered


def model_state(
    desc: ModelDescription, pp: int, dp: int, mem_cap_bytes: float | None = None
) -> dict[str, Any] | None:
    """state.json for a job of `pp` stages of `dp` ranks each, or None when the shape is not one
    the profile format can say (the global batch not split evenly over DP x micro-batches)."""
    per_rank = desc.global_batch // max(1, dp)
    if dp < 1 or pp < 1 or desc.global_batch % dp or per_rank % desc.micro_batches:
        return None
    units = desc.units
    return {
        "job": {
            "pp": pp,
            "dp": dp,
            "micro_batch": per_rank // desc.micro_batches,
            "global_batch": desc.global_batch,
        },
        "profile": {
            "layer_fwd_s": [u.forward_s_per_sample for u in units],
            "layer_bwd_s": [u.backward_s_per_sample for u in units],
            "layer_param_bytes": [u.param_bytes for u in units],
            "layer_act_bytes": [u.activation_bytes_per_sample for u in units],
            "mem_cap_bytes": mem_cap_bytes or UNBOUNDED_MEM_BYTES,
            # fp32 parameters with Adam's two fp32 moments: 2 bytes of state per parameter byte.
            "optimizer_bytes_per_param_byte": 2.0,
        },
        # No configuration can use more ranks than every unit its own stage with one sample per rank.
        "max_devices": min(MAX_DEVICES, len(units) * desc.global_batch),
    }


def job_model(desc: ModelDescription, layout: Layout, mem_cap_bytes: float | None) -> dict[str, Any] | None:
    """The job's model for `layout` when every stage has the same DP (FlexTrain's shape), else
    None (the job is then membership-only: offers are admitted without a scale table)."""
    sizes = {len(stage.ranks) for stage in layout.stages}
    if len(sizes) != 1 or len(desc.units) > MAX_LAYERS:
        return None
    model = model_state(desc, layout.num_stages, sizes.pop(), mem_cap_bytes)
    try:
        if model is not None:
            state_from_dict(model)  # what the Core checks: a model it would refuse is not sent
    except ValueError:
        return None  # the job is created membership-only rather than not at all
    return model
