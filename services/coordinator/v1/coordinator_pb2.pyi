from rlsync.common.v1 import generate_pb2 as _generate_pb2
from rlsync.trainer.v1 import trainer_pb2 as _trainer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_ROLLOUT: _ClassVar[Role]
    ROLE_TRAINER: _ClassVar[Role]

class SyncMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SYNC_MODE_UNSPECIFIED: _ClassVar[SyncMode]
    SYNC_MODE_COLOCATED: _ClassVar[SyncMode]
    SYNC_MODE_ASYNC: _ClassVar[SyncMode]
    SYNC_MODE_INFLIGHT: _ClassVar[SyncMode]
ROLE_UNSPECIFIED: Role
ROLE_ROLLOUT: Role
ROLE_TRAINER: Role
SYNC_MODE_UNSPECIFIED: SyncMode
SYNC_MODE_COLOCATED: SyncMode
SYNC_MODE_ASYNC: SyncMode
SYNC_MODE_INFLIGHT: SyncMode

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SyncWeightsRequest(_message.Message):
    __slots__ = ("version", "force_backend", "verify")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FORCE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    version: int
    force_backend: str
    verify: bool
    def __init__(self, version: _Optional[int] = ..., force_backend: _Optional[str] = ..., verify: _Optional[bool] = ...) -> None: ...

class SyncWeightsResponse(_message.Message):
    __slots__ = ("version", "mode", "phases", "seconds", "replicas", "bytes", "backends", "verified", "transfer_profile", "wire_bytes", "trainer_rank_bytes")
    class PhasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class BackendsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TransferProfileEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_PROFILE_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRAINER_RANK_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    mode: SyncMode
    phases: _containers.ScalarMap[str, float]
    seconds: float
    replicas: int
    bytes: int
    backends: _containers.ScalarMap[str, int]
    verified: bool
    transfer_profile: _containers.ScalarMap[str, float]
    wire_bytes: int
    trainer_rank_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., mode: _Optional[_Union[SyncMode, str]] = ..., phases: _Optional[_Mapping[str, float]] = ..., seconds: _Optional[float] = ..., replicas: _Optional[int] = ..., bytes: _Optional[int] = ..., backends: _Optional[_Mapping[str, int]] = ..., verified: _Optional[bool] = ..., transfer_profile: _Optional[_Mapping[str, float]] = ..., wire_bytes: _Optional[int] = ..., trainer_rank_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Member(_message.Message):
    __slots__ = ("id", "role", "address", "state", "weight_version", "seconds_since_heartbeat", "in_flight", "name", "backend", "suspect", "seconds_since_progress")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    id: str
    role: Role
    address: str
    state: str
    weight_version: int
    seconds_since_heartbeat: float
    in_flight: int
    name: str
    backend: str
    suspect: str
    seconds_since_progress: float
    def __init__(self, id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., weight_version: _Optional[int] = ..., seconds_since_heartbeat: _Optional[float] = ..., in_flight: _Optional[int] = ..., name: _Optional[str] = ..., backend: _Optional[str] = ..., suspect: _Optional[str] = ..., seconds_since_progress: _Optional[float] = ...) -> None: ...

class FleetStatus(_message.Message):
    __slots__ = ("mode", "weight_version", "trainer_step", "members", "max_staleness", "gateway_in_flight", "resubmissions", "syncs")
    MODE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RESUBMISSIONS_FIELD_NUMBER: _ClassVar[int]
    SYNCS_FIELD_NUMBER: _ClassVar[int]
    mode: SyncMode
    weight_version: int
    trainer_step: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    max_staleness: int
    gateway_in_flight: int
    resubmissions: int
    syncs: int
    def __init__(self, mode: _Optional[_Union[SyncMode, str]] = ..., weight_version: _Optional[int] = ..., trainer_step: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., max_staleness: _Optional[int] = ..., gateway_in_flight: _Optional[int] = ..., resubmissions: _Optional[int] = ..., syncs: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("role", "address", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: Role
    address: str
    name: str
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., address: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("member_id", "heartbeat_interval", "lease")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    heartbeat_interval: float
    lease: float
    def __init__(self, member_id: _Optional[str] = ..., heartbeat_interval: _Optional[float] = ..., lease: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("member_id", "progress", "cpu_seconds")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    progress: int
    cpu_seconds: float
    def __init__(self, member_id: _Optional[str] = ..., progress: _Optional[int] = ..., cpu_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("member_id", "reason")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    reason: str
    def __init__(self, member_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
