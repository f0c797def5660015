from wire.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SignalPreemptionRequest(_message.Message):
    __slots__ = ("job", "worker_ids", "deadline_unix", "reason")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job: str
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    deadline_unix: float
    reason: str
    def __init__(self, job: _Optional[str] = ..., worker_ids: _Optional[_Iterable[str]] = ..., deadline_unix: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class SignalPreemptionResponse(_message.Message):
    __slots__ = ("event_seq",)
    EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    event_seq: int
    def __init__(self, event_seq: _Optional[int] = ...) -> None: ...

class OfferResourcesRequest(_message.Message):
    __slots__ = ("job", "devices", "hosts", "expected_duration_s")
    JOB_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    job: str
    devices: int
    hosts: _containers.RepeatedScalarFieldContainer[str]
    expected_duration_s: float
    def __init__(self, job: _Optional[str] = ..., devices: _Optional[int] = ..., hosts: _Optional[_Iterable[str]] = ..., expected_duration_s: _Optional[float] = ...) -> None: ...

class OfferResourcesResponse(_message.Message):
    __slots__ = ("accepted", "reason", "event_seq", "admitted_workers")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    event_seq: int
    admitted_workers: int
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., event_seq: _Optional[int] = ..., admitted_workers: _Optional[int] = ...) -> None: ...

class ReclaimResourcesRequest(_message.Message):
    __slots__ = ("job", "devices", "deadline_unix")
    JOB_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    job: str
    devices: int
    deadline_unix: float
    def __init__(self, job: _Optional[str] = ..., devices: _Optional[int] = ..., deadline_unix: _Optional[float] = ...) -> None: ...

class ReclaimResourcesResponse(_message.Message):
    __slots__ = ("worker_ids", "event_seq")
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    event_seq: int
    def __init__(self, worker_ids: _Optional[_Iterable[str]] = ..., event_seq: _Optional[int] = ...) -> None: ...

class GetJobStateRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class GetJobStateResponse(_message.Message):
    __slots__ = ("job", "phase", "members", "plan_epoch", "last_event_seq", "final_checkpoint", "end_reason", "latest_checkpoint")
    JOB_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    FINAL_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    END_REASON_FIELD_NUMBER: _ClassVar[int]
    LATEST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    job: str
    phase: _common_pb2.JobPhase
    members: _containers.RepeatedCompositeFieldContainer[_common_pb2.Member]
    plan_epoch: int
    last_event_seq: int
    final_checkpoint: str
    end_reason: str
    latest_checkpoint: str
    def __init__(self, job: _Optional[str] = ..., phase: _Optional[_Union[_common_pb2.JobPhase, str]] = ..., members: _Optional[_Iterable[_Union[_common_pb2.Member, _Mapping]]] = ..., plan_epoch: _Optional[int] = ..., last_event_seq: _Optional[int] = ..., final_checkpoint: _Optional[str] = ..., end_reason: _Optional[str] = ..., latest_checkpoint: _Optional[str] = ...) -> None: ...

class EndJobRequest(_message.Message):
    __slots__ = ("job", "reason")
    JOB_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job: str
    reason: str
    def __init__(self, job: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class EndJobResponse(_message.Message):
    __slots__ = ("phase", "event_seq", "stopping_worker_ids")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    STOPPING_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    phase: _common_pb2.JobPhase
    event_seq: int
    stopping_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, phase: _Optional[_Union[_common_pb2.JobPhase, str]] = ..., event_seq: _Optional[int] = ..., stopping_worker_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetScaleTableRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class ScaleTableRow(_message.Message):
    __slots__ = ("devices", "dp", "pp", "tp", "throughput_samples_per_s", "step_time_s")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    devices: int
    dp: int
    pp: int
    tp: int
    throughput_samples_per_s: float
    step_time_s: float
    def __init__(self, devices: _Optional[int] = ..., dp: _Optional[int] = ..., pp: _Optional[int] = ..., tp: _Optional[int] = ..., throughput_samples_per_s: _Optional[float] = ..., step_time_s: _Optional[float] = ...) -> None: ...

class GetScaleTableResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[ScaleTableRow]
    def __init__(self, rows: _Optional[_Iterable[_Union[ScaleTableRow, _Mapping]]] = ...) -> None: ...

class PlanWhatIfRequest(_message.Message):
    __slots__ = ("job", "remove_worker_ids", "add_devices")
    JOB_FIELD_NUMBER: _ClassVar[int]
    REMOVE_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    ADD_DEVICES_FIELD_NUMBER: _ClassVar[int]
    job: str
    remove_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    add_devices: int
    def __init__(self, job: _Optional[str] = ..., remove_worker_ids: _Optional[_Iterable[str]] = ..., add_devices: _Optional[int] = ...) -> None: ...

class PlanWhatIfResponse(_message.Message):
    __slots__ = ("plan", "runnable", "reason")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    RUNNABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    plan: _common_pb2.Plan
    runnable: bool
    reason: str
    def __init__(self, plan: _Optional[_Union[_common_pb2.Plan, _Mapping]] = ..., runnable: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...
