from wire.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProbeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROBE_KIND_UNSPECIFIED: _ClassVar[ProbeKind]
    PROBE_KIND_PROCESS: _ClassVar[ProbeKind]
    PROBE_KIND_DEVICE: _ClassVar[ProbeKind]
    PROBE_KIND_HOST: _ClassVar[ProbeKind]
    PROBE_KIND_INTERCONNECT: _ClassVar[ProbeKind]
PROBE_KIND_UNSPECIFIED: ProbeKind
PROBE_KIND_PROCESS: ProbeKind
PROBE_KIND_DEVICE: ProbeKind
PROBE_KIND_HOST: ProbeKind
PROBE_KIND_INTERCONNECT: ProbeKind

class Register(_message.Message):
    __slots__ = ("job", "worker_id", "host", "pid", "devices", "stage", "dp_rank", "heartbeat_interval_ms", "holds_own_lease", "rank")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    HOLDS_OWN_LEASE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    job: str
    worker_id: str
    host: str
    pid: int
    devices: _containers.RepeatedCompositeFieldContainer[_common_pb2.Device]
    stage: int
    dp_rank: int
    heartbeat_interval_ms: int
    holds_own_lease: bool
    rank: int
    def __init__(self, job: _Optional[str] = ..., worker_id: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., devices: _Optional[_Iterable[_Union[_common_pb2.Device, _Mapping]]] = ..., stage: _Optional[int] = ..., dp_rank: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., holds_own_lease: _Optional[bool] = ..., rank: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("seq", "sent_unix", "echo")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    seq: int
    sent_unix: float
    echo: bool
    def __init__(self, seq: _Optional[int] = ..., sent_unix: _Optional[float] = ..., echo: _Optional[bool] = ...) -> None: ...

class HealthProbe(_message.Message):
    __slots__ = ("kind", "healthy", "detail", "latency_ms")
    KIND_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    kind: ProbeKind
    healthy: bool
    detail: str
    latency_ms: float
    def __init__(self, kind: _Optional[_Union[ProbeKind, str]] = ..., healthy: _Optional[bool] = ..., detail: _Optional[str] = ..., latency_ms: _Optional[float] = ...) -> None: ...

class MemoryUsage(_message.Message):
    __slots__ = ("host_used_bytes", "host_total_bytes", "worker_rss_bytes", "device_used_bytes", "device_total_bytes", "cpu_percent")
    HOST_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    host_used_bytes: int
    host_total_bytes: int
    worker_rss_bytes: int
    device_used_bytes: _containers.RepeatedScalarFieldContainer[int]
    device_total_bytes: _containers.RepeatedScalarFieldContainer[int]
    cpu_percent: float
    def __init__(self, host_used_bytes: _Optional[int] = ..., host_total_bytes: _Optional[int] = ..., worker_rss_bytes: _Optional[int] = ..., device_used_bytes: _Optional[_Iterable[int]] = ..., device_total_bytes: _Optional[_Iterable[int]] = ..., cpu_percent: _Optional[float] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("step", "step_time_s", "compute_time_s", "loss", "samples", "stage", "dp_rank", "checkpoint")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    step: int
    step_time_s: float
    compute_time_s: float
    loss: float
    samples: int
    stage: int
    dp_rank: int
    checkpoint: str
    def __init__(self, step: _Optional[int] = ..., step_time_s: _Optional[float] = ..., compute_time_s: _Optional[float] = ..., loss: _Optional[float] = ..., samples: _Optional[int] = ..., stage: _Optional[int] = ..., dp_rank: _Optional[int] = ..., checkpoint: _Optional[str] = ...) -> None: ...

class PreemptionNotice(_message.Message):
    __slots__ = ("source", "deadline_unix")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    source: str
    deadline_unix: float
    def __init__(self, source: _Optional[str] = ..., deadline_unix: _Optional[float] = ...) -> None: ...

class WorkerExit(_message.Message):
    __slots__ = ("exit_code", "detail")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    detail: str
    def __init__(self, exit_code: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class Leave(_message.Message):
    __slots__ = ("reason", "finished", "checkpoint")
    REASON_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    reason: str
    finished: bool
    checkpoint: str
    def __init__(self, reason: _Optional[str] = ..., finished: _Optional[bool] = ..., checkpoint: _Optional[str] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("register", "heartbeat", "probe", "memory", "step", "preemption", "worker_exit", "leave")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_FIELD_NUMBER: _ClassVar[int]
    WORKER_EXIT_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    register: Register
    heartbeat: Heartbeat
    probe: HealthProbe
    memory: MemoryUsage
    step: StepMetrics
    preemption: PreemptionNotice
    worker_exit: WorkerExit
    leave: Leave
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., probe: _Optional[_Union[HealthProbe, _Mapping]] = ..., memory: _Optional[_Union[MemoryUsage, _Mapping]] = ..., step: _Optional[_Union[StepMetrics, _Mapping]] = ..., preemption: _Optional[_Union[PreemptionNotice, _Mapping]] = ..., worker_exit: _Optional[_Union[WorkerExit, _Mapping]] = ..., leave: _Optional[_Union[Leave, _Mapping]] = ...) -> None: ...

class RegisterAck(_message.Message):
    __slots__ = ("session", "heartbeat_timeout_ms", "core_id", "worker_token")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    CORE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session: int
    heartbeat_timeout_ms: int
    core_id: str
    worker_token: str
    def __init__(self, session: _Optional[int] = ..., heartbeat_timeout_ms: _Optional[int] = ..., core_id: _Optional[str] = ..., worker_token: _Optional[str] = ...) -> None: ...

class HeartbeatEcho(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class SetFrequency(_message.Message):
    __slots__ = ("mhz",)
    MHZ_FIELD_NUMBER: _ClassVar[int]
    mhz: int
    def __init__(self, mhz: _Optional[int] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ("reason", "deadline_unix")
    REASON_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    reason: str
    deadline_unix: float
    def __init__(self, reason: _Optional[str] = ..., deadline_unix: _Optional[float] = ...) -> None: ...

class ReportNow(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("after_step", "stop")
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    after_step: int
    stop: bool
    def __init__(self, after_step: _Optional[int] = ..., stop: _Optional[bool] = ...) -> None: ...

class ReportRejected(_message.Message):
    __slots__ = ("report", "reason")
    REPORT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    report: str
    reason: str
    def __init__(self, report: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("ack", "set_frequency", "drain", "report_now", "rejected", "checkpoint", "echo")
    ACK_FIELD_NUMBER: _ClassVar[int]
    SET_FREQUENCY_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    REPORT_NOW_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    ack: RegisterAck
    set_frequency: SetFrequency
    drain: Drain
    report_now: ReportNow
    rejected: ReportRejected
    checkpoint: Checkpoint
    echo: HeartbeatEcho
    def __init__(self, ack: _Optional[_Union[RegisterAck, _Mapping]] = ..., set_frequency: _Optional[_Union[SetFrequency, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., report_now: _Optional[_Union[ReportNow, _Mapping]] = ..., rejected: _Optional[_Union[ReportRejected, _Mapping]] = ..., checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., echo: _Optional[_Union[HeartbeatEcho, _Mapping]] = ...) -> None: ...

class NodeFrame(_message.Message):
    __slots__ = ("channel", "request", "authorization", "worker_token", "end")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    AUTHORIZATION_FIELD_NUMBER: _ClassVar[int]
    WORKER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    channel: int
    request: ConnectRequest
    authorization: str
    worker_token: str
    end: bool
    def __init__(self, channel: _Optional[int] = ..., request: _Optional[_Union[ConnectRequest, _Mapping]] = ..., authorization: _Optional[str] = ..., worker_token: _Optional[str] = ..., end: _Optional[bool] = ...) -> None: ...

class NodeRequest(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[NodeFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[NodeFrame, _Mapping]]] = ...) -> None: ...

class NodeReply(_message.Message):
    __slots__ = ("channel", "response", "end", "code", "details")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    channel: int
    response: ConnectResponse
    end: bool
    code: int
    details: str
    def __init__(self, channel: _Optional[int] = ..., response: _Optional[_Union[ConnectResponse, _Mapping]] = ..., end: _Optional[bool] = ..., code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class NodeResponse(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[NodeReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[NodeReply, _Mapping]]] = ...) -> None: ...
