"""Single-failure planning latency: dataflow resize + Algorithm 1 partition + validation.

For every model depth L, pipeline depth P and device count N, one rank of stage 1 fails and the
ElasWave planner path runs on the post-failure layout: `resize_after_loss` (§4.1),
`rebalance_layers` (Alg. 1 over the eq. (1) cost model with memory caps, §4.2) and `validate`
with the memory model. Prints a markdown table of the median over `--repeats` runs.

    .venv/bin/python -m bench.plan_latency [--devices 1000 10000 100000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from planners import ensure_valid, make_uniform_layout
from planners.costmodel import CostModel, LayerProfile, LinkModel, MemoryProfile
from planners.dataflow import resize_after_loss
from planners.partition import rebalance_layers

GIB = 1024**3


def synthetic_cost_model(num_layers: int, seed: int = 0) -> CostModel:
    """Llama-like layers (~200M params each) with +-10% jitter, profiled at micro-batch 1..16."""
    rng = np.random.default_rng(seed)
    sizes = (1, 2, 4, 8, 16)
    base = rng.uniform(0.9, 1.1, size=num_layers) * 4e-3
    fwd = tuple(tuple(b * m for m in sizes) for b in base)
    bwd = tuple(tuple(2 * b * m for m in sizes) for b in base)
    memory = MemoryProfile(act_bytes_per_sample=(64e6,) * num_layers, stage_base_bytes=2 * GIB)
    link = LinkModel(boundary_bytes_per_sample=16e6, bandwidth_bytes_per_s=25e9, latency_s=2e-5,
                     sigma_f=0.6, sigma_b=0.6)
    return CostModel(LayerProfile(sizes, fwd, bwd, ref_mhz=1500), memory, link)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - start) * 1e3


def measure(num_layers: int, num_stages: int, devices: int, repeats: int) -> dict[str, float]:
    dp = devices // num_stages
    micro_per_rank, num_micro = 4, 2 * num_stages
    cost = synthetic_cost_model(num_layers)
    layout = make_uniform_layout(num_layers, num_stages, dp, global_batch=dp * num_micro * micro_per_rank,
                                 num_micro_batches=num_micro, layer_numel=(200_000_000,) * num_layers)
    layout = layout.replace(stage_mem_cap_bytes=(64.0 * GIB,) * num_stages)
    failed = layout.stages[1].ranks[0]
    rows: dict[str, list[float]] = {"dataflow": [], "partition": [], "validate": [], "total": []}
    for _ in range(repeats):
        flow, t_flow = _timed(lambda: resize_after_loss(layout, [failed]))
        graph, t_part = _timed(lambda flow=flow: rebalance_layers(flow.layout, cost))
        _, t_val = _timed(lambda graph=graph: ensure_valid(graph.layout, cost))
        for key, value in zip(rows, (t_flow, t_part, t_val, t_flow + t_part + t_val), strict=True):
            rows[key].append(value)
    return {k: statistics.median(v) for k, v in rows.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[32, 80, 128])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--devices", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print("| L | P | devices | DP/stage | dataflow ms | partition ms | validate ms | total ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for num_layers in args.layers:
        for num_stages in args.stages:
            for devices in args.devices:
                r = measure(num_layers, num_stages, devices, args.repeats)
                print(f"| {num_layers} | {num_stages} | {devices} | {devices // num_stages} | "
                      f"{r['dataflow']:.2f} | {r['partition']:.2f} | {r['validate']:.2f} | {r['total']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
