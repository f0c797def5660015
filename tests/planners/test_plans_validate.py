"""Property tests: every plan the planners produce validates (docs/architecture.md ("The central idea"), issue "plans always validate").

Two pipelines are exercised on random inputs:

* the ElasWave planner chain over `planners.layout.Layout`: random layout and losses ->
  `resize_after_loss` (§4.1) -> `rebalance_layers` (Algorithm 1, §4.2) -> `plan_straggler_frequency`
  (the DVFS model plan, §4.3) -> `validate(exhaustive=True)` with the memory model;
* the policy candidates of one cluster state: random job shape and failure set -> each
  single-pipeline policy (ElasWave and its ablations, TorchFT, ReCycle) -> `candidate_layout` ->
  `validate(exhaustive=True)`, with no failed rank used and the global batch covered exactly once
  per stage.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planners import Layout, validate
from planners.chameleon.policy import POLICIES
from planners.chameleon.state import ClusterState, JobProfile, JobShape
from planners.chameleon.to_layout import candidate_layout
from planners.costmodel import CostModel, LayerProfile, LinkModel, MemoryProfile
from planners.dataflow import micro_batch_sizes, resize_after_loss
from planners.dvfs import plan_straggler_frequency
from planners.partition import rebalance_layers
from tests.planners.strategies import layouts

F_REF, F_MAX = 1000, 1800
SINGLE_PIPELINE = ("elaswave", "elaswave-migrate", "elaswave-resize", "torchft", "recycle")


def _samples_by_stage(layout: Layout) -> list[list[int]]:
    """Every global sample each stage processes in one step (all ranks, all slots), explicitly."""
    out = []
    for s in layout.stages:
        samples: list[int] = []
        for m in range(layout.num_micro_batches):
            for r in s.ranks:
                got = layout.samples_of(r, m)
                samples.extend(range(got.start, got.stop))
        out.append(sorted(samples))
    return out


# ------------------------------------------------------- resize -> Algorithm 1 -> DVFS -> validate


@st.composite
def cost_models(draw: st.DrawFn, num_layers: int) -> CostModel:
    """Eq. (1) cost models with random per-layer times (monotone in micro-batch size), activations,
    P2P link and overlap factors."""
    sizes = tuple(sorted(draw(st.sets(st.integers(1, 8), min_size=1, max_size=3))))
    per_sample = draw(st.lists(st.floats(1e-3, 1e-1), min_size=num_layers, max_size=num_layers))
    bwd_ratio = draw(st.floats(1.0, 3.0))
    fwd = tuple(tuple(t * m for m in sizes) for t in per_sample)
    bwd = tuple(tuple(bwd_ratio * t * m for m in sizes) for t in per_sample)
    acts = tuple(draw(st.lists(st.floats(0.0, 50.0), min_size=num_layers, max_size=num_layers)))
    link = LinkModel(
        boundary_bytes_per_sample=draw(st.floats(0.0, 1e6)),
        bandwidth_bytes_per_s=1e8,
        latency_s=draw(st.floats(0.0, 1e-3)),
        sigma_f=draw(st.floats(0.0, 1.0)),
        sigma_b=draw(st.floats(0.0, 1.0)),
    )
    memory = MemoryProfile(act_bytes_per_sample=acts, stage_base_bytes=draw(st.floats(0.0, 100.0)))
    return CostModel(LayerProfile(sizes, fwd, bwd, ref_mhz=F_REF), memory, link)


@st.composite
def planner_inputs(draw: st.DrawFn) -> tuple[Layout, list[int], CostModel]:
    layout = draw(layouts(max_layers=10, max_stages=4, max_dp=4))
    lost: list[int] = []
    for s in layout.stages:  # any subset of losses that leaves every stage a survivor
        keep = draw(st.sampled_from(s.ranks))
        lost += [r for r in s.ranks if r != keep and draw(st.booleans())]
    cost = draw(cost_models(layout.num_layers))
    if draw(st.booleans()):  # memory caps: generous, tight or impossible
        scale = draw(st.sampled_from([0.01, 0.5, 1.0, 10.0]))
        full = [
            cost.memory.stage_base_bytes + float(cost.layer_mem_bytes(layout, p).sum())
            for p in range(layout.num_stages)
        ]
        layout = layout.replace(stage_mem_cap_bytes=tuple(max(scale * f, 1.0) for f in full))
    if draw(st.booleans()):  # some ranks already locked below the reference clock
        locked = draw(st.lists(st.sampled_from(layout.ranks()), unique=True, max_size=3))
        layout = layout.replace(
            frequencies_mhz=tuple(sorted((r, draw(st.integers(500, F_REF))) for r in locked))
        )
    return layout, lost, cost


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planner_inputs())
def test_resize_partition_dvfs_plan_always_validates(case: tuple[Layout, list[int], CostModel]) -> None:
    layout, lost, cost = case
    resized = resize_after_loss(layout, lost).layout
    graph = rebalance_layers(resized, cost)
    if not graph.partition.feasible:
        # Infeasible: the layers stay where they were, and the reason says why.
        assert graph.layout == resized and graph.reason.startswith("layers not moved: infeasible")
        return
    report = validate(graph.layout, cost, exhaustive=True)
    assert report.ok, report.problems
    assert math.isclose(max(cost.stage_times(graph.layout)), graph.partition.worst_stage_time, rel_tol=1e-9)
    dvfs = plan_straggler_frequency(graph.layout, cost, F_MAX)
    report = validate(dvfs.layout, cost, exhaustive=True)
    assert report.ok, report.problems
    assert dvfs.reason
    before, after = dict(graph.layout.frequencies_mhz), dict(dvfs.layout.frequencies_mhz)
    changed = {r for r in before.keys() | after.keys() if before.get(r) != after.get(r)}
    assert changed <= set(dvfs.layout.stages[dvfs.stage].ranks)  # only the straggler stage moves
    assert all(after[r] <= F_MAX for r in changed)
    # Everything but frequencies is untouched: same layers, ranks, split rules, batch.
    assert dvfs.layout.replace(frequencies_mhz=()) == graph.layout.replace(frequencies_mhz=())
    assert set(dvfs.layout.ranks()) == set(layout.ranks()) - set(lost)
    assert micro_batch_sizes(dvfs.layout) == micro_batch_sizes(resized)
    if dvfs.mhz is not None and changed:  # an up-clock never makes the straggler slower
        assert max(cost.stage_times(dvfs.layout)) <= max(cost.stage_times(graph.layout)) * (1 + 1e-9)
    for samples in _samples_by_stage(dvfs.layout):
        assert samples == list(range(layout.global_batch))


# ------------------------------------------ failure set -> policy candidate -> Layout -> validate


@st.composite
def cluster_states(draw: st.DrawFn) -> ClusterState:
    pp, dp, micro = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    shape = JobShape(
        pp=pp,
        dp=dp,
        micro_batch=micro,
        global_batch=dp * micro * draw(st.integers(1, 4)),
        tp=draw(st.sampled_from([1, 2])),
    )
    num_layers = draw(st.integers(pp, 8))
    per_layer = st.lists(st.floats(1e-3, 1e-1), min_size=num_layers, max_size=num_layers)
    fwd = draw(per_layer)
    profile = JobProfile(
        layer_fwd_s=tuple(fwd),
        layer_bwd_s=tuple(2 * t for t in fwd),
        layer_param_bytes=tuple(
            draw(st.lists(st.floats(1e6, 1e9), min_size=num_layers, max_size=num_layers))
        ),
        layer_act_bytes=(1e7,) * num_layers,
        mem_cap_bytes=draw(st.sampled_from([2e9, 1e10, 1e12])),
        p2p_s_per_sample=draw(st.floats(0.0, 1e-3)),
    )
    failed = draw(st.sets(st.integers(0, shape.num_ranks - 1), max_size=shape.num_ranks))
    slow = draw(
        st.lists(
            st.tuples(st.integers(0, shape.num_ranks - 1), st.floats(1.0, 2.0)),
            max_size=2,
            unique_by=lambda e: e[0],
        )
    )
    return ClusterState(shape, profile, failed=frozenset(failed), slowdown=tuple(slow))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster_states())
def test_single_pipeline_candidates_map_to_valid_layouts(state: ClusterState) -> None:
    for policy in SINGLE_PIPELINE:
        cand = POLICIES[policy](state)
        assert cand.reason  # feasible or not, every candidate says why
        if not cand.feasible:
            assert cand.throughput == 0.0
            continue
        layout = candidate_layout(cand, state)
        report = validate(layout, exhaustive=True)
        assert report.ok, (policy, report.problems)
        used = set(layout.ranks())
        assert not used & state.failed, (policy, sorted(used & state.failed))
        assert used <= set(range(state.shape.num_ranks))
        assert layout.global_batch == state.shape.global_batch == cand.samples_per_step
        for samples in _samples_by_stage(layout):  # the global batch, each sample once per stage
            assert samples == list(range(state.shape.global_batch)), policy
        assert cand.devices_used == len(used) * state.shape.tp or policy == "recycle"
        prof = state.profile
        assert all(prof.freq_nominal_mhz <= f <= prof.freq_max_mhz for _, f in layout.frequencies_mhz)
        assert all(s.mem_bytes <= prof.mem_cap_bytes for s in cand.pipelines[0].stages), policy
        if policy != "recycle":  # ReCycle's Layout spreads the rerouted samples over the peers
            sizes = micro_batch_sizes(layout)
            assert all(
                n <= max(s.samples_per_slot) for n, s in zip(sizes, cand.pipelines[0].stages, strict=True)
            ), policy


def test_candidate_layout_refuses_an_infeasible_candidate() -> None:
    shape = JobShape(pp=2, dp=1, micro_batch=1, global_batch=2)
    prof = JobProfile((0.01,) * 2, (0.02,) * 2, (1e6,) * 2, (1e6,) * 2, mem_cap_bytes=1e12)
    state = ClusterState(shape, prof, failed=frozenset({0}))
    cand = POLICIES["torchft"](state)
    assert not cand.feasible
    with pytest.raises(ValueError, match="only a feasible single-pipeline candidate"):
        candidate_layout(cand, state)
