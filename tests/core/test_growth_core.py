"""Growth against a real Core (in this process) with fake agents on real gRPC streams: a spare
registers, a loss is answered by one plan that takes the spare in (`Plan.joiners`), offers are
accepted or refused with their reason, and a job whose workers all finished is COMPLETED."""

from __future__ import annotations

import contextlib
import json
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from core_service.config import load_settings
from planners.layout import Plan
from tests.core.core_thread import CoreThread
from tests.core.procs import wait_until
from tests.core.test_growth import FAULT_FREE, renamed
from wire.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    executor_pb2,
    executor_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

SCHEDULER = "s" * 24
pytestmark = pytest.mark.multiproc  # a Core's servers and, for the offers, its planning process


class FakeAgent:
    """One agent stream: register, heartbeat every 0.2 s, then leave (finished) or vanish."""

    def __init__(self, address: str, token: str, job: str, worker: str, rank: int) -> None:
        self.channel = grpc.insecure_channel(address)
        self.outgoing: queue.Queue = queue.Queue()
        register = agent_pb2.Register(
            job=job, worker_id=worker, host=f"host-{worker}", pid=1, rank=rank, heartbeat_interval_ms=200
        )
        self.outgoing.put(agent_pb2.ConnectRequest(register=register))
        stub = agent_pb2_grpc.AgentServiceStub(self.channel)
        self.call = stub.Connect(
            iter(self.outgoing.get, None), metadata=[("authorization", f"Bearer {token}")]
        )
        ack = next(self.call).ack
        assert ack.session > 0
        self.job, self.worker, self.worker_token = job, worker, ack.worker_token
        self._stop = threading.Event()
        threading.Thread(target=self._beat, daemon=True).start()

    def subscribe(self) -> None:
        """What a worker does first: subscribe to plans with its own credential (for a spare:
        the Core takes it as ready to join)."""
        stub = executor_pb2_grpc.ExecutorServiceStub(self.channel)
        request = executor_pb2.SubscribePlansRequest(job=self.job, worker_id=self.worker)
        self.plans = stub.SubscribePlans(request, metadata=[("authorization", f"Bearer {self.worker_token}")])
        threading.Thread(target=self._drain_plans, daemon=True).start()

    def _drain_plans(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            for _ in self.plans:
                pass

    def _beat(self) -> None:
        seq = 0
        while not self._stop.wait(0.2):
            seq += 1
            self.outgoing.put(agent_pb2.ConnectRequest(heartbeat=agent_pb2.Heartbeat(seq=seq)))

    def finish(self, checkpoint: str) -> None:
        self._stop.set()
        leave = agent_pb2.Leave(reason="training complete", finished=True, checkpoint=checkpoint)
        self.outgoing.put(agent_pb2.ConnectRequest(leave=leave))
        self.outgoing.put(None)
        for _ in self.call:  # the Core closes the stream once the departure is stored
            pass
        self.channel.close()

    def vanish(self) -> None:
        self._stop.set()
        self.call.cancel()
        self.channel.close()


@pytest.fixture
def core() -> Iterator[CoreThread]:
    thread = CoreThread(
        load_settings(dev_mode=True, core_id="growth", grpc_port=0, http_port=0, scheduler_token=SCHEDULER)
    )
    assert thread.run(thread.core.wait_leader(10), 15)
    yield thread
    thread.stop()


def create(http: httpx.Client, name: str, **body: object) -> str:
    answer = http.post(
        "/api/v1/jobs", json={"name": name, **body}, headers={"Authorization": f"Bearer {SCHEDULER}"}
    )
    assert answer.status_code == 201, answer.text
    return answer.json()["token"]


@pytest.mark.timeout(60)
def test_a_spare_replaces_a_lost_worker_and_the_finished_job_is_completed(core: CoreThread) -> None:
    with httpx.Client(base_url=core.http_url, timeout=10) as http:
        layout = json.loads(FAULT_FREE.to_json())
        token = create(http, "g", layout=layout, expected_workers=4, spare_workers=1, max_workers=4)
        agents = {f"w{r}": FakeAgent(core.grpc_address, token, "g", f"w{r}", r) for r in FAULT_FREE.ranks()}
        agents["s0"] = FakeAgent(core.grpc_address, token, "g", "s0", -1)  # a spare
        # Registered, but its worker has not subscribed to plans: not ready to join yet.
        assert http.get("/api/v1/jobs/g").json()["spares"] == []
        agents["s0"].subscribe()
        wait_until(lambda: http.get("/api/v1/jobs/g").json()["spares"] != [], 10, "the spare to be ready")
        job = http.get("/api/v1/jobs/g").json()
        assert [s["worker_id"] for s in job["spares"]] == ["s0"] and job["max_workers"] == 4
        assert job["scale_table"] == {"rows": [], "why_empty": "the job was created without a model"}

        agents.pop("w3").vanish()  # a fail-stop: one plan removes rank 3 and takes the spare in
        wait_until(lambda: http.get("/api/v1/jobs/g").json()["plan_epoch"] == 1, 10, "the plan of the loss")
        raw = core.core.plans.get("g", 1)
        assert raw is not None
        plan = Plan.from_json(raw)
        assert plan.joiners == ((4, "s0"),) and plan.new == renamed(FAULT_FREE, 3, 4)
        job = http.get("/api/v1/jobs/g").json()
        s0 = next(m for m in job["members"] if m["worker_id"] == "s0")
        assert (s0["state"], s0["rank"], s0["stage"], s0["dp_rank"]) == ("JOINING", 4, 1, 1)
        assert job["spares"] == []

        for agent in agents.values():
            agent.finish("/checkpoints/g/step-000100")
        wait_until(lambda: http.get("/api/v1/jobs/g").json()["phase"] == "COMPLETED", 10, "COMPLETED")
        assert http.get("/api/v1/jobs/g").json()["final_checkpoint"] == "/checkpoints/g/step-000100"

    with grpc.insecure_channel(core.grpc_address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        auth = [("authorization", f"Bearer {SCHEDULER}")]
        state = scheduler.GetJobState(scheduler_pb2.GetJobStateRequest(job="g"), metadata=auth, timeout=5)
        assert state.final_checkpoint == "/checkpoints/g/step-000100"
        offer = scheduler.OfferResources(
            scheduler_pb2.OfferResourcesRequest(job="g", devices=2), metadata=auth, timeout=10
        )
        assert not offer.accepted and "COMPLETED" in offer.reason and offer.admitted_workers == 0


@pytest.mark.timeout(60)
def test_an_offer_that_does_not_pay_changes_nothing_and_says_why(core: CoreThread) -> None:
    model = json.loads(
        (Path(__file__).parents[2] / "planners/examples/llama2-34b-one-node-lost.json").read_text()
    )
    model["failed_ranks"], model["max_devices"] = [], 128
    with httpx.Client(base_url=core.http_url, timeout=10) as http:
        create(http, "big", model=model, expected_workers=96)
        with grpc.insecure_channel(core.grpc_address) as channel:
            scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            auth = [("authorization", f"Bearer {SCHEDULER}")]

            def offer(duration_s: float) -> scheduler_pb2.OfferResourcesResponse:
                request = scheduler_pb2.OfferResourcesRequest(
                    job="big", devices=32, hosts=["n13"], expected_duration_s=duration_s
                )
                return scheduler.OfferResources(request, metadata=auth, timeout=20)

            short = offer(5)  # reclaimed within seconds: cannot pay for a reconfiguration
            assert not short.accepted and "eq. 16" in short.reason and short.admitted_workers == 0
            assert http.get("/api/v1/jobs/big").json()["offered_workers"] == 0
            long = offer(24 * 3600)
            assert long.accepted and "scale to" in long.reason and long.admitted_workers == 32
            job = http.get("/api/v1/jobs/big").json()
            assert job["offered_workers"] == 32 and job["scale_table"]["rows"]
        events = http.get("/api/v1/jobs/big/events").json()["events"]
        offers = [e["data"] for e in events if e["kind"] == "resources_offered"]
        assert [(o["accepted"], o["admitted_workers"]) for o in offers] == [(False, 0), (True, 32)]
        assert offers[0]["reason"] == short.reason
