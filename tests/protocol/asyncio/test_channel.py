"""protocol.asyncio.channel over a real WebSocket pair on loopback: replies, streams, chunks, bad
input, limits."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch
import websockets

from protocol.asyncio.channel import Channel
from protocol.codec import encode_frame
from protocol.errors import ErrorCode, ErrorInfo, RemoteError
from protocol.messages import (
    CHUNK_BYTES,
    Ack,
    Call,
    Deliver,
    Heartbeat,
    JobEvent,
    Result,
    Status,
    Watch,
)
from tests.utils import UNIT, RecordingSink


async def _pair(handler):
    """A server channel with ``handler`` and a client channel to it, over loopback."""
    ready: asyncio.Future[Channel] = asyncio.get_running_loop().create_future()

    async def serve(ws):
        channel = Channel(ws, "server", handler)
        ready.set_result(channel)
        await channel.run()

    server = await websockets.serve(
        serve, "127.0.0.1", 0, max_size=2 * CHUNK_BYTES, compression=None
    )
    port = server.sockets[0].getsockname()[1]
    ws = await websockets.connect(
        f"ws://127.0.0.1:{port}", max_size=2 * CHUNK_BYTES, compression=None
    )
    client = Channel(ws, "client")
    reader = asyncio.ensure_future(client.run())
    return server, client, reader, await ready


async def _close(server, client, reader):
    await client.close()
    reader.cancel()
    server.close()
    await server.wait_closed()


def test_request_reply_and_a_large_tensor_in_chunks():
    big = torch.arange(3 * CHUNK_BYTES // 4, dtype=torch.float32)  # 3 MiB: four chunks

    async def handler(message):
        if isinstance(message, Status):
            return Result(result={"echo": big, "small": np.arange(3)})
        raise RemoteError(ErrorInfo(code=ErrorCode.BAD_REQUEST, message="nope"))

    async def main():
        server, client, reader, _ = await _pair(handler)
        try:
            reply = await client.request(Status(), timeout=10 * UNIT)
            assert torch.equal(reply.result["echo"], big)
            assert reply.result["small"].tolist() == [0, 1, 2]
            with pytest.raises(RemoteError, match="nope"):
                await client.request(Heartbeat(sent_at=0.0), timeout=10 * UNIT)
        finally:
            await _close(server, client, reader)

    asyncio.run(main())


def test_what_comes_in_and_the_chunks_that_go_out_set_the_channels_clocks():
    # When the last message (a chunk counts) came in, and the last chunk of a large one went
    # out: what the coordinator's reaper and the agent's link watch take for signs of life.
    big = torch.arange(3 * CHUNK_BYTES // 4, dtype=torch.float32)

    async def handler(message):
        return Result(result={"echo": big})

    async def main():
        server, client, reader, served = await _pair(handler)
        try:
            before = time.monotonic()
            await client.request(Status(), timeout=10 * UNIT)
            assert before < served.received_at < served.chunk_sent_at  # its reply, in chunks
            assert client.chunk_sent_at < before < client.received_at  # a small request
        finally:
            await _close(server, client, reader)

    asyncio.run(main())


def test_a_stream_of_events_ends_with_an_ack():
    async def handler(message):
        channel = served[0]
        for seq in (1, 2, 3):
            await channel.reply(message, JobEvent(job_id="j", seq=seq, time=0.0, event="progress"))
        return Ack()

    served: list[Channel] = []

    async def main():
        server, client, reader, channel = await _pair(handler)
        served.append(channel)
        try:
            kinds = [m.kind async for m in client.stream(Watch(job_id="j"), 10 * UNIT)]
            assert kinds == ["job_event", "job_event", "job_event", "ack"]
        finally:
            await _close(server, client, reader)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("payload", "code", "text"),
    [
        (b"\x00\x01garbage", ErrorCode.BAD_FRAME, "frame"),
        (
            encode_frame({"kind": "launch_missiles", "id": 5}),
            ErrorCode.BAD_REQUEST,
            "unknown message kind 'launch_missiles'",
        ),
        (
            encode_frame({"kind": "heartbeat", "id": 6, "sent_at": "soon"}),
            ErrorCode.BAD_REQUEST,
            "field 'sent_at'",
        ),
        (encode_frame({"id": 7}), ErrorCode.BAD_REQUEST, "no 'kind'"),
    ],
)
def test_bad_messages_get_an_error_reply_and_the_connection_stays_up(payload, code, text):
    async def handler(message):
        return Result(result="fine")

    async def main():
        server, client, reader, _ = await _pair(handler)
        try:
            errors: asyncio.Queue = asyncio.Queue()
            client.on_unsolicited = errors.put_nowait  # type: ignore[method-assign]
            await client.transport.send(payload)
            error = await asyncio.wait_for(errors.get(), 10 * UNIT)
            assert error.error.code == code
            assert text in error.error.message
            reply = await client.request(Status(), timeout=10 * UNIT)
            assert reply.result == "fine"
        finally:
            await _close(server, client, reader)

    asyncio.run(main())


async def _limited_pair(handler, **limits):
    """A server channel with ``limits`` and a client channel to it."""
    ready: asyncio.Future[Channel] = asyncio.get_running_loop().create_future()

    async def serve(ws):
        channel = Channel(ws, "server", handler, **limits)
        ready.set_result(channel)
        await channel.run()

    server = await websockets.serve(
        serve, "127.0.0.1", 0, max_size=2 * CHUNK_BYTES, compression=None
    )
    port = server.sockets[0].getsockname()[1]
    ws = await websockets.connect(
        f"ws://127.0.0.1:{port}", max_size=2 * CHUNK_BYTES, compression=None
    )
    client = Channel(ws, "client", max_message_bytes=2 * CHUNK_BYTES)
    reader = asyncio.ensure_future(client.run())
    return server, client, reader, await ready


def test_too_large_requests_and_replies_fail_at_once_and_the_connection_stays_up():
    from protocol.messages import Call

    async def handler(message):
        if message.request.get("big"):
            return Result(result=np.zeros(3 * CHUNK_BYTES, np.uint8))  # over the client's limit
        return Result(result="fine")

    async def main():
        server, client, reader, served = await _limited_pair(
            handler, max_message_bytes=2 * CHUNK_BYTES
        )
        try:
            x = np.zeros(3 * CHUNK_BYTES, np.uint8)
            # Answered by the first chunk's refusal: well before the request's own timeout.
            async with asyncio.timeout(10 * UNIT):
                with pytest.raises(RemoteError, match="exceeds the limit") as refused:
                    await client.request(Call(job_id="j", request={"x": x}), timeout=60)
            assert refused.value.code == ErrorCode.TOO_LARGE
            async with asyncio.timeout(10 * UNIT):
                with pytest.raises(RemoteError, match="reply refused") as reply_refused:
                    await client.request(Call(job_id="j", request={"big": True}), timeout=60)
            assert reply_refused.value.code == ErrorCode.TOO_LARGE
            reply = await client.request(Call(job_id="j", request={}), timeout=10 * UNIT)
            assert reply.result == "fine"
            assert served._inbox.pending_bytes == 0
        finally:
            await _close(server, client, reader)

    asyncio.run(main())


def test_a_single_message_over_a_small_limit_is_too_large():
    from protocol.messages import Call

    async def handler(message):
        return Result(result="fine")

    async def main():
        server, client, reader, _ = await _limited_pair(handler, max_message_bytes=1000)
        try:
            assert (await client.request(Status(), timeout=10 * UNIT)).result == "fine"
            with pytest.raises(RemoteError, match=r"message of \d+ bytes exceeds") as refused:
                await client.request(Call(job_id="j", request={"pad": "x" * 2000}), 10 * UNIT)
            assert refused.value.code == ErrorCode.TOO_LARGE
            assert (await client.request(Status(), timeout=10 * UNIT)).result == "fine"
        finally:
            await _close(server, client, reader)

    asyncio.run(main())


def test_requests_beyond_max_inflight_are_busy_at_once_and_heartbeats_never_are():
    from protocol.messages import Call

    release, two_held, three_beats = asyncio.Event(), asyncio.Event(), asyncio.Event()
    beats: list[float] = []
    held: list[int] = []

    async def handler(message):
        if isinstance(message, Heartbeat):
            beats.append(message.sent_at)
            if len(beats) == 3:
                three_beats.set()
            return None
        held.append(message.request["n"])
        if len(held) == 2:
            two_held.set()
        await release.wait()
        return Result(result=message.request["n"])

    async def main():
        server, client, reader, served = await _limited_pair(handler, max_inflight=2)
        try:
            holding = [
                asyncio.ensure_future(client.request(Call(job_id="j", request={"n": n}), 30))
                for n in (0, 1)
            ]
            await asyncio.wait_for(two_held.wait(), 10 * UNIT)
            assert served.inflight == 2
            async with asyncio.timeout(10 * UNIT):
                with pytest.raises(RemoteError, match="2 requests in flight") as busy:
                    await client.request(Call(job_id="j", request={"n": 2}), timeout=30)
            assert busy.value.code == ErrorCode.BUSY
            for sent_at in (1.0, 2.0, 3.0):
                await client.send(Heartbeat(sent_at=sent_at))
            await asyncio.wait_for(three_beats.wait(), 10 * UNIT)
            assert beats == [1.0, 2.0, 3.0] and served.refused_busy == 1
            release.set()
            assert [(await h).result for h in holding] == [0, 1]
            reply = await client.request(Call(job_id="j", request={"n": 3}), timeout=10 * UNIT)
            assert reply.result == 3 and served.inflight == 0
        finally:
            await _close(server, client, reader)

    asyncio.run(main())


class _Unread:
    """A transport whose peer sends bad messages and never reads a reply: ``send`` never
    completes (what a full socket buffer looks like from here)."""

    def __init__(self) -> None:
        self.closed_with: tuple[int, str] | None = None

    async def send(self, message):
        await asyncio.Event().wait()

    async def recv(self):
        await asyncio.sleep(0)
        return b"\x00\x01not a frame"

    async def close(self, code=1000, reason=""):
        self.closed_with = (code, reason)


def test_a_peer_that_floods_bad_messages_and_reads_no_reply_is_disconnected():
    async def main():
        transport = _Unread()
        channel = Channel(transport, "flooded", reply_timeout=0.2 * UNIT)
        async with asyncio.timeout(10 * UNIT):
            await channel.run()  # returns: it does not pile up replies forever
        assert channel.closed.is_set()
        assert "did not read an error reply" in channel.close_reason
        assert transport.closed_with is not None and transport.closed_with[0] == 1008
        assert not channel._tasks

    asyncio.run(main())


class _Recording:
    """A transport that takes a little while per send and records which chunked messages are
    being written at the same time, over every transport sharing ``open``."""

    def __init__(self, open_streams: set[tuple[int, int]], peak: list[int], n: int) -> None:
        self.open, self.peak, self.n = open_streams, peak, n
        self.sent: list[str] = []

    async def send(self, message):
        from protocol.chunking import CHUNK_HEAD as _CHUNK_HEAD
        from protocol.chunking import CHUNK_MAGIC

        if isinstance(message, tuple):  # a large one, as fragments
            message = b"".join(message)
        if message[: len(CHUNK_MAGIC)] == CHUNK_MAGIC:
            _, stream, offset, total = _CHUNK_HEAD.unpack_from(message)
            self.open.add((self.n, stream))
            self.peak[0] = max(self.peak[0], len(self.open))
            self.sent.append("chunk")
            await asyncio.sleep(0.001)
            if offset + len(message) - _CHUNK_HEAD.size == total:
                self.open.discard((self.n, stream))
        else:
            self.sent.append("small")
            await asyncio.sleep(0)

    async def recv(self):
        await asyncio.Future()

    async def close(self, code=1000, reason=""):
        pass


def test_a_shared_bulk_gate_bounds_the_chunked_messages_written_at_once():
    big = Result(result=torch.zeros(3 * CHUNK_BYTES // 4))  # four chunks each

    async def peak(gate):
        open_streams: set[tuple[int, int]] = set()
        seen = [0]
        transports = [_Recording(open_streams, seen, n) for n in range(5)]
        channels = [Channel(t, f"c{n}", bulk_gate=gate) for n, t in enumerate(transports)]
        sends = [asyncio.ensure_future(c.send(big)) for c in channels]
        await asyncio.sleep(0)
        # A small message of a channel waiting at the gate goes out at once.
        await channels[4].send(Heartbeat(sent_at=0.0))
        await asyncio.gather(*sends)
        return seen[0], transports[4].sent

    most, last = asyncio.run(peak(None))
    assert most == 5 and last[0] == "chunk"
    gate = asyncio.Semaphore(2)
    most, last = asyncio.run(peak(gate))
    assert most == 2
    assert last == ["small"] + ["chunk"] * 4


@pytest.mark.parametrize("floats", [25_000, 5 * CHUNK_BYTES // 8], ids=["one", "chunked"])
def test_a_reply_is_not_kept_alive_waiting_for_the_connections_next_message(floats):
    """A coordinator with thousands of idle connections must not hold each one's last reply (a
    state) until that connection's next heartbeat: not in the channel, and not in websockets'
    frame parser, which keeps the last frame it parsed until the next one arrives (a message
    sent as one frame would stay alive; sent as fragments, only an empty last frame stays; of a
    chunked one, its last chunk is sent so)."""
    import gc
    import weakref

    from websockets.frames import Frame

    big = torch.ones(floats)  # 100 KB, one message; or 2.5 MiB, in chunks (the last 0.5 MiB)

    def large_frames() -> list[Frame]:
        gc.collect()
        return [f for f in gc.get_objects() if type(f) is Frame and len(f.data) > 50_000]

    async def handler(message):
        return Result(result={"state": big})

    async def main():
        server, client, reader, _ = await _pair(handler)
        try:
            reply = await client.request(Status(), timeout=10 * UNIT)
            received = weakref.ref(reply.result["state"])
            assert torch.equal(reply.result["state"], big)
            del reply
            await asyncio.sleep(0)  # the loop lets go of the step that brought the reply
            gc.collect()
            assert received() is None
            assert [(f.opcode, f.fin, len(f.data)) for f in large_frames()] == []
        finally:
            await _close(server, client, reader)

    asyncio.run(main())


def test_a_large_message_is_parsed_in_a_thread_and_the_loop_keeps_running(monkeypatch):
    """A message over PARSE_ON_LOOP_BYTES is decoded and validated off the event loop: the
    loop's other work goes on meanwhile (issue 14, row 5), and messages stay in order."""
    from protocol.asyncio import channel as channel_module

    threads: list[tuple[int, bool]] = []
    real_parse = channel_module.parse

    def watched_parse(frame, relay=False):
        threads.append((len(frame), threading.current_thread() is threading.main_thread()))
        if len(frame) > CHUNK_BYTES:
            time.sleep(0.3)  # a slow validation: the loop must not wait for it
        return real_parse(frame, relay)

    monkeypatch.setattr(channel_module, "parse", watched_parse)
    seen: list[str] = []

    async def handler(message):
        seen.append(message.kind)
        return None

    async def main():
        server, client, reader, _ = await _pair(handler)
        try:
            ticks = 0

            async def tick():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            ticker = asyncio.ensure_future(tick())
            big = Deliver(
                id=client.next_id(), job_id="j", to="w", key="k", payload=bytes(CHUNK_BYTES + 64)
            )
            await client.send(big)
            await client.send(Heartbeat(id=client.next_id(), sent_at=0.0))
            for _ in range(200):
                if len(seen) == 2:
                    break
                await asyncio.sleep(0.01)
            ticker.cancel()
            assert seen == ["deliver", "heartbeat"]  # in order, the small one after the large
            assert ticks >= 15  # the loop ran through the 0.3 s validation
            big, small = threads[-2], threads[-1]
            assert big[0] > CHUNK_BYTES and big[1] is False  # in a thread
            assert small[1] is True  # on the loop
        finally:
            await _close(server, client, reader)

    asyncio.run(main())


def test_a_reply_lands_in_the_callers_sink_as_it_arrives():
    big = torch.arange(3 * CHUNK_BYTES // 4, dtype=torch.float32)  # 3 MiB: four chunks

    async def handler(message):
        return Result(result={"echo": big} if isinstance(message, Status) else {"small": 1})

    async def main():
        server, client, reader, _ = await _pair(handler)
        try:
            sink = RecordingSink()
            reply = await client.request(Status(), timeout=10 * UNIT, sink=sink)
            assert torch.equal(reply.result["echo"], big)
            assert len(sink.seen) == 4 and sink.seen == sorted(sink.seen)
            assert sink.seen[-1] == len(sink.landed)
            start = np.frombuffer(sink.landed, dtype=np.uint8).ctypes.data
            assert start <= reply.result["echo"].data_ptr() < start + len(sink.landed)
            small = RecordingSink()  # a reply of one message lands whole
            reply = await client.request(Heartbeat(sent_at=0.0), timeout=10 * UNIT, sink=small)
            assert reply.result == {"small": 1} and small.seen == [len(small.landed)]
            unclaimed = await client.request(Status(), timeout=10 * UNIT)  # no sink: as ever
            assert torch.equal(unclaimed.result["echo"], big)
        finally:
            await _close(server, client, reader)

    asyncio.run(main())


class _Filling:
    """A Pacer over a frame whose only buffer the test writes after the frame was encoded."""

    def __init__(self) -> None:
        self.final = 0
        self.changed = asyncio.Event()
        self.asked: list[int] = []

    def bind(self, parts):
        self.header = len(parts[0])

        async def until(n: int) -> None:
            self.asked.append(n)
            while self.final < n:
                self.changed.clear()
                await self.changed.wait()

        return until

    def advance(self, final: int) -> None:
        self.final = final
        self.changed.set()


def test_a_paced_request_goes_out_chunk_by_chunk_as_its_bytes_become_final():
    values = np.zeros(3 * CHUNK_BYTES // 8 + 5, dtype=np.float64)  # 3 MiB and a bit: 4 chunks
    got: list[np.ndarray] = []

    async def handler(message):
        got.append(np.array(message.request["values"]))
        return Ack()

    async def main():
        server, client, reader, _ = await _pair(handler)
        try:
            pacer = _Filling()
            message = Call(job_id="j", request={"cmd": "gradients", "values": values}, timeout=9)
            sending = asyncio.ensure_future(client.request(message, 10 * UNIT, pace=pacer))
            await asyncio.sleep(0.05 * UNIT)
            assert not sending.done() and pacer.asked == [CHUNK_BYTES]  # nothing went out
            for part in range(4):  # the bytes are written after the frame was encoded
                lo, hi = part * len(values) // 4, (part + 1) * len(values) // 4
                values[lo:hi] = np.arange(lo, hi)
                pacer.advance(pacer.header + hi * 8)
                await asyncio.sleep(0.01 * UNIT)
            assert (await asyncio.wait_for(sending, 10 * UNIT)).kind == "ack"
            np.testing.assert_array_equal(got[0], np.arange(len(values)))
            assert pacer.asked[1:] == [
                min(k * CHUNK_BYTES, pacer.header + values.nbytes) for k in range(1, 5)
            ]
        finally:
            await _close(server, client, reader)

    asyncio.run(main())
