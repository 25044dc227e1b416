from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Backend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_UNSPECIFIED: _ClassVar[Backend]
    BACKEND_CUDA_IPC: _ClassVar[Backend]
    BACKEND_NCCL: _ClassVar[Backend]
    BACKEND_SHM: _ClassVar[Backend]
    BACKEND_GLOO: _ClassVar[Backend]
BACKEND_UNSPECIFIED: Backend
BACKEND_CUDA_IPC: Backend
BACKEND_NCCL: Backend
BACKEND_SHM: Backend
BACKEND_GLOO: Backend

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes", "checksum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    checksum: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[str] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("tensors", "version", "adapter", "format")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    version: int
    adapter: LoraAdapter
    format: WeightFormat
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., version: _Optional[int] = ..., adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ..., format: _Optional[_Union[WeightFormat, _Mapping]] = ...) -> None: ...

class WeightFormat(_message.Message):
    __slots__ = ("fp8", "stacked_experts")
    FP8_FIELD_NUMBER: _ClassVar[int]
    STACKED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    fp8: Fp8Blocks
    stacked_experts: bool
    def __init__(self, fp8: _Optional[_Union[Fp8Blocks, _Mapping]] = ..., stacked_experts: _Optional[bool] = ...) -> None: ...

class Fp8Blocks(_message.Message):
    __slots__ = ("fmt", "block", "scale_dtype", "pow2_scales", "weights")
    FMT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    SCALE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    POW2_SCALES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    fmt: str
    block: _containers.RepeatedScalarFieldContainer[int]
    scale_dtype: str
    pow2_scales: bool
    weights: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, fmt: _Optional[str] = ..., block: _Optional[_Iterable[int]] = ..., scale_dtype: _Optional[str] = ..., pow2_scales: _Optional[bool] = ..., weights: _Optional[_Iterable[str]] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("rank", "alpha", "use_rslora", "base_version")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    USE_RSLORA_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    use_rslora: bool
    base_version: int
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., use_rslora: _Optional[bool] = ..., base_version: _Optional[int] = ...) -> None: ...

class Facts(_message.Message):
    __slots__ = ("host_id", "device_type", "gpu_uuids", "hostname", "peer_uuids")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PEER_UUIDS_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    device_type: str
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    hostname: str
    peer_uuids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, host_id: _Optional[str] = ..., device_type: _Optional[str] = ..., gpu_uuids: _Optional[_Iterable[str]] = ..., hostname: _Optional[str] = ..., peer_uuids: _Optional[_Iterable[str]] = ...) -> None: ...

class Offer(_message.Message):
    __slots__ = ("protocol_version", "manifest", "facts", "backends", "token", "control_address", "local_control", "bucket_bytes", "one_copy", "transfer_id", "mapped", "routing", "post_ahead", "peer_readers")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    FACTS_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CONTROL_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    ONE_COPY_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    MAPPED_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    POST_AHEAD_FIELD_NUMBER: _ClassVar[int]
    PEER_READERS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    manifest: Manifest
    facts: Facts
    backends: _containers.RepeatedScalarFieldContainer[Backend]
    token: str
    control_address: str
    local_control: str
    bucket_bytes: int
    one_copy: bool
    transfer_id: str
    mapped: MappedTensors
    routing: Routing
    post_ahead: bool
    peer_readers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, protocol_version: _Optional[int] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., facts: _Optional[_Union[Facts, _Mapping]] = ..., backends: _Optional[_Iterable[_Union[Backend, str]]] = ..., token: _Optional[str] = ..., control_address: _Optional[str] = ..., local_control: _Optional[str] = ..., bucket_bytes: _Optional[int] = ..., one_copy: _Optional[bool] = ..., transfer_id: _Optional[str] = ..., mapped: _Optional[_Union[MappedTensors, _Mapping]] = ..., routing: _Optional[_Union[Routing, _Mapping]] = ..., post_ahead: _Optional[bool] = ..., peer_readers: _Optional[_Iterable[str]] = ...) -> None: ...

class Box(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, start: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[int]] = ...) -> None: ...

class RankLayout(_message.Message):
    __slots__ = ("tensors", "facts")
    class Boxes(_message.Message):
        __slots__ = ("boxes",)
        BOXES_FIELD_NUMBER: _ClassVar[int]
        boxes: _containers.RepeatedCompositeFieldContainer[Box]
        def __init__(self, boxes: _Optional[_Iterable[_Union[Box, _Mapping]]] = ...) -> None: ...
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FACTS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[RankLayout.Boxes]
    facts: Facts
    def __init__(self, tensors: _Optional[_Iterable[_Union[RankLayout.Boxes, _Mapping]]] = ..., facts: _Optional[_Union[Facts, _Mapping]] = ...) -> None: ...

class RankMemory(_message.Message):
    __slots__ = ("facts", "ipc", "held", "groups", "regions", "digest")
    class Held(_message.Message):
        __slots__ = ("region", "offset", "stride", "dtype")
        REGION_FIELD_NUMBER: _ClassVar[int]
        OFFSET_FIELD_NUMBER: _ClassVar[int]
        STRIDE_FIELD_NUMBER: _ClassVar[int]
        DTYPE_FIELD_NUMBER: _ClassVar[int]
        region: int
        offset: int
        stride: _containers.RepeatedScalarFieldContainer[int]
        dtype: str
        def __init__(self, region: _Optional[int] = ..., offset: _Optional[int] = ..., stride: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...
    FACTS_FIELD_NUMBER: _ClassVar[int]
    IPC_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    facts: Facts
    ipc: _containers.RepeatedScalarFieldContainer[bytes]
    held: _containers.RepeatedCompositeFieldContainer[RankMemory.Held]
    groups: _containers.RepeatedScalarFieldContainer[str]
    regions: int
    digest: str
    def __init__(self, facts: _Optional[_Union[Facts, _Mapping]] = ..., ipc: _Optional[_Iterable[bytes]] = ..., held: _Optional[_Iterable[_Union[RankMemory.Held, _Mapping]]] = ..., groups: _Optional[_Iterable[str]] = ..., regions: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class RoutedGroup(_message.Message):
    __slots__ = ("id", "reuse")
    ID_FIELD_NUMBER: _ClassVar[int]
    REUSE_FIELD_NUMBER: _ClassVar[int]
    id: str
    reuse: bool
    def __init__(self, id: _Optional[str] = ..., reuse: _Optional[bool] = ...) -> None: ...

class Roster(_message.Message):
    __slots__ = ("answers", "layouts", "layout_of", "facts")
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_OF_FIELD_NUMBER: _ClassVar[int]
    FACTS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[Answer]
    layouts: _containers.RepeatedCompositeFieldContainer[RankLayout]
    layout_of: _containers.RepeatedScalarFieldContainer[int]
    facts: _containers.RepeatedCompositeFieldContainer[Facts]
    def __init__(self, answers: _Optional[_Iterable[_Union[Answer, _Mapping]]] = ..., layouts: _Optional[_Iterable[_Union[RankLayout, _Mapping]]] = ..., layout_of: _Optional[_Iterable[int]] = ..., facts: _Optional[_Iterable[_Union[Facts, _Mapping]]] = ...) -> None: ...

class RoutedSend(_message.Message):
    __slots__ = ("offer", "answers", "timeout_seconds")
    OFFER_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    offer: Offer
    answers: _containers.RepeatedCompositeFieldContainer[Answer]
    timeout_seconds: float
    def __init__(self, offer: _Optional[_Union[Offer, _Mapping]] = ..., answers: _Optional[_Iterable[_Union[Answer, _Mapping]]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class AuditShares(_message.Message):
    __slots__ = ("dtype", "format")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    format: WeightFormat
    def __init__(self, dtype: _Optional[str] = ..., format: _Optional[_Union[WeightFormat, _Mapping]] = ...) -> None: ...

class Routing(_message.Message):
    __slots__ = ("store", "layout", "holder", "memories")
    STORE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    MEMORIES_FIELD_NUMBER: _ClassVar[int]
    store: str
    layout: str
    holder: str
    memories: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, store: _Optional[str] = ..., layout: _Optional[str] = ..., holder: _Optional[str] = ..., memories: _Optional[_Iterable[str]] = ...) -> None: ...

class RankDigest(_message.Message):
    __slots__ = ("digest", "mapped", "replaces", "error")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    MAPPED_FIELD_NUMBER: _ClassVar[int]
    REPLACES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    digest: str
    mapped: bytes
    replaces: str
    error: str
    def __init__(self, digest: _Optional[str] = ..., mapped: _Optional[bytes] = ..., replaces: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class TrainerLayout(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankLayout]
    def __init__(self, ranks: _Optional[_Iterable[_Union[RankLayout, _Mapping]]] = ...) -> None: ...

class MappedTensors(_message.Message):
    __slots__ = ("ipc", "region", "offset", "waits", "bell", "dtype")
    IPC_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    WAITS_FIELD_NUMBER: _ClassVar[int]
    BELL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ipc: _containers.RepeatedScalarFieldContainer[bytes]
    region: _containers.RepeatedScalarFieldContainer[int]
    offset: _containers.RepeatedScalarFieldContainer[int]
    waits: bool
    bell: int
    dtype: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ipc: _Optional[_Iterable[bytes]] = ..., region: _Optional[_Iterable[int]] = ..., offset: _Optional[_Iterable[int]] = ..., waits: _Optional[bool] = ..., bell: _Optional[int] = ..., dtype: _Optional[_Iterable[str]] = ...) -> None: ...

class Answer(_message.Message):
    __slots__ = ("backend", "receiver_id", "ranks", "bucket_bytes", "reason", "facts", "transfer_id", "pull", "stages", "delta", "base_version", "copied", "layout", "groups")
    class StagesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FACTS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    COPIED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    backend: Backend
    receiver_id: str
    ranks: int
    bucket_bytes: int
    reason: str
    facts: Facts
    transfer_id: str
    pull: bool
    stages: _containers.ScalarMap[str, float]
    delta: bool
    base_version: int
    copied: _containers.RepeatedScalarFieldContainer[bytes]
    layout: _containers.RepeatedCompositeFieldContainer[RankLayout]
    groups: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, backend: _Optional[_Union[Backend, str]] = ..., receiver_id: _Optional[str] = ..., ranks: _Optional[int] = ..., bucket_bytes: _Optional[int] = ..., reason: _Optional[str] = ..., facts: _Optional[_Union[Facts, _Mapping]] = ..., transfer_id: _Optional[str] = ..., pull: _Optional[bool] = ..., stages: _Optional[_Mapping[str, float]] = ..., delta: _Optional[bool] = ..., base_version: _Optional[int] = ..., copied: _Optional[_Iterable[bytes]] = ..., layout: _Optional[_Iterable[_Union[RankLayout, _Mapping]]] = ..., groups: _Optional[_Iterable[str]] = ...) -> None: ...

class Doorbell(_message.Message):
    __slots__ = ("host_id", "address", "name")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    address: str
    name: str
    def __init__(self, host_id: _Optional[str] = ..., address: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class BellHandle(_message.Message):
    __slots__ = ("device", "host")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    device: CudaIpcHandle
    host: HostWords
    def __init__(self, device: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., host: _Optional[_Union[HostWords, _Mapping]] = ...) -> None: ...

class HostWords(_message.Message):
    __slots__ = ("pid", "fd", "host_id", "nonce")
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    pid: int
    fd: int
    host_id: str
    nonce: int
    def __init__(self, pid: _Optional[int] = ..., fd: _Optional[int] = ..., host_id: _Optional[str] = ..., nonce: _Optional[int] = ...) -> None: ...
