"""worker.daemon.pipe: length-prefixed frames split and joined over any reads and writes, no I/O."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from protocol.codec import decode, encode
from protocol.errors import FrameError
from worker.daemon.pipe import (
    LENGTH,
    FrameReader,
    FrameWriter,
)
from worker.daemon.shared_memory import allocate_fast, allocate_paged


def _frames_through_pipe(frames: list[bytes], rng: random.Random) -> list[bytes]:
    """Write ``frames`` with a FrameWriter and read them back with a FrameReader, both moving
    random amounts at a time, as a pipe would."""
    writer = FrameWriter()
    for frame in frames:
        writer.add([frame[: len(frame) // 2], memoryview(frame)[len(frame) // 2 :]])
    stream = bytearray()
    while not writer.done:
        chunk = b"".join(bytes(v) for v in writer.buffers(limit=rng.randint(1, 3)))
        n = rng.randint(0, len(chunk))
        stream += chunk[:n]
        writer.advance(n)
    reader, out, pos = FrameReader(), [], 0
    while pos < len(stream):
        target = reader.buffer()
        n = min(len(target), rng.randint(1, 50), len(stream) - pos)
        target[:n] = stream[pos : pos + n]
        pos += n
        frame = reader.advance(n)
        if frame is not None:
            out.append(bytes(frame))
    assert not reader.mid_frame
    return out


def test_frames_survive_arbitrary_partial_reads_and_writes():
    rng = random.Random(7)
    frames = [bytes(rng.randbytes(rng.randint(0, 300))) for _ in range(40)]
    assert _frames_through_pipe(frames, rng) == frames


def test_the_writer_prefixes_each_frame_with_its_u64_length():
    writer = FrameWriter(encode({"a": np.arange(3)}))
    data = b"".join(bytes(v) for v in writer.buffers(limit=100))
    (length,) = LENGTH.unpack(data[:8])
    assert length == len(data) - 8
    assert decode(data[8:])["a"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("allocate", [allocate_paged, allocate_fast])
@pytest.mark.parametrize("size", [10, 3 << 20])
def test_frames_decode_to_writable_zero_copy_tensors_with_either_allocator(allocate, size):
    tensor = torch.arange(size // 4, dtype=torch.float32)
    data = b"".join(bytes(v) for v in FrameWriter(encode({"t": tensor})).buffers(limit=100))
    reader = FrameReader(allocate=allocate)
    target = reader.buffer()
    target[:8] = data[:8]
    assert reader.advance(8) is None
    target = reader.buffer()
    target[:] = data[8:]
    frame = reader.advance(len(data) - 8)
    assert frame is not None and not frame.readonly
    decoded = decode(frame)["t"]
    assert torch.equal(decoded, tensor)
    address = np.frombuffer(frame, np.uint8).ctypes.data
    assert address <= decoded.data_ptr() < address + frame.nbytes
    decoded.add_(1)  # writable: the frame is the tensor's memory


def test_an_impossible_length_prefix_is_a_frame_error():
    reader = FrameReader(max_frame=1000)
    reader.buffer()[:8] = LENGTH.pack(1001)
    with pytest.raises(FrameError, match="exceeds"):
        reader.advance(8)


def test_a_reader_in_the_middle_of_a_frame_says_so():
    reader = FrameReader()
    assert not reader.mid_frame
    reader.buffer()[:3] = b"\x01\x00\x00"
    reader.advance(3)
    assert reader.mid_frame
