"""worker.daemon.shared_memory: large frames through a sealed memfd both sides map, small ones down
the pipe."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from protocol.codec import decode, encode
from protocol.errors import FrameError
from worker.daemon.pipe import (
    LENGTH,
    SHARED_FLAG,
    SHARED_MAX_BYTES,
    SHARED_MIN_BYTES,
    FrameReader,
    FrameWriter,
)
from worker.daemon.shared_memory import SharedRegion


def _region_pair() -> tuple[SharedRegion, SharedRegion]:
    """The writer's and the reader's view of one region, as two processes would hold it."""
    region = SharedRegion.create("test")
    assert region is not None, "memfds are Linux's, and so is this machine"
    return region, SharedRegion(os.dup(region.fd))


def _through(writer: FrameWriter, reader: FrameReader) -> tuple[list[bytes], int]:
    """Move what ``writer`` queued to ``reader`` as a pipe would; the frames and pipe bytes."""
    stream = b"".join(bytes(v) for v in writer.buffers(limit=1000))
    writer.advance(len(stream))
    frames, position = [], 0
    while position < len(stream):
        target = reader.buffer()
        n = min(len(target), len(stream) - position)
        target[:n] = stream[position : position + n]
        position += n
        frame = reader.advance(n)
        if frame is not None:
            frames.append(bytes(frame))
    return frames, len(stream)


def test_large_frames_go_through_shared_memory_and_small_ones_through_the_pipe():
    out, into = _region_pair()
    small = bytes(range(256)) * 4
    large = np.random.default_rng(0).bytes(SHARED_MIN_BYTES + 12_345)
    larger = np.random.default_rng(1).bytes(3 * SHARED_MIN_BYTES + 7)
    writer, reader = FrameWriter(shared=out), FrameReader(shared=into)
    for frame in (small, large, larger, large):  # the region grows, then is reused
        writer.add([frame[:100], memoryview(frame)[100:]])
        frames, piped = _through(writer, reader)
        assert frames == [frame]
        assert piped == (8 if len(frame) >= SHARED_MIN_BYTES else 8 + len(frame))
    assert out.frames == into.frames == 3
    assert out.nbytes == into.nbytes == 2 * len(large) + len(larger)
    out.close()
    into.close()


def test_a_shared_frame_decodes_to_writable_tensors_independent_of_the_region():
    out, into = _region_pair()
    tensor = torch.arange(SHARED_MIN_BYTES, dtype=torch.float32)
    writer, reader = FrameWriter(encode({"t": tensor}), shared=out), FrameReader(shared=into)
    (frame,) = _through(writer, reader)[0]
    decoded = decode(bytearray(frame))["t"]
    assert torch.equal(decoded, tensor)
    out.write([memoryview(bytes(out.nbytes))])  # the next frame overwrites the region
    assert torch.equal(decoded, tensor)  # what was read is a copy
    out.close()
    into.close()


def test_a_shared_frame_longer_than_the_region_is_a_frame_error():
    out, into = _region_pair()
    out.write([memoryview(bytes(SHARED_MIN_BYTES))])
    reader = FrameReader(shared=into)
    reader.buffer()[:8] = LENGTH.pack(SHARED_FLAG | (64 << 20))
    with pytest.raises(FrameError, match="shared memory"):
        reader.advance(8)
    out.close()
    into.close()


def test_a_reader_without_shared_memory_refuses_a_shared_frame():
    reader = FrameReader()
    reader.buffer()[:8] = LENGTH.pack(SHARED_FLAG | 1000)
    with pytest.raises(FrameError, match="exceeds"):
        reader.advance(8)


def test_a_shared_region_cannot_be_shrunk_under_its_reader():
    out, into = _region_pair()
    out.write([memoryview(bytes(SHARED_MIN_BYTES))])
    with pytest.raises(PermissionError):
        os.ftruncate(into.fd, 0)  # sealed: a daemon cannot make the agent's mapping fault
    out.close()
    into.close()


def test_a_frame_over_the_shared_limit_goes_down_the_pipe():
    out, into = _region_pair()
    frame = bytes(SHARED_MAX_BYTES + 1)  # one copy of it would stall an event loop too long
    frames, piped = _through(FrameWriter([frame], shared=out), FrameReader(shared=into))
    assert frames == [frame] and piped == 8 + len(frame)
    assert out.frames == 0
    out.close()
    into.close()


def test_a_frame_the_region_cannot_take_goes_down_the_pipe():
    out, into = _region_pair()
    os.close(out.fd)  # the writer's region is unusable (as if memory ran out)
    frame = bytes(SHARED_MIN_BYTES)
    writer = FrameWriter([frame], shared=out)
    frames, piped = _through(writer, FrameReader(shared=into))
    assert frames == [frame] and piped == 8 + len(frame)
    into.close()
