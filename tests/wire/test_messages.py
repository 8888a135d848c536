"""A slab handle has one in-process form (``SlabHandle``) and one conversion to and from its message."""

import pickle

from helix_core.memory.shm import SlabHandle
from helix_core.wire.messages import slab_handle, slab_handle_pb
from helix_core.wire.proto import helix_pb2 as pb


def test_a_slab_handle_converts_to_its_message_and_back_with_the_same_bytes():
    h = SlabHandle("helix-x-1-2-ab", 7, 4096)
    msg = slab_handle_pb(h)
    assert slab_handle(msg) == h
    assert msg.SerializeToString() == pb.SlabHandle(segment=h.segment, generation=7, nbytes=4096).SerializeToString()
    # a release names the slab alone: the message carries no nbytes, as one built without it
    released = slab_handle_pb(h.unsized()).SerializeToString()
    assert released == pb.SlabHandle(segment=h.segment, generation=7).SerializeToString()
    assert slab_handle(pb.SlabHandle.FromString(released)) == SlabHandle(h.segment, 7)


def test_a_slab_handle_is_a_value_that_crosses_a_process_pipe():
    h = SlabHandle("helix-x-1-2-ab", 3, 10)
    assert pickle.loads(pickle.dumps(h)) == h and hash(h) == hash(SlabHandle("helix-x-1-2-ab", 3, 10))
    assert len({h, h.unsized(), SlabHandle("helix-x-1-2-ab", 3)}) == 2
