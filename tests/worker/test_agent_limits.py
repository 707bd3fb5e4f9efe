"""The agent's limits, on what it receives from its coordinator and on its ``/peer`` endpoint.

A message over ``max_message_bytes`` is ``too_large`` (from its first chunk), one WebSocket
message over 4 MiB closes the link with 1009, a request beyond ``max_inflight`` is ``busy``, a
peer link has ``open_timeout`` for its upgrade and for its hello, and a delivery for a job that
is not open here is refused instead of kept. The agent keeps serving after each.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from protocol.asyncio.channel import Channel
from protocol.chunking import CHUNK_MAGIC
from protocol.errors import ErrorCode, RemoteError
from protocol.messages import CHUNK_BYTES, Ack, Call, CloseJob, Deliver, PeerHello
from protocol.parsing import encode_small
from tests.utils import UNIT, Center
from tests.worker.standin import (
    StandIn,
    call_error,
    drive,
    no_process_left,
    open_job,
    presented,
    running,
)

pytestmark = pytest.mark.integration

__all__ = ["no_process_left"]  # the autouse fixture: no daemon is left behind

LIMIT = 2 * CHUNK_BYTES


def _chunk_head(stream: int, offset: int, total: int) -> bytes:
    return struct.pack("<8sQQQ", CHUNK_MAGIC, stream, offset, total)


def test_messages_from_the_coordinator_over_the_limit_are_refused_and_the_agent_serves_on():
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in, worker_id="w-big", spare=False, max_message_bytes=LIMIT):
            channel = await stand_in.next_channel()
            unsolicited: asyncio.Queue[Any] = asyncio.Queue()
            channel.on_unsolicited = unsolicited.put_nowait  # type: ignore[method-assign]
            big = Call(job_id="j", request={"cmd": "fit", "x": bytes(LIMIT)})
            with pytest.raises(RemoteError, match=f"exceeds the limit of {LIMIT} bytes") as info:
                await channel.request(big, timeout=30 * UNIT)  # refused from its first chunk
            assert info.value.code == ErrorCode.TOO_LARGE
            await channel.transport.send(_chunk_head(9, 0, 1 << 62) + bytes(16))
            error = await asyncio.wait_for(unsolicited.get(), 10 * UNIT)
            assert error.error.code == ErrorCode.TOO_LARGE
            # Still serving on the same connection.
            refused = await call_error(channel, "nope", "ping")
            assert refused.code == ErrorCode.UNKNOWN_JOB
            # One WebSocket message over 4 MiB: the agent closes with 1009, then reconnects.
            await channel.transport.send(bytes(4 * CHUNK_BYTES + 1))
            await asyncio.wait_for(channel.closed.wait(), 10 * UNIT)
            assert channel.transport.close_code == 1009  # type: ignore[attr-defined]
            again = await stand_in.next_channel()
            assert stand_in.hellos[-1].worker_id == "w-big"
            assert (await call_error(again, "nope", "ping")).code == ErrorCode.UNKNOWN_JOB

    drive(main)


def test_requests_beyond_max_inflight_on_the_agent_are_busy_until_one_ends():
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in, spare=False, max_inflight=2):
            channel = await stand_in.next_channel()
            await open_job(channel, "j", center=Center())
            # Two calls wait for mailbox inputs that never come: both in flight for a while.
            held = [
                asyncio.ensure_future(
                    channel.request(
                        Call(
                            job_id="j",
                            request={"cmd": "forward", "node_id": "center"},
                            timeout=2 * UNIT,
                            input_from=f"never/{n}",
                        ),
                        timeout=30 * UNIT,
                    )
                )
                for n in (0, 1)
            ]
            await asyncio.sleep(0)  # both sent, in order, before the next request
            with pytest.raises(RemoteError, match="2 requests in flight") as info:
                await channel.request(CloseJob(job_id="j"), timeout=10 * UNIT)
            assert info.value.code == ErrorCode.BUSY
            for call in held:
                with pytest.raises(RemoteError) as timed_out:
                    await call
                assert timed_out.value.code == ErrorCode.TIMEOUT
            assert isinstance(await channel.request(CloseJob(job_id="j"), 30 * UNIT), Ack)

    drive(main)


@contextlib.asynccontextmanager
async def _peer_endpoint(stand_in: StandIn, **options: Any) -> AsyncIterator[tuple[str, Channel]]:
    """An agent serving ``/peer`` with ``options``; yields its ``ws://`` address and the
    stand-in's channel to it."""
    listen = "127.0.0.1:0"  # the port the agent binds, announced: no port picked and then raced for
    async with running(stand_in, spare=False, peer_listen=listen, **options) as agent:
        channel = await stand_in.next_channel()
        assert agent.peer_address is not None
        yield agent.peer_address, channel


async def _dropped_after(sock: socket.socket, seconds: float) -> float:
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    async with asyncio.timeout(seconds):
        while True:
            try:
                if not await loop.sock_recv(sock, 4096):
                    break
            except ConnectionResetError:
                break
    return time.monotonic() - started


def test_a_peer_link_has_the_open_timeout_for_its_upgrade_and_for_its_hello():
    stand_in = StandIn()
    limit = 1.0 * UNIT

    async def main() -> None:
        async with _peer_endpoint(stand_in, open_timeout=limit) as (address, _):
            # Upgraded, never a hello: closed with the reason.
            ws = await websockets.connect(f"{address}/peer")
            started = time.monotonic()
            with pytest.raises(ConnectionClosed) as closed:
                async with asyncio.timeout(limit + 5 * UNIT):
                    await ws.recv()
            assert time.monotonic() - started <= limit + 2 * UNIT
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
            assert "expected a peer_hello" in closed.value.rcvd.reason
            # Half an HTTP request: dropped within the open timeout.
            loop = asyncio.get_running_loop()
            host, port = address.removeprefix("ws://").rsplit(":", 1)
            with socket.socket() as sock:
                sock.setblocking(False)
                await loop.sock_connect(sock, (host, int(port)))
                await loop.sock_sendall(sock, b"GET /peer HTTP/1.1\r\nHost: x\r\n")
                assert await _dropped_after(sock, limit + 5 * UNIT) <= limit + 2 * UNIT

    drive(main)


def test_a_peer_link_refuses_what_is_too_large_and_deliveries_for_other_jobs():
    stand_in = StandIn()

    async def main() -> None:
        async with _peer_endpoint(stand_in, max_message_bytes=LIMIT) as (address, coordinator):
            await open_job(coordinator, "j", center=Center())
            ws = await websockets.connect(f"{address}/peer", compression=None, max_size=1 << 24)
            channel = Channel(ws, "raw peer")
            reader = asyncio.ensure_future(channel.run())
            hello = PeerHello(worker_id="p", job_id="j", secret=presented("p"))
            try:
                assert isinstance(await channel.request(hello, 10 * UNIT), Ack)
                big = Deliver(job_id="j", to="x", key="k", payload=bytes(LIMIT))
                with pytest.raises(RemoteError, match="exceeds the limit") as info:
                    await channel.request(big, timeout=30 * UNIT)
                assert info.value.code == ErrorCode.TOO_LARGE
                stray = Deliver(job_id="not-open", to="x", key="k", payload=b"1")
                with pytest.raises(RemoteError, match="serves job 'j'") as info:
                    await channel.request(stray, timeout=10 * UNIT)
                assert info.value.code == ErrorCode.BAD_REQUEST
                await ws.send(bytes(4 * CHUNK_BYTES + 1))
                await asyncio.wait_for(reader, 10 * UNIT)
                assert ws.close_code == 1009
            finally:
                await ws.close()
            # The endpoint still takes links.
            async with websockets.connect(f"{address}/peer") as again:
                again_hello = PeerHello(id=1, worker_id="q", job_id="j", secret=presented("q"))
                await again.send(encode_small(again_hello))
                assert b'"ack"' in await asyncio.wait_for(again.recv(), 10 * UNIT)

    drive(main)
