from wire.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PlanPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLAN_PHASE_UNSPECIFIED: _ClassVar[PlanPhase]
    PLAN_PHASE_RECEIVED: _ClassVar[PlanPhase]
    PLAN_PHASE_PAUSED: _ClassVar[PlanPhase]
    PLAN_PHASE_APPLIED: _ClassVar[PlanPhase]
    PLAN_PHASE_RESUMED: _ClassVar[PlanPhase]
    PLAN_PHASE_FAILED: _ClassVar[PlanPhase]
    PLAN_PHASE_REPROTECTED: _ClassVar[PlanPhase]

class PlanFailure(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLAN_FAILURE_UNSPECIFIED: _ClassVar[PlanFailure]
    PLAN_FAILURE_NOT_APPLICABLE: _ClassVar[PlanFailure]
    PLAN_FAILURE_INTERRUPTED: _ClassVar[PlanFailure]
PLAN_PHASE_UNSPECIFIED: PlanPhase
PLAN_PHASE_RECEIVED: PlanPhase
PLAN_PHASE_PAUSED: PlanPhase
PLAN_PHASE_APPLIED: PlanPhase
PLAN_PHASE_RESUMED: PlanPhase
PLAN_PHASE_FAILED: PlanPhase
PLAN_PHASE_REPROTECTED: PlanPhase
PLAN_FAILURE_UNSPECIFIED: PlanFailure
PLAN_FAILURE_NOT_APPLICABLE: PlanFailure
PLAN_FAILURE_INTERRUPTED: PlanFailure

class SubscribePlansRequest(_message.Message):
    __slots__ = ("job", "worker_id", "after_epoch")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    job: str
    worker_id: str
    after_epoch: int
    def __init__(self, job: _Optional[str] = ..., worker_id: _Optional[str] = ..., after_epoch: _Optional[int] = ...) -> None: ...

class SubscribePlansResponse(_message.Message):
    __slots__ = ("plan",)
    PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: _common_pb2.Plan
    def __init__(self, plan: _Optional[_Union[_common_pb2.Plan, _Mapping]] = ...) -> None: ...

class AckPlanPhaseRequest(_message.Message):
    __slots__ = ("job", "worker_id", "epoch", "phase", "failure_reason", "phase_time_s", "failure", "steps_replayed", "backup_window")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    PHASE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    STEPS_REPLAYED_FIELD_NUMBER: _ClassVar[int]
    BACKUP_WINDOW_FIELD_NUMBER: _ClassVar[int]
    job: str
    worker_id: str
    epoch: int
    phase: PlanPhase
    failure_reason: str
    phase_time_s: float
    failure: PlanFailure
    steps_replayed: int
    backup_window: BackupWindow
    def __init__(self, job: _Optional[str] = ..., worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., phase: _Optional[_Union[PlanPhase, str]] = ..., failure_reason: _Optional[str] = ..., phase_time_s: _Optional[float] = ..., failure: _Optional[_Union[PlanFailure, str]] = ..., steps_replayed: _Optional[int] = ..., backup_window: _Optional[_Union[BackupWindow, _Mapping]] = ...) -> None: ...

class BackupPair(_message.Message):
    __slots__ = ("owner", "holder")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    owner: int
    holder: int
    def __init__(self, owner: _Optional[int] = ..., holder: _Optional[int] = ...) -> None: ...

class BackupWindow(_message.Message):
    __slots__ = ("pairs", "from_step", "until_step", "closed_step")
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    UNTIL_STEP_FIELD_NUMBER: _ClassVar[int]
    CLOSED_STEP_FIELD_NUMBER: _ClassVar[int]
    pairs: _containers.RepeatedCompositeFieldContainer[BackupPair]
    from_step: int
    until_step: int
    closed_step: int
    def __init__(self, pairs: _Optional[_Iterable[_Union[BackupPair, _Mapping]]] = ..., from_step: _Optional[int] = ..., until_step: _Optional[int] = ..., closed_step: _Optional[int] = ...) -> None: ...

class AckPlanPhaseResponse(_message.Message):
    __slots__ = ("current_epoch",)
    CURRENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    current_epoch: int
    def __init__(self, current_epoch: _Optional[int] = ...) -> None: ...

class ReportPeerFailureRequest(_message.Message):
    __slots__ = ("job", "worker_id", "peer_rank", "step", "operation", "error")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    job: str
    worker_id: str
    peer_rank: int
    step: int
    operation: str
    error: str
    def __init__(self, job: _Optional[str] = ..., worker_id: _Optional[str] = ..., peer_rank: _Optional[int] = ..., step: _Optional[int] = ..., operation: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class ReportPeerFailureResponse(_message.Message):
    __slots__ = ("peer_marked_lost", "peer_worker_id")
    PEER_MARKED_LOST_FIELD_NUMBER: _ClassVar[int]
    PEER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    peer_marked_lost: bool
    peer_worker_id: str
    def __init__(self, peer_marked_lost: _Optional[bool] = ..., peer_worker_id: _Optional[str] = ...) -> None: ...

class GetJobStoresRequest(_message.Message):
    __slots__ = ("job", "worker_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    worker_id: str
    def __init__(self, job: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class GetJobStoresResponse(_message.Message):
    __slots__ = ("stores",)
    STORES_FIELD_NUMBER: _ClassVar[int]
    stores: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stores: _Optional[_Iterable[str]] = ...) -> None: ...
