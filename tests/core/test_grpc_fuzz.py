"""Every RPC of the Core, fed random bytes, truncated messages and out-of-range fields, answers
with a definite status (INVALID_ARGUMENT, PERMISSION_DENIED, NOT_FOUND, ...): never UNKNOWN or
INTERNAL (a crash in the handler), never a hang; and the Core is healthy afterwards."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core_service.core import SERVICES
from tests.core.procs import CoreProcess, create_job, new_token

pytestmark = pytest.mark.multiproc

CRASHES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
CALL_TIMEOUT_S = 10.0
INT_LIMITS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1, -1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1, -1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (2**32 - 1,),
    FieldDescriptor.TYPE_UINT64: (2**64 - 1,),
}
FLOATS = (math.nan, math.inf, -math.inf, 1e308, -1e308)
STRINGS = ("x" * 100_000, "a\nforged\x00\x1b[31m", "\u2028é" * 40)


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CoreProcess, dict[str, list]]]:
    token = new_token()
    proc = CoreProcess(tmp_path_factory.mktemp("fuzz"), "fuzz", "memory://", token)
    proc.wait_leader()
    job_token = create_job(proc, token, "train", expected_workers=2)
    scheduler = [("authorization", f"Bearer {token}")]
    job = [("authorization", f"Bearer {job_token}")]
    yield proc, {"scheduler": scheduler, "job": job, "none": []}
    proc.stop()


def out_of_range(descriptor: Descriptor) -> Iterator[Message]:
    """Messages of `descriptor`'s type with one field at an extreme (job and worker_id valid)."""
    cls = message_factory.GetMessageClass(descriptor)
    for field in descriptor.fields:
        for value in _extremes(field):
            message = cls()
            for name, good in (("job", "train"), ("worker_id", "w0")):
                if name in descriptor.fields_by_name and name != field.name:
                    setattr(message, name, good)
            try:
                _set(message, field, value)
            except (TypeError, ValueError):
                continue
            yield message


def _extremes(field: FieldDescriptor) -> tuple[object, ...]:
    if field.type in INT_LIMITS:
        return INT_LIMITS[field.type]
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return FLOATS
    if field.type == FieldDescriptor.TYPE_STRING:
        return STRINGS
    if field.type == FieldDescriptor.TYPE_BYTES:
        return (b"\xff" * 100_000, b"{not json")
    if field.type == FieldDescriptor.TYPE_ENUM:
        return (999, -1)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return (True,)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return tuple(list(out_of_range(field.message_type))[:12])
    return ()


def _set(message: Message, field: FieldDescriptor, value: object) -> None:
    if field.is_repeated:
        target = getattr(message, field.name)
        count = 20_000 if field.type == FieldDescriptor.TYPE_STRING and value == STRINGS[1] else 3
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            for _ in range(count):
                target.add().CopyFrom(value)
        else:
            target.extend([value] * count)
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        getattr(message, field.name).CopyFrom(value)
    else:
        setattr(message, field.name, value)


def payloads(method: MethodDescriptor, rng: random.Random) -> Iterator[bytes]:
    for size in (1, 7, 64, 1024):
        yield rng.randbytes(size)
    for message in out_of_range(method.input_type):
        body = message.SerializeToString()
        yield body
        if len(body) > 4:
            yield body[: rng.randrange(1, len(body))]  # truncated mid-field


def call(
    channel: grpc.Channel, method: MethodDescriptor, body: bytes, metadata: list
) -> tuple[grpc.StatusCode, str]:
    path = f"/{method.containing_service.full_name}/{method.name}"
    identity = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    try:
        if method.client_streaming:
            responses = channel.stream_stream(path, **identity)(
                iter([body]), metadata=metadata, timeout=CALL_TIMEOUT_S
            )
            next(iter(responses), None)
            responses.cancel()
        elif method.server_streaming:
            responses = channel.unary_stream(path, **identity)(body, metadata=metadata, timeout=2.0)
            next(iter(responses), None)
            responses.cancel()
        else:
            channel.unary_unary(path, **identity)(body, metadata=metadata, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as err:
        code = err.code()
        # A valid subscription waits for plans: its 2 s deadline passing is no failure.
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and method.server_streaming:
            return grpc.StatusCode.OK, ""
        return code, err.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.mark.timeout(180)
def test_every_rpc_survives_random_truncated_and_out_of_range_input(
    core: tuple[CoreProcess, dict[str, list]], tmp_path: Path
) -> None:
    proc, credentials = core
    rng = random.Random(12)
    seen: dict[str, set[str]] = {}
    crashes = []
    longest = 0  # the longest status message: large inputs are never echoed back
    with grpc.insecure_channel(proc.grpc_address) as channel:
        for service in SERVICES:
            auth = credentials["scheduler" if service.name == "SchedulerService" else "job"]
            for method in service.methods:
                for index, body in enumerate(payloads(method, rng)):
                    metadata = auth if index % 5 else credentials["none"]
                    code, details = call(channel, method, body, metadata)
                    longest = max(longest, len(details))
                    seen.setdefault(method.name, set()).add(code.name)
                    if code in CRASHES or code == grpc.StatusCode.DEADLINE_EXCEEDED:
                        crashes.append((method.name, code.name, body[:80]))
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert not crashes, crashes[:10]
    assert longest <= 1_000, longest
    assert set(seen) == {m.name for s in SERVICES for m in s.methods}
    assert all("INVALID_ARGUMENT" in codes or "PERMISSION_DENIED" in codes for codes in seen.values()), seen
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    assert proc.http.get("/healthz").json()["role"] == "leader"
    for api in ("agent", "executor", "scheduler"):
        assert proc.metric("elaswave_server_errors_total", api=api) == 0
