"""What one connection receives, turned into messages: chunks joined, limits kept, no I/O.

:class:`Inbox` takes each incoming WebSocket message as it is and returns the protocol message it
completes (``None`` for a chunk of one still coming), or raises the
:class:`~protocol.errors.BadMessage` whose error reply the owner sends. The first message of a
connection is checked before anything else is read of it (:func:`check_first`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from protocol.chunking import (
    DEFAULT_STALL_SECONDS,
    Budget,
    Claim,
    Reassembler,
    frame_buffer,
    is_chunk,
)
from protocol.errors import (
    BadMessage,
    ErrorCode,
    ErrorInfo,
    FrameError,
    MessageTooLarge,
    ReassemblyFull,
)
from protocol.messages import CHUNK_BYTES
from protocol.parsing import check_version, parse, peek_ids

__all__ = ["Inbox", "check_first"]


def check_first(payload: Any) -> None:
    """Refuse a connection's first message when it is chunked or speaks another version.

    A hello fits one message: no buffer is reserved for a peer that has not said hello.

    Raises:
        BadMessage: a chunk (``too_large``).
        VersionMismatch: the peer speaks another protocol version.
    """
    if not isinstance(payload, bytes | bytearray | memoryview):
        return  # take() refuses it
    if is_chunk(payload):
        info = ErrorInfo(
            code=ErrorCode.TOO_LARGE,
            message=f"a chunked first message: a hello fits in {CHUNK_BYTES} bytes",
        )
        raise BadMessage(info, None)
    check_version(payload)


class Inbox:
    """One connection's incoming messages.

    Args:
        max_message_bytes: largest message accepted, whole or reassembled from its chunks (the
            chunked ones in progress together, see :class:`~protocol.chunking.Reassembler`).
        budget: the bytes of chunked messages in progress, shared with other connections.
        stall_seconds: how long a chunked message may wait for its next chunk.
        claim: where a message the owner claims lands, whole or chunked
            (:class:`~protocol.chunking.StreamSink`).
        buffer_for: where any other chunked message is reassembled
            (:class:`~protocol.chunking.Reassembler`).
    """

    def __init__(
        self,
        max_message_bytes: int,
        budget: Budget | None = None,
        stall_seconds: float | None = DEFAULT_STALL_SECONDS,
        claim: Claim | None = None,
        buffer_for: Callable[[int], memoryview] = frame_buffer,
    ) -> None:
        self.max_message_bytes = max_message_bytes
        self.bytes_in = 0
        self.claim = claim
        self.reassembler = Reassembler(
            max_message_bytes,
            budget=budget,
            stall_seconds=stall_seconds,
            claim=claim,
            buffer_for=buffer_for,
        )
        """Its chunked messages in progress (the owner expires stalled ones, see
        :meth:`~protocol.chunking.Reassembler.expire`, and closes it)."""

    @property
    def pending_bytes(self) -> int:
        """The announced totals of the chunked messages in progress."""
        return self.reassembler.pending_bytes

    def take(self, payload: Any) -> Any:
        """The message ``payload`` completes, or ``None`` (a chunk of one still coming).

        Raises:
            BadMessage: as :meth:`frame`, or the frame is not a valid message.
        """
        frame = self.frame(payload)
        return None if frame is None else parse(frame)

    def frame(self, payload: Any) -> Any:
        """The frame ``payload`` completes — itself, or the chunked message it ends — not yet
        parsed; ``None`` (a chunk of one still coming).

        Raises:
            BadMessage: with the error reply to send; caused by a
                :class:`~protocol.errors.MessageTooLarge` when the message was refused for its
                size (its ``answers`` names the request it would have answered).
        """
        if isinstance(payload, str):
            raise BadMessage(
                ErrorInfo(code=ErrorCode.BAD_FRAME, message="text message: frames are binary"),
                None,
            )
        size = len(payload)
        self.bytes_in += size
        try:
            if not is_chunk(payload):
                if size > self.max_message_bytes:
                    raise MessageTooLarge(
                        f"message of {size} bytes exceeds the limit of "
                        f"{self.max_message_bytes} bytes",
                        *peek_ids(memoryview(payload)),
                    )
                sink = None if self.claim is None else self.claim(memoryview(payload))
                if sink is None:
                    return payload
                landed = sink.buffer(size)
                landed[:] = payload
                sink.received(size)
                return landed
            frame = self.reassembler.add(payload)
        except ReassemblyFull as exc:
            info = ErrorInfo(code=ErrorCode.BUSY, message=str(exc))
            raise BadMessage(info, exc.reply_to) from exc
        except MessageTooLarge as exc:
            info = ErrorInfo(
                code=ErrorCode.TOO_LARGE,
                message=str(exc),
                detail={"limit": self.max_message_bytes},
            )
            raise BadMessage(info, exc.reply_to) from exc
        except FrameError as exc:
            raise BadMessage(ErrorInfo(code=ErrorCode.BAD_FRAME, message=str(exc)), None) from exc
        return frame
