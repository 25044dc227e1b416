from rlsync.common.v1 import weights_pb2 as _weights_pb2
from rlsync.transfer.v1 import transfer_pb2 as _transfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StalePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STALE_POLICY_UNSPECIFIED: _ClassVar[StalePolicy]
    STALE_POLICY_KEEP: _ClassVar[StalePolicy]
    STALE_POLICY_DROP: _ClassVar[StalePolicy]
    STALE_POLICY_DOWNWEIGHT: _ClassVar[StalePolicy]
STALE_POLICY_UNSPECIFIED: StalePolicy
STALE_POLICY_KEEP: StalePolicy
STALE_POLICY_DROP: StalePolicy
STALE_POLICY_DOWNWEIGHT: StalePolicy

class Trajectory(_message.Message):
    __slots__ = ("prompt_ids", "completion_ids", "reward", "advantage", "behavior_logprobs", "token_versions", "group_id")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    reward: float
    advantage: float
    behavior_logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_versions: _containers.RepeatedScalarFieldContainer[int]
    group_id: str
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., completion_ids: _Optional[_Iterable[int]] = ..., reward: _Optional[float] = ..., advantage: _Optional[float] = ..., behavior_logprobs: _Optional[_Iterable[float]] = ..., token_versions: _Optional[_Iterable[int]] = ..., group_id: _Optional[str] = ...) -> None: ...

class TrainRequest(_message.Message):
    __slots__ = ("trajectories", "max_staleness", "stale_policy", "stale_weight")
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    STALE_POLICY_FIELD_NUMBER: _ClassVar[int]
    STALE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    max_staleness: int
    stale_policy: StalePolicy
    stale_weight: float
    def __init__(self, trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ..., max_staleness: _Optional[int] = ..., stale_policy: _Optional[_Union[StalePolicy, str]] = ..., stale_weight: _Optional[float] = ...) -> None: ...

class TrainResponse(_message.Message):
    __slots__ = ("step", "metrics", "trajectories_used", "stale", "dropped")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_USED_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    step: int
    metrics: _containers.ScalarMap[str, float]
    trajectories_used: int
    stale: int
    dropped: int
    def __init__(self, step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., trajectories_used: _Optional[int] = ..., stale: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerState(_message.Message):
    __slots__ = ("step", "model", "device", "offloaded", "device_bytes", "device_reserved_bytes", "parameters", "dtype")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    step: int
    model: str
    device: str
    offloaded: bool
    device_bytes: int
    device_reserved_bytes: int
    parameters: int
    dtype: str
    def __init__(self, step: _Optional[int] = ..., model: _Optional[str] = ..., device: _Optional[str] = ..., offloaded: _Optional[bool] = ..., device_bytes: _Optional[int] = ..., device_reserved_bytes: _Optional[int] = ..., parameters: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class OffloadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OffloadResponse(_message.Message):
    __slots__ = ("state", "released")
    STATE_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    state: TrainerState
    released: int
    def __init__(self, state: _Optional[_Union[TrainerState, _Mapping]] = ..., released: _Optional[int] = ...) -> None: ...

class OnloadRequest(_message.Message):
    __slots__ = ("ring",)
    RING_FIELD_NUMBER: _ClassVar[int]
    ring: _containers.RepeatedCompositeFieldContainer[_transfer_pb2.Doorbell]
    def __init__(self, ring: _Optional[_Iterable[_Union[_transfer_pb2.Doorbell, _Mapping]]] = ...) -> None: ...

class OnloadResponse(_message.Message):
    __slots__ = ("state", "held")
    STATE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    state: TrainerState
    held: int
    def __init__(self, state: _Optional[_Union[TrainerState, _Mapping]] = ..., held: _Optional[int] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class LoadCheckpointResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class OfferWeightsRequest(_message.Message):
    __slots__ = ("version", "pull", "ring", "force_backend", "timeout", "hold", "publish", "format")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    FORCE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    version: int
    pull: bool
    ring: _containers.RepeatedCompositeFieldContainer[_transfer_pb2.Doorbell]
    force_backend: str
    timeout: float
    hold: bool
    publish: bool
    format: _transfer_pb2.WeightFormat
    def __init__(self, version: _Optional[int] = ..., pull: _Optional[bool] = ..., ring: _Optional[_Iterable[_Union[_transfer_pb2.Doorbell, _Mapping]]] = ..., force_backend: _Optional[str] = ..., timeout: _Optional[float] = ..., hold: _Optional[bool] = ..., publish: _Optional[bool] = ..., format: _Optional[_Union[_transfer_pb2.WeightFormat, _Mapping]] = ...) -> None: ...

class OfferWeightsResponse(_message.Message):
    __slots__ = ("offer", "rung", "ring_seconds", "publishing")
    OFFER_FIELD_NUMBER: _ClassVar[int]
    RUNG_FIELD_NUMBER: _ClassVar[int]
    RING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHING_FIELD_NUMBER: _ClassVar[int]
    offer: _transfer_pb2.Offer
    rung: _containers.RepeatedCompositeFieldContainer[Rung]
    ring_seconds: float
    publishing: bool
    def __init__(self, offer: _Optional[_Union[_transfer_pb2.Offer, _Mapping]] = ..., rung: _Optional[_Iterable[_Union[Rung, _Mapping]]] = ..., ring_seconds: _Optional[float] = ..., publishing: _Optional[bool] = ...) -> None: ...

class Rung(_message.Message):
    __slots__ = ("rung", "answer")
    RUNG_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    rung: bool
    answer: _transfer_pb2.Answer
    def __init__(self, rung: _Optional[bool] = ..., answer: _Optional[_Union[_transfer_pb2.Answer, _Mapping]] = ...) -> None: ...

class PublishWeightsRequest(_message.Message):
    __slots__ = ("transfer_id", "answers", "timeout")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    answers: _containers.RepeatedCompositeFieldContainer[_transfer_pb2.Answer]
    timeout: float
    def __init__(self, transfer_id: _Optional[str] = ..., answers: _Optional[_Iterable[_Union[_transfer_pb2.Answer, _Mapping]]] = ..., timeout: _Optional[float] = ...) -> None: ...

class PublishWeightsResponse(_message.Message):
    __slots__ = ("version", "bytes", "seconds", "data_seconds", "backends", "profile", "wire_bytes", "rank_bytes")
    class BackendsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ProfileEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    DATA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RANK_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    bytes: int
    seconds: float
    data_seconds: float
    backends: _containers.ScalarMap[str, int]
    profile: _containers.ScalarMap[str, float]
    wire_bytes: int
    rank_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., data_seconds: _Optional[float] = ..., backends: _Optional[_Mapping[str, int]] = ..., profile: _Optional[_Mapping[str, float]] = ..., wire_bytes: _Optional[int] = ..., rank_bytes: _Optional[_Iterable[int]] = ...) -> None: ...
