"""A described model as the planners see it: its units' costs, and what must match across nodes.

The describe run (`wire.worker_env.ModelDescription`) is plain data; the launcher, the Core's
rendezvous and the harness all turn it into placement inputs and compare two nodes' descriptions
the same way, so those rules live here, below all three.
"""

from __future__ import annotations

from typing import Any

from planners.placement import UnitCost
from wire.worker_env import ModelDescription


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
