"""protocol.inbox: incoming WebSocket messages to protocol messages, within limits, no I/O."""

from __future__ import annotations

import numpy as np
import pytest

from protocol import PROTOCOL_VERSION
from protocol.chunking import chunk_messages
from protocol.codec import encode, encode_frame
from protocol.errors import BadMessage, ErrorCode, MessageTooLarge, VersionMismatch
from protocol.inbox import Inbox, check_first
from protocol.messages import CHUNK_BYTES, Call, ClientHello, Heartbeat
from protocol.parsing import dump, encode_small


def test_a_whole_frame_is_one_message_and_counted():
    inbox = Inbox(1 << 20)
    frame = encode_small(Heartbeat(id=3, sent_at=1.5))
    message = inbox.take(frame)
    assert isinstance(message, Heartbeat) and message.id == 3 and message.sent_at == 1.5
    assert inbox.bytes_in == len(frame)


def test_chunks_complete_one_message_at_their_last_chunk():
    inbox = Inbox(1 << 30)
    big = Call(id=9, job_id="j", request={"x": np.arange(CHUNK_BYTES // 4, dtype=np.int64)})
    chunks = list(chunk_messages(encode(dump(big)), stream=1))
    assert len(chunks) == 3
    assert inbox.take(chunks[0]) is None and inbox.pending_bytes > 0
    assert inbox.take(chunks[1]) is None
    message = inbox.take(chunks[2])
    assert isinstance(message, Call) and np.array_equal(message.request["x"], big.request["x"])
    assert inbox.pending_bytes == 0 and inbox.bytes_in == sum(len(c) for c in chunks)


def test_a_text_message_is_a_bad_frame():
    with pytest.raises(BadMessage, match="text message: frames are binary") as refused:
        Inbox(1 << 20).take("hello")
    assert refused.value.info.code == ErrorCode.BAD_FRAME and refused.value.reply_to is None


def test_a_whole_message_over_the_limit_is_too_large_and_names_its_request():
    frame = encode_small(Call(id=5, reply_to=2, job_id="j", request={"pad": "x" * 2000}))
    with pytest.raises(BadMessage, match=r"message of \d+ bytes exceeds the limit") as refused:
        Inbox(1000).take(frame)
    assert refused.value.info.code == ErrorCode.TOO_LARGE
    assert refused.value.info.detail == {"limit": 1000}
    assert refused.value.reply_to == 5
    cause = refused.value.__cause__
    assert isinstance(cause, MessageTooLarge) and cause.answers == 2


def test_a_chunk_out_of_order_is_a_bad_frame():
    chunks = list(chunk_messages([bytes(3 * CHUNK_BYTES)], stream=1))
    with pytest.raises(BadMessage, match="starts at offset") as refused:
        Inbox(1 << 30).take(chunks[1])
    assert refused.value.info.code == ErrorCode.BAD_FRAME


def test_the_first_message_must_be_whole_and_of_this_version():
    check_first(encode_small(ClientHello()))
    check_first("text: take() refuses it")
    chunk = next(chunk_messages([bytes(2 * CHUNK_BYTES)], stream=1))
    with pytest.raises(BadMessage, match="a chunked first message") as refused:
        check_first(chunk)
    assert refused.value.info.code == ErrorCode.TOO_LARGE
    other = encode_frame({"v": PROTOCOL_VERSION + 1, "kind": "client_hello"})
    with pytest.raises(VersionMismatch, match=f"peer speaks {PROTOCOL_VERSION + 1}"):
        check_first(other)
