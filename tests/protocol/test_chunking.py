"""protocol.chunking: frames cut into chunk messages and joined again, within limits, no I/O."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol.messages import CHUNK_BYTES
from tests.utils import RecordingSink


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


def _stream(stream: int, nbytes: int) -> list[bytes]:
    from protocol.messages import Call

    x = np.zeros(nbytes, np.uint8)
    return _chunks_of(Call(id=stream, job_id="j", request={"x": x}), stream)


def test_a_stream_with_no_chunk_for_the_stall_timeout_is_dropped_and_its_rest_ignored():
    from protocol.chunking import Reassembler

    now = [0.0]
    reassembler = Reassembler(1 << 30, stall_seconds=10.0, clock=lambda: now[0])
    stalled, alive = _stream(1, 3 * CHUNK_BYTES), _stream(2, 2 * CHUNK_BYTES)
    assert reassembler.add(stalled[0]) is None
    now[0] = 6.0
    assert reassembler.add(alive[0]) is None
    assert reassembler.next_stall() == 10.0  # the first stream's last chunk + 10 s
    now[0] = 10.5
    assert reassembler.expire() == [1] and reassembler.stalled == 1
    assert reassembler.add(stalled[1]) is None  # dropped silently, no error per chunk
    assert reassembler.add(stalled[2]) is None
    assert [reassembler.add(c) is not None for c in alive[1:]] == [False, True]  # untouched
    assert reassembler.pending_bytes == 0 and reassembler.next_stall() is None


def test_a_budget_counts_the_bytes_received_over_every_connection_and_share_charging_it():
    from protocol.chunking import Budget, Reassembler
    from protocol.errors import MessageTooLarge, ReassemblyFull

    pool = Budget(5 * CHUNK_BYTES)
    one, two = Reassembler(1 << 30, budget=pool), Reassembler(1 << 30, budget=pool)
    first, second = _stream(1, 4 * CHUNK_BYTES), _stream(2, 4 * CHUNK_BYTES)
    # Announcing 4 MiB costs nothing: each chunk is charged as it arrives.
    assert one.add(first[0]) is None and one.add(first[1]) is None
    assert pool.used == 2 * CHUNK_BYTES
    assert two.add(second[0]) is None and two.add(second[1]) is None
    assert pool.used == 4 * CHUNK_BYTES
    assert two.add(second[2]) is None  # 5 MiB received: the pool is full
    # The stream whose chunk would go over ends, busy, naming its request (the Call's id);
    # what it held is freed.
    with pytest.raises(ReassemblyFull, match=r"on all connections \(the budget is 5242880") as full:
        two.add(second[3])
    assert full.value.reply_to == 2
    assert pool.used == 2 * CHUNK_BYTES  # the first stream's two chunks, still in progress
    assert all(two.add(chunk) is None for chunk in second[3:])  # its rest dropped silently
    assert [one.add(chunk) is not None for chunk in first[2:]][-1]  # the first completes
    # (the first stream's last chunks fit now that the second's bytes are freed)
    assert pool.used == 0

    # A share of the pool: charged in both, bounded by the smaller.
    share = Budget(3 * CHUNK_BYTES, "client 'a'", parent=pool)
    three = Reassembler(1 << 30, budget=share)
    third = _stream(3, 2 * CHUNK_BYTES)
    assert three.add(third[0]) is None
    assert share.used == pool.used == CHUNK_BYTES
    with pytest.raises(MessageTooLarge, match="exceeds the 3145728 bytes its sender may have"):
        three.add(_stream(4, 4 * CHUNK_BYTES)[0])
    three.close()  # its connection went: what it held is free again
    assert share.used == pool.used == 0


def test_a_reply_its_owner_awaits_is_charged_to_the_reply_budget_and_nothing_else_is():
    """Issue 53, Medium 5: what a peer sends unasked cannot take the room of the replies its
    owner waits for (two worker ids once made an honest worker's reply busy)."""
    from protocol.chunking import Budget, Reassembler
    from protocol.errors import ReassemblyFull
    from protocol.messages import Call

    unasked, replies = Budget(3 * CHUNK_BYTES, "unasked"), Budget(4 * CHUNK_BYTES, "replies")
    reassembler = Reassembler(1 << 30, budget=unasked)
    reassembler.reply_budget = replies
    reassembler.awaited = lambda reply_to: reply_to == 9
    flood = _stream(1, 2 * CHUNK_BYTES)
    assert all(reassembler.add(chunk) is None for chunk in flood[:2])
    assert unasked.used == 2 * CHUNK_BYTES
    x = np.zeros(3 * CHUNK_BYTES, np.uint8)
    reply = _chunks_of(Call(id=5, reply_to=9, job_id="j", request={"x": x}), 2)
    assert [reassembler.add(c) is not None for c in reply][-1]  # the awaited reply, whole
    assert replies.used == 0 and unasked.used == 2 * CHUNK_BYTES
    stranger = _chunks_of(Call(id=6, reply_to=8, job_id="j", request={"x": x[:CHUNK_BYTES]}), 3)
    assert reassembler.add(stranger[0]) is None  # a reply to nothing awaited: unasked's
    with pytest.raises(ReassemblyFull, match=r"on unasked \(the budget is 3145728"):
        reassembler.add(stranger[1])


def test_a_claimed_stream_lands_in_its_sinks_buffer_and_is_told_each_chunk():
    from protocol.chunking import Reassembler, chunk_messages
    from protocol.codec import decode, encode

    value = {"a": np.arange(CHUNK_BYTES // 4 + 9, dtype=np.float32)}
    parts = encode(value)
    sink = RecordingSink()
    heads: list[bytes] = []

    def claim(head: memoryview) -> RecordingSink:
        heads.append(bytes(head[:8]))
        return sink

    reassembler = Reassembler(1 << 30, claim=claim)
    chunks = list(chunk_messages(parts, stream=3))
    assert reassembler.add(chunks[0]) is None
    frame = reassembler.add(chunks[1])
    assert frame is not None and frame.obj is sink.landed.obj
    assert sink.seen == [CHUNK_BYTES, len(b"".join(parts))]
    assert heads == [bytes(parts[0][:8])]  # asked once, with the frame's first bytes
    np.testing.assert_array_equal(decode(frame)["a"], value["a"])
    unclaimed = Reassembler(1 << 30, claim=lambda head: None)
    unclaimed.add(chunks[0])
    assert bytes(unclaimed.add(chunks[1])) == b"".join(parts)
