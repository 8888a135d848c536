"""The Deliver stream's hand-encoded data chunks are byte-for-byte protobuf's StreamChunk."""

import pytest

from helix_core.wire import frames as wire
from helix_core.wire.proto import helix_pb2 as pb


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16_384, (4 << 20) + 3])
def test_data_chunks_encode_as_protobuf_does_and_decode_without_copies(size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    raw = wire.encode_chunk(memoryview(data))
    assert raw == pb.StreamChunk(data=data).SerializeToString()
    got = wire.decode_chunk(raw)
    assert isinstance(got, memoryview) and got.obj is raw and got.tobytes() == data
    assert pb.StreamChunk.FromString(raw).data == data  # any protobuf peer reads it too


def test_headers_and_non_canonical_chunks_go_through_protobuf():
    header = pb.StreamChunk(header=pb.StreamHeader(task_id=7, total_bytes=10))
    got = wire.decode_chunk(wire.encode_chunk(header))
    assert isinstance(got, pb.StreamChunk) and got.header.task_id == 7 and got.header.total_bytes == 10
    padded = pb.StreamChunk(data=b"abc").SerializeToString() + pb.StreamChunk(data=b"xy").SerializeToString()
    got = wire.decode_chunk(padded)  # two data fields: protobuf keeps the last
    assert isinstance(got, pb.StreamChunk) and got.data == b"xy"


def test_truncated_chunks_are_refused():
    from google.protobuf.message import DecodeError

    raw = wire.encode_chunk(b"x" * 300)
    with pytest.raises(DecodeError):
        wire.decode_chunk(raw[:-1])
