"""The Core's ElasWave policy sizes the backup redundancy k from the node losses it saw and the
registered model's memory cap; the job view shows k and why (planners.redundancy)."""

from __future__ import annotations

import json

from core_service.config import FailSlowSettings
from core_service.elaswave_policy import ElasWavePolicy
from core_service.failslow import FailSlowDetector
from core_service.job_snapshot import JobSnapshot, WorkerView
from core_service.job_view import job_summary
from core_service.jobs import Job
from core_service.rendezvous import _placement
from planners.layout import Plan, make_uniform_layout
from wire import worker_env as we

LAYOUT = make_uniform_layout(num_layers=4, num_stages=2, dp=3, global_batch=12, num_micro_batches=2)
MODEL = {
    "job": {"pp": 2, "dp": 3, "micro_batch": 2, "global_batch": 12},
    "profile": {
        "layer_fwd_s": [1.0] * 4,
        "layer_bwd_s": [2.0] * 4,
        "layer_param_bytes": [1.0] * 4,
        "layer_act_bytes": [0.0] * 4,
        "mem_cap_bytes": 1e12,
    },
}


def snapshot(lost: tuple[int, ...], model: bool) -> JobSnapshot:
    def view(r: int, state: str) -> WorkerView:
        return WorkerView(f"w{r}", f"host{r}", LAYOUT.stage_of_rank(r), 0, r, state)

    return JobSnapshot(
        "j",
        0,
        LAYOUT,
        tuple(view(r, "RUNNING") for r in LAYOUT.ranks() if r not in lost),
        tuple(view(r, "LOST") for r in lost),
        tuple(f"worker_lost:w{r}" for r in lost),
        json.dumps(MODEL) if model else None,
    )


def test_a_burst_of_two_hosts_raises_k_when_the_cap_is_known() -> None:
    policy = ElasWavePolicy(clock=lambda: 50.0)
    decision = policy.decide(snapshot((1, 4), model=True))
    assert decision.action == "publish" and decision.layout is not None
    assert decision.layout.backup_copies == 2
    said = [r for r in decision.reasons if r.startswith("backup copies k=")]
    assert said and "largest burst 2 node(s)" in said[0], decision.reasons
    # The job view reads k and its reason from the published plan.
    job = Job("j", "", 6, 0.0, FailSlowDetector(FailSlowSettings()))
    job.layout_json = decision.layout.to_json()
    job.last_plan = Plan(1, LAYOUT, decision.layout, decision.reasons, 1.0)
    view = job_summary(job)
    assert view["backup_copies"] == 2 and view["backup_copies_reason"] == said[0]


def test_without_a_memory_cap_k_stays_one_and_says_why() -> None:
    decision = ElasWavePolicy(clock=lambda: 50.0).decide(snapshot((1, 4), model=False))
    assert decision.layout is not None and decision.layout.backup_copies == 1
    assert any("no memory cap is known" in r for r in decision.reasons), decision.reasons


def test_losses_are_remembered_once_per_worker() -> None:
    times = iter([10.0, 40.0, 5000.0])
    policy = ElasWavePolicy(clock=lambda: next(times))
    policy.decide(snapshot((1,), model=True))
    policy.decide(snapshot((1, 4), model=True))  # rank 4 30 s later: one burst of two hosts
    history = policy.losses.history("j")
    assert [(loss.time_s, sorted(loss.nodes)) for loss in history] == [(10.0, ["host1"]), (40.0, ["host4"])]


def test_the_rendezvous_places_a_job_with_the_prior_copies_where_memory_allows() -> None:
    desc = we.ModelDescription(
        units=tuple(we.UnitDescription(f"u{i}", 1024, 4096, 1e-4, 2e-4, 64) for i in range(4)),
        global_batch=16,
        micro_batches=2,
        dataset_len=64,
        steps=6,
        fingerprints={},
    )
    four = _placement(desc, 4, 2, 2, 2.0**34)  # 4 nodes, a 16 GiB cap: room for two copies
    assert four.layout.backup_copies == 2
    assert "backup copies k=2" in four.reason and "bursts of 2 nodes assumed possible" in four.reason
    two = _placement(desc, 2, 2, 2, 2.0**34)  # 2 nodes: no second failure domain for a copy
    assert two.layout.backup_copies == 1 and "only 2 failure domain(s)" in two.reason
    unknown = _placement(desc, 4, 2, 2, None)  # no cap: nothing says a second copy fits
    assert unknown.layout.backup_copies == 1 and "no memory cap is known" in unknown.reason
