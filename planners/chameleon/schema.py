"""The JSON of `elaswave plan`: state.json in, the chosen plan and every alternative out.

state.json (all times in seconds, bytes per device after TP):

    {
      "job": {"pp": 8, "dp": 3, "micro_batch": 1, "global_batch": 768, "tp": 4},
      "profile": {
        "num_layers": 48,                       # needed when the per-layer fields are scalars
        "layer_fwd_s": 0.0124,                  # per sample, per layer: a number or a list of L
        "layer_bwd_s": 0.0248,
        "layer_param_bytes": 346030080,
        "layer_act_bytes": 285212672,           # stored activations per sample per layer
        "mem_cap_bytes": 34359738368,           # per-device memory cap
        "p2p_s_per_sample": 0.0007,             # optional, default 0
        "allreduce_bytes_per_s": 2.5e10,        # optional
        "migrate_bytes_per_s": 2.5e10,          # optional
        "optimizer_bytes_per_param_byte": 6,    # optional (fp32 master + Adam over bf16)
        "freq_nominal_mhz": 1400, "freq_max_mhz": 1650, "freq_step_mhz": 10   # optional
      },
      "boundaries": [6, 12, 18, 24, 30, 36, 42],  # optional current layout (Alg. 1's b_1..b_{P-1})
      "failed_ranks": [0, 1],                     # rank id = replica * pp + stage
      "slow_ranks": [[5, 1.3]],                   # optional [rank, slowdown factor]
      "expected_time_to_next_event_s": 3600,      # eq. 8 horizon
      "policies": ["elaswave", "reparallelise", "recycle", "torchft"],   # optional
      "mttr": {"torchft_restart_s": 20},          # optional overrides of MttrModel
      "max_devices": 192                          # `plan scale-table` only: largest allocation
    }

Each stage's ranks are the job's DP replicas of that stage (`dp` per stage, ids as above).
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from planners.chameleon.policy import DEFAULT_CHOICES, POLICIES, PolicyDecision
from planners.chameleon.state import Candidate, ClusterState, JobProfile, JobShape, MttrModel

PER_LAYER = ("layer_fwd_s", "layer_bwd_s", "layer_param_bytes", "layer_act_bytes")
PROFILE_SCALARS = (
    "mem_cap_bytes",
    "p2p_s_per_sample",
    "allreduce_bytes_per_s",
    "migrate_bytes_per_s",
    "optimizer_bytes_per_param_byte",
)
PROFILE_INTS = ("freq_nominal_mhz", "freq_max_mhz", "freq_step_mhz")


def state_from_dict(d: Any) -> tuple[ClusterState, tuple[str, ...]]:
    """Parse state.json; every error is a ValueError that names the field."""
    _obj(d, "state")
    known = {
        "job",
        "profile",
        "boundaries",
        "failed_ranks",
        "slow_ranks",
        "expected_time_to_next_event_s",
        "policies",
        "mttr",
        "max_devices",
    }
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"state: unknown field(s) {unknown}")
    job = _obj(_need(d, "job", "state"), "job")
    if set(job) - {"pp", "dp", "micro_batch", "global_batch", "tp"}:
        raise ValueError(
            f"job: unknown field(s) {sorted(set(job) - {'pp', 'dp', 'micro_batch', 'global_batch', 'tp'})}"
        )
    try:
        shape = JobShape(
            **{k: _int(job, k, "job") for k in ("pp", "dp", "micro_batch", "global_batch")},
            tp=_int(job, "tp", "job") if "tp" in job else 1,
        )
    except ValueError as e:
        raise ValueError(f"job: {e}") from None
    profile = _profile(_obj(_need(d, "profile", "state"), "profile"))
    policies = tuple(_str_list(d.get("policies", list(DEFAULT_CHOICES)), "policies"))
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise ValueError(f"policies: unknown {bad}; choose from {sorted(POLICIES)}")
    mttr_d = _obj(d.get("mttr", {}), "mttr")
    names = {f.name for f in fields(MttrModel)}
    if set(mttr_d) - names:
        raise ValueError(f"mttr: unknown field(s) {sorted(set(mttr_d) - names)}")
    mttr = MttrModel(**{k: _num(mttr_d, k, "mttr") for k in mttr_d})
    slow = tuple(_slow_entry(e) for e in _list(d.get("slow_ranks", []), "slow_ranks"))
    try:
        state = ClusterState(
            shape,
            profile,
            failed=frozenset(
                _as_int(r, "failed_ranks") for r in _list(d.get("failed_ranks", []), "failed_ranks")
            ),
            slowdown=slow,
            boundaries=tuple(_as_int(b, "boundaries") for b in _list(d.get("boundaries", []), "boundaries")),
            expected_time_to_next_event_s=_num(d, "expected_time_to_next_event_s", "state")
            if "expected_time_to_next_event_s" in d
            else 3600.0,
            mttr=mttr,
        )
    except ValueError as e:
        raise ValueError(f"state: {e}") from None
    return state, policies


def _profile(p: dict[str, Any]) -> JobProfile:
    n = _int(p, "num_layers", "profile") if "num_layers" in p else None
    per_layer: dict[str, Any] = {}  # field -> tuple of per-layer values
    for k in PER_LAYER:
        v = _need(p, k, "profile")
        if isinstance(v, list):
            per_layer[k] = tuple(_as_num(x, f"profile.{k}") for x in v)
        elif n is None:
            raise ValueError(f"profile.{k} is a single number, so profile.num_layers is required")
        else:
            per_layer[k] = (_as_num(v, f"profile.{k}"),) * n
        if n is not None and len(per_layer[k]) != n:
            raise ValueError(f"profile.{k} has {len(per_layer[k])} entries but num_layers is {n}")
    extra = sorted(set(p) - set(PER_LAYER) - set(PROFILE_SCALARS) - set(PROFILE_INTS) - {"num_layers"})
    if extra:
        raise ValueError(f"profile: unknown field(s) {extra}")
    kwargs: dict[str, Any] = {k: _num(p, k, "profile") for k in PROFILE_SCALARS if k in p}
    kwargs.update({k: _int(p, k, "profile") for k in PROFILE_INTS if k in p})
    if "mem_cap_bytes" not in kwargs:
        raise ValueError("profile.mem_cap_bytes is missing")
    try:
        return JobProfile(**per_layer, **kwargs)
    except ValueError as e:
        raise ValueError(f"profile: {e}") from None


def decision_to_dict(decision: PolicyDecision, state: ClusterState, fault_free: Candidate) -> dict[str, Any]:
    """The chosen plan with its predictions and every alternative's eq. (8) score."""
    chosen = decision.chosen
    alive_devices = len(state.alive) * state.shape.tp
    return {
        "policy": chosen.policy if chosen.feasible else None,
        "reason": decision.reason,
        "plan": candidate_to_dict(chosen, state, fault_free) if chosen.feasible else None,
        "alive_devices": alive_devices,
        "fault_free_samples_per_s": _finite(fault_free.throughput),
        "alternatives": [
            {
                "policy": s.candidate.policy,
                "feasible": s.candidate.feasible,
                "score": _finite(s.score),
                "effective_ratio": s.effective_ratio,
                "samples_per_s": _finite(s.candidate.throughput),
                "step_time_s": _finite(s.candidate.step_time_s),
                "transition_s": s.candidate.transition_s,
                "bytes_moved": s.candidate.bytes_moved,
                "reason": s.candidate.reason,
            }
            for s in decision.scored
        ],
    }


def candidate_to_dict(c: Candidate, state: ClusterState, fault_free: Candidate) -> dict[str, Any]:
    alive = len(state.alive) / state.shape.num_ranks
    lse = c.throughput / (fault_free.throughput * alive) if fault_free.throughput and alive else None
    return {
        "pipelines": [
            {
                "num_micro_batches": p.num_slots,
                "boundaries": list(p.boundaries),
                "stages": [
                    {
                        "layers": [s.layer_start, s.layer_stop],
                        "ranks": list(s.ranks),
                        "micro_batch_sizes": list(s.samples_per_slot),
                        "freq_mhz": s.freq_mhz,
                        "ministep_s": s.ministep_s,
                        "mem_bytes": s.mem_bytes,
                    }
                    for s in p.stages
                ],
            }
            for p in c.pipelines
        ],
        "predicted_step_time_s": c.step_time_s,
        "samples_per_s": c.throughput,
        "lse": lse,
        "memory_per_stage_bytes": [[s.mem_bytes for s in p.stages] for p in c.pipelines],
        "bytes_moved": c.bytes_moved,
        "transition_s": c.transition_s,
        "devices_used": c.devices_used,
    }


def _slow_entry(e: Any) -> tuple[int, float]:
    if not isinstance(e, list) or len(e) != 2:
        raise ValueError(f"slow_ranks entries must be [rank, slowdown factor], got {e!r}")
    return _as_int(e[0], "slow_ranks"), _as_num(e[1], "slow_ranks")


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _obj(x: Any, where: str) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(x).__name__}")
    return x


def _need(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ValueError(f"{where}.{key} is missing")
    return d[key]


def _list(x: Any, where: str) -> list[Any]:
    if not isinstance(x, list):
        raise ValueError(f"{where} must be a list, got {type(x).__name__}")
    return x


def _str_list(x: Any, where: str) -> list[str]:
    items = _list(x, where)
    if any(not isinstance(i, str) for i in items):
        raise ValueError(f"{where} must be a list of strings")
    return items


def _as_int(x: Any, where: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"{where} must contain integers, got {x!r}")
    return x


def _as_num(x: Any, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        raise ValueError(f"{where} must be a finite number, got {x!r}")
    return float(x)


def _int(d: dict[str, Any], key: str, where: str) -> int:
    return _as_int(_need(d, key, where), f"{where}.{key}")


def _num(d: dict[str, Any], key: str, where: str) -> float:
    return _as_num(_need(d, key, where), f"{where}.{key}")
