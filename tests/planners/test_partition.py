"""Algorithm 1 (minimax layer partition under memory caps) against brute force (ElasWave §4.2)."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners import make_uniform_layout, validate
from planners.costmodel import CostModel, LayerProfile, LinkModel, MemoryProfile
from planners.dataflow import resize_after_loss
from planners.partition import apply_boundaries, rebalance_layers, solve_partition_request


def _brute_force(req: dict) -> tuple[bool, float]:
    cost, mem = np.asarray(req["layer_cost"]), np.asarray(req["layer_mem"])
    P, L = cost.shape
    best = math.inf
    for cuts in itertools.combinations(range(1, L), P - 1):
        edges = (0, *cuts, L)
        blocks = [range(edges[p], edges[p + 1]) for p in range(P)]
        if any(
            req["stage_mem_base"][p] + sum(mem[p][i] for i in b) > req["mem_cap"][p]
            for p, b in enumerate(blocks)
        ):
            continue
        best = min(
            best, max(req["stage_overhead"][p] + sum(cost[p][i] for i in b) for p, b in enumerate(blocks))
        )
    return math.isfinite(best), best


@st.composite
def requests(draw: st.DrawFn) -> dict:
    L = draw(st.integers(1, 8))
    P = draw(st.integers(1, L))

    # Integer-valued floats keep every sum exact, so ties and caps met with equality are decided
    # the same way by the solver (prefix sums) and the brute force (direct sums).
    def num(hi: int) -> st.SearchStrategy[float]:
        return st.integers(0, hi).map(float)

    return {
        "layer_cost": [[draw(num(10)) for _ in range(L)] for _ in range(P)],
        "stage_overhead": [draw(num(2)) for _ in range(P)],
        "layer_mem": [[draw(num(10)) for _ in range(L)] for _ in range(P)],
        "stage_mem_base": [draw(num(3)) for _ in range(P)],
        "mem_cap": [draw(num(40)) for _ in range(P)],
    }


@settings(max_examples=300, deadline=None)
@given(requests())
def test_algorithm1_equals_brute_force(req: dict) -> None:
    out = solve_partition_request(req)
    feasible, best = _brute_force(req)
    assert out["feasible"] == feasible, out["reason"]
    if not feasible:
        assert out["reason"].startswith("infeasible") and out["boundaries"] == []
        return
    assert math.isclose(out["worst_stage_time"], best, rel_tol=1e-9, abs_tol=1e-9)
    P, L = len(req["layer_cost"]), len(req["layer_cost"][0])
    edges = [0, *out["boundaries"], L]
    assert all(a < b for a, b in zip(edges, edges[1:], strict=False)) and len(edges) == P + 1
    for p in range(P):  # the reported boundaries realise the reported times and respect the caps
        block = range(edges[p], edges[p + 1])
        t = req["stage_overhead"][p] + sum(req["layer_cost"][p][i] for i in block)
        m = req["stage_mem_base"][p] + sum(req["layer_mem"][p][i] for i in block)
        assert math.isclose(out["stage_times"][p], t, rel_tol=1e-9, abs_tol=1e-9)
        assert math.isclose(out["stage_mem"][p], m, rel_tol=1e-9, abs_tol=1e-9)
        assert m <= req["mem_cap"][p] + 1e-9
    assert math.isclose(max(out["stage_times"]), out["worst_stage_time"], rel_tol=1e-12)


def test_known_instance_and_json_output() -> None:
    req = {
        "layer_cost": [[1, 1, 1, 1], [2, 2, 2, 2]],
        "stage_overhead": [0, 0],
        "layer_mem": [[1, 1, 1, 1], [1, 1, 1, 1]],
        "stage_mem_base": [0, 0],
        "mem_cap": [10, 10],
    }
    out = solve_partition_request(req)
    assert out["boundaries"] == [3] and out["worst_stage_time"] == 3.0 and out["stage_times"] == [3.0, 2.0]
    req["mem_cap"] = [2, 10]  # stage 1 may hold only 2 layers now
    out = solve_partition_request(req)
    assert out["boundaries"] == [2] and out["worst_stage_time"] == 4.0
    json.dumps(out)  # plain JSON types only


def test_infeasible_reasons() -> None:
    base = {
        "layer_cost": [[1, 1], [1, 1]],
        "stage_overhead": [0, 0],
        "layer_mem": [[5, 5], [1, 1]],
        "stage_mem_base": [0, 0],
        "mem_cap": [4, 10],
    }
    out = solve_partition_request(base)
    assert not out["feasible"] and out["worst_stage_time"] is None
    assert "stage(s) [0] cannot hold even one layer" in out["reason"]
    three = {
        **base,
        "layer_cost": [[1, 1]] * 3,
        "layer_mem": [[1, 1]] * 3,
        "stage_overhead": [0] * 3,
        "stage_mem_base": [0] * 3,
        "mem_cap": [9] * 3,
    }
    assert "3 stages cannot each hold a layer of a 2-layer model" in solve_partition_request(three)["reason"]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.pop("mem_cap"), "mem_cap is missing"),
        (lambda r: r.update(mem_cap=[1]), r"mem_cap must have one number per stage \(2\), got 1"),
        (
            lambda r: r.update(layer_cost=[[1, 2], [1]]),
            "layer_cost rows must all have the same number of layers",
        ),
        (lambda r: r.update(layer_mem=[[1, 2, 3], [1, 2, 3]]), "layer_mem must be 2 lists of 2 numbers"),
        (lambda r: r.update(stage_overhead=[1, "x"]), "stage_overhead must contain only numbers"),
        (
            lambda r: r.update(layer_cost=[[1, float("nan")], [1, 1]]),
            r"layer_cost\[0\] must contain only finite",
        ),
        (lambda r: r.update(extra=1), r"unknown field\(s\) \['extra'\]"),
        (lambda r: r.update(layer_cost=[]), "layer_cost must be a non-empty list"),
    ],
)
def test_malformed_requests_name_the_field(mutate: Callable[[dict[str, Any]], None], message: str) -> None:
    req = {
        "layer_cost": [[1, 1], [1, 1]],
        "stage_overhead": [0, 0],
        "layer_mem": [[1, 1], [1, 1]],
        "stage_mem_base": [0, 0],
        "mem_cap": [5, 5],
    }
    mutate(req)
    with pytest.raises(ValueError, match=message):
        solve_partition_request(req)
    with pytest.raises(ValueError, match="request must be a JSON object"):
        solve_partition_request([1])


def _cost_model(L: int) -> CostModel:
    rng = np.random.default_rng(7)
    base = rng.uniform(0.8, 1.2, size=L)
    profile = LayerProfile(
        (1, 2, 4),
        tuple((b, 2 * b, 4 * b) for b in base),
        tuple((2 * b, 4 * b, 8 * b) for b in base),
        ref_mhz=1000,
    )
    return CostModel(
        profile,
        MemoryProfile(act_bytes_per_sample=(1e6,) * L),
        LinkModel(boundary_bytes_per_sample=1e6, bandwidth_bytes_per_s=1e9, sigma_f=0.5, sigma_b=0.5),
    )


def test_rebalance_equals_brute_force_under_eq1() -> None:
    L = 9
    cost = _cost_model(L)
    lay = make_uniform_layout(L, 3, 3, global_batch=36, num_micro_batches=4, layer_numel=(1000,) * L)
    lay = resize_after_loss(lay, [4, 5]).layout  # stage 1 keeps one rank: triple micro-batch
    plan = rebalance_layers(lay, cost)
    assert validate(plan.layout, exhaustive=True).ok
    best = min(
        max(cost.stage_times(apply_boundaries(lay, cuts))) for cuts in itertools.combinations(range(1, L), 2)
    )
    assert math.isclose(plan.partition.worst_stage_time, best, rel_tol=1e-9)
    assert math.isclose(max(cost.stage_times(plan.layout)), best, rel_tol=1e-9)
    assert plan.layout.stages[1].num_layers < 3  # the shrunken stage gives layers away
    assert cost.step_time(plan.layout) < cost.step_time(lay)


def test_rebalance_respects_memory_caps() -> None:
    L = 8
    cost = _cost_model(L)
    lay = make_uniform_layout(L, 2, 2, 8, 2, layer_numel=(100,) * L)
    free = rebalance_layers(lay, cost)
    per_stage_mem = [cost.stage_memory_bytes(free.layout, p) for p in range(2)]
    capped = lay.replace(stage_mem_cap_bytes=(min(per_stage_mem) * 0.75, 1e12))
    plan = rebalance_layers(capped, cost)
    assert plan.partition.feasible
    assert cost.stage_memory_bytes(plan.layout, 0) <= capped.stage_mem_cap_bytes[0]  # type: ignore[index]
    assert validate(plan.layout, cost).ok
    impossible = rebalance_layers(lay.replace(stage_mem_cap_bytes=(1.0, 1.0)), cost)
    assert not impossible.partition.feasible and impossible.layout == lay.replace(
        stage_mem_cap_bytes=(1.0, 1.0)
    )


def test_apply_boundaries_rejects_bad_boundaries() -> None:
    lay = make_uniform_layout(6, 3, 1, 3, 1)
    assert [(s.layer_start, s.layer_stop) for s in apply_boundaries(lay, (1, 5)).stages] == [
        (0, 1),
        (1, 5),
        (5, 6),
    ]
    with pytest.raises(ValueError, match="3 stages need 2 boundaries"):
        apply_boundaries(lay, (3,))
    with pytest.raises(ValueError, match="must increase strictly"):
        apply_boundaries(lay, (4, 4))


def test_slow_clock_stage_gets_fewer_layers() -> None:
    L = 12
    cost = _cost_model(L)
    lay = make_uniform_layout(L, 3, 2, 12, 3, layer_numel=(10,) * L)
    even = rebalance_layers(lay, cost).layout
    slowed = rebalance_layers(
        lay.replace(frequencies_mhz=((2, 500), (3, 500))), cost
    )  # stage 1 at half clock
    assert slowed.layout.stages[1].num_layers < even.stages[1].num_layers
    best = min(
        max(cost.stage_times(apply_boundaries(slowed.layout, cuts)))
        for cuts in itertools.combinations(range(1, L), 2)
    )
    assert math.isclose(slowed.partition.worst_stage_time, best, rel_tol=1e-9)
