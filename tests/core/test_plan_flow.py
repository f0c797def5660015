"""A job registered with a layout: a lost worker leads to a published plan that executors receive
over ExecutorService, acknowledge phase by phase, and the job returns to RUNNING."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from planners.layout import Layout, Plan, PlanMode, make_uniform_layout
from tests.core.procs import CoreProcess, create_job, new_token, wait_until
from wire.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    executor_pb2,
    executor_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

pytestmark = pytest.mark.multiproc


class RawAgent:
    """A minimal real gRPC agent stream: register with a rank, then heartbeat until closed."""

    def __init__(self, address: str, token: str, worker_id: str, rank: int, stage: int, dp_rank: int) -> None:
        self.channel = grpc.insecure_channel(address)
        self.outgoing: queue.Queue = queue.Queue()
        register = agent_pb2.Register(
            job="train",
            worker_id=worker_id,
            host="testhost",
            pid=1000 + rank,
            stage=stage,
            dp_rank=dp_rank,
            rank=rank,
            heartbeat_interval_ms=200,
        )
        self.outgoing.put(agent_pb2.ConnectRequest(register=register))
        stub = agent_pb2_grpc.AgentServiceStub(self.channel)
        self.call = stub.Connect(
            iter(self.outgoing.get, None), metadata=[("authorization", f"Bearer {token}")]
        )
        self.ack = next(self.call).ack
        # The worker's own credential: what its executor acks plans and reports failures with.
        self.auth = [("authorization", f"Bearer {self.ack.worker_token}")]
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat, daemon=True)
        self._beats.start()

    def _beat(self) -> None:
        seq = 0
        while not self._stop.wait(0.2):
            seq += 1
            self.outgoing.put(
                agent_pb2.ConnectRequest(heartbeat=agent_pb2.Heartbeat(seq=seq, sent_unix=time.time()))
            )

    def step(self, step: int, stage: int, dp_rank: int) -> None:
        self.outgoing.put(
            agent_pb2.ConnectRequest(
                step=agent_pb2.StepMetrics(
                    step=step,
                    step_time_s=0.1,
                    compute_time_s=0.09,
                    loss=2.0,
                    samples=2,
                    stage=stage,
                    dp_rank=dp_rank,
                )
            )
        )

    def vanish(self) -> None:
        """Drop the stream without a Leave, like a crashed agent."""
        self._stop.set()
        self.call.cancel()
        self.channel.close()

    def close(self) -> None:
        self._stop.set()
        self.outgoing.put(None)
        self.channel.close()


@pytest.fixture
def core(tmp_path: Path) -> Iterator[tuple[CoreProcess, str]]:
    token = new_token()
    proc = CoreProcess(tmp_path, "planner", "memory://", token)
    proc.wait_leader()
    yield proc, token
    proc.stop()


@pytest.mark.timeout(60)
def test_lost_worker_yields_a_plan_that_executors_apply(core: tuple[CoreProcess, str]) -> None:
    proc, token = core
    layout = make_uniform_layout(num_layers=4, num_stages=2, dp=2, global_batch=8, num_micro_batches=2)
    job_token = create_job(proc, token, "train", layout=json.loads(layout.to_json()))
    agents = {}
    for rank in layout.ranks():
        stage = layout.stage_of_rank(rank)
        dp = layout.stages[stage].dp_index(rank)
        agents[rank] = RawAgent(proc.grpc_address, job_token, f"w{rank}", rank, stage, dp)
        agents[rank].step(0, stage, dp)
    wait_until(
        lambda: set(proc.states("train").values()) == {"RUNNING"} and len(proc.states("train")) == 4,
        10,
        "four running workers",
    )
    wait_until(lambda: proc.job("train")["phase"] == "RUNNING", 10, "the engine to settle")

    channel = grpc.insecure_channel(proc.grpc_address)
    auth = [("authorization", f"Bearer {job_token}")]  # reading plans: the job token will do
    w0_auth = agents[0].auth  # acks and failure reports: only w0 itself
    executor = executor_pb2_grpc.ExecutorServiceStub(channel)
    plans = executor.SubscribePlans(
        executor_pb2.SubscribePlansRequest(job="train", worker_id="w0"), metadata=auth, timeout=30
    )

    # What-if first: the scheduler sees the plan for losing w3 without anything being applied.
    scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    what_if = scheduler.PlanWhatIf(
        scheduler_pb2.PlanWhatIfRequest(job="train", remove_worker_ids=["w3"]),
        metadata=[("authorization", f"Bearer {token}")],
        timeout=5,
    )
    assert what_if.runnable and what_if.plan.epoch == 0
    assert 3 not in Layout.from_json(what_if.plan.layout_json).ranks()
    assert proc.job("train")["plan_epoch"] == 0

    agents[3].vanish()
    plan = next(plans).plan
    assert plan.epoch == 1
    new_layout = Layout.from_json(plan.layout_json)
    assert new_layout == Layout.from_json(what_if.plan.layout_json)
    assert sorted(new_layout.ranks()) == [0, 1, 2]
    assert proc.states("train")["w3"] == "LOST"
    assert proc.job("train")["phase"] == "APPLYING"

    for rank in (0, 1, 2):
        for phase in (
            executor_pb2.PLAN_PHASE_RECEIVED,
            executor_pb2.PLAN_PHASE_PAUSED,
            executor_pb2.PLAN_PHASE_APPLIED,
            executor_pb2.PLAN_PHASE_RESUMED,
        ):
            reply = executor.AckPlanPhase(
                executor_pb2.AckPlanPhaseRequest(
                    job="train", worker_id=f"w{rank}", epoch=1, phase=phase, phase_time_s=0.01
                ),
                metadata=agents[rank].auth,
                timeout=5,
            )
            assert reply.current_epoch == 1
    wait_until(lambda: proc.job("train")["phase"] == "RUNNING", 5, "the job to resume")
    kinds = [e["kind"] for e in proc.http.get("/api/v1/jobs/train/events").json()["events"]]
    assert kinds[-2:] == ["plan_resumed", "phase_running"]
    assert proc.job("train")["layout"] == json.loads(new_layout.to_json())

    # Fencing: an ack for an older epoch after a newer plan is refused.
    agents[1].vanish()
    assert next(plans).plan.epoch == 2
    with pytest.raises(grpc.RpcError) as err:
        executor.AckPlanPhase(
            executor_pb2.AckPlanPhaseRequest(
                job="train", worker_id="w0", epoch=1, phase=executor_pb2.PLAN_PHASE_RESUMED
            ),
            metadata=w0_auth,
            timeout=5,
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "stale" in err.value.details()

    # A collective failure with no membership change: rank 2's agent still heartbeats, so the step
    # is replayed on the same layout (a retry plan) twice; reported again after that, it is lost
    # (detection path "collective failure").
    def report(peer_rank: int) -> executor_pb2.ReportPeerFailureResponse:
        return executor.ReportPeerFailure(
            executor_pb2.ReportPeerFailureRequest(
                job="train",
                worker_id="w0",
                peer_rank=peer_rank,
                step=7,
                operation="send(stage 1)",
                error="Connection reset",
            ),
            metadata=w0_auth,
            timeout=5,
        )

    with pytest.raises(grpc.RpcError) as err:
        report(-2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "peer_rank" in err.value.details()
    target = Layout.from_json(json.dumps(proc.job("train")["layout"]))  # epoch 2's layout
    executor.AckPlanPhase(
        executor_pb2.AckPlanPhaseRequest(
            job="train", worker_id="w0", epoch=2, phase=executor_pb2.PLAN_PHASE_RECEIVED
        ),
        metadata=w0_auth,
        timeout=5,
    )
    for retry, epoch in ((1, 3), (2, 4)):
        answer = report(2)
        assert not answer.peer_marked_lost and answer.peer_worker_id == "w2"
        plan = next(plans).plan
        decoded = Plan.from_json(plan.plan_json)
        assert (plan.epoch, decoded.epoch, decoded.new, decoded.mode) == (
            epoch,
            epoch,
            target,
            PlanMode.IN_PLACE,
        )
        assert decoded.reasons[0] == (
            f"retry of epoch {epoch - 1} after collective failure in send(stage 1) at step 7: "
            f"replay on the same layout (retry {retry} of 2)"
        )
        # w0 received the replay: its next report is about a new failure, not this one.
        executor.AckPlanPhase(
            executor_pb2.AckPlanPhaseRequest(
                job="train", worker_id="w0", epoch=epoch, phase=executor_pb2.PLAN_PHASE_RECEIVED
            ),
            metadata=w0_auth,
            timeout=5,
        )
    assert proc.states("train")["w2"] == "RUNNING"
    answer = report(2)
    assert answer.peer_marked_lost and answer.peer_worker_id == "w2"
    lost = next(m for m in proc.job("train")["members"] if m["worker_id"] == "w2")
    assert lost["state"] == "LOST" and "Connection reset" in lost["lost_reason"]
    assert next(plans).plan.epoch == 5
    plans.cancel()
    for agent in agents.values():
        agent.close()
    channel.close()


@pytest.mark.timeout(60)
def test_scale_table_and_offers_follow_flextrain(core: tuple[CoreProcess, str]) -> None:
    from planners.cli import scale_table as reference_scale_table

    proc, token = core
    model = json.loads(
        (Path(__file__).parents[2] / "planners/examples/llama2-34b-one-node-lost.json").read_text()
    )
    model["failed_ranks"] = []
    model["max_devices"] = 128
    create_job(proc, token, "big", model=model)
    create_job(proc, token, "plain")
    auth = [("authorization", f"Bearer {token}")]
    with grpc.insecure_channel(proc.grpc_address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        rows = scheduler.GetScaleTable(
            scheduler_pb2.GetScaleTableRequest(job="big"), metadata=auth, timeout=10
        ).rows
        reference = reference_scale_table(model)["entries"]
        assert [(r.devices, r.dp, r.pp) for r in rows] == [
            (e["devices"], e["dp"], e["pp"]) for e in reference
        ]
        assert all(r.tp == 4 and r.step_time_s > 0 and r.throughput_samples_per_s > 0 for r in rows)
        with pytest.raises(grpc.RpcError) as err:
            scheduler.GetScaleTable(scheduler_pb2.GetScaleTableRequest(job="plain"), metadata=auth, timeout=5)
        assert (
            err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            and "without a model" in err.value.details()
        )

        # An offer that is reclaimed within seconds cannot pay for a reconfiguration; a long one can.
        short = scheduler.OfferResources(
            scheduler_pb2.OfferResourcesRequest(
                job="big", devices=32, hosts=["n13", "n14", "n15", "n16"], expected_duration_s=5
            ),
            metadata=auth,
            timeout=10,
        )
        long = scheduler.OfferResources(
            scheduler_pb2.OfferResourcesRequest(
                job="big", devices=32, hosts=["n13", "n14", "n15", "n16"], expected_duration_s=24 * 3600
            ),
            metadata=auth,
            timeout=10,
        )
        assert not short.accepted and "eq. 16" in short.reason
        assert long.accepted and "scale to" in long.reason
    bad = proc.http.post(
        "/api/v1/jobs",
        json={"name": "broken", "model": {"job": {"pp": 0}}},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert bad.status_code == 422 and bad.json()["detail"][0]["msg"].startswith("model:")
