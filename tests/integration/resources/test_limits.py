"""The coordinator's limits, on a real ``somatize-coordinator`` started with small ones.

Pending connections (idle sockets, half-sent upgrades, upgrades without a hello) are bounded in
number and in time; a message over ``--max-message-bytes`` is refused from its first chunk; a
request beyond ``--max-inflight`` is ``busy``; heartbeats never are; and after each breach the
coordinator keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import resource
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

import somatize as sz
from coordinator.server.app import Coordinator
from coordinator.server.config import CoordinatorConfig
from protocol.asyncio.channel import Channel
from protocol.chunking import CHUNK_MAGIC
from protocol.errors import ErrorCode, RemoteError
from protocol.messages import (
    CHUNK_BYTES,
    MAX_GRAPH_NODES,
    Capabilities,
    ClientHello,
    Deliver,
    GetResult,
    GraphSpec,
    Heartbeat,
    Status,
    StrategySpec,
    Submit,
    Watch,
    WorkerHello,
)
from somatize.cli.cluster import wait_for
from tests.integration.cluster import healthy
from tests.utils import UNIT, Center, said_port, stop_groups

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
PENDING = 4
PER_ADDRESS = 24
"""--max-pending-per-address: the 16 idle sockets of 127.0.0.1, a client and a probe fit."""
HANDSHAKE = 1.0 * UNIT
MAX_BYTES = 3 * CHUNK_BYTES
INFLIGHT = 4
BUDGET = 4 * CHUNK_BYTES
"""--max-reassembly-bytes: two chunked messages of 2.5 MiB do not fit at once."""
STALL = 2.0 * UNIT
STALLERS = 4
"""Client connections that each hold 2 MiB of a chunked message: 8 MiB of the clients' pool of
three 3 MiB shares (each connection a share of its own: no client tokens here)."""
"""--stall-timeout."""


CAPS = Capabilities(cpus=1, memory_bytes=1 << 30, torch="x", python="3", cloudpickle="3")


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A coordinator with small limits (its own flags), shared by the tests of this module."""
    tmp = tmp_path_factory.mktemp("limits")
    argv = [
        str(BIN / "somatize-coordinator"),
        *("--listen", "127.0.0.1:0", "--state-dir", str(tmp / "state")),
        *("--max-pending-connections", str(PENDING), "--handshake-timeout", str(HANDSHAKE)),
        *("--max-pending-per-address", str(PER_ADDRESS)),
        *("--max-message-bytes", str(MAX_BYTES), "--max-inflight", str(INFLIGHT)),
        *("--max-reassembly-bytes", str(BUDGET), "--stall-timeout", str(STALL)),
        *("--heartbeat-interval", "0.5", "--heartbeat-timeout", str(30 * UNIT)),
    ]
    env = {k: v for k, v in os.environ.items() if "SOMATIZE_" not in k}
    with (tmp / "coordinator.log").open("ab") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        port = said_port(proc, tmp / "coordinator.log")
        wait_for(lambda: healthy(port), 30 * UNIT, "the coordinator to listen")
        yield f"ws://127.0.0.1:{port}"
        assert proc.poll() is None, "the coordinator died"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20 * UNIT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@contextlib.asynccontextmanager
async def _raw(url: str, path: str, hello: Any) -> AsyncIterator[tuple[Any, Channel]]:
    """A hand-driven connection to ``path`` after its hello: the websocket and a channel."""
    ws = await websockets.connect(f"{url}{path}", compression=None, max_size=1 << 24)
    channel = Channel(ws, f"raw {path}")
    try:
        await channel.send(hello)
        async with asyncio.timeout(10 * UNIT):
            welcome = await channel.receive()
        assert welcome.kind == "welcome", welcome
        yield ws, channel
    finally:
        await ws.close()


def _chunk_head(stream: int, offset: int, total: int) -> bytes:
    return struct.pack("<8sQQQ", CHUNK_MAGIC, stream, offset, total)


async def _closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closes ``sock`` (reads return EOF); fails after ``seconds``."""
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    sock.setblocking(False)
    async with asyncio.timeout(seconds):
        while True:
            try:
                data = await loop.sock_recv(sock, 4096)
            except ConnectionResetError:
                break
            if not data:
                break
    return time.monotonic() - started


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


def _closed_now(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` already (a non-blocking read sees EOF)."""
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_idle_sockets_lock_nobody_out_and_silent_upgrades_beyond_the_limit_get_503(url):
    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def idle_socket(source: str) -> socket.socket:
            sock = socket.socket()
            sock.setblocking(False)
            sock.bind((source, 0))
            await loop.sock_connect(sock, ("127.0.0.1", _port(url)))
            return sock

        # TCP only: not a byte sent, no token shown.
        idle = [await idle_socket("127.0.0.1") for _ in range(4 * PENDING)]
        # Another address opens more than its share: each beyond it takes the place of the
        # address's oldest idle socket, which is closed; the others are held like any idle one.
        greedy = [await idle_socket("127.0.0.2") for _ in range(PER_ADDRESS + 8)]
        await asyncio.sleep(0.2 * UNIT)  # accepted by the server
        closed = [s for s in greedy if _closed_now(s)]
        assert closed == greedy[:8]
        # Whoever shows no token cannot lock a valid client out (issue 14, row 4), nor one
        # behind their own address, whose flood holds its share (issue 32).
        with await asyncio.to_thread(sz.connect, url, timeout=10 * UNIT) as client:
            assert client.status()["workers"] == []
        same_address = await websockets.connect(
            f"{url}/client", local_addr=("127.0.0.2", 0), open_timeout=10 * UNIT
        )
        channel = Channel(same_address, "behind the flood's address")
        await channel.send(ClientHello(name="neighbour"))
        async with asyncio.timeout(10 * UNIT):
            assert (await channel.receive()).kind == "welcome"
        await same_address.close()
        assert await asyncio.to_thread(healthy, _port(url))
        metrics = await asyncio.to_thread(_metrics, _port(url))
        assert "somatize_displaced_pending_total 9\n" in metrics
        assert "somatize_refused_accepts_total 0\n" in metrics
        closed.append(next(s for s in greedy[8:] if _closed_now(s)))  # the neighbour's room
        for sock in closed:
            sock.close()
        idle += [s for s in greedy if s not in closed]
        # The handshake timeout drops the idle sockets, counted from their accept.
        took = await asyncio.gather(*(_closed_within(s, HANDSHAKE + 5 * UNIT) for s in idle))
        assert max(took) <= HANDSHAKE + 2 * UNIT
        for sock in idle:
            sock.close()

        # Upgrades that passed the token check and never say hello count, up to the limit;
        # beyond it a new one gets 503 until the handshake timeout closes them, with the reason.
        silent = [await websockets.connect(f"{url}/worker") for _ in range(PENDING)]
        with pytest.raises(InvalidStatus) as refused:
            await websockets.connect(f"{url}/worker", open_timeout=10 * UNIT)
        assert refused.value.response.status_code == 503
        assert b"too many connections waiting for their hello" in refused.value.response.body
        assert refused.value.response.headers["Retry-After"] == str(int(np.ceil(HANDSHAKE)))
        # The SDK says why; health checks are not held up.
        with pytest.raises(sz.ConnectionFailed, match="HTTP 503: the coordinator is busy"):
            await asyncio.to_thread(sz.connect, url, timeout=10 * UNIT)
        assert await asyncio.to_thread(healthy, _port(url))
        for ws in silent:
            with pytest.raises(ConnectionClosed) as closed:
                async with asyncio.timeout(HANDSHAKE + 5 * UNIT):
                    await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4008
            assert "no hello within the handshake timeout" in closed.value.rcvd.reason
        with await asyncio.to_thread(sz.connect, url, timeout=10 * UNIT) as client:
            assert client.status()["workers"] == []

    asyncio.run(main())


def test_a_half_sent_http_request_is_dropped_within_the_handshake_timeout(url):
    async def main() -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", _port(url)))
        await loop.sock_sendall(sock, b"GET /client HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgr")
        took = await _closed_within(sock, HANDSHAKE + 5 * UNIT)
        sock.close()
        assert took <= HANDSHAKE + 2 * UNIT

    asyncio.run(main())


@pytest.mark.parametrize("path", ["/client", "/worker"])
def test_messages_over_the_limits_are_refused_and_the_coordinator_keeps_serving(url, path):
    hello = (
        ClientHello(name="big")
        if path == "/client"
        else WorkerHello(worker_id="big", capabilities=CAPS)
    )

    async def main() -> None:
        async with _raw(url, path, hello) as (ws, channel):
            reader = asyncio.ensure_future(channel.run())
            errors: asyncio.Queue[Any] = asyncio.Queue()
            channel.on_unsolicited = errors.put_nowait  # type: ignore[method-assign]
            # A chunk header announcing more than --max-message-bytes: refused at once, no
            # buffer reserved, and the announced stream's later chunks are dropped silently.
            await ws.send(_chunk_head(5, 0, MAX_BYTES + 1) + bytes(64))
            error = await asyncio.wait_for(errors.get(), 10 * UNIT)
            assert error.error.code == ErrorCode.TOO_LARGE
            assert f"exceeds the limit of {MAX_BYTES} bytes" in error.error.message
            await ws.send(_chunk_head(5, 64, MAX_BYTES + 1) + bytes(64))
            # A real request over the limit, sent in chunks, fails at once, naming the request.
            big = Deliver(job_id="j", to="nobody", key="k", payload=bytes(MAX_BYTES))
            with pytest.raises(RemoteError, match="exceeds the limit") as refused:
                await channel.request(big, timeout=30 * UNIT)
            assert refused.value.code == ErrorCode.TOO_LARGE
            assert errors.empty()  # nothing about the dropped chunk
            # The same connection still works.
            if path == "/client":
                reply = await channel.request(Status(), timeout=10 * UNIT)
                assert reply.kind == "result"
            # One WebSocket message over its 4 MiB: closed with 1009 (message too big).
            await ws.send(bytes(4 * CHUNK_BYTES + 1))
            async with asyncio.timeout(10 * UNIT):
                await reader
            assert ws.close_code == 1009
        workers = (await asyncio.to_thread(_status, url))["workers"]  # it still serves
        assert ("big" in [w["id"] for w in workers]) == (path == "/worker")

    asyncio.run(main())


def test_chunked_messages_share_one_budget_and_a_stalled_one_is_dropped_in_time(url):
    half = 5 * CHUNK_BYTES // 2

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            stallers = [
                await stack.enter_async_context(_raw(url, "/client", ClientHello(name=f"s{k}")))
                for k in range(STALLERS)
            ]
            _, b = await stack.enter_async_context(_raw(url, "/client", ClientHello(name="b")))
            readers = [asyncio.ensure_future(c.run()) for c in (*(a for _, a in stallers), b)]
            errors: asyncio.Queue[Any] = asyncio.Queue()
            for ws_a, a in stallers:
                a.on_unsolicited = errors.put_nowait  # type: ignore[method-assign]
                # 2.5 MiB announced on each, 2 MiB of it sent (what counts), then nothing.
                await ws_a.send(_chunk_head(9, 0, half) + bytes(CHUNK_BYTES))
                await ws_a.send(_chunk_head(9, CHUNK_BYTES, half) + bytes(CHUNK_BYTES))
                await asyncio.wait_for(a.request(Status(), 10 * UNIT), 10 * UNIT)  # it arrived
            stalled_at = time.monotonic()
            # Another 2.5 MiB on another connection: with the 8 MiB received it would fill the
            # clients' pool (three shares of 3 MiB, 9 MiB); busy, retry later.
            deliver = Deliver(job_id="j", to="x", key="k", payload=bytes(half))
            with pytest.raises(
                RemoteError, match=r"all clients' connections \(the budget is"
            ) as full:
                await b.request(deliver, 10 * UNIT)
            assert full.value.code == ErrorCode.BUSY
            # Once the first stall they are dropped, and the same request goes through (to be
            # refused for what it is: a client sends no deliver).
            async with asyncio.timeout(STALL + 10 * UNIT):
                while True:
                    try:
                        await b.request(deliver, 10 * UNIT)
                    except RemoteError as exc:
                        if exc.code == ErrorCode.BAD_REQUEST:
                            break
                        assert exc.code == ErrorCode.BUSY
                    await asyncio.sleep(0.1)
            waited = time.monotonic() - stalled_at
            assert STALL * 0.9 <= waited <= STALL + 5 * UNIT
            # The rest of a stalled message is dropped without an error; its connection works.
            ws_a, a = stallers[0]
            await ws_a.send(_chunk_head(9, 2 * CHUNK_BYTES, half) + bytes(half - 2 * CHUNK_BYTES))
            assert (await a.request(Status(), 10 * UNIT)).kind == "result"
            assert errors.empty()
            for channel in (*(a for _, a in stallers), b):
                await channel.close()
            await asyncio.gather(*readers)

    asyncio.run(main())


def test_the_sdk_reports_a_submission_over_the_limit_as_too_large(url):
    x = np.zeros((MAX_BYTES // 8 + 1, 1))
    with sz.connect(url, timeout=10 * UNIT) as client:
        graph = sz.Graph([Center().named("f")])
        with pytest.raises(sz.ClientError, match="exceeds the limit") as refused:
            client.submit(graph, x)
        assert refused.value.code == "too_large"
        assert client.status()["workers"] is not None


def test_a_graph_over_the_node_limit_is_refused_by_its_validation_and_by_the_sdk(url):
    """Issue 14, row 5: 50,000 nodes are refused at validation, in a line, not by checks whose
    cost grows with the graph; the SDK refuses before pickling anything."""
    nodes = [f"n{i}" for i in range(50_000)]
    local = StrategySpec(name="local")

    def huge(filters: dict[str, bytes]) -> Submit:
        graph = GraphSpec.model_construct(node_ids=nodes, filters=filters, nodes={})
        return Submit.model_construct(graph=graph, x=None, y=None, dataset=None, strategy=local)

    async def main() -> RemoteError:
        async with _raw(url, "/client", ClientHello(name="huge")) as (_, channel):
            reader = asyncio.ensure_future(channel.run())
            # With its filters it exceeds --max-message-bytes, and its header alone exceeds a
            # chunk: refused from its first chunk all the same, the sender answered at once.
            with pytest.raises(RemoteError, match="exceeds the limit") as too_large:
                await channel.request(huge(dict.fromkeys(nodes, b"-")), timeout=10 * UNIT)
            assert too_large.value.code == ErrorCode.TOO_LARGE
            with pytest.raises(RemoteError) as refused:
                await channel.request(huge({}), timeout=30 * UNIT)
            assert (await channel.request(Status(), 10 * UNIT)).kind == "result"
            await channel.close()
            await reader
            return refused.value

    refused = asyncio.run(main())
    assert refused.code == ErrorCode.BAD_REQUEST
    assert "graph.node_ids" in refused.info.message
    assert f"at most {MAX_GRAPH_NODES} items" in refused.info.message
    assert len(refused.info.message) < 300
    with sz.connect(url, timeout=10 * UNIT) as client:
        too_many = sz.Graph([Center().named(f"c{i}") for i in range(MAX_GRAPH_NODES + 1)])
        with pytest.raises(ValueError, match="4097 nodes: a job's graph may have at most 4096"):
            client.submit(too_many, np.zeros((4, 1)))
        assert client.jobs() == []


def test_requests_beyond_max_inflight_are_busy_and_the_connection_stays_usable(url):
    async def main() -> None:
        async with _raw(url, "/client", ClientHello(name="watcher")) as (_, channel):
            reader = asyncio.ensure_future(channel.run())
            job_id = await asyncio.to_thread(_queued_job, url)
            # Watching a queued job holds a request in flight until it ends: once its first
            # event came, each of these is in flight.
            watches = []
            for _ in range(INFLIGHT):
                events = channel.stream(Watch(job_id=job_id), None)
                first = await asyncio.wait_for(anext(events), 10 * UNIT)
                assert first.event == "queued"
                watches.append(asyncio.ensure_future(_drain(events)))
            with pytest.raises(RemoteError) as refused:
                await channel.request(Status(), timeout=10 * UNIT)
            busy = refused.value
            assert busy.code == ErrorCode.BUSY
            assert f"the limit is {INFLIGHT}" in busy.info.message
            await asyncio.to_thread(_cancel, url, job_id)  # the watches end...
            async with asyncio.timeout(10 * UNIT):
                assert [await w for w in watches] == ["cancelled"] * INFLIGHT
            reply = await channel.request(Status(), timeout=10 * UNIT)  # ...and it serves again
            assert reply.kind == "result"
            await channel.close()
            await reader

    asyncio.run(main())


def test_heartbeats_are_never_busy_on_the_worker_path(url):
    async def never_answer(message: Any) -> None:
        await asyncio.Event().wait()  # the job's open_job, and every relay, stay unanswered

    async def main() -> None:
        mute_hello = WorkerHello(worker_id="mute", tags=["hb"], capabilities=CAPS)
        chatty_hello = WorkerHello(worker_id="chatty", tags=["hb"], capabilities=CAPS)
        async with (
            _raw(url, "/worker", mute_hello) as (_, mute),
            _raw(url, "/worker", chatty_hello) as (_, w),
        ):
            mute.handler = w.handler = never_answer
            readers = [asyncio.ensure_future(c.run()) for c in (mute, w)]
            # A job placed on both: the coordinator relays between them from then on.
            job_id = await asyncio.to_thread(_placed_job, url, "hb")
            # Relays to a worker that never acknowledges stay in flight on chatty's connection.
            for n in range(INFLIGHT):
                await w.send(
                    Deliver(id=w.next_id(), job_id=job_id, to="mute", key=f"{n}", payload=b"")
                )
            busy = None
            async with asyncio.timeout(10 * UNIT):
                while busy is None:
                    more = Deliver(job_id=job_id, to="mute", key="more", payload=b"")
                    try:
                        await w.request(more, 1 * UNIT)
                    except RemoteError as exc:
                        busy = exc
                    except TimeoutError:
                        continue
            assert busy.code == ErrorCode.BUSY
            # The connection stays busy (its relays wait for mute) while heartbeats are sent
            # and they count: the age the coordinator reports drops below what it was.
            before = await asyncio.to_thread(_heartbeat_age, url, "chatty")
            after = before
            async with asyncio.timeout(10 * UNIT):
                while after >= before:
                    await w.send(Heartbeat(id=w.next_id(), sent_at=time.time()))
                    after = await asyncio.to_thread(_heartbeat_age, url, "chatty")
                    await asyncio.sleep(0.2)
            await asyncio.to_thread(_cancel, url, job_id)
            for channel in (mute, w):
                await channel.close()
            await asyncio.gather(*readers)

    asyncio.run(main())


def _placed_job(url: str, tag: str) -> str:
    """A DataParallel job on the two workers tagged ``tag``, once both are placed on it."""
    with sz.connect(url, timeout=10 * UNIT) as client:
        model = torch.nn.Linear(2, 1)
        graph = sz.Graph([sz.TorchFilter(model, loss="mse").named("f")])
        job = client.submit(
            graph, np.zeros((4, 2)), np.zeros((4, 1)), strategy=sz.DataParallel(2, tag=tag)
        )
        wait_for(lambda: len(job.status()["workers"] or []) == 2, 20 * UNIT, "the placement")
        return str(job.id)


async def _drain(stream: Any) -> str:
    last = ""
    async for message in stream:
        last = getattr(message, "event", last)
    return last


def _queued_job(url: str) -> str:
    """A job that stays queued: there is no worker."""
    with sz.connect(url, timeout=10 * UNIT) as client:
        job = client.submit(sz.Graph([Center().named("f")]), np.zeros((2, 2)))
        return str(job.id)


def _cancel(url: str, job_id: str) -> None:
    with sz.connect(url, timeout=10 * UNIT) as client:
        client.job(job_id).cancel()


def _status(url: str) -> dict[str, Any]:
    with sz.connect(url, timeout=10 * UNIT) as client:
        return dict(client.status())


def _heartbeat_age(url: str, worker_id: str) -> float:
    (worker,) = [w for w in _status(url)["workers"] if w["id"] == worker_id]
    return float(worker["last_heartbeat_age"])


def test_a_clients_waits_end_with_its_connection(tmp_path):
    """A watch of a job that stays queued, a long get_result: gone when the client goes."""

    async def main() -> None:
        coordinator = Coordinator(CoordinatorConfig("127.0.0.1", 0, tmp_path / "state"))
        await coordinator.start()
        assert coordinator.jobs is not None
        url = f"ws://127.0.0.1:{coordinator.port}"
        try:
            job_id = await asyncio.to_thread(_queued_job, url)
            async with _raw(url, "/client", ClientHello(name="leaver")) as (_, channel):
                reader = asyncio.ensure_future(channel.run())
                events = channel.stream(Watch(job_id=job_id), None)
                assert (await asyncio.wait_for(anext(events), 10 * UNIT)).event == "queued"
                waiting = asyncio.ensure_future(
                    channel.request(GetResult(job_id=job_id, wait=3600.0), 3600.0)
                )
                (served,) = [c for c in coordinator._channels if c.name == "client leaver"]
                await _eventually(lambda: served.inflight == 2)
                assert coordinator.jobs.events._watchers[job_id]
            await reader
            waiting.cancel()
            # Both handlers ended with the connection.
            await _eventually(
                lambda: not (served.inflight or coordinator.jobs.events._watchers.get(job_id))
            )
        finally:
            await coordinator.stop(1.0)

    asyncio.run(main())


async def _eventually(condition: Any, seconds: float = 10 * UNIT) -> None:
    """Wait until ``condition()`` holds (state of this process: nothing to await on)."""
    async with asyncio.timeout(seconds):
        while True:
            if condition():
                return
            await asyncio.sleep(0.01)


def test_a_closed_connections_channel_is_freed_without_the_cyclic_gc(tmp_path):
    """A channel, its handler and what it reassembled go with the connection (issue 14, row
    6), not when the cyclic garbage collector happens to run."""

    async def main() -> None:
        coordinator = Coordinator(CoordinatorConfig("127.0.0.1", 0, tmp_path / "state"))
        await coordinator.start()
        url = f"ws://127.0.0.1:{coordinator.port}"
        hellos = [
            ("/client", ClientHello(name="gone")),
            ("/worker", WorkerHello(worker_id="gone", capabilities=CAPS)),
        ]
        gc.collect()
        gc.disable()
        try:
            for path, hello in hellos:
                async with _raw(url, path, hello) as (ws, channel):
                    reader = asyncio.ensure_future(channel.run())
                    if path == "/client":
                        assert (await channel.request(Status(), 10 * UNIT)).kind == "result"
                    # A chunked message left in progress: its buffer must go too.
                    await ws.send(_chunk_head(3, 0, 2 * CHUNK_BYTES) + bytes(CHUNK_BYTES))
                    await asyncio.sleep(0.1)
                    served = [weakref.ref(c) for c in coordinator._channels]
                    side = coordinator.reassembly.clients if path == "/client" else None
                    side = side or coordinator.reassembly.worker_unasked
                    assert side.used == CHUNK_BYTES  # what was received, not announced
                    await channel.close()
                    await reader
                for _ in range(int(10 * UNIT / 0.05)):  # the server side's teardown
                    if all(ref() is None for ref in served):
                        break
                    await asyncio.sleep(0.05)
                assert [ref() for ref in served] == [None], path
                assert side.used == 0
        finally:
            gc.enable()
            await coordinator.stop()

    asyncio.run(main())


def test_healthz_says_when_the_job_store_cannot_be_written(tmp_path):
    async def main() -> None:
        coordinator = Coordinator(CoordinatorConfig("127.0.0.1", 0, tmp_path / "state"))
        await coordinator.start()
        assert coordinator.store is not None
        store = coordinator.store
        try:
            assert await asyncio.to_thread(_healthz, coordinator.port) == (200, "ok\n")
            conn = store._connection()
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full
            with pytest.raises(sqlite3.OperationalError, match="full"):
                await asyncio.to_thread(store.create, "local", {"pad": "x" * 100_000})
            status, body = await asyncio.to_thread(_healthz, coordinator.port)
            assert status == 503
            assert body.startswith("the job store cannot be written: OperationalError:")
            conn.execute("PRAGMA max_page_count = 1073741823")
            await asyncio.to_thread(store.create, "local", {})
            assert await asyncio.to_thread(_healthz, coordinator.port) == (200, "ok\n")
        finally:
            await coordinator.stop()

    asyncio.run(main())


def _healthz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as reply:
            return int(reply.status), reply.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def test_the_coordinator_lifts_its_open_files_limit_to_the_hard_one(tmp_path):
    """Every live job's submit file (1 MiB or more) stays mapped, a descriptor each: started
    from a shell whose soft limit is 64, the coordinator may hold what the hard limit allows."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))

    argv = [str(BIN / "somatize-coordinator"), "--listen", "127.0.0.1:0"]
    argv += ["--state-dir", str(tmp_path / "state")]
    with (tmp_path / "coordinator.log").open("ab") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=low, start_new_session=True
        )
    try:
        said_port(proc, tmp_path / "coordinator.log")
        limits = Path(f"/proc/{proc.pid}/limits").read_text().splitlines()
        (line,) = [row for row in limits if row.startswith("Max open files")]
        soft = line.split()[3]
        assert soft == (str(hard) if hard != resource.RLIM_INFINITY else str(1 << 20))
    finally:
        stop_groups(proc)
