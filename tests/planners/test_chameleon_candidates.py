"""Policy candidates: TorchFT, ReCycle, ElasWave (resize / migrate / DVFS), re-parallelisation."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from planners.chameleon.candidates import recycle, torchft
from planners.chameleon.elastic import elaswave
from planners.chameleon.reparallel import _plan, oobleck, reparallelise
from planners.chameleon.state import ClusterState, JobProfile, JobShape
from planners.chameleon.to_layout import candidate_layout
from planners.validation import validate

SHAPE = JobShape(pp=4, dp=3, micro_batch=2, global_batch=48)
PROFILE = JobProfile(
    layer_fwd_s=(0.01,) * 12,
    layer_bwd_s=(0.02,) * 12,
    layer_param_bytes=(1e8,) * 12,
    layer_act_bytes=(5e7,) * 12,
    mem_cap_bytes=16e9,
    p2p_s_per_sample=1e-4,
)
BASE = ClusterState(SHAPE, PROFILE)


def state(*failed: int) -> ClusterState:
    return replace(BASE, failed=frozenset(failed))


def covers_all_layers(cand, num_layers: int = 12) -> bool:
    for pipe in cand.pipelines:
        edges = [(s.layer_start, s.layer_stop) for s in pipe.stages]
        if edges[0][0] != 0 or edges[-1][1] != num_layers:
            return False
        if any(a[1] != b[0] or a[0] >= a[1] for a, b in zip(edges, edges[1:], strict=False)):
            return False
    return True


def test_torchft_drops_every_replica_that_lost_a_rank() -> None:
    cand = torchft(state(SHAPE.rank(1, 2)))
    assert cand.feasible
    pipe = cand.pipelines[0]
    assert [s.ranks for s in pipe.stages] == [(s, 8 + s) for s in range(4)]
    assert pipe.num_slots == math.ceil(48 / (2 * 2))
    assert cand.devices_used == 8
    assert not torchft(state(0, 5, 10)).feasible  # every replica touched


def test_recycle_reroutes_and_refuses_an_emptied_stage() -> None:
    cand = recycle(state(SHAPE.rank(0, 1)))
    assert cand.feasible and cand.transition_s == BASE.mttr.recycle_s
    assert recycle(state(SHAPE.rank(0, 1), SHAPE.rank(2, 1))).feasible
    dead = recycle(state(SHAPE.rank(0, 1), SHAPE.rank(1, 1), SHAPE.rank(2, 1)))
    assert not dead.feasible and "stage 1" in dead.reason


def test_whole_replica_loss_makes_recycle_and_elaswave_match_torchft() -> None:
    s = state(*[SHAPE.rank(2, k) for k in range(4)])
    ft = torchft(s).throughput
    assert recycle(s).throughput == pytest.approx(ft, rel=0.01)
    assert elaswave(s).throughput == pytest.approx(ft, rel=0.01)


def test_elaswave_plan_is_a_valid_layout_within_memory() -> None:
    s = state(SHAPE.rank(0, 0), SHAPE.rank(1, 3))
    cand = elaswave(s)
    assert cand.feasible and covers_all_layers(cand)
    pipe = cand.pipelines[0]
    assert pipe.stages[0].ranks == (4, 8) and pipe.stages[3].ranks == (3, 11)
    assert all(st.mem_bytes <= PROFILE.mem_cap_bytes for st in pipe.stages)
    assert all(PROFILE.freq_nominal_mhz <= st.freq_mhz <= PROFILE.freq_max_mhz for st in pipe.stages)
    report = validate(candidate_layout(cand, s), exhaustive=True)
    assert report.ok, report.problems


def test_migration_moves_layers_off_the_shrunk_stage_and_beats_resizing() -> None:
    s = state(SHAPE.rank(0, 1))
    resize = elaswave(s, migrate=False, dvfs=False)
    migrate = elaswave(s, migrate=True, dvfs=False)
    full = elaswave(s)
    assert resize.pipelines[0].boundaries == (3, 6, 9)
    assert migrate.pipelines[0].stages[1].layer_stop - migrate.pipelines[0].stages[1].layer_start < 3
    assert migrate.step_time_s < resize.step_time_s
    assert full.step_time_s <= migrate.step_time_s
    assert migrate.bytes_moved > 0 and resize.bytes_moved > 0  # optimizer shards of the lost rank remap


def test_resizing_alone_cannot_serve_an_emptied_stage_but_migration_can() -> None:
    s = state(*[SHAPE.rank(d, 2) for d in range(3)])
    assert not elaswave(s, migrate=False, dvfs=False).feasible
    cand = elaswave(s)
    assert cand.feasible and len(cand.pipelines[0].stages) == 3 and covers_all_layers(cand)


def test_dvfs_is_not_used_without_an_event_and_a_straggler_gets_fewer_layers() -> None:
    healthy = elaswave(BASE)
    assert {st.freq_mhz for st in healthy.pipelines[0].stages} == {PROFILE.freq_nominal_mhz}
    slow = elaswave(replace(BASE, slowdown=tuple((SHAPE.rank(d, 0), 1.5) for d in range(3))), dvfs=False)
    stage0 = slow.pipelines[0].stages[0]
    assert stage0.layer_stop - stage0.layer_start < 3


def test_reparallelise_uses_every_live_rank_with_matched_transfers() -> None:
    s = state(SHAPE.rank(1, 1))
    cand = reparallelise(s)
    assert cand.feasible and covers_all_layers(cand)
    used = sorted(r for p in cand.pipelines for st in p.stages for r in st.ranks)
    assert used == sorted(s.alive)
    assert sum(p.num_slots for p in cand.pipelines) == SHAPE.global_batch // SHAPE.micro_batch
    lengths = [len(p.stages) for p in cand.pipelines]
    in_order = _plan(s, "in-order", lengths, list(s.alive), matched=False, restart_s=0.0)
    assert cand.bytes_moved <= in_order.bytes_moved
    assert in_order.step_time_s == pytest.approx(cand.step_time_s)  # same shapes, same ranks' speed
    assert oobleck(s).feasible
