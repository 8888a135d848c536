"""The one request type, end to end: a ``Task`` (one batch of one rank) made of ``Part``s (the
requests it is sent as: itself, or its fan-out / microbatch parts), each placed by a ``Route`` and
answered with an ``ExecuteReply`` whose failure is an ``ErrorKind``; a batch's slab travels as a
``SlabHandle`` (``memory/shm.py``). The protobuf <-> dataclass conversions of the request path and
of slab handles live here and nowhere else.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field

from helix_core.memory.shm import SlabHandle
from helix_core.wire.proto import helix_pb2 as pb

__all__ = [
    "meta_dicts",
    "metas_to_pb",
    "TASK_ID_BITS",
    "ErrorKind",
    "Part",
    "Route",
    "Task",
    "cost_term",
    "execute_request",
    "route_request",
    "slab_handle",
    "slab_handle_pb",
]

TASK_ID_BITS = 40  # task ids a client may use before it would reach the next client's base


class ErrorKind(enum.IntEnum):
    """Why a request failed (``helix.v1.ErrorKind``). The client acts on the kind alone."""

    NONE = pb.ERROR_NONE
    SAMPLE = pb.ERROR_SAMPLE  # a sample failed: SampleError at the batch (final)
    SPEC = pb.ERROR_SPEC  # the dataset spec could not be loaded (final)
    INTERNAL = pb.ERROR_INTERNAL  # collate / writing the batch failed (final)
    NOT_COMPLETED = pb.ERROR_NOT_COMPLETED  # the server gave the task up: run it elsewhere
    DELIVERY_LOST = pb.ERROR_DELIVERY_LOST  # a sidecar lost the delivery server: run it elsewhere
    NO_ROOM = pb.ERROR_NO_ROOM  # /dev/shm is full (final)

    @property
    def retry(self) -> bool:
        """Run the part again on another server (the task id stays: duplicates are dropped)."""
        return self in (ErrorKind.NOT_COMPLETED, ErrorKind.DELIVERY_LOST)


@dataclass(frozen=True)
class Route:
    """Where a part runs (``exec_*``) and which local server delivers it (``delivery_*``);
    ``exec_kind`` "local" delivers by shared memory itself, "remote" streams to the delivery server."""

    exec_server_id: str
    exec_address: str
    exec_kind: str
    delivery_server_id: str
    delivery_address: str
    reason: str
    decision_us: float

    @classmethod
    def from_pb(cls, r: pb.RouteReply) -> Route:
        return cls(
            r.exec_server_id,
            r.exec_address,
            r.exec_kind,
            r.delivery_server_id,
            r.delivery_address,
            r.reason,
            r.decision_us,
        )

    @property
    def deliver_to(self) -> str:
        """``ExecuteRequest.deliver_to``: the delivery server's address for a remote part."""
        return self.delivery_address if self.exec_kind == "remote" else ""


@dataclass(eq=False)
class Part:
    """One request of a task: its own task id (kept across resubmissions), samples and summed
    cost; the servers it must avoid, its attempts, the current route and the gRPC future."""

    task_id: int
    indices: list[int]
    cost: object = None  # CostProfile of its samples (None: unknown)
    excluded: set = field(default_factory=set)
    attempts: int = 0
    route: Route | None = None
    future: object = None
    landed: float = 0.0  # time.perf_counter when its reply landed (the done-callback ran)


@dataclass(eq=False)
class Task:
    """One batch of one rank in flight: its place in the epoch (``position``) and in the loader's
    life (``seq``: the deadline clock's position), its samples' costs and substitutes, its parts
    and what came back. Times from ``time.perf_counter``."""

    position: int
    indices: list[int]
    costs: list  # CostProfile (or None) of each sample, in batch order
    substitutes: list[int]
    epoch: int = 0
    microbatch_size: int | None = None
    seq: int = 0
    parts: list[Part] = field(default_factory=list)
    taken: set = field(default_factory=set)  # part numbers whose reply was read (their slab is the batch's)
    cancelled: set = field(default_factory=set)  # futures given up already (cancel is idempotent per future)
    t_dispatch: float = 0.0
    landed: float = 0.0  # when its last reply landed
    result: object = None  # the batch, once collected
    error: BaseException | None = None
    wanted: Future = field(default_factory=Future)  # done once the rank waits in next() for this batch

    def want(self) -> None:
        """The rank waits for this batch now (``wanted`` wakes whatever holds it back)."""
        if not self.wanted.done():
            self.wanted.set_result(True)

    def splits(self) -> list[list[int]]:
        """The samples of each request the batch is sent as when no fan-out applies."""
        m = self.microbatch_size or len(self.indices)
        return [self.indices[i : i + m] for i in range(0, len(self.indices), m)]


def slab_handle(msg: pb.SlabHandle) -> SlabHandle:
    """A ``SlabHandle`` message as the in-process handle."""
    return SlabHandle(msg.segment, msg.generation, msg.nbytes)


def slab_handle_pb(handle: SlabHandle) -> pb.SlabHandle:
    """The in-process handle as its message (``nbytes`` 0 is not sent, as proto3 leaves any default)."""
    return pb.SlabHandle(segment=handle.segment, generation=handle.generation, nbytes=handle.nbytes)


def cost_term(cost, samples: int = 0) -> pb.CostTerm:
    """A part's summed ``CostProfile`` (None: unknown) and its number of ``samples`` as a message."""
    if cost is None:
        return pb.CostTerm(samples=samples)
    return pb.CostTerm(
        cpu_s=cost.cpu_s, io_bytes=cost.io_bytes, out_bytes=cost.out_bytes, tokens=cost.tokens, samples=samples
    )


def route_request(
    client_id: str,
    rank: int,
    part: Part,
    deadline_s: float | None,
    scheduler: str,
    completed: list[int],
    host: str,
    local_rank: int,
) -> pb.RouteRequest:
    return pb.RouteRequest(
        client_id=client_id,
        rank=rank,
        task_id=part.task_id,
        cost=cost_term(part.cost, len(part.indices)),
        deadline_s=deadline_s or 0.0,
        has_deadline=deadline_s is not None,
        exclude=sorted(part.excluded),
        scheduler=scheduler,
        completed=completed,
        host=host,
        local_rank=local_rank,
    )


def execute_request(
    task: Task,
    part: Part,
    spec_id: str,
    on_error: str,
    client_id: str,
    deadline_s: float | None,
    splittable: bool = False,
    features: bool = False,
) -> pb.ExecuteRequest:
    """``splittable``: the client merges pieces exactly (the server may split the batch among idle workers),
    and the batch's first part leaves the room of the later parts' rows in its slab, which the merge
    grows into (``room``); ``features``: Tier 2 — the workers measure each sample's features
    (``Rebalance.feature_fn``)."""
    room = [i for p in task.parts[1:] for i in p.indices] if splittable and task.parts and part is task.parts[0] else []
    return pb.ExecuteRequest(
        task_id=part.task_id,
        spec_id=spec_id,
        indices=part.indices,
        epoch=task.epoch,
        substitutes=task.substitutes if on_error == "skip" else (),  # raise: never used
        on_error=on_error,
        deliver_to=part.route.deliver_to,
        client_id=client_id,
        deadline_s=deadline_s or 0.0,
        has_deadline=deadline_s is not None,
        predicted_cpu_s=part.cost.cpu_s if part.cost is not None else 0.0,
        splittable=splittable,
        features=features,
        room=room,
    )


def metas_to_pb(metas: list[dict]) -> list[pb.TensorMeta]:
    """A batch's tensor layout (``memory.tensors`` metas) as ``TensorMeta`` messages."""
    return [
        pb.TensorMeta(
            dtype=m["dtype"],
            shape=m["shape"],
            offset=m["offset"],
            nbytes=m["nbytes"],
            is_inline=m["is_inline"],
            inline_data=m.get("inline_data") or b"",
        )
        for m in metas
    ]


def meta_dicts(metas) -> list[dict]:
    """``TensorMeta`` messages back into the layout dicts ``memory.tensors`` reads."""
    return [
        {
            "dtype": m.dtype,
            "shape": list(m.shape),
            "offset": m.offset,
            "nbytes": m.nbytes,
            "is_inline": m.is_inline,
            "inline_data": m.inline_data,
        }
        for m in metas
    ]
