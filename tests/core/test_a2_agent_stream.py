"""The agent stream of a real Core, driven by a raw gRPC client: a bad report is refused on its
own (the worker stays alive, nothing is re-planned), a heartbeat interval the timeout cannot
cover is refused at registration, and the Core's commands (SetFrequency, Drain, ReportNow) reach
the agent on its stream - from the REST endpoint, from a layout's per-rank frequencies, and when
a heartbeat is late."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import TypedDict, Unpack

import grpc
import pytest

from planners.layout import make_uniform_layout
from tests.core.procs import CoreProcess, create_job, new_token, wait_until
from wire.v1 import agent_pb2, agent_pb2_grpc

pytestmark = pytest.mark.multiproc

HEARTBEAT_TIMEOUT_S = 4.0  # the floor of each stream's adaptive deadline
HEARTBEAT_CEILING_S = 2 * HEARTBEAT_TIMEOUT_S


class ConnectBody(TypedDict, total=False):
    """The body of one ConnectRequest (a oneof: set exactly one)."""

    register: agent_pb2.Register
    heartbeat: agent_pb2.Heartbeat
    probe: agent_pb2.HealthProbe
    memory: agent_pb2.MemoryUsage
    step: agent_pb2.StepMetrics
    preemption: agent_pb2.PreemptionNotice
    worker_exit: agent_pb2.WorkerExit
    leave: agent_pb2.Leave


class RawStream:
    """One agent stream over real gRPC: messages go out when sent, every Core message is kept."""

    def __init__(
        self,
        address: str,
        token: str,
        job: str,
        worker_id: str,
        *,
        rank: int = -1,
        heartbeat_interval_ms: int = 200,
        beat: bool = True,
    ) -> None:
        self.channel = grpc.insecure_channel(address)
        self.outgoing: queue.Queue = queue.Queue()
        self.incoming: queue.Queue = queue.Queue()
        register = agent_pb2.Register(
            job=job,
            worker_id=worker_id,
            host="testhost",
            pid=4242,
            stage=0,
            dp_rank=max(rank, 0),
            rank=rank,
            heartbeat_interval_ms=heartbeat_interval_ms,
        )
        self.outgoing.put(agent_pb2.ConnectRequest(register=register))
        stub = agent_pb2_grpc.AgentServiceStub(self.channel)
        self.call = stub.Connect(
            iter(self.outgoing.get, None), metadata=[("authorization", f"Bearer {token}")]
        )
        self.error: grpc.RpcError | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        first = self.next(5.0)
        assert first.WhichOneof("body") == "ack", first
        self.ack = first.ack
        self._seq = 0
        self._stop = threading.Event()
        if beat:
            threading.Thread(target=self._beat, args=(heartbeat_interval_ms / 1000,), daemon=True).start()

    def _beat(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.heartbeat()

    def _read(self) -> None:
        try:
            for response in self.call:
                self.incoming.put(response)
        except grpc.RpcError as err:
            self.error = err
        self.incoming.put(None)

    def next(self, timeout_s: float) -> agent_pb2.ConnectResponse:
        item = self.incoming.get(timeout=timeout_s)
        assert item is not None, f"stream ended: {self.error}"
        return item

    def nothing_within(self, timeout_s: float) -> bool:
        try:
            item = self.incoming.get(timeout=timeout_s)
        except queue.Empty:
            return True
        self.incoming.put(item)
        return False

    def send(self, **body: Unpack[ConnectBody]) -> None:
        self.outgoing.put(agent_pb2.ConnectRequest(**body))

    def heartbeat(self) -> None:
        self._seq += 1
        self.send(heartbeat=agent_pb2.Heartbeat(seq=self._seq, sent_unix=time.time()))

    def step(self, step: int) -> None:
        self.send(
            step=agent_pb2.StepMetrics(
                step=step, step_time_s=0.1, compute_time_s=0.09, loss=2.0, samples=2, stage=0, dp_rank=0
            )
        )

    def leave(self, reason: str = "test done", finished: bool = False) -> None:
        self._stop.set()
        self.send(leave=agent_pb2.Leave(reason=reason, finished=finished))
        self.outgoing.put(None)
        self._reader.join(timeout=5)

    def close(self) -> None:
        self._stop.set()
        self.outgoing.put(None)
        self.call.cancel()
        self.channel.close()


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CoreProcess, str]]:
    tmp = tmp_path_factory.mktemp("a2core")
    token = new_token()
    # A Core-held liveness lease (TTL = the floor): the Core keeps it alive while a worker is only
    # late, so heartbeats and the ceiling decide here, not its expiry.
    proc = CoreProcess(
        tmp,
        "a2",
        "memory://",
        token,
        extra_env={"ELASWAVE_HEARTBEAT_CEILING_S": str(HEARTBEAT_CEILING_S)},
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        lease_ttl_s=HEARTBEAT_TIMEOUT_S,
    )
    proc.wait_leader()
    yield proc, token
    proc.stop()


def member(core: CoreProcess, job: str, worker_id: str) -> dict:
    return next(m for m in core.job(job)["members"] if m["worker_id"] == worker_id)


def settled(core: CoreProcess, job: str) -> None:
    """Waits until the engine has handled the join: the job is RUNNING and an event says it went
    there (on a loaded machine a late-heartbeat note may follow that event, so it need not be
    the last)."""

    def running() -> bool:
        kinds = [e["kind"] for e in core.http.get(f"/api/v1/jobs/{job}/events").json()["events"]]
        return "phase_running" in kinds and core.job(job)["phase"] == "RUNNING"

    wait_until(running, 10, f"job {job} to settle")


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.timeout(60)
def test_bad_reports_are_refused_alone_and_the_worker_stays_alive(core: tuple[CoreProcess, str]) -> None:
    proc, token = core
    job_token = create_job(proc, token, "reports")
    stream = RawStream(proc.grpc_address, job_token, "reports", "w0")
    stream.step(1)
    wait_until(lambda: proc.states("reports") == {"w0": "RUNNING"}, 10, "w0 RUNNING")
    settled(proc, "reports")
    before = proc.job("reports")
    before_member = member(proc, "reports", "w0")
    bad = {
        "memory": agent_pb2.ConnectRequest(memory=agent_pb2.MemoryUsage(cpu_percent=1e9)),
        "empty": agent_pb2.ConnectRequest(),
        "step": agent_pb2.ConnectRequest(step=agent_pb2.StepMetrics(step=2, step_time_s=float("nan"))),
    }
    counted = {
        kind: proc.metric("elaswave_rejected_requests_total", api="agent", reason=f"invalid_report_{kind}")
        for kind in bad
    }
    for request in bad.values():
        stream.outgoing.put(request)
    notices = [stream.next(5.0) for _ in bad]
    assert [n.WhichOneof("body") for n in notices] == ["rejected"] * 3
    assert [n.rejected.report for n in notices] == ["memory", "empty", "step"]
    assert "cpu_percent out of range: 1000000000.0" in notices[0].rejected.reason
    assert notices[1].rejected.reason == "report has no body"
    assert "step.step_time_s must be a finite number" in notices[2].rejected.reason

    # The stream is still served: a heartbeat after the bad reports is taken.
    sent_after = time.time()
    stream.heartbeat()
    wait_until(
        lambda: member(proc, "reports", "w0")["last_heartbeat_unix"] >= sent_after - 0.5,
        5,
        "the heartbeat after the bad reports to land",
    )
    after = proc.job("reports")
    after_member = member(proc, "reports", "w0")
    assert after_member["state"] == "RUNNING" and after_member["lost_reason"] == ""
    # Nothing was recorded or re-planned; the bad values were not stored.
    assert (after["last_event_seq"], after["plan_epoch"], after["phase"]) == (
        before["last_event_seq"],
        before["plan_epoch"],
        "RUNNING",
    )
    assert after_member["memory"] == before_member["memory"] == {}
    assert after_member["last_step"]["step"] == 1
    for kind in bad:
        assert (
            proc.metric("elaswave_rejected_requests_total", api="agent", reason=f"invalid_report_{kind}")
            == counted[kind] + 1
        ), kind
    # And it still ends cleanly.
    stream.leave()
    wait_until(lambda: proc.states("reports") == {"w0": "LEFT"}, 5, "w0 LEFT after its Leave")
    kinds = [e["kind"] for e in proc.http.get("/api/v1/jobs/reports/events").json()["events"]]
    assert "worker_lost" not in kinds


@pytest.mark.timeout(60)
def test_heartbeat_interval_the_timeout_cannot_cover_is_refused(core: tuple[CoreProcess, str]) -> None:
    proc, token = core
    job_token = create_job(proc, token, "intervals")
    refused = proc.metric("elaswave_rejected_requests_total", api="agent", reason="INVALID_ARGUMENT")
    timeout_ms = int(HEARTBEAT_TIMEOUT_S * 1000)
    for interval_ms in (timeout_ms, timeout_ms + 2000):
        with pytest.raises(AssertionError, match="stream ended") as err:
            RawStream(proc.grpc_address, job_token, "intervals", "w0", heartbeat_interval_ms=interval_ms)
        assert f"heartbeat_interval_ms is {interval_ms} ms" in str(err.value)
        assert f"heartbeat timeout of {timeout_ms} ms" in str(err.value)
        assert "StatusCode.INVALID_ARGUMENT" in str(err.value)
    assert proc.states("intervals") == {}
    assert (
        proc.metric("elaswave_rejected_requests_total", api="agent", reason="INVALID_ARGUMENT") == refused + 2
    )
    # Just below the timeout is accepted.
    stream = RawStream(proc.grpc_address, job_token, "intervals", "w0", heartbeat_interval_ms=timeout_ms - 1)
    assert proc.states("intervals") == {"w0": "JOINING"}
    stream.leave()


@pytest.mark.timeout(60)
def test_rest_commands_reach_the_agent_stream_and_bad_ones_change_nothing(
    core: tuple[CoreProcess, str],
) -> None:
    proc, token = core
    job_token = create_job(proc, token, "cmds")
    stream = RawStream(proc.grpc_address, job_token, "cmds", "w0")
    settled(proc, "cmds")
    url = "/api/v1/jobs/cmds/workers/w0/commands"
    before = proc.job("cmds")["last_event_seq"]
    refused = [
        (url, {"command": "set_frequency"}, None, 422, "set_frequency needs frequency_mhz"),
        (url, {"command": "set_frequency", "frequency_mhz": -5}, None, 422, "greater than or equal to 0"),
        (
            url,
            {"command": "set_frequency", "frequency_mhz": 20_000},
            None,
            422,
            "less than or equal to 10000",
        ),
        (url, {"command": "report_now", "frequency_mhz": 900}, None, 422, "only for set_frequency"),
        (url, {"command": "reboot"}, None, 422, "set_frequency"),
        (url, {"command": "drain", "deadline_unix": time.time() - 5}, None, 422, "not in the future"),
        ("/api/v1/jobs/nope/workers/w0/commands", {"command": "report_now"}, None, 404, "unknown job 'nope'"),
        (
            "/api/v1/jobs/cmds/workers/ghost/commands",
            {"command": "report_now"},
            None,
            404,
            "no worker 'ghost'",
        ),
        (url, {"command": "report_now"}, {}, 401, "missing"),
        (url, {"command": "report_now"}, auth("wrong-token-0123456789"), 403, "wrong scheduler token"),
    ]
    for path, body, headers, status, text in refused:
        response = proc.http.post(path, json=body, headers=auth(token) if headers is None else headers)
        assert response.status_code == status, (body, response.text)
        assert text in json.dumps(response.json()["detail"]), (body, response.text)
    assert proc.job("cmds")["last_event_seq"] == before
    assert stream.nothing_within(0.3), "a refused command reached the stream"

    sent = []
    for body in (
        {"command": "set_frequency", "frequency_mhz": 1410},
        {"command": "report_now"},
        {"command": "set_frequency", "frequency_mhz": 0},
        {"command": "drain", "reason": "node maintenance", "deadline_unix": time.time() + 30},
    ):
        response = proc.http.post(url, json=body, headers=auth(token))
        assert response.status_code == 202, response.text
        sent.append(response.json()["event_seq"])
    received = [stream.next(5.0) for _ in sent]
    assert [r.WhichOneof("body") for r in received] == [
        "set_frequency",
        "report_now",
        "set_frequency",
        "drain",
    ]
    assert (received[0].set_frequency.mhz, received[2].set_frequency.mhz) == (1410, 0)
    assert received[3].drain.reason == "node maintenance"
    assert proc.states("cmds") == {"w0": "DRAINING"}
    events = {e["seq"]: e for e in proc.http.get("/api/v1/jobs/cmds/events").json()["events"]}
    assert [events[seq]["detail"] for seq in sent[:3]] == [
        "set_frequency 1410 MHz",
        "report_now",
        "set_frequency 0 MHz",
    ]
    stream.leave()
    gone = proc.http.post(url, json={"command": "report_now"}, headers=auth(token))
    assert gone.status_code == 409 and "is LEFT" in gone.json()["detail"]


@pytest.mark.timeout(60)
def test_late_heartbeat_gets_one_report_now_then_is_late_not_lost_until_the_ceiling(
    core: tuple[CoreProcess, str],
) -> None:
    proc, token = core
    job_token = create_job(proc, token, "late")
    stream = RawStream(proc.grpc_address, job_token, "late", "w0", beat=False)
    registered = time.monotonic()
    # Silence 1: past half the deadline the Core asks for a report; answering keeps the worker.
    nudge = stream.next(HEARTBEAT_TIMEOUT_S)
    waited = time.monotonic() - registered
    assert nudge.WhichOneof("body") == "report_now"
    assert HEARTBEAT_TIMEOUT_S / 2 - 0.2 <= waited < HEARTBEAT_TIMEOUT_S, waited
    stream.heartbeat()
    answered = time.monotonic()
    time.sleep(max(0.0, HEARTBEAT_TIMEOUT_S + 0.5 - (time.monotonic() - registered)))
    assert proc.states("late") == {"w0": "JOINING"}  # the first deadline has passed: the answer counted
    # Silence 2: one more ReportNow, left unanswered. Past the deadline the worker is late (its
    # stream is open and its Core-held lease kept alive), and it stays a member, not LOST.
    assert stream.next(HEARTBEAT_TIMEOUT_S).WhichOneof("body") == "report_now"
    wait_until(
        lambda: member(proc, "late", "w0")["heartbeat_late_since_unix"] is not None,
        HEARTBEAT_TIMEOUT_S,
        "w0 noted late",
    )
    assert proc.states("late") == {"w0": "JOINING"}
    late_event = next(e for e in events(proc, "late") if e["kind"] == "heartbeat_late")
    assert "stream open: late, not lost" in late_event["detail"]
    assert proc.metric("elaswave_heartbeats_late_total") >= 1
    # The lease TTL (= the floor) has long passed: the Core kept the lease, no lease loss.
    time.sleep(max(0.0, answered + HEARTBEAT_TIMEOUT_S * 1.5 - time.monotonic()))
    assert proc.states("late") == {"w0": "JOINING"}
    # Past the ceiling: a hung agent, whatever keeps its stream open.
    wait_until(lambda: proc.states("late") == {"w0": "LOST"}, HEARTBEAT_CEILING_S, "w0 LOST at the ceiling")
    lost = time.monotonic() - answered
    assert lost >= HEARTBEAT_CEILING_S - 0.5, lost
    reason = member(proc, "late", "w0")["lost_reason"]
    assert reason.startswith("no heartbeat for") and f"past the {HEARTBEAT_CEILING_S:g}s ceiling" in reason
    assert stream.nothing_within(0.3), "more than one ReportNow per silence"
    stream.close()


@pytest.mark.timeout(60)
def test_a_late_worker_that_beats_again_is_on_time(core: tuple[CoreProcess, str]) -> None:
    proc, token = core
    job_token = create_job(proc, token, "ontime")
    stream = RawStream(proc.grpc_address, job_token, "ontime", "w0", beat=False)
    wait_until(
        lambda: member(proc, "ontime", "w0")["heartbeat_late_since_unix"] is not None,
        HEARTBEAT_TIMEOUT_S + 2,
        "w0 noted late",
    )
    stream.heartbeat()
    wait_until(
        lambda: member(proc, "ontime", "w0")["heartbeat_late_since_unix"] is None,
        5,
        "the late note cleared by a heartbeat",
    )
    kinds = [e["kind"] for e in events(proc, "ontime") if e["worker_id"] == "w0"]
    assert kinds[-2:] == ["heartbeat_late", "heartbeat_on_time"]
    assert proc.states("ontime") == {"w0": "JOINING"}
    stream.leave()


def events(proc: CoreProcess, job: str) -> list[dict]:
    return proc.http.get(f"/api/v1/jobs/{job}/events").json()["events"]


@pytest.mark.timeout(60)
def test_failed_device_probe_marks_the_worker_lost(core: tuple[CoreProcess, str]) -> None:
    proc, token = core
    job_token = create_job(proc, token, "probes")
    sick = RawStream(proc.grpc_address, job_token, "probes", "w0")
    other = RawStream(proc.grpc_address, job_token, "probes", "w1")
    for s in (sick, other):
        s.step(1)
    wait_until(lambda: proc.states("probes") == {"w0": "RUNNING", "w1": "RUNNING"}, 10, "both RUNNING")
    lost_before = proc.metric("elaswave_failures_detected_total", path="device_probe")

    def probe(stream: RawStream, kind: agent_pb2.ProbeKind, healthy: bool, detail: str) -> None:
        stream.send(probe=agent_pb2.HealthProbe(kind=kind, healthy=healthy, detail=detail, latency_ms=1.5))

    # A healthy device probe and a failed host probe are recorded; neither is a fail-stop.
    probe(sick, agent_pb2.PROBE_KIND_DEVICE, True, "cuda:0 answers")
    probe(other, agent_pb2.PROBE_KIND_HOST, False, "disk 99% full")
    wait_until(
        lambda: member(proc, "probes", "w1")["probes"].get("host", {}).get("healthy") is False,
        5,
        "w1's failed host probe recorded",
    )
    assert member(proc, "probes", "w0")["probes"]["device"]["healthy"] is True
    assert proc.states("probes") == {"w0": "RUNNING", "w1": "RUNNING"}

    # A failed device probe is: the worker is LOST with the probe's detail, on an open stream.
    probe(sick, agent_pb2.PROBE_KIND_DEVICE, False, "cuda:0 ECC error")
    wait_until(lambda: proc.states("probes")["w0"] == "LOST", 2, "w0 LOST after its device probe failed")
    lost = member(proc, "probes", "w0")
    assert lost["lost_reason"] == "device probe failed: cuda:0 ECC error"
    assert lost["probes"]["device"]["healthy"] is False
    assert proc.states("probes")["w1"] == "RUNNING"
    events = proc.http.get("/api/v1/jobs/probes/events").json()["events"]
    assert [(e["kind"], e["worker_id"], e["detail"]) for e in events if e["kind"] == "worker_lost"] == [
        ("worker_lost", "w0", "device probe failed: cuda:0 ECC error")
    ]
    assert proc.metric("elaswave_failures_detected_total", path="device_probe") == lost_before + 1
    sick.close()
    other.leave()


def _dvfs_layout() -> dict:
    # One stage, two data-parallel ranks; rank 1 runs at a locked 1500 MHz (a DVFS plan).
    layout = make_uniform_layout(num_layers=4, num_stages=1, dp=2, global_batch=8, num_micro_batches=2)
    return json.loads(replace(layout, frequencies_mhz=((1, 1500),)).to_json())


@pytest.mark.timeout(60)
def test_layout_frequencies_are_sent_at_registration_and_with_each_plan(
    core: tuple[CoreProcess, str],
) -> None:
    proc, token = core
    job_token = create_job(proc, token, "dvfs", layout=_dvfs_layout())
    plain = RawStream(proc.grpc_address, job_token, "dvfs", "w0", rank=0)
    pinned = RawStream(proc.grpc_address, job_token, "dvfs", "w1", rank=1)
    first = pinned.next(5.0)
    assert first.WhichOneof("body") == "set_frequency" and first.set_frequency.mhz == 1500
    for s in (plain, pinned):
        s.heartbeat()
    assert plain.nothing_within(0.5), "rank 0 has no frequency in the layout"
    # Rank 0 vanishes; the re-plan keeps rank 1 at 1500 MHz and the Core tells it again.
    plain.close()
    wait_until(lambda: proc.job("dvfs")["plan_epoch"] == 1, 10, "a plan after w0 is lost")
    pinned.heartbeat()
    again = pinned.next(5.0)
    assert again.WhichOneof("body") == "set_frequency" and again.set_frequency.mhz == 1500
    assert json.loads(json.dumps(proc.job("dvfs")["layout"]))["frequencies_mhz"] == [[1, 1500]]
    pinned.leave()


@pytest.mark.timeout(60)
def test_a_finished_worker_is_no_change_to_plan_for_and_an_early_departure_is(
    core: tuple[CoreProcess, str],
) -> None:
    proc, token = core
    layout = make_uniform_layout(num_layers=4, num_stages=1, dp=3, global_batch=6, num_micro_batches=1)

    def running_job(name: str) -> list[RawStream]:
        job_token = create_job(proc, token, name, layout=json.loads(layout.to_json()))
        streams = [RawStream(proc.grpc_address, job_token, name, f"w{r}", rank=r) for r in range(3)]
        for s in streams:
            s.step(1)
        wait_until(lambda: set(proc.states(name).values()) == {"RUNNING"}, 10, "three RUNNING")
        time.sleep(0.3)  # the joins are planned for (nothing to do) within a few leader ticks
        wait_until(lambda: proc.job(name)["phase"] == "RUNNING", 10, "the joins handled")
        return streams

    def kinds_after(name: str, seq: int) -> list[str]:
        events = proc.http.get(f"/api/v1/jobs/{name}/events").json()["events"]
        return [e["kind"] for e in events if e["seq"] > seq]

    def last_seq(name: str) -> int:
        return int(proc.http.get(f"/api/v1/jobs/{name}/events").json()["events"][-1]["seq"])

    streams = running_job("ending")
    last = last_seq("ending")
    streams[0].leave("worker 1 finished its work (exited with code 0)", finished=True)
    wait_until(lambda: proc.states("ending")["w0"] == "LEFT", 5, "w0 LEFT")
    time.sleep(0.5)  # several leader ticks: a change would have started planning by now
    assert kinds_after("ending", last) == ["worker_finished"]
    assert proc.job("ending")["plan_epoch"] == 0 and proc.job("ending")["phase"] == "RUNNING"
    # Once one worker finished, the last step committed everywhere: another's end is no change.
    streams[1].leave("worker 2 left (exited with code 0)")
    streams[2].leave("worker 3 finished its work (exited with code 0)", finished=True)
    wait_until(lambda: proc.job("ending")["phase"] == "COMPLETED", 10, "the job COMPLETED")
    assert proc.job("ending")["plan_epoch"] == 0

    # A worker that stops early (exit 0 without saying its work is done) is a departure to plan for.
    streams = running_job("early")
    last = last_seq("early")
    streams[1].leave("worker 2 left (exited with code 0)")
    wait_until(lambda: proc.job("early")["plan_epoch"] == 1, 10, "a plan without w1")
    assert kinds_after("early", last)[:2] == ["worker_left", "phase_planning"]
    streams[0].leave()
    streams[2].leave()
