"""The Core and the re-protection windows the workers report (issue 23 item 2,
`core_service.backup_windows`): a loss inside the committed layout's open window is planned as
a RESTORE, the job view shows the window, and the ExecutorService checks what it is sent.

The first tests are the Core's pure decisions on a Job; the last one runs a real Core process
with raw agents and acknowledges plans as the executors do, windows included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypedDict, Unpack

import grpc
import pytest

from core_service.backup_windows import record_window, unprotected_pairs, windows_view
from core_service.config import FailSlowSettings
from core_service.executor_service import backup_window_of
from core_service.failslow import FailSlowDetector
from core_service.grpc_util import RpcError
from core_service.jobs import Job
from core_service.recovery import choose_mode
from planners.applicability import judge
from planners.backup import backup_holder_sets, first_surviving
from planners.dataflow import resize_after_loss
from planners.layout import Layout, Plan, PlanMode, make_uniform_layout
from planners.reprotect import ReprotectWindow, reseed_pairs
from tests.core.procs import CoreProcess, create_job, new_token, wait_until
from tests.core.test_plan_flow import RawAgent
from wire.v1 import executor_pb2, executor_pb2_grpc

L0 = make_uniform_layout(
    num_layers=4, num_stages=2, dp=3, global_batch=12, num_micro_batches=2, layer_numel=(100, 100, 100, 100)
)
L1 = resize_after_loss(L0, {5}).layout  # stage 1 = (3, 4): its ring re-seeded


def job_committed_on(layout: Layout, epoch: int) -> Job:
    job = Job("j", "", 6, 0.0, FailSlowDetector(FailSlowSettings()))
    job.committed_layout_json, job.committed_epoch = layout.to_json(), epoch
    return job


def test_a_loss_in_the_open_window_is_planned_as_restore_and_in_place_once_closed() -> None:
    job = job_committed_on(L1, 1)
    pairs = reseed_pairs(L0, L1)
    assert pairs == {(3, 4), (4, 3)}
    record_window(job, 1, ReprotectWindow(1, tuple(sorted(pairs)), 4, 5), closed=False)
    lose_3 = resize_after_loss(L1, {3}).layout
    assert judge(L1, lose_3).in_place  # 4 keeps 3's copy once it is re-seeded
    mode, why = choose_mode(job, L1, lose_3, None)
    assert mode == PlanMode.RESTORE and "re-protection window" in why[0], why
    # a loss whose copy the plan did not move is still in place
    assert choose_mode(job, L1, resize_after_loss(L1, {1}).layout, None)[0] == PlanMode.IN_PLACE
    view = windows_view(job)
    assert view["backup_window"] == {
        "epoch": 1,
        "owners": [3, 4],
        "pairs": [[3, 4], [4, 3]],
        "from_step": 4,
        "until_step": 5,
        "closed_step": None,
        "superseded_by": None,
        "state": "open",
    }
    record_window(job, 1, ReprotectWindow(1, tuple(sorted(pairs)), 4, 5, closed_step=5), closed=True)
    assert unprotected_pairs(job) == frozenset()
    assert choose_mode(job, L1, lose_3, None)[0] == PlanMode.IN_PLACE
    assert windows_view(job)["backup_window"] is None
    assert windows_view(job)["backup_windows"][0]["state"] == "closed"


def test_reports_merge_and_only_the_committed_epochs_window_counts() -> None:
    job = job_committed_on(L1, 1)
    record_window(job, 1, ReprotectWindow(1, ((3, 4),), 4, 5), closed=False)
    record_window(job, 1, ReprotectWindow(1, ((4, 3),), 4, 5), closed=False)  # a joiner's view
    assert unprotected_pairs(job) == {(3, 4), (4, 3)}
    record_window(job, 2, ReprotectWindow(2, ((0, 1),), 6, 7), closed=False)  # not committed yet
    assert unprotected_pairs(job) == {(3, 4), (4, 3)}
    assert [w["state"] for w in windows_view(job)["backup_windows"]] == ["pending", "open"]
    job.committed_epoch = 2
    assert unprotected_pairs(job) == {(0, 1)}
    assert [w["state"] for w in windows_view(job)["backup_windows"]] == ["open", "superseded"]


def ack(
    stub: executor_pb2_grpc.ExecutorServiceStub,
    agents: dict[int, RawAgent],
    rank: int,
    epoch: int,
    phase: executor_pb2.PlanPhase,
    window: ReprotectWindow | None = None,
) -> executor_pb2.AckPlanPhaseResponse:
    request = executor_pb2.AckPlanPhaseRequest(
        job="train", worker_id=f"w{rank}", epoch=epoch, phase=phase, phase_time_s=0.01
    )
    if window is not None:
        request.backup_window.CopyFrom(
            executor_pb2.BackupWindow(
                pairs=[executor_pb2.BackupPair(owner=o, holder=h) for o, h in window.pairs],
                from_step=window.from_step,
                until_step=window.until_step,
                closed_step=window.closed_step or 0,
            )
        )
    return stub.AckPlanPhase(request, metadata=agents[rank].auth, timeout=5)


def apply_everywhere(
    stub: executor_pb2_grpc.ExecutorServiceStub,
    agents: dict[int, RawAgent],
    epoch: int,
    window: ReprotectWindow,
) -> None:
    """What every executor of the plan's layout says: RECEIVED .. APPLIED (with the window),
    RESUMED after the first commit."""
    for rank in agents:
        for phase in (executor_pb2.PLAN_PHASE_RECEIVED, executor_pb2.PLAN_PHASE_PAUSED):
            ack(stub, agents, rank, epoch, phase)
        ack(stub, agents, rank, epoch, executor_pb2.PLAN_PHASE_APPLIED, window)
        ack(stub, agents, rank, epoch, executor_pb2.PLAN_PHASE_RESUMED)


def window_for(old: Layout, new: Layout, epoch: int, committed: int) -> ReprotectWindow:
    return ReprotectWindow(epoch, tuple(sorted(reseed_pairs(old, new))), committed + 1, committed + 2)


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_core_plans_a_loss_inside_the_reported_window_as_restore(tmp_path: Path) -> None:
    """A real Core: w5 lost -> plan 1, whose executors report its window (the copies
    `reseed_pairs` gives) and then close it (REPROTECTED); w2 lost -> plan 2 in place, its
    window left open; a rank whose only copy is in that window lost -> plan 3 is a RESTORE."""
    token = new_token()
    proc = CoreProcess(tmp_path, "core", "memory://", token)
    try:
        proc.wait_leader()
        job_token = create_job(proc, token, "train", layout=json.loads(L0.to_json()))
        agents = {}
        for rank in L0.ranks():
            stage = L0.stage_of_rank(rank)
            dp = L0.stages[stage].dp_index(rank)
            agents[rank] = RawAgent(proc.grpc_address, job_token, f"w{rank}", rank, stage, dp)
            agents[rank].step(0, stage, dp)
        wait_until(lambda: proc.job("train")["phase"] == "RUNNING", 15, "the job to run")
        channel = grpc.insecure_channel(proc.grpc_address)
        stub = executor_pb2_grpc.ExecutorServiceStub(channel)
        plans = stub.SubscribePlans(
            executor_pb2.SubscribePlansRequest(job="train", worker_id="w0"),
            metadata=[("authorization", f"Bearer {job_token}")],
            timeout=60,
        )

        def next_plan(lost: int) -> Plan:
            agents.pop(lost).vanish()
            return Plan.from_json(next(plans).plan.plan_json)

        plan1 = next_plan(5)
        assert plan1.mode == PlanMode.IN_PLACE and plan1.old == L0
        w1 = window_for(L0, plan1.new, 1, committed=3)
        apply_everywhere(stub, agents, 1, w1)
        wait_until(lambda: proc.job("train")["committed_epoch"] == 1, 10, "epoch 1 to commit")
        shown = proc.job("train")["backup_window"]
        assert shown is not None and shown["pairs"] == [list(p) for p in w1.pairs], shown
        assert (shown["from_step"], shown["until_step"], shown["state"]) == (4, 5, "open")
        # a REPROTECTED without its window, or with a window on another phase, is refused
        with pytest.raises(grpc.RpcError) as err:
            ack(stub, agents, 0, 1, executor_pb2.PLAN_PHASE_REPROTECTED)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "backup_window" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            ack(stub, agents, 0, 1, executor_pb2.PLAN_PHASE_PAUSED, w1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        closed = ReprotectWindow(1, w1.pairs, 4, 5, closed_step=5)
        ack(stub, agents, 3, 1, executor_pb2.PLAN_PHASE_REPROTECTED, closed)
        wait_until(lambda: proc.job("train")["backup_window"] is None, 5, "the window to close")
        assert proc.job("train")["backup_windows"][0]["closed_step"] == 5

        plan2 = next_plan(2)  # stage 0's copies are all in place: in place
        assert plan2.mode == PlanMode.IN_PLACE, plan2.reasons
        w2 = window_for(plan1.new, plan2.new, 2, committed=7)
        apply_everywhere(stub, agents, 2, w2)
        wait_until(lambda: proc.job("train")["committed_epoch"] == 2, 10, "epoch 2 to commit")
        assert proc.job("train")["backup_window"]["epoch"] == 2

        sets = backup_holder_sets(plan2.new)
        victim = next(r for r in sorted(agents) if (r, first_surviving(sets, r, {r})) in w2.pairs)
        assert judge(plan2.new, resize_after_loss(plan2.new, {victim}).layout).in_place
        plan3 = next_plan(victim)
        assert plan3.mode == PlanMode.RESTORE, plan3.reasons
        assert any("re-protection window" in r for r in plan3.reasons), plan3.reasons
        channel.close()
        for agent in agents.values():
            agent.close()
    finally:
        proc.stop()


class _WindowFields(TypedDict, total=False):
    """The fields of a BackupWindow message."""

    pairs: list[executor_pb2.BackupPair]
    from_step: int
    until_step: int
    closed_step: int


def _request(
    phase: executor_pb2.PlanPhase, **window: Unpack[_WindowFields]
) -> executor_pb2.AckPlanPhaseRequest:
    request = executor_pb2.AckPlanPhaseRequest(job="train", worker_id="w0", epoch=3, phase=phase)
    if window:
        request.backup_window.CopyFrom(executor_pb2.BackupWindow(**window))
    return request


def test_the_executor_service_checks_the_window_it_is_sent() -> None:
    pairs = [executor_pb2.BackupPair(owner=1, holder=3)]
    applied = backup_window_of(
        _request(executor_pb2.PLAN_PHASE_APPLIED, pairs=pairs, from_step=4, until_step=5)
    )
    assert applied == ReprotectWindow(3, ((1, 3),), 4, 5)
    closed = backup_window_of(
        _request(executor_pb2.PLAN_PHASE_REPROTECTED, pairs=pairs, from_step=4, until_step=5, closed_step=5)
    )
    assert closed == ReprotectWindow(3, ((1, 3),), 4, 5, closed_step=5)
    assert backup_window_of(_request(executor_pb2.PLAN_PHASE_RESUMED)) is None
    bad = {
        "required with PLAN_PHASE_REPROTECTED": _request(executor_pb2.PLAN_PHASE_REPROTECTED),
        "only sent with": _request(executor_pb2.PLAN_PHASE_RESUMED, pairs=pairs, from_step=4, until_step=5),
        "1 to 65536 pairs": _request(executor_pb2.PLAN_PHASE_APPLIED, from_step=4, until_step=5),
        "owner and holder must differ": _request(
            executor_pb2.PLAN_PHASE_APPLIED,
            pairs=[executor_pb2.BackupPair(owner=2, holder=2)],
            from_step=4,
            until_step=5,
        ),
        "run from a step >= 0": _request(
            executor_pb2.PLAN_PHASE_APPLIED, pairs=pairs, from_step=6, until_step=5
        ),
        "closed_step must be": _request(
            executor_pb2.PLAN_PHASE_REPROTECTED, pairs=pairs, from_step=4, until_step=5, closed_step=4
        ),
        "closed_step is only set": _request(
            executor_pb2.PLAN_PHASE_APPLIED, pairs=pairs, from_step=4, until_step=5, closed_step=5
        ),
    }
    for said, request in bad.items():
        with pytest.raises(RpcError) as err:
            backup_window_of(request)
        assert said in str(err.value), (said, err.value)
