"""protocol.chunking: frames cut into chunk messages and joined again, within limits, no I/O."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol.messages import CHUNK_BYTES


def test_chunks_are_cut_across_the_codec_parts_and_reassemble_exactly():
    from protocol.chunking import CHUNK_MAGIC, Reassembler, chunk_messages
    from protocol.codec import decode, encode

    value = {
        "a": np.arange(CHUNK_BYTES // 8 + 3, dtype=np.float64),
        "b": b"x" * 1000,
        "c": torch.ones(7),
    }
    parts = encode(value)
    chunks = list(chunk_messages(parts, stream=7))
    assert all(c.startswith(CHUNK_MAGIC) for c in chunks)
    assert len(chunks) == 2
    reassembler = Reassembler(max_bytes=1 << 30)
    assert reassembler.add(chunks[0]) is None
    frame = reassembler.add(chunks[1])
    assert frame == b"".join(parts)
    got = decode(frame)
    assert np.array_equal(got["a"], value["a"]) and got["b"] == value["b"]


def test_bad_chunks_are_frame_errors():
    from protocol.chunking import Reassembler, chunk_messages
    from protocol.errors import FrameError

    chunks = list(chunk_messages([bytes(3 * CHUNK_BYTES)], stream=1))
    with pytest.raises(FrameError, match="starts at offset"):
        Reassembler(1 << 30).add(chunks[1])
    reassembler = Reassembler(1 << 30)
    reassembler.add(chunks[0])
    with pytest.raises(FrameError, match="expected the next at"):
        reassembler.add(chunks[2])
    with pytest.raises(FrameError, match="exceeds the limit"):
        Reassembler(CHUNK_BYTES).add(chunks[0])
    with pytest.raises(FrameError, match="shorter than its header"):
        Reassembler(1 << 30).add(chunks[0][:10])


# -- limits -------------------------------------------------------------------------------------


def _chunks_of(message, stream: int) -> list[bytes]:
    from protocol.chunking import chunk_messages
    from protocol.codec import encode
    from protocol.parsing import dump

    return list(chunk_messages(encode(dump(message)), stream))


def test_a_chunked_message_over_the_limit_is_refused_on_its_first_chunk_and_the_rest_dropped():
    from protocol.chunking import Reassembler
    from protocol.errors import MessageTooLarge
    from protocol.messages import Call

    big = Call(id=41, reply_to=7, job_id="j", request={"x": np.zeros(3 * CHUNK_BYTES, np.uint8)})
    chunks = _chunks_of(big, stream=1)
    assert len(chunks) == 4
    reassembler = Reassembler(max_bytes=2 * CHUNK_BYTES)
    with pytest.raises(MessageTooLarge, match="exceeds the limit of 2097152 bytes") as refused:
        reassembler.add(chunks[0])
    # Whom to tell, read from the frame's header in the first chunk; nothing was reserved.
    assert (refused.value.reply_to, refused.value.answers) == (41, 7)
    assert reassembler.pending_bytes == 0
    assert [reassembler.add(c) for c in chunks[1:]] == [None, None, None]  # no error per chunk
    small = _chunks_of(Call(id=42, job_id="j", request={"x": np.ones(CHUNK_BYTES, np.uint8)}), 1)
    assert reassembler.add(small[0]) is None  # the stream id is free again after its last chunk
    assert reassembler.pending_bytes > CHUNK_BYTES
    frame = reassembler.add(small[1])
    assert frame is not None and not frame.readonly
    assert reassembler.pending_bytes == 0


def test_the_chunked_messages_in_progress_together_stay_within_the_limits():
    from protocol.chunking import Reassembler
    from protocol.errors import MessageTooLarge
    from protocol.messages import Call

    def chunks(stream: int) -> list[bytes]:
        x = np.zeros(CHUNK_BYTES + CHUNK_BYTES // 2, np.uint8)
        return _chunks_of(Call(id=stream, job_id="j", request={"x": x}), stream)

    reassembler = Reassembler(max_bytes=2 * CHUNK_BYTES)
    first, second = chunks(1), chunks(2)
    assert reassembler.add(first[0]) is None
    with pytest.raises(MessageTooLarge, match=r"with the \d+ bytes of the 1 in progress"):
        reassembler.add(second[0])
    assert reassembler.add(first[1]) is not None
    third = chunks(3)
    assert reassembler.add(third[0]) is None  # room again once the first completed

    counted = Reassembler(max_bytes=1 << 30, max_streams=2)
    assert counted.add(chunks(1)[0]) is None and counted.add(chunks(2)[0]) is None
    with pytest.raises(MessageTooLarge, match="2 are already in progress"):
        counted.add(chunks(3)[0])
