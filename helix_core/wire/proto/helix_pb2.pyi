from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_NONE: _ClassVar[ErrorKind]
    ERROR_SAMPLE: _ClassVar[ErrorKind]
    ERROR_SPEC: _ClassVar[ErrorKind]
    ERROR_INTERNAL: _ClassVar[ErrorKind]
    ERROR_NOT_COMPLETED: _ClassVar[ErrorKind]
    ERROR_DELIVERY_LOST: _ClassVar[ErrorKind]
    ERROR_NO_ROOM: _ClassVar[ErrorKind]
ERROR_NONE: ErrorKind
ERROR_SAMPLE: ErrorKind
ERROR_SPEC: ErrorKind
ERROR_INTERNAL: ErrorKind
ERROR_NOT_COMPLETED: ErrorKind
ERROR_DELIVERY_LOST: ErrorKind
ERROR_NO_ROOM: ErrorKind

class HelloRequest(_message.Message):
    __slots__ = ("protocol_version", "role")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    role: str
    def __init__(self, protocol_version: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("protocol_version", "cluster_id", "pickle_allowed", "bulk_port")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    PICKLE_ALLOWED_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    cluster_id: str
    pickle_allowed: bool
    bulk_port: int
    def __init__(self, protocol_version: _Optional[int] = ..., cluster_id: _Optional[str] = ..., pickle_allowed: _Optional[bool] = ..., bulk_port: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class RegisterServerRequest(_message.Message):
    __slots__ = ("address", "kind", "local_rank", "host", "workers")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    address: str
    kind: str
    local_rank: int
    host: str
    workers: int
    def __init__(self, address: _Optional[str] = ..., kind: _Optional[str] = ..., local_rank: _Optional[int] = ..., host: _Optional[str] = ..., workers: _Optional[int] = ...) -> None: ...

class RegisterServerReply(_message.Message):
    __slots__ = ("server_id", "cluster_id", "heartbeat_interval_s")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    cluster_id: str
    heartbeat_interval_s: float
    def __init__(self, server_id: _Optional[str] = ..., cluster_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class RegisterClientRequest(_message.Message):
    __slots__ = ("rank", "world_size", "host", "local_rank", "client_id", "task_id_base")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_BASE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    host: str
    local_rank: int
    client_id: str
    task_id_base: int
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., host: _Optional[str] = ..., local_rank: _Optional[int] = ..., client_id: _Optional[str] = ..., task_id_base: _Optional[int] = ...) -> None: ...

class RoundLeaderRequest(_message.Message):
    __slots__ = ("client_id", "rank")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    rank: int
    def __init__(self, client_id: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class RoundLeaderReply(_message.Message):
    __slots__ = ("server_id", "address", "host")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    address: str
    host: str
    def __init__(self, server_id: _Optional[str] = ..., address: _Optional[str] = ..., host: _Optional[str] = ...) -> None: ...

class RankSamples(_message.Message):
    __slots__ = ("rank", "indices", "release")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    indices: _containers.RepeatedScalarFieldContainer[int]
    release: _containers.RepeatedCompositeFieldContainer[SlabHandle]
    def __init__(self, rank: _Optional[int] = ..., indices: _Optional[_Iterable[int]] = ..., release: _Optional[_Iterable[_Union[SlabHandle, _Mapping]]] = ...) -> None: ...

class CommitRoundRequest(_message.Message):
    __slots__ = ("group", "run", "step", "ranks", "age_s")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    group: str
    run: str
    step: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankSamples]
    age_s: float
    def __init__(self, group: _Optional[str] = ..., run: _Optional[str] = ..., step: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankSamples, _Mapping]]] = ..., age_s: _Optional[float] = ...) -> None: ...

class CommitRoundReply(_message.Message):
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: bool
    def __init__(self, committed: _Optional[bool] = ...) -> None: ...

class RoundFateRequest(_message.Message):
    __slots__ = ("group", "run", "step", "rank", "age_s")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    group: str
    run: str
    step: int
    rank: int
    age_s: float
    def __init__(self, group: _Optional[str] = ..., run: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., age_s: _Optional[float] = ...) -> None: ...

class RoundFateReply(_message.Message):
    __slots__ = ("moved", "indices", "release")
    MOVED_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    moved: bool
    indices: _containers.RepeatedScalarFieldContainer[int]
    release: _containers.RepeatedCompositeFieldContainer[SlabHandle]
    def __init__(self, moved: _Optional[bool] = ..., indices: _Optional[_Iterable[int]] = ..., release: _Optional[_Iterable[_Union[SlabHandle, _Mapping]]] = ...) -> None: ...

class RegisterClientReply(_message.Message):
    __slots__ = ("client_id", "cluster_id", "task_id_base")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_BASE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    cluster_id: str
    task_id_base: int
    def __init__(self, client_id: _Optional[str] = ..., cluster_id: _Optional[str] = ..., task_id_base: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("server_id", "queue_depth", "inflight", "workers_alive", "latency_per_cost", "completed", "cross_ds_bytes", "queued_cpu_s", "link_bandwidth_bps", "link_latency_s", "bulk_bytes", "next_beat_s", "storage_bandwidth_bps", "storage_latency_s")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_ALIVE_FIELD_NUMBER: _ClassVar[int]
    LATENCY_PER_COST_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    CROSS_DS_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_CPU_S_FIELD_NUMBER: _ClassVar[int]
    LINK_BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    LINK_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    BULK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEXT_BEAT_S_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    queue_depth: int
    inflight: int
    workers_alive: int
    latency_per_cost: float
    completed: int
    cross_ds_bytes: int
    queued_cpu_s: float
    link_bandwidth_bps: float
    link_latency_s: float
    bulk_bytes: int
    next_beat_s: float
    storage_bandwidth_bps: float
    storage_latency_s: float
    def __init__(self, server_id: _Optional[str] = ..., queue_depth: _Optional[int] = ..., inflight: _Optional[int] = ..., workers_alive: _Optional[int] = ..., latency_per_cost: _Optional[float] = ..., completed: _Optional[int] = ..., cross_ds_bytes: _Optional[int] = ..., queued_cpu_s: _Optional[float] = ..., link_bandwidth_bps: _Optional[float] = ..., link_latency_s: _Optional[float] = ..., bulk_bytes: _Optional[int] = ..., next_beat_s: _Optional[float] = ..., storage_bandwidth_bps: _Optional[float] = ..., storage_latency_s: _Optional[float] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class CostTerm(_message.Message):
    __slots__ = ("cpu_s", "io_bytes", "out_bytes", "tokens", "samples")
    CPU_S_FIELD_NUMBER: _ClassVar[int]
    IO_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    cpu_s: float
    io_bytes: int
    out_bytes: int
    tokens: int
    samples: int
    def __init__(self, cpu_s: _Optional[float] = ..., io_bytes: _Optional[int] = ..., out_bytes: _Optional[int] = ..., tokens: _Optional[int] = ..., samples: _Optional[int] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("client_id", "rank", "task_id", "cost", "deadline_s", "exclude", "scheduler", "has_deadline", "completed", "host", "local_rank")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    HAS_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    rank: int
    task_id: int
    cost: CostTerm
    deadline_s: float
    exclude: _containers.RepeatedScalarFieldContainer[str]
    scheduler: str
    has_deadline: bool
    completed: _containers.RepeatedScalarFieldContainer[int]
    host: str
    local_rank: int
    def __init__(self, client_id: _Optional[str] = ..., rank: _Optional[int] = ..., task_id: _Optional[int] = ..., cost: _Optional[_Union[CostTerm, _Mapping]] = ..., deadline_s: _Optional[float] = ..., exclude: _Optional[_Iterable[str]] = ..., scheduler: _Optional[str] = ..., has_deadline: _Optional[bool] = ..., completed: _Optional[_Iterable[int]] = ..., host: _Optional[str] = ..., local_rank: _Optional[int] = ...) -> None: ...

class RouteReply(_message.Message):
    __slots__ = ("exec_server_id", "exec_address", "delivery_server_id", "delivery_address", "reason", "decision_us", "exec_kind", "delivery_host")
    EXEC_SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DECISION_US_FIELD_NUMBER: _ClassVar[int]
    EXEC_KIND_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_HOST_FIELD_NUMBER: _ClassVar[int]
    exec_server_id: str
    exec_address: str
    delivery_server_id: str
    delivery_address: str
    reason: str
    decision_us: float
    exec_kind: str
    delivery_host: str
    def __init__(self, exec_server_id: _Optional[str] = ..., exec_address: _Optional[str] = ..., delivery_server_id: _Optional[str] = ..., delivery_address: _Optional[str] = ..., reason: _Optional[str] = ..., decision_us: _Optional[float] = ..., exec_kind: _Optional[str] = ..., delivery_host: _Optional[str] = ...) -> None: ...

class Completions(_message.Message):
    __slots__ = ("client_id", "task_ids")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    task_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, client_id: _Optional[str] = ..., task_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TelemetryRequest(_message.Message):
    __slots__ = ("last_decisions",)
    LAST_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    last_decisions: int
    def __init__(self, last_decisions: _Optional[int] = ...) -> None: ...

class TelemetryReply(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConfigureRequest(_message.Message):
    __slots__ = ("spec_id", "payload", "format")
    SPEC_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    spec_id: str
    payload: bytes
    format: str
    def __init__(self, spec_id: _Optional[str] = ..., payload: _Optional[bytes] = ..., format: _Optional[str] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("dtype", "shape", "offset", "nbytes", "inline_data", "is_inline")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    INLINE_DATA_FIELD_NUMBER: _ClassVar[int]
    IS_INLINE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    inline_data: bytes
    is_inline: bool
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., inline_data: _Optional[bytes] = ..., is_inline: _Optional[bool] = ...) -> None: ...

class SlabHandle(_message.Message):
    __slots__ = ("segment", "generation", "nbytes")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    segment: str
    generation: int
    nbytes: int
    def __init__(self, segment: _Optional[str] = ..., generation: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class BatchHandle(_message.Message):
    __slots__ = ("slab", "tree_json", "tree_pickle", "tensors")
    SLAB_FIELD_NUMBER: _ClassVar[int]
    TREE_JSON_FIELD_NUMBER: _ClassVar[int]
    TREE_PICKLE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    slab: SlabHandle
    tree_json: str
    tree_pickle: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    def __init__(self, slab: _Optional[_Union[SlabHandle, _Mapping]] = ..., tree_json: _Optional[str] = ..., tree_pickle: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ...) -> None: ...

class SampleFailure(_message.Message):
    __slots__ = ("index", "path", "cause")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    index: int
    path: str
    cause: str
    def __init__(self, index: _Optional[int] = ..., path: _Optional[str] = ..., cause: _Optional[str] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("task_id", "spec_id", "indices", "epoch", "substitutes", "on_error", "deliver_to", "client_id", "deadline_s", "has_deadline", "predicted_cpu_s", "splittable", "features", "room")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_ID_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SUBSTITUTES_FIELD_NUMBER: _ClassVar[int]
    ON_ERROR_FIELD_NUMBER: _ClassVar[int]
    DELIVER_TO_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    HAS_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CPU_S_FIELD_NUMBER: _ClassVar[int]
    SPLITTABLE_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    spec_id: str
    indices: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    substitutes: _containers.RepeatedScalarFieldContainer[int]
    on_error: str
    deliver_to: str
    client_id: str
    deadline_s: float
    has_deadline: bool
    predicted_cpu_s: float
    splittable: bool
    features: bool
    room: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, task_id: _Optional[int] = ..., spec_id: _Optional[str] = ..., indices: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ..., substitutes: _Optional[_Iterable[int]] = ..., on_error: _Optional[str] = ..., deliver_to: _Optional[str] = ..., client_id: _Optional[str] = ..., deadline_s: _Optional[float] = ..., has_deadline: _Optional[bool] = ..., predicted_cpu_s: _Optional[float] = ..., splittable: _Optional[bool] = ..., features: _Optional[bool] = ..., room: _Optional[_Iterable[int]] = ...) -> None: ...

class ExecuteReply(_message.Message):
    __slots__ = ("task_id", "batch", "error_kind", "error", "failure", "skipped", "delivered_by", "cross_ds_bytes", "exec_s", "decoded", "decode_cpu_s", "queue_s", "pieces", "piece_rows", "features_json")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_BY_FIELD_NUMBER: _ClassVar[int]
    CROSS_DS_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXEC_S_FIELD_NUMBER: _ClassVar[int]
    DECODED_FIELD_NUMBER: _ClassVar[int]
    DECODE_CPU_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    PIECE_ROWS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_JSON_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    batch: BatchHandle
    error_kind: ErrorKind
    error: str
    failure: SampleFailure
    skipped: _containers.RepeatedCompositeFieldContainer[SampleFailure]
    delivered_by: str
    cross_ds_bytes: int
    exec_s: float
    decoded: _containers.RepeatedScalarFieldContainer[int]
    decode_cpu_s: _containers.RepeatedScalarFieldContainer[float]
    queue_s: float
    pieces: _containers.RepeatedCompositeFieldContainer[BatchHandle]
    piece_rows: _containers.RepeatedScalarFieldContainer[int]
    features_json: str
    def __init__(self, task_id: _Optional[int] = ..., batch: _Optional[_Union[BatchHandle, _Mapping]] = ..., error_kind: _Optional[_Union[ErrorKind, str]] = ..., error: _Optional[str] = ..., failure: _Optional[_Union[SampleFailure, _Mapping]] = ..., skipped: _Optional[_Iterable[_Union[SampleFailure, _Mapping]]] = ..., delivered_by: _Optional[str] = ..., cross_ds_bytes: _Optional[int] = ..., exec_s: _Optional[float] = ..., decoded: _Optional[_Iterable[int]] = ..., decode_cpu_s: _Optional[_Iterable[float]] = ..., queue_s: _Optional[float] = ..., pieces: _Optional[_Iterable[_Union[BatchHandle, _Mapping]]] = ..., piece_rows: _Optional[_Iterable[int]] = ..., features_json: _Optional[str] = ...) -> None: ...

class StreamHeader(_message.Message):
    __slots__ = ("task_id", "tree_json", "tree_pickle", "tensors", "total_bytes")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_JSON_FIELD_NUMBER: _ClassVar[int]
    TREE_PICKLE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    tree_json: str
    tree_pickle: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    total_bytes: int
    def __init__(self, task_id: _Optional[int] = ..., tree_json: _Optional[str] = ..., tree_pickle: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class StreamChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: StreamHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[StreamHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class DeliverReply(_message.Message):
    __slots__ = ("batch", "server_id")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    batch: BatchHandle
    server_id: str
    def __init__(self, batch: _Optional[_Union[BatchHandle, _Mapping]] = ..., server_id: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("task_ids", "client_id")
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    task_ids: _containers.RepeatedScalarFieldContainer[int]
    client_id: str
    def __init__(self, task_ids: _Optional[_Iterable[int]] = ..., client_id: _Optional[str] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("server_id", "workers_alive", "queue_depth", "serving", "worker_pids", "pid", "inflight")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_ALIVE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    WORKER_PIDS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    workers_alive: int
    queue_depth: int
    serving: bool
    worker_pids: _containers.RepeatedScalarFieldContainer[int]
    pid: int
    inflight: int
    def __init__(self, server_id: _Optional[str] = ..., workers_alive: _Optional[int] = ..., queue_depth: _Optional[int] = ..., serving: _Optional[bool] = ..., worker_pids: _Optional[_Iterable[int]] = ..., pid: _Optional[int] = ..., inflight: _Optional[int] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("group", "group_size", "rank", "step", "batches", "batch_rows", "features_json", "host", "buffer_size", "timeout_s", "policy_id", "policy", "policy_format", "client_id", "seconds_per_unit", "indices", "delivery", "exchange", "run", "input_wait_s")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_JSON_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FORMAT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_UNIT_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    INPUT_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    group: str
    group_size: int
    rank: int
    step: int
    batches: _containers.RepeatedCompositeFieldContainer[BatchHandle]
    batch_rows: _containers.RepeatedScalarFieldContainer[int]
    features_json: str
    host: str
    buffer_size: int
    timeout_s: float
    policy_id: str
    policy: bytes
    policy_format: str
    client_id: str
    seconds_per_unit: float
    indices: _containers.RepeatedScalarFieldContainer[int]
    delivery: str
    exchange: str
    run: str
    input_wait_s: float
    def __init__(self, group: _Optional[str] = ..., group_size: _Optional[int] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., batches: _Optional[_Iterable[_Union[BatchHandle, _Mapping]]] = ..., batch_rows: _Optional[_Iterable[int]] = ..., features_json: _Optional[str] = ..., host: _Optional[str] = ..., buffer_size: _Optional[int] = ..., timeout_s: _Optional[float] = ..., policy_id: _Optional[str] = ..., policy: _Optional[bytes] = ..., policy_format: _Optional[str] = ..., client_id: _Optional[str] = ..., seconds_per_unit: _Optional[float] = ..., indices: _Optional[_Iterable[int]] = ..., delivery: _Optional[str] = ..., exchange: _Optional[str] = ..., run: _Optional[str] = ..., input_wait_s: _Optional[float] = ...) -> None: ...

class RowTake(_message.Message):
    __slots__ = ("batch", "rows", "shared", "batch_rows", "indices", "costs")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    COSTS_FIELD_NUMBER: _ClassVar[int]
    batch: BatchHandle
    rows: _containers.RepeatedScalarFieldContainer[int]
    shared: bool
    batch_rows: int
    indices: _containers.RepeatedScalarFieldContainer[int]
    costs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, batch: _Optional[_Union[BatchHandle, _Mapping]] = ..., rows: _Optional[_Iterable[int]] = ..., shared: _Optional[bool] = ..., batch_rows: _Optional[int] = ..., indices: _Optional[_Iterable[int]] = ..., costs: _Optional[_Iterable[float]] = ...) -> None: ...

class RebalanceReply(_message.Message):
    __slots__ = ("takes", "outcome", "moved_in", "moved_out", "gain_s", "transfer_s", "round_samples", "closed_by", "moved_bytes", "crossed_bytes", "transport", "release", "input_wait_s")
    TAKES_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    MOVED_IN_FIELD_NUMBER: _ClassVar[int]
    MOVED_OUT_FIELD_NUMBER: _ClassVar[int]
    GAIN_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    ROUND_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CLOSED_BY_FIELD_NUMBER: _ClassVar[int]
    MOVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CROSSED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    INPUT_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    takes: _containers.RepeatedCompositeFieldContainer[RowTake]
    outcome: str
    moved_in: int
    moved_out: int
    gain_s: float
    transfer_s: float
    round_samples: int
    closed_by: str
    moved_bytes: int
    crossed_bytes: int
    transport: str
    release: _containers.RepeatedCompositeFieldContainer[SlabHandle]
    input_wait_s: float
    def __init__(self, takes: _Optional[_Iterable[_Union[RowTake, _Mapping]]] = ..., outcome: _Optional[str] = ..., moved_in: _Optional[int] = ..., moved_out: _Optional[int] = ..., gain_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., round_samples: _Optional[int] = ..., closed_by: _Optional[str] = ..., moved_bytes: _Optional[int] = ..., crossed_bytes: _Optional[int] = ..., transport: _Optional[str] = ..., release: _Optional[_Iterable[_Union[SlabHandle, _Mapping]]] = ..., input_wait_s: _Optional[float] = ...) -> None: ...

class LeaveRoundRequest(_message.Message):
    __slots__ = ("group", "run", "step", "rank", "timeout_s", "client_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    group: str
    run: str
    step: int
    rank: int
    timeout_s: float
    client_id: str
    def __init__(self, group: _Optional[str] = ..., run: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., timeout_s: _Optional[float] = ..., client_id: _Optional[str] = ...) -> None: ...

class AskRoundRequest(_message.Message):
    __slots__ = ("group", "run", "step", "rank", "client_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    group: str
    run: str
    step: int
    rank: int
    client_id: str
    def __init__(self, group: _Optional[str] = ..., run: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., client_id: _Optional[str] = ...) -> None: ...

class AskRoundReply(_message.Message):
    __slots__ = ("asked",)
    ASKED_FIELD_NUMBER: _ClassVar[int]
    asked: bool
    def __init__(self, asked: _Optional[bool] = ...) -> None: ...

class LeaveRoundReply(_message.Message):
    __slots__ = ("left", "reply")
    LEFT_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    left: bool
    reply: RebalanceReply
    def __init__(self, left: _Optional[bool] = ..., reply: _Optional[_Union[RebalanceReply, _Mapping]] = ...) -> None: ...

class ExchangeSend(_message.Message):
    __slots__ = ("batch", "rows", "batch_rows", "to", "key", "last_reader")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    LAST_READER_FIELD_NUMBER: _ClassVar[int]
    batch: BatchHandle
    rows: _containers.RepeatedScalarFieldContainer[int]
    batch_rows: int
    to: int
    key: int
    last_reader: bool
    def __init__(self, batch: _Optional[_Union[BatchHandle, _Mapping]] = ..., rows: _Optional[_Iterable[int]] = ..., batch_rows: _Optional[int] = ..., to: _Optional[int] = ..., key: _Optional[int] = ..., last_reader: _Optional[bool] = ...) -> None: ...

class ExchangeRequest(_message.Message):
    __slots__ = ("round", "members", "member", "transport", "sends", "store", "generation", "timeout_s", "drop", "share", "readers")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SENDS_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    READERS_FIELD_NUMBER: _ClassVar[int]
    round: str
    members: _containers.RepeatedScalarFieldContainer[str]
    member: int
    transport: str
    sends: _containers.RepeatedCompositeFieldContainer[ExchangeSend]
    store: str
    generation: int
    timeout_s: float
    drop: _containers.RepeatedCompositeFieldContainer[SlabHandle]
    share: _containers.RepeatedCompositeFieldContainer[SlabHandle]
    readers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, round: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., member: _Optional[int] = ..., transport: _Optional[str] = ..., sends: _Optional[_Iterable[_Union[ExchangeSend, _Mapping]]] = ..., store: _Optional[str] = ..., generation: _Optional[int] = ..., timeout_s: _Optional[float] = ..., drop: _Optional[_Iterable[_Union[SlabHandle, _Mapping]]] = ..., share: _Optional[_Iterable[_Union[SlabHandle, _Mapping]]] = ..., readers: _Optional[_Iterable[int]] = ...) -> None: ...

class ExchangeGot(_message.Message):
    __slots__ = ("key", "batch")
    KEY_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    key: int
    batch: BatchHandle
    def __init__(self, key: _Optional[int] = ..., batch: _Optional[_Union[BatchHandle, _Mapping]] = ...) -> None: ...

class ExchangeReply(_message.Message):
    __slots__ = ("got", "bytes", "seconds")
    GOT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    got: _containers.RepeatedCompositeFieldContainer[ExchangeGot]
    bytes: int
    seconds: float
    def __init__(self, got: _Optional[_Iterable[_Union[ExchangeGot, _Mapping]]] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
