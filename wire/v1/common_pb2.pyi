from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_JOINING: _ClassVar[WorkerState]
    WORKER_STATE_RUNNING: _ClassVar[WorkerState]
    WORKER_STATE_SLOW: _ClassVar[WorkerState]
    WORKER_STATE_PREEMPTING: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_LOST: _ClassVar[WorkerState]
    WORKER_STATE_LEFT: _ClassVar[WorkerState]
    WORKER_STATE_SPARE: _ClassVar[WorkerState]

class JobPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_PHASE_UNSPECIFIED: _ClassVar[JobPhase]
    JOB_PHASE_RUNNING: _ClassVar[JobPhase]
    JOB_PHASE_PLANNING: _ClassVar[JobPhase]
    JOB_PHASE_APPLYING: _ClassVar[JobPhase]
    JOB_PHASE_COMPLETED: _ClassVar[JobPhase]
    JOB_PHASE_FAILED: _ClassVar[JobPhase]
    JOB_PHASE_STOPPED: _ClassVar[JobPhase]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_JOINING: WorkerState
WORKER_STATE_RUNNING: WorkerState
WORKER_STATE_SLOW: WorkerState
WORKER_STATE_PREEMPTING: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_LOST: WorkerState
WORKER_STATE_LEFT: WorkerState
WORKER_STATE_SPARE: WorkerState
JOB_PHASE_UNSPECIFIED: JobPhase
JOB_PHASE_RUNNING: JobPhase
JOB_PHASE_PLANNING: JobPhase
JOB_PHASE_APPLYING: JobPhase
JOB_PHASE_COMPLETED: JobPhase
JOB_PHASE_FAILED: JobPhase
JOB_PHASE_STOPPED: JobPhase

class Device(_message.Message):
    __slots__ = ("kind", "index", "name", "memory_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    index: int
    name: str
    memory_bytes: int
    def __init__(self, kind: _Optional[str] = ..., index: _Optional[int] = ..., name: _Optional[str] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("worker_id", "host", "pid", "devices", "state", "lost_reason", "last_heartbeat_unix", "last_step", "last_step_time_s", "stage", "dp_rank", "rank", "state_reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOST_REASON_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    host: str
    pid: int
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    state: WorkerState
    lost_reason: str
    last_heartbeat_unix: float
    last_step: int
    last_step_time_s: float
    stage: int
    dp_rank: int
    rank: int
    state_reason: str
    def __init__(self, worker_id: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., state: _Optional[_Union[WorkerState, str]] = ..., lost_reason: _Optional[str] = ..., last_heartbeat_unix: _Optional[float] = ..., last_step: _Optional[int] = ..., last_step_time_s: _Optional[float] = ..., stage: _Optional[int] = ..., dp_rank: _Optional[int] = ..., rank: _Optional[int] = ..., state_reason: _Optional[str] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("job", "epoch", "layout_json", "reasons", "predicted_step_time_s", "created_unix", "plan_json")
    JOB_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    job: str
    epoch: int
    layout_json: bytes
    reasons: _containers.RepeatedScalarFieldContainer[str]
    predicted_step_time_s: float
    created_unix: float
    plan_json: bytes
    def __init__(self, job: _Optional[str] = ..., epoch: _Optional[int] = ..., layout_json: _Optional[bytes] = ..., reasons: _Optional[_Iterable[str]] = ..., predicted_step_time_s: _Optional[float] = ..., created_unix: _Optional[float] = ..., plan_json: _Optional[bytes] = ...) -> None: ...
