"""Tier-2 redistribution by collective (paper Section 3.5): DataServers of one ``client_ranks``
group form a ``torch.distributed`` group of their own and move a round's decoded samples with
one ``all_to_all`` instead of one gRPC call per sample.

Samples travel as Helix's own wire form — a JSON tree plus tensor descriptors
(``tensors.flatten``), never pickle — packed per destination into one contiguous ``uint8``
buffer (:func:`pack`): ``[u64 header length][header JSON][pad to 64][tensor payload]``. A round is
two collectives: an ``all_to_all_single`` of the per-destination sizes (int64), then one of the
bytes with those splits (gloo on CPU; NCCL, where each server is bound to a GPU, is not built). Every collective
has a timeout (``timeout_s``): a peer that dies mid-round fails the round with ``ClusterError``
(the caller falls back to resubmitting), never a hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
from datetime import timedelta

import torch

from helix_core.errors import ClusterError
from helix_core.memory.tensors import flatten, layout, read_tensors, unflatten, write_tensors

__all__ = ["GlooGroup", "open_store", "pack", "pack_many", "unpack"]

_LEN = struct.Struct("<Q")
_ALIGN = 64


def _plan(samples: list) -> tuple[bytes, list[torch.Tensor], list[dict], int, int]:
    """``(header, tensors, metas, payload start, total bytes)`` of ``samples`` packed."""
    trees, counts, flat = [], [], []
    for s in samples:
        tree, _, ts = flatten(s, allow_pickle=False)
        trees.append(tree)
        counts.append(len(ts))
        flat += ts
    metas, payload = layout(flat)
    # small tensors travel in the header (latin-1 text: JSON has no bytes)
    inline = {
        i: t.reshape(-1).view(torch.uint8).numpy().tobytes().decode("latin-1")
        for i, (t, m) in enumerate(zip(flat, metas))
        if m["is_inline"]
    }
    header = json.dumps({"trees": trees, "counts": counts, "metas": metas, "inline": inline}).encode()
    start = -(-(_LEN.size + len(header)) // _ALIGN) * _ALIGN
    return header, flat, metas, start, start + payload


def _write(plan, mv: memoryview) -> None:
    header, flat, metas, start, total = plan
    _LEN.pack_into(mv, 0, len(header))
    mv[_LEN.size : _LEN.size + len(header)] = header
    if total > start:
        write_tensors(mv[start:total], flat, metas)


def pack(samples: list) -> torch.Tensor:
    """One contiguous ``uint8`` tensor holding ``samples`` (each a dict / list / tensor tree)."""
    plan = _plan(samples)
    buf = torch.empty(plan[4], dtype=torch.uint8)
    _write(plan, memoryview(buf.numpy()))
    return buf


def pack_many(groups: list[list]) -> tuple[torch.Tensor, list[int]]:
    """``(buffer, sizes)``: every group of samples packed back to back in one buffer (an empty
    group takes no bytes) — what one ``all_to_all_single`` sends, with no copy to join them."""
    plans = [_plan(g) if g else None for g in groups]
    sizes = [p[4] if p else 0 for p in plans]
    buf = torch.empty(sum(sizes), dtype=torch.uint8)
    mv, off = memoryview(buf.numpy()), 0
    for plan, n in zip(plans, sizes):
        if plan:
            _write(plan, mv[off : off + n])
        off += n
    return buf, sizes


def unpack(buf: torch.Tensor) -> list:
    """The samples :func:`pack` put in ``buf`` (tensors view ``buf``: no copy)."""
    mv = memoryview(buf.numpy())
    if len(mv) < _LEN.size:
        raise ValueError(f"a packed round buffer has at least {_LEN.size} bytes, got {len(mv)}")
    (n,) = _LEN.unpack_from(mv, 0)
    if _LEN.size + n > len(mv):
        raise ValueError(f"packed header of {n} bytes does not fit a {len(mv)}-byte buffer")
    head = json.loads(bytes(mv[_LEN.size : _LEN.size + n]))
    start = -(-(_LEN.size + n) // _ALIGN) * _ALIGN
    metas = head["metas"]
    for i, data in head["inline"].items():
        metas[int(i)]["inline_data"] = data.encode("latin-1")
    tensors = read_tensors(mv[start:], metas) if metas else []
    out, k = [], 0
    for tree, count in zip(head["trees"], head["counts"]):
        out.append(unflatten(tree, b"", tensors[k : k + count]))
        k += count
    return out


def open_store(host: str, world: int, timeout_s: float = 30.0, port: int = 0):
    """A group's rendezvous, hosted in this process on ``port`` of ``host`` (0: a free one; its ``.port``).

    It listens on ``host`` alone: a ``TCPStore`` left to itself binds every interface, so the
    socket is bound here and handed over (``master_listen_fd``)."""
    import torch.distributed as dist

    fd = -1
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.bind(addr[:2] if family == socket.AF_INET else addr)
            sock.listen(max(16, 2 * world))
            fd = sock.detach()  # the store's now: it closes it with itself
        return dist.TCPStore(
            host,
            port,
            world,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=fd,
            use_libuv=True,
        )
    except (RuntimeError, OSError) as e:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise ClusterError(f"redistribution rendezvous on {host}: {e}") from None


class GlooGroup:
    """This process's member of a redistribution group: ``rank`` of ``world`` on the store at
    ``host:port`` (rank 0 hosts it unless ``store`` — from :func:`open_store` — is given). A gloo
    group of its own (not torch.distributed's default one, so a process may hold several), its
    connections on ``bind`` (this member's address: gloo would otherwise pick the address its
    hostname resolves to); ``prefix`` keeps groups on one store apart."""

    def __init__(
        self,
        rank: int,
        world: int,
        host: str,
        port: int,
        backend: str = "gloo",
        timeout_s: float = 30.0,
        store=None,
        bind: str | None = None,
        prefix: str = "helix",
    ):
        import torch.distributed as dist

        if backend != "gloo":
            raise ValueError(f"GlooGroup backend {backend!r}: only gloo is built (NCCL needs a GPU per server)")
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        try:
            if store is None and rank == 0:
                store = open_store(bind or host, world, timeout_s, port)
            elif store is None:
                store = dist.TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=timeout_s))
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timedelta(seconds=timeout_s)
            gloo = dist.ProcessGroupGloo
            opts._devices = [gloo.create_device(hostname=bind) if bind else gloo.create_default_device()]
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/", store), rank, world, opts)
        except (RuntimeError, OSError) as e:  # DistStoreError, DistNetworkError, timeouts
            raise ClusterError(f"redistribution group {host}:{port} (rank {rank} of {world}): {e}") from None
        self._store = store

    def _failed(self, e: Exception) -> ClusterError:
        return ClusterError(f"redistribution round failed on rank {self.rank} of {self.world}: {e}")

    def all_to_all(self, outgoing: list[list]) -> list[list]:
        """Send ``outgoing[dst]`` (samples) to every rank ``dst``; returns ``incoming[src]``."""
        if len(outgoing) != self.world:
            raise ValueError(f"all_to_all: one list per rank ({self.world}), got {len(outgoing)}")
        got = self.all_to_all_bytes(*pack_many(outgoing))
        return [unpack(b) if b.numel() else [] for b in got]

    def all_to_all_bytes(self, send: torch.Tensor, split: list[int]) -> list[torch.Tensor]:
        """The bytes of :meth:`all_to_all`: ``send[...]`` cut by ``split`` (one part per rank) goes
        to each rank; one ``all_to_all`` of sizes, one of bytes. Returns each rank's part."""
        if len(split) != self.world or sum(split) != send.numel():
            raise ValueError(
                f"all_to_all_bytes: {len(split)} parts of {sum(split)} bytes for {self.world} ranks "
                f"and a {send.numel()}-byte buffer"
            )
        try:
            sizes = torch.tensor(split, dtype=torch.int64)
            theirs = torch.empty(self.world, dtype=torch.int64)
            self._pg.alltoall_base(theirs, sizes, [], []).wait()
            recv = torch.empty(int(theirs.sum()), dtype=torch.uint8)
            self._pg.alltoall_base(recv, send, theirs.tolist(), list(split)).wait()
        except RuntimeError as e:  # a peer died or timed out: the round fails, the caller falls back
            raise self._failed(e) from None
        return list(torch.split(recv, theirs.tolist()))

    def all_gather_json(self, value) -> list:
        """Every rank's ``value`` (small, JSON-able: features, handles), in rank order."""
        mine = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
        try:  # bytes, not all_gather_object: nothing is unpickled from a peer
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
            self._pg.allgather([sizes], [torch.tensor([mine.numel()], dtype=torch.int64)]).wait()
            most = max(int(n) for n in sizes)
            bufs = [torch.empty(most, dtype=torch.uint8) for _ in range(self.world)]
            self._pg.allgather([bufs], [torch.cat([mine, torch.zeros(most - mine.numel(), dtype=torch.uint8)])]).wait()
        except RuntimeError as e:
            raise self._failed(e) from None
        return [json.loads(bytes(b[: int(n)].numpy())) for b, n in zip(bufs, sizes)]

    def close(self) -> None:
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None:
            try:
                pg.shutdown()
            except (RuntimeError, AttributeError):  # already broken by a failed round
                pass
