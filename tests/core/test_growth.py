"""Growth, stepped one tick at a time: spares, joins planned by the Core, min/max, COMPLETED.

The reference is the fault-free layout the job was created with: after a loss and a join the
plan's `new` is that layout with the fresh rank in the lost rank's place (same stages, same
layers, same DP sizes and sample split), and `Plan.joiners` names the spare taking it.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from pydantic import SecretStr

from core_service.agent_session import Registration
from core_service.config import JobSpec
from core_service.elaswave_policy import ElasWavePolicy
from core_service.grpc_util import RpcError
from core_service.jobs import Job
from core_service.model import JobPhase, WorkerState
from core_service.recovery import stored_plans
from planners.layout import Layout, Plan, make_uniform_layout
from tests.core.test_engine import RESUMED, Harness, run

FAULT_FREE = make_uniform_layout(num_layers=8, num_stages=2, dp=2, global_batch=24, num_micro_batches=4)


def make_job(h: Harness, name: str = "g", **bounds: int) -> Job:
    spec = JobSpec(name=name, token=SecretStr("t" * 16), expected_workers=4, spare_workers=1, **bounds)
    return h.table.create_job(spec, FAULT_FREE.to_json(), now=0.0)


async def spare(h: Harness, job: Job, worker: str, host: str = "spare-host") -> None:
    """A spare registers (JOINING: its worker may still be starting), then its worker subscribes
    to plans with its own credential (ExecutorService), which makes it a SPARE the policy may take."""
    before = len(job.pending_changes)
    await h.membership.register(Registration(job.name, worker, host, 7, [], -1, -1, -1, False), now=0.0)
    assert job.members[worker].state is WorkerState.JOINING and len(job.pending_changes) == before
    assert h.membership.mark_spare_ready(job, worker, 0.0)
    assert not h.membership.mark_spare_ready(job, worker, 0.0)  # once


async def ticks(h: Harness, job: Job, until: JobPhase, now: float, most: int = 4) -> None:
    for i in range(most):
        if await h.engine.tick(job, now + i * 0.01) == until:
            return
    raise AssertionError(f"job stayed {job.phase} (events {[e.kind for e in job.events][-6:]})")


def plan(h: Harness, job: Job, epoch: int) -> Plan:
    raw = h.plans.get(job.name, epoch)
    assert raw is not None
    return Plan.from_json(raw)


def commit(job: Job) -> None:
    for worker, member in job.members.items():
        if not member.state.is_gone and member.state is not WorkerState.SPARE:
            job.acks.setdefault(job.plan_epoch, {})[worker] = RESUMED


def renamed(layout: Layout, old: int, new: int) -> Layout:
    stages = tuple(
        dataclasses.replace(s, ranks=tuple(new if r == old else r for r in s.ranks)) for s in layout.stages
    )
    return dataclasses.replace(layout, stages=stages)


async def lose_and_recover(h: Harness, job: Job, rank: int, now: float) -> None:
    h.membership.mark_lost(job, f"{job.name}-w{rank}", "killed", "process_exit", now)
    await ticks(h, job, JobPhase.APPLYING, now)
    commit(job)
    await ticks(h, job, JobPhase.RUNNING, now + 0.1)


@pytest.mark.timeout(30)
def test_a_spare_after_a_loss_returns_the_job_to_its_fault_free_layout() -> None:
    # Growth after a thinned stage is the subject: the DP shape step is off.
    h = Harness(None, ElasWavePolicy(replicas=False), default_job=False)
    job = make_job(h)

    async def scenario() -> None:
        await h.join_layout("g", FAULT_FREE)
        await ticks(h, job, JobPhase.RUNNING, 1.0)
        await lose_and_recover(h, job, 2, 2.0)
        shrunk = plan(h, job, 1).new
        assert 2 not in shrunk.ranks() and shrunk.dp_sizes == (2, 1) and plan(h, job, 1).joiners == ()

        await spare(h, job, "s0")
        assert job.members["s0"].state is WorkerState.SPARE and job.members["s0"].rank == -1
        await ticks(h, job, JobPhase.APPLYING, 3.0)
        joined = plan(h, job, 2)
        # Rank 4: the largest rank the job ever used (3) + 1, never the lost rank's id 2.
        assert joined.joiners == ((4, "s0"),) and joined.rank_of_joiner("s0") == 4
        assert joined.new == renamed(FAULT_FREE, 2, 4)
        assert joined.old == shrunk  # planned from the committed layout
        member = job.members["s0"]
        assert (member.state, member.rank, member.stage, member.dp_rank) == (WorkerState.JOINING, 4, 1, 0)
        published = next(e for e in reversed(job.events) if e.kind == "plan_published")
        assert published.data["joiners"] == [[4, "s0"]]

    run(scenario())


@pytest.mark.timeout(30)
def test_a_join_waits_for_the_recovery_in_flight_and_a_loss_during_a_join_replans_from_the_cumulative_state() -> (
    None
):
    # Growth after a thinned stage is the subject: the DP shape step is off.
    h = Harness(None, ElasWavePolicy(replicas=False), default_job=False)
    job = make_job(h)

    async def scenario() -> None:
        await h.join_layout("g", FAULT_FREE)
        await ticks(h, job, JobPhase.RUNNING, 1.0)
        h.membership.mark_lost(job, "g-w1", "killed", "process_exit", 2.0)
        await ticks(h, job, JobPhase.APPLYING, 2.0)  # epoch 1 removes rank 1, not committed yet
        await spare(h, job, "s0")
        # A spare ready while the recovery applies does not supersede it (a superseded plan
        # abandons group builds its members entered): it is planned once epoch 1 is applied.
        await ticks(h, job, JobPhase.APPLYING, 2.5, most=2)
        assert job.plan_epoch == 1
        commit(job)
        await ticks(h, job, JobPhase.RUNNING, 2.6)
        await ticks(h, job, JobPhase.APPLYING, 2.7)
        again = plan(h, job, 2)
        assert again.old == plan(h, job, 1).new and again.new == renamed(FAULT_FREE, 1, 4)
        assert again.joiners == ((4, "s0"),)

        # The joiner dies during its state transfer: the next plan takes its rank out again.
        h.membership.mark_lost(job, "s0", "killed during the transfer", "process_exit", 3.0)
        await ticks(h, job, JobPhase.APPLYING, 3.0, most=2)
        out = plan(h, job, 3)
        assert 4 not in out.new.ranks() and 1 not in out.new.ranks() and out.joiners == ()
        assert out.new.dp_sizes == (1, 2) and out.old == plan(h, job, 1).new

    run(scenario())


@pytest.mark.timeout(30)
def test_max_and_min_workers_bound_every_plan_and_the_spares_admitted() -> None:
    # Growth after a thinned stage is the subject: the DP shape step is off.
    h = Harness(None, ElasWavePolicy(replicas=False), default_job=False)
    job = make_job(h, min_workers=4, max_workers=4)

    async def scenario() -> None:
        await h.join_layout("g", FAULT_FREE)
        await ticks(h, job, JobPhase.RUNNING, 1.0)
        # Below min_workers: the loss alone is not planned, nothing is published.
        h.membership.mark_lost(job, "g-w3", "killed", "process_exit", 2.0)
        await ticks(h, job, JobPhase.RUNNING, 2.0)
        refused = next(e for e in reversed(job.events) if e.kind == "decision_refuse")
        assert "below the job's min_workers 4" in refused.detail and job.plan_epoch == 0

        await spare(h, job, "s0")
        await spare(h, job, "s1")  # three live workers and two spares: expected 4 + spare 1
        with pytest.raises(RpcError) as err:
            await spare(h, job, "s2")
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "s2" not in job.members
        # A spare makes the cumulative plan (loss + join) reach min_workers; max_workers takes one.
        await ticks(h, job, JobPhase.APPLYING, 3.0)
        assert plan(h, job, 1).new == renamed(FAULT_FREE, 3, 4) and plan(h, job, 1).joiners == ((4, "s0"),)
        assert job.members["s1"].state is WorkerState.SPARE
        commit(job)
        await ticks(h, job, JobPhase.RUNNING, 3.5)

        # An accepted offer admits one more spare; at max_workers it stays a spare too.
        job.offered_workers = 1
        await spare(h, job, "s2")
        await ticks(h, job, JobPhase.RUNNING, 4.0)
        assert job.plan_epoch == 1 and job.members["s2"].state is WorkerState.SPARE
        assert "the job's maximum is 4" in job.events[-2].detail  # decision_none, then phase_running

    run(scenario())


@pytest.mark.timeout(30)
def test_growth_beyond_the_fault_free_layout_only_where_it_pays() -> None:
    h = Harness(None, ElasWavePolicy(), default_job=False)
    job = make_job(h, max_workers=6)

    async def scenario() -> None:
        await h.join_layout("g", FAULT_FREE)
        await ticks(h, job, JobPhase.RUNNING, 1.0)
        await spare(h, job, "s0")
        await ticks(h, job, JobPhase.APPLYING, 2.0)
        grown = plan(h, job, 1)
        assert grown.joiners == ((4, "s0"),) and len(grown.new.ranks()) == 5
        assert grown.predicted_step_time_s < plan_free_step(grown)

    run(scenario())


def plan_free_step(grown: Plan) -> float:
    """The fault-free layout's predicted step under the same uniform model."""
    text = next(r for r in grown.reasons if r.startswith("predicted step time"))
    return float(text.split("(")[1].split()[0])


@pytest.mark.timeout(30)
def test_a_spare_that_dies_is_just_removed() -> None:
    h = Harness(None, ElasWavePolicy(), default_job=False)
    job = make_job(h)

    async def scenario() -> None:
        await h.join_layout("g", FAULT_FREE)
        await spare(h, job, "s0")
        await ticks(h, job, JobPhase.RUNNING, 1.0)  # at the fault-free size: the spare waits
        assert job.members["s0"].state is WorkerState.SPARE and job.plan_epoch == 0
        h.membership.mark_lost(job, "s0", "agent stream closed", "stream_closed", 2.0)
        assert job.members["s0"].state is WorkerState.LOST and not job.pending_changes
        assert await h.engine.tick(job, 2.1) == JobPhase.RUNNING and job.plan_epoch == 0

    run(scenario())


@pytest.mark.timeout(30)
def test_a_job_whose_workers_all_finished_is_completed_and_stays_so_after_a_takeover() -> None:
    h = Harness(None, ElasWavePolicy(), default_job=False)

    async def scenario() -> None:
        h.persister.start()
        job = make_job(h)
        await h.join_layout("g", FAULT_FREE)
        await spare(h, job, "s0")
        await ticks(h, job, JobPhase.RUNNING, 1.0)
        sessions = [h.membership.sessions[("g", w)] for w in job.members if w != "s0"]
        for session in sessions[:-1]:
            await h.membership.leave(session, "done", 2.0, finished=True, checkpoint="/ckpt/g/step-99")
            assert await h.engine.tick(job, 2.0) == JobPhase.RUNNING  # one still trains
        last = sessions[-1]
        await h.membership.leave(last, "done", 3.0, finished=True, checkpoint="/ckpt/g/step-99")
        assert await h.engine.tick(job, 3.0) == JobPhase.COMPLETED
        assert job.final_checkpoint == "/ckpt/g/step-99"
        done = next(e for e in job.events if e.kind == "job_completed")
        assert done.data == {"final_checkpoint": "/ckpt/g/step-99", "workers": 4}
        assert not job.pending_changes and job.plan_epoch == 0
        with pytest.raises(RpcError) as err:
            await spare(h, job, "late")
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "COMPLETED" in err.value.message

        # A new leader reads it back from the registry: still COMPLETED, with the checkpoint.
        await h.persister.wait_durable(5.0)
        reloaded = h.table.read_registry(now=4.0)["g"]
        epoch, latest, committed = stored_plans(h.plans, reloaded)
        h.engine.restore(reloaded, epoch, latest, 4.0, committed)
        assert reloaded.phase is JobPhase.COMPLETED and reloaded.final_checkpoint == "/ckpt/g/step-99"
        assert await h.engine.tick(reloaded, 4.1) == JobPhase.COMPLETED
        await h.persister.stop(5.0)

    run(scenario())
