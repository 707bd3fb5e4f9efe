"""A 64 MB tensor from an agent to the coordinator: our stack next to bare websockets and TCP.

``python -m benchmarks.transport`` times one 64 MB float32 torch tensor going from an agent
process to a coordinator process over 127.0.0.1, three ways, each a request answered by the
tensor (the shape of a ``get_state`` or ``get_gradients`` call):

- *ours*: this process plays the coordinator: a ``websockets`` server on uvloop with the
  coordinator's settings (no compression, ``max_size`` 4 MB) and a
  :class:`protocol.asyncio.channel.Channel` on the connection. The agent, a subprocess, dials it
  with the agent's settings and answers every ``Call`` with ``Result(result={"t": tensor})`` from a
  ``Channel`` handler: the codec encodes the tensor without copying it, the channel cuts the frame
  into 1 MB chunk messages, the coordinator reassembles them into one buffer and decodes the tensor
  over it. Timed from ``channel.request(Call(...))`` to the decoded ``Result`` in hand;
- *bare websockets*: the same two processes' roles with bare ``websockets`` (no codec, no
  chunk headers), two ways: the tensor's 64 MB as *one message* (``max_size=None``), and as
  *1 MB messages* (memoryview slices of the tensor, what ``websockets`` moves fastest) copied
  into one preallocated buffer as they arrive, as a receiver that wants the tensor whole must;
- *TCP*: plain blocking sockets: a 1-byte request, ``sendall`` of the 64 MB, ``recv_into`` a
  preallocated buffer on the coordinator side: the loopback limit.

Each figure is the median throughput (MB/s, 10⁶ bytes) over :data:`REPEATS` transfers per way
per round, in :data:`ROUNDS` interleaved rounds, after a warm-up transfer each; both ratios are
ours over the anchor's throughput. Every process started here is stopped at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import uvloop
from websockets.asyncio.server import ServerConnection, serve

from benchmarks.report import Row, Target
from benchmarks.roundtrip import Processes, free_port
from protocol.asyncio.channel import Channel
from protocol.messages import CHUNK_BYTES, Call, Result

SIZE_BYTES = 64 << 20
REPEATS = 8
ROUNDS = 3
TIMEOUT = 60.0
WS_MAX_SIZE = 4 * CHUNK_BYTES
"""The coordinator's and the agent's ``max_size`` (``coordinator.server.app.WS_MAX_SIZE``)."""

AGENT = """
import asyncio, socket, sys
import torch, uvloop
from websockets.asyncio.client import connect

MODE, PORT, NBYTES = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tensor = torch.randn(NBYTES // 4, generator=torch.Generator().manual_seed(0))

async def ours():
    from protocol.asyncio.channel import Channel
    from protocol.messages import CHUNK_BYTES, Result

    async def handler(message):
        return Result(result={"t": tensor})

    async with connect(
        f"ws://127.0.0.1:{PORT}", compression=None, max_size=4 * CHUNK_BYTES
    ) as ws:
        await Channel(ws, "agent", handler).run()

async def bare():
    payload = tensor.numpy().tobytes()
    view = memoryview(payload)
    async with connect(f"ws://127.0.0.1:{PORT}", compression=None, max_size=None) as ws:
        async for request in ws:
            if request == b"one":
                await ws.send(payload)
            else:  # 1 MB messages
                for start in range(0, len(view), 1 << 20):
                    await ws.send(view[start : start + (1 << 20)])

def tcp():
    payload = memoryview(tensor.numpy()).cast("B")
    with socket.create_connection(("127.0.0.1", PORT)) as sock:
        while sock.recv(1):
            sock.sendall(payload)

if MODE == "tcp":
    tcp()
else:
    uvloop.run(ours() if MODE == "ours" else bare())
"""
"""The agent side, run as ``python -c AGENT MODE PORT NBYTES`` with ``MODE`` ``ours``,
``bare`` or ``tcp``: it dials the coordinator side and answers every request with the tensor."""


# -- the coordinator side of each way ---------------------------------------------------------


class _Accepting:
    """A listening server of one way that hands over the first connection it accepts."""

    def __init__(self) -> None:
        self.connected: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def take(self, value: Any) -> None:
        if not self.connected.done():
            self.connected.set_result(value)


async def _ours(port: int, procs: Processes, nbytes: int) -> tuple[Any, Channel]:
    accepting = _Accepting()
    done = asyncio.Event()

    async def handler(ws: ServerConnection) -> None:
        channel = Channel(ws, "coordinator")
        accepting.take(channel)
        reader = asyncio.ensure_future(channel.run())
        await done.wait()
        await channel.close()
        await reader

    server = await serve(handler, "127.0.0.1", port, compression=None, max_size=WS_MAX_SIZE)
    procs.spawn("agent-ours", [sys.executable, "-c", AGENT, "ours", str(port), str(nbytes)])
    async with asyncio.timeout(TIMEOUT):
        channel = await accepting.connected
    return (server, done), channel


async def _bare(port: int, procs: Processes, nbytes: int) -> tuple[Any, ServerConnection]:
    accepting = _Accepting()
    done = asyncio.Event()

    async def handler(ws: ServerConnection) -> None:
        accepting.take(ws)
        await done.wait()

    server = await serve(handler, "127.0.0.1", port, compression=None, max_size=None)
    procs.spawn("agent-bare", [sys.executable, "-c", AGENT, "bare", str(port), str(nbytes)])
    async with asyncio.timeout(TIMEOUT):
        ws = await accepting.connected
    return (server, done), ws


def _tcp(port: int, procs: Processes, nbytes: int) -> tuple[socket.socket, socket.socket]:
    listener = socket.create_server(("127.0.0.1", port))
    listener.settimeout(TIMEOUT)
    procs.spawn("agent-tcp", [sys.executable, "-c", AGENT, "tcp", str(port), str(nbytes)])
    conn, _ = listener.accept()
    conn.settimeout(TIMEOUT)
    return listener, conn


async def _time_ours(channel: Channel, nbytes: int) -> float:
    start = time.perf_counter()
    reply = await channel.request(Call(job_id="bench", request={"cmd": "get_state"}), TIMEOUT)
    elapsed = time.perf_counter() - start
    if not isinstance(reply, Result) or reply.result["t"].numel() * 4 != nbytes:
        raise RuntimeError(f"the agent answered with {reply!r:.200}")
    return elapsed


async def _time_bare(ws: ServerConnection, nbytes: int) -> float:
    start = time.perf_counter()
    await ws.send(b"one")
    message = await asyncio.wait_for(ws.recv(decode=False), TIMEOUT)
    elapsed = time.perf_counter() - start
    if len(message) != nbytes:
        raise RuntimeError(f"got {len(message)} bytes, expected {nbytes}")
    return elapsed


async def _time_bare_1mb(ws: ServerConnection, buffer: bytearray) -> float:
    view = memoryview(buffer)
    start = time.perf_counter()
    await ws.send(b"1mb")
    received = 0
    async with asyncio.timeout(TIMEOUT):
        while received < len(buffer):
            message = await ws.recv(decode=False)
            view[received : received + len(message)] = message
            received += len(message)
    return time.perf_counter() - start


def _time_tcp(conn: socket.socket, buffer: bytearray) -> float:
    view = memoryview(buffer)
    start = time.perf_counter()
    conn.sendall(b"g")
    received = 0
    while received < len(buffer):
        n = conn.recv_into(view[received:])
        if n == 0:
            raise RuntimeError(f"the agent closed the TCP connection after {received} bytes")
        received += n
    return time.perf_counter() - start


async def _measure(procs: Processes, nbytes: int, repeats: int, rounds: int) -> dict[str, Any]:
    (ours_server, ours_done), channel = await _ours(free_port(), procs, nbytes)
    (bare_server, bare_done), ws = await _bare(free_port(), procs, nbytes)
    listener, conn = await asyncio.to_thread(_tcp, free_port(), procs, nbytes)
    buffer = bytearray(nbytes)
    times: dict[str, list[float]] = defaultdict(list)
    try:
        for _ in range(rounds):
            for way, timed in (
                ("ours", lambda: _time_ours(channel, nbytes)),
                ("bare_ws", lambda: _time_bare(ws, nbytes)),
                ("bare_ws_1mb", lambda: _time_bare_1mb(ws, buffer)),
                ("tcp", lambda: asyncio.to_thread(_time_tcp, conn, buffer)),
            ):
                await timed()  # warm-up: buffers, page faults, the first import of torch
                for _ in range(repeats):
                    times[way].append(await timed())
    finally:
        conn.close()
        listener.close()
        ours_done.set()
        bare_done.set()
        for server in (ours_server, bare_server):
            server.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await server.wait_closed()
    return times


def run(
    size_bytes: int = SIZE_BYTES, repeats: int = REPEATS, rounds: int = ROUNDS
) -> dict[str, Any]:
    """Time ``size_bytes`` agent → coordinator, ours and the two anchors, ``repeats`` times
    each per round in ``rounds`` interleaved rounds.

    Returns:
        ``{"size_bytes", "repeats", "rounds", "ours", "bare_ws", "bare_ws_1mb", "tcp",
        "ratio_bare_ws", "ratio_bare_ws_1mb", "ratio_tcp"}``: each way ``{"n", "p50_ms",
        "min_ms", "max_ms", "mb_s"}`` (``mb_s`` the throughput of the median transfer); the
        ratios are ours over each anchor's throughput.
    """
    nbytes = size_bytes // 4 * 4
    with (
        tempfile.TemporaryDirectory(prefix="somatize-transport-") as tmp,
        Processes(Path(tmp)) as procs,
    ):
        times = uvloop.run(_measure(procs, nbytes, repeats, rounds))
    results: dict[str, Any] = {"size_bytes": nbytes, "repeats": repeats, "rounds": rounds}
    for way, values in times.items():
        p50 = statistics.median(values)
        results[way] = {
            "n": len(values),
            "p50_ms": p50 * 1e3,
            "min_ms": min(values) * 1e3,
            "max_ms": max(values) * 1e3,
            "mb_s": nbytes / p50 / 1e6,
        }
    results["ratio_bare_ws"] = results["ours"]["mb_s"] / results["bare_ws"]["mb_s"]
    results["ratio_bare_ws_1mb"] = results["ours"]["mb_s"] / results["bare_ws_1mb"]["mb_s"]
    results["ratio_tcp"] = results["ours"]["mb_s"] / results["tcp"]["mb_s"]
    return results


def rows(results: dict[str, Any]) -> list[Row]:
    """Our throughput next to both bare websockets ways (the target holds against each) and
    plain TCP (the limit)."""
    mb = results["size_bytes"] / 2**20
    ours = results["ours"]
    return [
        Row(
            bench="transport",
            name=f"{mb:.0f} MB tensor agent → coordinator",
            ours=ours["mb_s"],
            unit="MB/s",
            anchor=results[way]["mb_s"],
            anchor_name=name,
            target=Target(">=", 0.7, text=">= 0.7 x bare ws") if way != "tcp" else None,
            note=f"ours {ours['p50_ms']:.0f} ms vs {results[way]['p50_ms']:.0f} ms",
        )
        for way, name in (
            ("bare_ws", "bare websockets, one message"),
            ("bare_ws_1mb", "bare websockets, 1 MB messages"),
            ("tcp", "plain TCP socket"),
        )
    ]


def main() -> None:
    results = run()
    mb = results["size_bytes"] / 2**20
    print(
        f"transport: {mb:.0f} MB float32 tensor agent → coordinator on 127.0.0.1, medians of "
        f"{results['ours']['n']} transfers in {results['rounds']} interleaved rounds"
    )
    print(f"  {'':52} {'p50 ms':>8} {'min ms':>8} {'max ms':>8} {'MB/s':>8}")
    for label, key in (
        ("ours: Channel over websockets, chunks, codec", "ours"),
        ("anchor: bare websockets, one message", "bare_ws"),
        ("anchor: bare websockets, 1 MB messages into a buffer", "bare_ws_1mb"),
        ("anchor: plain TCP, sendall / recv_into", "tcp"),
    ):
        r = results[key]
        print(
            f"  {label:52} {r['p50_ms']:8.1f} {r['min_ms']:8.1f} {r['max_ms']:8.1f} "
            f"{r['mb_s']:8.0f}"
        )
    print(
        f"  ours / bare websockets: {results['ratio_bare_ws']:.2f} x (one message), "
        f"{results['ratio_bare_ws_1mb']:.2f} x (1 MB messages); "
        f"ours / TCP: {results['ratio_tcp']:.2f} x"
    )


if __name__ == "__main__":
    main()
