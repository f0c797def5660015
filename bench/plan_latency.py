"""Single-failure planning latency: the whole ElasWave plan, stage by stage, and the policy path.

Table 1. For every model depth L, pipeline depth P and device count N, one rank of stage 1 fails
and the whole ElasWave plan is built on the post-failure layout, each stage timed on its own:

  dataflow   `resize_after_loss` (§4.1)
  partition  `rebalance_layers`: Algorithm 1 over the eq. (1) cost model with memory caps (§4.2)
  dvfs       `plan_straggler_frequency`: the model-based first guess for the residual straggler (§4.3)
  migration  `migration_cost` old -> new: ZeRO elements (bytes) each stage sends or receives (§6.3)
  rng        `rng_plan` old -> new (§4.4; placement-invariant keys: nothing to move)
  validate   `ensure_valid` with the memory model (docs/architecture.md ("The central idea"))
  plan       predicted step time and stage memory, `Plan` assembled and serialised to JSON

`total` is their sum. Outside the total, `diff` is `diff_layouts(old, new)` with its full ZeRO
interval list, what an executor derives from the plan.

Table 2 (L = 128, P = 32 only): the `elaswave plan` policy path for the same failure, i.e. each
candidate of `planners.chameleon` (ElasWave, Chameleon's re-parallelisation, ReCycle, TorchFT)
and `planners.cli.plan` (all four, eq. 8, JSON) on a state of N / P replicas.

Median over `--repeats` runs, in ms.

    .venv/bin/python -m bench.plan_latency [--layers ...] [--stages ...] [--devices 1000 10000 100000]
                                           [--repeats 5] [--policy-devices ...]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from planners import Plan, diff_layouts, ensure_valid, make_uniform_layout
from planners.chameleon.policy import POLICIES
from planners.cli import plan as cli_plan
from planners.costmodel import CostModel, LayerProfile, LinkModel, MemoryProfile
from planners.dataflow import resize_after_loss
from planners.dvfs import plan_straggler_frequency
from planners.partition import rebalance_layers
from planners.rng import rng_plan
from planners.zero import migration_cost

GIB = 1024**3
LAYER_NUMEL = 200_000_000
F_MAX_MHZ = 2000
STAGES = ("dataflow", "partition", "dvfs", "migration", "rng", "validate", "plan")
POLICY_COLUMNS = ("elaswave", "reparallelise", "recycle", "torchft")


def synthetic_cost_model(num_layers: int, seed: int = 0) -> CostModel:
    """Llama-like layers (~200M params each) with +-10% jitter, profiled at micro-batch 1..16."""
    rng = np.random.default_rng(seed)
    sizes = (1, 2, 4, 8, 16)
    base = rng.uniform(0.9, 1.1, size=num_layers) * 4e-3
    fwd = tuple(tuple(b * m for m in sizes) for b in base)
    bwd = tuple(tuple(2 * b * m for m in sizes) for b in base)
    memory = MemoryProfile(act_bytes_per_sample=(64e6,) * num_layers, stage_base_bytes=2 * GIB)
    link = LinkModel(
        boundary_bytes_per_sample=16e6, bandwidth_bytes_per_s=25e9, latency_s=2e-5, sigma_f=0.6, sigma_b=0.6
    )
    return CostModel(LayerProfile(sizes, fwd, bwd, ref_mhz=1500), memory, link)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - start) * 1e3


def whole_plan(layout: Any, failed: int, cost: CostModel) -> tuple[Plan, dict[str, float]]:
    """The ElasWave plan for losing `failed`, with the milliseconds of each stage."""
    ms: dict[str, float] = {}
    flow, ms["dataflow"] = _timed(lambda: resize_after_loss(layout, [failed]))
    graph, ms["partition"] = _timed(lambda: rebalance_layers(flow.layout, cost))
    dvfs, ms["dvfs"] = _timed(lambda: plan_straggler_frequency(graph.layout, cost, F_MAX_MHZ))
    new = dvfs.layout
    moved, ms["migration"] = _timed(lambda: migration_cost(layout, new))
    rng, ms["rng"] = _timed(lambda: rng_plan(layout, layout, new))
    _, ms["validate"] = _timed(lambda: ensure_valid(new, cost))

    def assemble() -> tuple[Plan, str]:
        plan = Plan(
            1,
            layout,
            new,
            (flow.reason, graph.reason, dvfs.reason, moved.reason, rng.reason),
            cost.step_time(new),
            tuple(cost.stage_memory_bytes(new, p) for p in range(new.num_stages)),
        )
        return plan, plan.to_json()

    (plan, _), ms["plan"] = _timed(assemble)
    ms["total"] = sum(ms[k] for k in STAGES)
    return plan, ms


def measure(num_layers: int, num_stages: int, devices: int, repeats: int) -> dict[str, float]:
    dp = devices // num_stages
    micro_per_rank, num_micro = 4, 2 * num_stages
    cost = synthetic_cost_model(num_layers)
    layout = make_uniform_layout(
        num_layers,
        num_stages,
        dp,
        global_batch=dp * num_micro * micro_per_rank,
        num_micro_batches=num_micro,
        layer_numel=(LAYER_NUMEL,) * num_layers,
    )
    layout = layout.replace(stage_mem_cap_bytes=(64.0 * GIB,) * num_stages)
    failed = layout.stages[1].ranks[0]
    rows: dict[str, list[float]] = {k: [] for k in (*STAGES, "total", "diff")}
    for _ in range(repeats):
        gc.collect()  # every repeat starts from the same heap: a pending collection is not charged to it
        plan, ms = whole_plan(layout, failed, cost)
        _, ms["diff"] = _timed(partial(diff_layouts, layout, plan.new))
        for key in rows:
            rows[key].append(ms[key])
    return {k: statistics.median(v) for k, v in rows.items()}


def policy_state(num_layers: int, num_stages: int, devices: int) -> dict[str, Any]:
    """state.json of the same job (N / P replicas, 4 samples per rank, 2P micro-batches), rank 1
    (stage 1 of replica 0) failed."""
    dp = devices // num_stages
    return {
        "job": {
            "pp": num_stages,
            "dp": dp,
            "micro_batch": 4,
            "global_batch": dp * 4 * 2 * num_stages,
            "tp": 1,
        },
        "profile": {
            "num_layers": num_layers,
            "layer_fwd_s": 4e-3,
            "layer_bwd_s": 8e-3,
            "layer_param_bytes": 2.0 * LAYER_NUMEL,
            "layer_act_bytes": 64e6,
            "mem_cap_bytes": 64.0 * GIB,
            "p2p_s_per_sample": 16e6 / 25e9,
        },
        "failed_ranks": [1],
        "policies": list(POLICY_COLUMNS),
    }


def measure_policies(num_layers: int, num_stages: int, devices: int, repeats: int) -> dict[str, float]:
    from planners.chameleon.schema import state_from_dict

    request = policy_state(num_layers, num_stages, devices)
    rows: dict[str, list[float]] = {k: [] for k in (*POLICY_COLUMNS, "cli")}
    for _ in range(repeats):
        gc.collect()
        state, _ = state_from_dict(request)  # fresh state: nothing cached on it between repeats
        for name in POLICY_COLUMNS:
            _, ms = _timed(partial(POLICIES[name], state))
            rows[name].append(ms)
        _, ms = _timed(lambda: cli_plan(request))
        rows["cli"].append(ms)
    return {k: statistics.median(v) for k, v in rows.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[32, 80, 128])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--devices", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--policy-devices",
        type=int,
        nargs="*",
        default=None,
        help="device counts for the policy-path table (default: --devices; none to skip)",
    )
    args = parser.parse_args(argv)
    print(
        "| L | P | devices | DP/stage | "
        + " | ".join(f"{k} ms" for k in STAGES)
        + " | **total ms** | diff ms |"
    )
    print("|---:|---:|---:|---:|" + "---:|" * (len(STAGES) + 2))
    for num_layers in args.layers:
        for num_stages in args.stages:
            for devices in args.devices:
                r = measure(num_layers, num_stages, devices, args.repeats)
                print(
                    f"| {num_layers} | {num_stages} | {devices} | {devices // num_stages} | "
                    + " | ".join(f"{r[k]:.2f}" for k in STAGES)
                    + f" | **{r['total']:.2f}** | {r['diff']:.1f} |"
                )
    policy_devices = args.devices if args.policy_devices is None else args.policy_devices
    if policy_devices:
        L, P = max(args.layers), max(args.stages)
        print()
        print(f"`elaswave plan` policy path, L = {L}, P = {P}, rank 1 failed (median of {args.repeats}, ms):")
        print()
        print(
            "| devices | replicas | " + " | ".join(POLICY_COLUMNS) + " | `plan()` (all four + eq. 8 + JSON) |"
        )
        print("|---:|---:|" + "---:|" * (len(POLICY_COLUMNS) + 1))
        for devices in policy_devices:
            r = measure_policies(L, P, devices, args.repeats)
            print(
                f"| {devices} | {devices // P} | "
                + " | ".join(f"{r[k]:.1f}" for k in POLICY_COLUMNS)
                + f" | {r['cli']:.1f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
