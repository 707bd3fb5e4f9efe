"""protocol.asyncio.handshake: the hello exchange over a pair of in-memory transports."""

from __future__ import annotations

import asyncio

import pytest

from protocol import PROTOCOL_VERSION
from protocol.asyncio.channel import Channel
from protocol.asyncio.handshake import receive_hello, refuse_hello, send_hello
from protocol.codec import decode, encode_frame
from protocol.errors import (
    ErrorCode,
    RemoteError,
    UnexpectedHello,
    UnexpectedReply,
    VersionMismatch,
)
from protocol.messages import Ack, ClientHello, PeerHello, Welcome
from tests.utils import UNIT


class _End:
    """One end of an in-memory connection: what it sends, the other end receives."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.other: _End | None = None
        self.closed: tuple[int, str] | None = None

    async def send(self, message: bytes) -> None:
        assert self.other is not None
        self.other.inbox.put_nowait(message)

    async def recv(self) -> bytes:
        return await self.inbox.get()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed = (code, reason)


def _pair() -> tuple[_End, _End]:
    a, b = _End(), _End()
    a.other, b.other = b, a
    return a, b


def _deadline(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


def test_a_hello_and_its_welcome():
    async def main():
        dialer, acceptor = _pair()
        theirs = Channel(acceptor, "accepting")

        async def accept():
            hello = await receive_hello(
                theirs, ClientHello, "expects client_hello, got {kind}", deadline=_deadline(UNIT)
            )
            await theirs.reply(
                hello, Welcome(heartbeat_interval=1, heartbeat_timeout=5, server="s")
            )
            return hello

        accepted = asyncio.ensure_future(accept())
        welcome = await send_hello(
            Channel(dialer, "dialing"), ClientHello(name="n"), Welcome, 5 * UNIT, first=True
        )
        assert welcome.server == "s" and (await accepted).name == "n"

    asyncio.run(main())


def test_the_wrong_hello_is_refused_and_no_hello_times_out():
    async def main():
        dialer, acceptor = _pair()
        await dialer.send(encode_frame(Ack(id=3).model_dump()))
        with pytest.raises(UnexpectedHello, match="expects peer_hello, got ack") as refused:
            await receive_hello(
                Channel(acceptor, "a"),
                PeerHello,
                "expects peer_hello, got {kind}",
                deadline=_deadline(UNIT),
            )
        assert refused.value.reply_to == 3
        with pytest.raises(TimeoutError):
            await receive_hello(
                Channel(acceptor, "a"), PeerHello, "{kind}", deadline=_deadline(0.05)
            )
        await dialer.send(encode_frame({"v": PROTOCOL_VERSION + 1, "kind": "peer_hello"}))
        with pytest.raises(VersionMismatch):
            await receive_hello(
                Channel(acceptor, "a"), PeerHello, "{kind}", deadline=_deadline(UNIT)
            )

    asyncio.run(main())


def test_a_refused_hello_is_the_peers_error_and_the_connection_closes():
    async def main():
        dialer, acceptor = _pair()

        async def refuse():
            await acceptor.recv()
            await refuse_hello(acceptor, ErrorCode.UNAUTHORIZED, "who are you", UNIT)

        refusing = asyncio.ensure_future(refuse())
        with pytest.raises(RemoteError, match="who are you") as refused:
            await send_hello(Channel(dialer, "d"), ClientHello(), Welcome, 5 * UNIT)
        await refusing
        assert refused.value.code == ErrorCode.UNAUTHORIZED
        assert refused.value.info.detail == {"server_version": PROTOCOL_VERSION}
        assert acceptor.closed == (4002, "who are you")

    asyncio.run(main())


def test_an_answer_of_another_kind_is_unexpected():
    async def main():
        dialer, acceptor = _pair()

        async def answer():
            hello = decode(await acceptor.recv())
            await acceptor.send(encode_frame(Ack(reply_to=hello["id"]).model_dump()))

        answering = asyncio.ensure_future(answer())
        with pytest.raises(UnexpectedReply, match="the coordinator answered the hello with 'ack'"):
            await send_hello(
                Channel(dialer, "d"), ClientHello(), Welcome, 5 * UNIT, peer="the coordinator"
            )
        await answering
        with pytest.raises(TimeoutError):
            await send_hello(Channel(dialer, "d"), ClientHello(), Welcome, 0.05)

    asyncio.run(main())
