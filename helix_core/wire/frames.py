"""The ``Deliver`` stream's data chunks without protobuf copies.

A ``StreamChunk`` carrying ``data`` (field 2, length-delimited) is, on the wire, the tag byte
``0x12``, the length as a varint, then the bytes. Building that message with protobuf costs three
copies per chunk (slice to bytes, into the message, serialising) and parsing it two more; these
functions write and read exactly the same bytes with one copy on each side, so the proto in
``helix.proto`` stays the truth and any protobuf peer interoperates. Header chunks (field 1) go
through protobuf as usual.
"""

from __future__ import annotations

import grpc
from google.protobuf.message_factory import GetMessageClass

from helix_core.wire.proto import helix_pb2 as pb

__all__ = ["add_servicer", "decode_chunk", "deliver_callable", "encode_chunk"]

_DATA_TAG = 0x12  # (field 2 << 3) | wire type 2
_SERVICE = "helix.v1.DataServer"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def encode_chunk(part) -> bytes:
    """A ``StreamChunk`` message as bytes: protobuf for a message, else ``part`` (bytes or a
    memoryview of a slab) as the ``data`` field with a single copy."""
    if isinstance(part, pb.StreamChunk):
        return part.SerializeToString()
    return b"".join((bytes((_DATA_TAG,)), _varint(len(part)), part))


def decode_chunk(raw: bytes):
    """The inverse of ``encode_chunk``: a memoryview of the data (no copy) for a data chunk in
    canonical form, else the parsed ``StreamChunk``."""
    if raw[:1] == b"\x12":
        n, shift, pos = 0, 0, 1
        while pos < len(raw) and pos <= 10:
            byte = raw[pos]
            n |= (byte & 0x7F) << shift
            pos, shift = pos + 1, shift + 7
            if not byte & 0x80:
                if pos + n == len(raw):
                    return memoryview(raw)[pos:]
                break
    return pb.StreamChunk.FromString(raw)


def deliver_callable(channel: grpc.Channel):
    """``DataServer.Deliver`` on ``channel``, taking an iterator of ``StreamChunk`` headers and raw
    data parts (bytes / memoryviews) and returning the ``DeliverReply``."""
    return channel.stream_unary(
        f"/{_SERVICE}/Deliver", request_serializer=encode_chunk, response_deserializer=pb.DeliverReply.FromString
    )


def add_servicer(servicer, server: grpc.Server) -> None:
    """Register a DataServer servicer like the generated ``add_DataServerServicer_to_server``,
    except that ``Deliver`` receives data chunks as memoryviews (``decode_chunk``)."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["DataServer"].methods:
        request_cls, reply_cls = GetMessageClass(method.input_type), GetMessageClass(method.output_type)
        deserialize = decode_chunk if method.name == "Deliver" else request_cls.FromString
        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[method.client_streaming, method.server_streaming]
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=deserialize,
            response_serializer=reply_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    server.add_registered_method_handlers(_SERVICE, handlers)
