from rlsync.common.v1 import generate_pb2 as _generate_pb2
from rlsync.common.v1 import weights_pb2 as _weights_pb2
from rlsync.transfer.v1 import transfer_pb2 as _transfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_UNSPECIFIED: _ClassVar[PauseMode]
    PAUSE_MODE_ABORT: _ClassVar[PauseMode]
    PAUSE_MODE_KEEP: _ClassVar[PauseMode]
    PAUSE_MODE_WAIT: _ClassVar[PauseMode]

class WakeTag(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WAKE_TAG_UNSPECIFIED: _ClassVar[WakeTag]
    WAKE_TAG_WEIGHTS: _ClassVar[WakeTag]
    WAKE_TAG_KV_CACHE: _ClassVar[WakeTag]

class ServingState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVING_STATE_UNSPECIFIED: _ClassVar[ServingState]
    SERVING_STATE_SERVING: _ClassVar[ServingState]
    SERVING_STATE_PAUSED: _ClassVar[ServingState]
    SERVING_STATE_SLEEPING: _ClassVar[ServingState]
    SERVING_STATE_DEAD: _ClassVar[ServingState]
PAUSE_MODE_UNSPECIFIED: PauseMode
PAUSE_MODE_ABORT: PauseMode
PAUSE_MODE_KEEP: PauseMode
PAUSE_MODE_WAIT: PauseMode
WAKE_TAG_UNSPECIFIED: WakeTag
WAKE_TAG_WEIGHTS: WakeTag
WAKE_TAG_KV_CACHE: WakeTag
SERVING_STATE_UNSPECIFIED: ServingState
SERVING_STATE_SERVING: ServingState
SERVING_STATE_PAUSED: ServingState
SERVING_STATE_SLEEPING: ServingState
SERVING_STATE_DEAD: ServingState

class PrepareUpdateRequest(_message.Message):
    __slots__ = ("offer", "force_backend", "timeout", "force")
    OFFER_FIELD_NUMBER: _ClassVar[int]
    FORCE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    offer: _transfer_pb2.Offer
    force_backend: str
    timeout: float
    force: bool
    def __init__(self, offer: _Optional[_Union[_transfer_pb2.Offer, _Mapping]] = ..., force_backend: _Optional[str] = ..., timeout: _Optional[float] = ..., force: _Optional[bool] = ...) -> None: ...

class PrepareUpdateResponse(_message.Message):
    __slots__ = ("answer",)
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    answer: _transfer_pb2.Answer
    def __init__(self, answer: _Optional[_Union[_transfer_pb2.Answer, _Mapping]] = ...) -> None: ...

class CommitUpdateRequest(_message.Message):
    __slots__ = ("version", "force", "timeout", "recompute_kv")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_KV_FIELD_NUMBER: _ClassVar[int]
    version: int
    force: bool
    timeout: float
    recompute_kv: bool
    def __init__(self, version: _Optional[int] = ..., force: _Optional[bool] = ..., timeout: _Optional[float] = ..., recompute_kv: _Optional[bool] = ...) -> None: ...

class CommitUpdateResponse(_message.Message):
    __slots__ = ("version", "wait_seconds", "switch_seconds", "changed", "recomputed", "stages")
    class StagesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWITCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    version: int
    wait_seconds: float
    switch_seconds: float
    changed: bool
    recomputed: int
    stages: _containers.ScalarMap[str, float]
    def __init__(self, version: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., switch_seconds: _Optional[float] = ..., changed: _Optional[bool] = ..., recomputed: _Optional[int] = ..., stages: _Optional[_Mapping[str, float]] = ...) -> None: ...

class HoldWeightsRequest(_message.Message):
    __slots__ = ("holder", "mapped", "facts", "routing")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    MAPPED_FIELD_NUMBER: _ClassVar[int]
    FACTS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    holder: str
    mapped: _transfer_pb2.MappedTensors
    facts: _transfer_pb2.Facts
    routing: _transfer_pb2.Routing
    def __init__(self, holder: _Optional[str] = ..., mapped: _Optional[_Union[_transfer_pb2.MappedTensors, _Mapping]] = ..., facts: _Optional[_Union[_transfer_pb2.Facts, _Mapping]] = ..., routing: _Optional[_Union[_transfer_pb2.Routing, _Mapping]] = ...) -> None: ...

class HoldWeightsResponse(_message.Message):
    __slots__ = ("mapped", "held", "seconds", "bell", "peer_gpu")
    MAPPED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BELL_FIELD_NUMBER: _ClassVar[int]
    PEER_GPU_FIELD_NUMBER: _ClassVar[int]
    mapped: int
    held: int
    seconds: float
    bell: bytes
    peer_gpu: str
    def __init__(self, mapped: _Optional[int] = ..., held: _Optional[int] = ..., seconds: _Optional[float] = ..., bell: _Optional[bytes] = ..., peer_gpu: _Optional[str] = ...) -> None: ...

class ReleaseWeightsRequest(_message.Message):
    __slots__ = ("holder",)
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    holder: str
    def __init__(self, holder: _Optional[str] = ...) -> None: ...

class ReleaseWeightsResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class AbortUpdateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortUpdateResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: PauseMode
    def __init__(self, mode: _Optional[_Union[PauseMode, str]] = ...) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("aborted", "in_flight")
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    aborted: int
    in_flight: int
    def __init__(self, aborted: _Optional[int] = ..., in_flight: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ("aborted", "memory")
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    aborted: int
    memory: MemoryUsage
    def __init__(self, aborted: _Optional[int] = ..., memory: _Optional[_Union[MemoryUsage, _Mapping]] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[WakeTag]
    def __init__(self, tags: _Optional[_Iterable[_Union[WakeTag, str]]] = ...) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ("memory",)
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    memory: MemoryUsage
    def __init__(self, memory: _Optional[_Union[MemoryUsage, _Mapping]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemoryUsage(_message.Message):
    __slots__ = ("device", "weights_bytes", "kv_cache_bytes", "device_reserved_bytes", "staging_bytes", "spare_bytes")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPARE_BYTES_FIELD_NUMBER: _ClassVar[int]
    device: str
    weights_bytes: int
    kv_cache_bytes: int
    device_reserved_bytes: int
    staging_bytes: int
    spare_bytes: int
    def __init__(self, device: _Optional[str] = ..., weights_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., device_reserved_bytes: _Optional[int] = ..., staging_bytes: _Optional[int] = ..., spare_bytes: _Optional[int] = ...) -> None: ...

class RolloutInfo(_message.Message):
    __slots__ = ("engine", "model", "weight_version", "state", "in_flight", "asleep", "max_model_len", "tensor_parallel_size", "replica_id", "memory", "vocab_size", "pending_version", "dtype", "dead_reason", "requests_admitted", "doorbell", "received_bytes", "weight_format")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ASLEEP_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PENDING_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEAD_REASON_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    engine: str
    model: str
    weight_version: int
    state: ServingState
    in_flight: int
    asleep: _containers.RepeatedScalarFieldContainer[WakeTag]
    max_model_len: int
    tensor_parallel_size: int
    replica_id: str
    memory: MemoryUsage
    vocab_size: int
    pending_version: int
    dtype: str
    dead_reason: str
    requests_admitted: int
    doorbell: _transfer_pb2.Doorbell
    received_bytes: _containers.RepeatedScalarFieldContainer[int]
    weight_format: _transfer_pb2.WeightFormat
    def __init__(self, engine: _Optional[str] = ..., model: _Optional[str] = ..., weight_version: _Optional[int] = ..., state: _Optional[_Union[ServingState, str]] = ..., in_flight: _Optional[int] = ..., asleep: _Optional[_Iterable[_Union[WakeTag, str]]] = ..., max_model_len: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., replica_id: _Optional[str] = ..., memory: _Optional[_Union[MemoryUsage, _Mapping]] = ..., vocab_size: _Optional[int] = ..., pending_version: _Optional[int] = ..., dtype: _Optional[str] = ..., dead_reason: _Optional[str] = ..., requests_admitted: _Optional[int] = ..., doorbell: _Optional[_Union[_transfer_pb2.Doorbell, _Mapping]] = ..., received_bytes: _Optional[_Iterable[int]] = ..., weight_format: _Optional[_Union[_transfer_pb2.WeightFormat, _Mapping]] = ...) -> None: ...
