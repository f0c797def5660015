"""The model a launcher registers with its job: its describe run as FlexTrain's profile.

`elaswave run` already describes the script's model (units, parameter bytes, forward and
backward seconds per sample, activation bytes; `elaswave.launcher_describe`). Registered with the
job (the `model` of `POST /api/v1/jobs`, the `elaswave plan` state.json), it gives the Core a
scale table (FlexTrain §4.4), so `OfferResources` judges offers to launcher jobs by eq. 16 as it
does for any job with a model (issue 27: offers to `run --core` jobs were accepted unjudged).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elaswave.worker_env import ModelDescription

if TYPE_CHECKING:
    from planners.layout import Layout

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
    from planners.chameleon.schema import state_from_dict  # noqa: PLC0415 - planners only here

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
