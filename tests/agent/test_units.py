"""Pure parts of the agent: validation, backoff, leader hints, notice parsing, settings."""

from __future__ import annotations

import json
import math
import random
import socket
from pathlib import Path
from typing import Any

import pytest

from agent.backoff import AddressRotation, Backoff, parse_leader_hint
from agent.config import Address, AgentConfig, default_metrics_socket, parse_address, parse_address_list
from agent.daemon import agent_exit_code
from agent.local_metrics import _remove_stale_socket, parse_line
from agent.logs import format_event
from agent.preemption import parse_notice_deadline
from agent.worker import ExitStatus, describe_exit
from wire.local_protocol import EXIT_CODE_UNKNOWN, BadMetrics, StepMetricsClient

GOOD: dict[str, Any] = {  # StepMetricsClient.send's keywords
    "step": 3,
    "step_time_s": 1.5,
    "compute_time_s": 1.0,
    "loss": 2.25,
    "samples": 16,
    "stage": 1,
    "dp_rank": 0,
}


_DROP = object()  # a field value meaning "leave the field out"


def _line(**changes: object) -> bytes:
    record = {**GOOD, **changes}
    return json.dumps({k: v for k, v in record.items() if v is not _DROP}).encode()


def test_valid_record_becomes_proto_field_for_field():
    metrics = parse_line(_line())
    assert (
        metrics.step,
        metrics.step_time_s,
        metrics.compute_time_s,
        metrics.loss,
        metrics.samples,
        metrics.stage,
        metrics.dp_rank,
    ) == tuple(GOOD.values())
    assert math.isnan(parse_line(_line(loss=None)).loss)
    assert math.isnan(parse_line(_line(loss=_DROP)).loss)
    assert parse_line(_line(step_time_s=2)).step_time_s == 2.0  # JSON integers are fine for seconds


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b"{", "not JSON"),
        (b"\xff", "not JSON"),
        (b"3", "expected a JSON object, got int"),
        (_line(step=_DROP), "missing field(s) ['step']"),
        (_line(extra=1), "unknown field(s) ['extra']"),
        (_line(step=1.5), "step must be an integer"),
        (_line(step=True), "step must be an integer"),
        (_line(samples=-1), "samples must be >= 0"),
        (_line(stage=-2), "stage must be >= -1"),
        (_line(step_time_s=-0.1), "step_time_s must be a finite number of seconds >= 0"),
        (
            b'{"step": 1, "step_time_s": NaN, "compute_time_s": 0, "samples": 1, "stage": 0, "dp_rank": 0}',
            "step_time_s must be a finite",
        ),
        (_line(compute_time_s="1"), "compute_time_s must be a finite"),
        (_line(loss="low"), "loss must be a number or null"),
    ],
)
def test_bad_records_are_rejected_with_the_reason(line: bytes, reason: str):
    with pytest.raises(BadMetrics) as info:
        parse_line(line)
    assert reason in str(info.value)


def test_client_never_raises_when_agent_is_gone_but_rejects_bad_arguments(tmp_path: Path):
    with StepMetricsClient(tmp_path / "nobody.sock") as client:
        assert client.send(**GOOD) is False
        assert (client.sent, client.dropped) == (0, 1)
        with pytest.raises(ValueError, match="samples must be >= 0"):
            negative = {**GOOD, "samples": -4}
            client.send(**negative)


def test_client_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("ELASWAVE_METRICS_SOCKET", raising=False)
    assert StepMetricsClient.from_env() is None
    monkeypatch.setenv("ELASWAVE_METRICS_SOCKET", str(tmp_path / "m.sock"))
    client = StepMetricsClient.from_env()
    assert client is not None and client.path == str(tmp_path / "m.sock")
    client.close()


def test_stale_socket_is_replaced_but_a_live_one_or_a_plain_file_is_not(tmp_path: Path):
    path = tmp_path / "s.sock"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    live.bind(str(path))
    with pytest.raises(ValueError, match="another agent is already listening"):
        _remove_stale_socket(path)
    live.close()  # the file stays behind, nobody listens: stale
    _remove_stale_socket(path)
    assert not path.exists()
    path.write_text("data")
    with pytest.raises(ValueError, match="is not a socket"):
        _remove_stale_socket(path)
    assert path.read_text() == "data"


def test_backoff_doubles_from_initial_to_cap_with_jitter_and_resets():
    backoff = Backoff(0.05, 2.0, random.Random(7))
    delays = [backoff.next_delay() for _ in range(10)]
    ceilings = [min(2.0, 0.05 * 2**i) for i in range(10)]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert len(set(delays)) == len(delays)  # jittered, not lock-step
    backoff.reset()
    assert backoff.next_delay() <= 0.05
    with pytest.raises(ValueError, match="initial"):
        Backoff(1.0, 0.5)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("not leader; leader is 10.0.0.5:7070", Address("10.0.0.5", 7070)),
        ("not leader; leader is core-b.svc:7070.", Address("core-b.svc", 7070)),  # sentence full stop
        ("not leader; leader is core-b.svc:7070", Address("core-b.svc", 7070)),
        ("not leader; leader is [fd00::1]:7070", Address("fd00::1", 7070)),
        ("not leader", None),
        ("", None),
    ],
)
def test_leader_hint_parsing(message: str, expected: Address | None):
    assert parse_leader_hint(message) == expected


def test_rotation_follows_hint_once_then_resumes_list():
    a, b, c = Address("a", 1), Address("b", 2), Address("c", 3)
    rotation = AddressRotation((a, b))
    assert rotation.current() == a
    rotation.failed(c)
    assert rotation.current() == c
    rotation.failed(None)
    assert rotation.current() == b
    rotation.failed(b)  # a hint naming the address that just refused is ignored
    assert rotation.current() == a


def test_notice_deadline_parsing():
    assert parse_notice_deadline("1700000100\n", 1700000000.0, 30) == (1700000100.0, "deadline from file")
    assert parse_notice_deadline("", 1000.0, 30)[0] == 1030.0
    deadline, note = parse_notice_deadline("soon", 1000.0, 30)
    assert deadline == 1030.0 and "unreadable deadline 'soon'" in note
    assert parse_notice_deadline("inf", 1000.0, 30)[0] == 1030.0
    assert parse_notice_deadline("900", 1000.0, 30) == (900.0, "deadline already passed")


def _config(**changes: object) -> AgentConfig:
    settings: dict[str, object] = {"job": "j", "worker_id": "w", "cores": (Address("h", 1),), "worker_pid": 1}
    settings.update(changes)
    return AgentConfig(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"job": ""}, "--job: must be 1-128 letters, digits or '._:@-'"),
        (
            {"worker_id": "a/b"},
            "--worker-id: must be 1-128 letters, digits or '._:@-', starting with a letter or digit, got 'a/b'",
        ),
        ({"worker_id": "-w"}, "--worker-id: must be 1-128"),
        ({"cores": ()}, "--core: at least one"),
        ({"worker_command": ("python",)}, "exactly one of --pid PID or a worker command"),
        ({"worker_pid": None}, "exactly one of --pid PID or a worker command"),
        ({"worker_pid": -3}, "--pid: must be a positive process id"),
        ({"stage": -2}, "--stage: must be >= -1"),
        ({"rank": -5}, "--rank: must be >= -1"),
        ({"heartbeat_interval_s": 0.0}, "--heartbeat-interval: must be a positive number"),
        ({"probe_interval_s": math.inf}, "--probe-interval: must be a positive number"),
        ({"grace_s": -1.0}, "--grace: must be >= 0"),
        ({"lease_ttl_s": 0}, "--lease-ttl: must be a whole number of seconds >= 1"),
        ({"etcd_prefix": "elaswave"}, "--etcd-prefix: must start with '/'"),
        ({"metrics_socket": Path("/tmp/" + "x" * 120)}, "--metrics-socket: "),
    ],
)
def test_bad_settings_are_refused_with_the_flag_named(changes: dict[str, object], message: str):
    with pytest.raises(ValueError) as info:
        _config(**changes)
    assert message in str(info.value)


def test_addresses_and_default_paths():
    assert parse_address_list("a:1, [::1]:2", "--core") == (Address("a", 1), Address("::1", 2))
    assert str(Address("::1", 2)) == "[::1]:2"
    for bad, message in [("a", "expected host:port"), ("a:0", "outside 1..65535"), (",", "at least one")]:
        with pytest.raises(ValueError, match=message):
            parse_address_list(bad, "--core")
    with pytest.raises(ValueError, match="--peer: expected host:port"):
        parse_address("h:p", "--peer")
    path = default_metrics_socket("my job", "w/1")
    assert path.name == "my_job.w_1.metrics.sock"
    assert _config().alive_key == "/elaswave/jobs/j/alive/w"


def test_exit_codes_and_descriptions():
    assert describe_exit(-9) == "killed by signal 9 (SIGKILL)"
    assert describe_exit(3) == "exited with code 3"
    assert "unknown" in describe_exit(EXIT_CODE_UNKNOWN)
    assert [
        agent_exit_code(s)
        for s in (
            None,
            ExitStatus(0, ""),
            ExitStatus(3, ""),
            ExitStatus(-15, ""),
            ExitStatus(EXIT_CODE_UNKNOWN, ""),
        )
    ] == [0, 0, 3, 143, 1]


def test_log_lines_are_single_line_key_values():
    line = format_event("worker_exit", pid=7, detail='killed by "x"\nnext', empty="")
    assert line == 'worker_exit pid=7 detail="killed by \\"x\\"\\nnext" empty=""'
    assert "\n" not in line


class _StandInCuda:
    """Answers like ``torch.cuda`` for two devices, the second one failing as a lost GPU does.

    Only the agent's bookkeeping is under test here; the real torch.cuda path needs a GPU host.
    """

    @staticmethod
    def device_memory_used(index: int) -> int:
        raise ModuleNotFoundError("pynvml")  # as torch does without nvidia-ml-py: use the runtime

    @staticmethod
    def mem_get_info(index: int) -> tuple[int, int]:
        if index == 1:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return 30 * 2**30, 80 * 2**30


def test_device_read_reports_a_failing_accelerator_as_unhealthy():
    from agent.devices import DeviceSet
    from wire.v1 import agent_pb2, common_pb2

    devices = [common_pb2.Device(kind="cuda", index=i, name="GPU", memory_bytes=80 * 2**30) for i in range(2)]
    reading = DeviceSet("cuda", _StandInCuda, devices).read(worker_rss_bytes=123)
    assert reading.used_bytes == [50 * 2**30, 0] and reading.total_bytes == [80 * 2**30, 80 * 2**30]
    assert reading.probe.kind == agent_pb2.PROBE_KIND_DEVICE and not reading.probe.healthy
    assert reading.probe.detail == "cuda:1 RuntimeError: CUDA error: unspecified launch failure"


def test_discovery_on_this_host_cpu_means_one_device_backed_by_host_memory():
    import psutil

    from agent.devices import DeviceSet

    found = DeviceSet.discover()
    if found.has_accelerator:  # a GPU/NPU host: every device is named and sized by the driver
        assert found.devices and all(d.kind in ("cuda", "npu") and d.memory_bytes > 0 for d in found.devices)
        return
    assert [(d.kind, d.index, d.memory_bytes) for d in found.devices] == [
        ("cpu", 0, psutil.virtual_memory().total)
    ]
    reading = found.read(worker_rss_bytes=4096)
    assert reading.used_bytes == [4096] and reading.probe.healthy
