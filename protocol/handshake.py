"""The hello every connection starts with, checked the same way on all four sides: no I/O.

A connection's first message is a hello (``worker_hello``, ``client_hello``, ``peer_hello``);
the accepting side refuses one from another protocol version before reading anything else of it
(:func:`~protocol.inbox.check_first`), and one of the wrong kind with an ``error`` reply
(:func:`expect_hello`). The dialing side takes only the answer it expects (``welcome``, ``ack``):
an ``error`` is the peer's refusal (:class:`~protocol.errors.RemoteError`), anything else an
:class:`~protocol.errors.UnexpectedReply` (:func:`expect_reply`). The exchange itself, with its
timeout, is the binding's (:mod:`protocol.asyncio.handshake`).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

from protocol import PROTOCOL_VERSION
from protocol.errors import ErrorCode, ErrorInfo, RemoteError, UnexpectedHello, UnexpectedReply
from protocol.inbox import check_first
from protocol.messages import Error

__all__ = ["check_first", "expect_hello", "expect_reply", "refusal"]

M = TypeVar("M", bound=BaseModel)


def expect_hello(message: Any, expected: type[M] | tuple[type[M], ...], refused: str) -> M:
    """``message`` when it is one of the ``expected`` hellos.

    Args:
        refused: the refusal's text; ``{kind}`` stands for the kind that came instead.

    Raises:
        UnexpectedHello: another kind of message (``bad_request``).
    """
    if isinstance(message, expected):
        return message
    info = ErrorInfo(code=ErrorCode.BAD_REQUEST, message=refused.format(kind=message.kind))
    raise UnexpectedHello(info, message.id)


def expect_reply(reply: Any, expected: type[M], peer: str = "the peer") -> M:
    """The answer to a hello, when it is the ``expected`` kind.

    Raises:
        RemoteError: the peer refused the hello (an ``error`` reply).
        UnexpectedReply: another kind of message ("``peer`` answered the hello with ...").
    """
    if isinstance(reply, expected):
        return reply
    if isinstance(reply, Error):
        raise RemoteError(reply.error)
    raise UnexpectedReply(f"{peer} answered the hello with {reply.kind!r}", reply.kind)


def refusal(code: ErrorCode, message: str) -> Error:
    """The ``error`` an accepting side sends before closing a connection whose hello it refuses;
    it names this side's protocol version."""
    return Error(
        error=ErrorInfo(code=code, message=message, detail={"server_version": PROTOCOL_VERSION})
    )
