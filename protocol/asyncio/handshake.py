"""The hello exchange over a :class:`~protocol.asyncio.channel.Channel`, with its timeout.

Both halves of every handshake (the coordinator accepting a worker or a client, an agent
accepting a peer link; an agent, a peer link and a client dialing) go through here; what counts
as a good hello or answer is :mod:`protocol.handshake`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TypeVar

from pydantic import BaseModel

from protocol.asyncio.channel import Channel, Transport
from protocol.asyncio.websocket import close_reason
from protocol.errors import ErrorCode
from protocol.handshake import expect_hello, expect_reply, refusal
from protocol.parsing import encode_small

__all__ = ["receive_hello", "refuse_hello", "send_hello"]

M = TypeVar("M", bound=BaseModel)

REFUSED_CLOSE_CODE = 4002
"""The close code after a refused hello (an application code: RFC 6455 §7.4.2)."""


async def receive_hello(
    channel: Channel,
    expected: type[M] | tuple[type[M], ...],
    refused: str,
    *,
    deadline: float,
) -> M:
    """Read a connection's first message, by the loop time ``deadline``; it must be a hello.

    Args:
        refused: the refusal's text for another kind of message (``{kind}``: the kind).

    Raises:
        TimeoutError: no message by ``deadline``.
        VersionMismatch: the peer speaks another protocol version.
        BadMessage: the message is chunked, not a frame or not valid.
        UnexpectedHello: a valid message, but not one of the ``expected`` hellos.
    """
    async with asyncio.timeout_at(deadline):
        message = await channel.receive(first=True)
    return expect_hello(message, expected, refused)


async def send_hello(
    channel: Channel,
    hello: BaseModel,
    expected: type[M],
    timeout: float,  # noqa: ASYNC109
    *,
    peer: str = "the peer",
    first: bool = False,
) -> M:
    """Send ``hello`` and read its answer, both within ``timeout`` seconds, before
    :meth:`~protocol.asyncio.channel.Channel.run`.

    Args:
        peer: who answers, for the error ("the coordinator answered the hello with ...").
        first: check the answer's protocol version too (see ``Channel.receive``).

    Raises:
        TimeoutError: no answer within ``timeout``.
        RemoteError: the peer refused the hello.
        UnexpectedReply: the peer answered with another kind of message.
        VersionMismatch, BadMessage: the answer could not be read (``first``: another version).
        ChannelClosed: the connection closed first.
    """
    async with asyncio.timeout(timeout):
        await channel.send(hello)
        reply = await channel.receive(first=first)
    return expect_reply(reply, expected, peer)


async def refuse_hello(
    transport: Transport,
    code: ErrorCode,
    message: str,
    timeout: float,  # noqa: ASYNC109
) -> None:
    """Answer a refused hello with an ``error`` naming this side's version, then close.

    Never raises: the peer may be gone already, and the refusal is all it would get.
    """
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout):
            await transport.send(encode_small(refusal(code, message)))
            await transport.close(REFUSED_CLOSE_CODE, close_reason(message))
