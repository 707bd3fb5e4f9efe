"""The simulated agents of :mod:`benchmarks.fleet`: N WebSocket connections on one event loop,
each saying hello and heartbeating as an agent does and answering the coordinator's job messages
from memory (:class:`SimAgent`), or, for the bare anchor, echoing a state's bytes."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from websockets.asyncio.client import ClientConnection, connect
from websockets.protocol import State

from benchmarks.roundtrip import MAX_SIZE
from protocol.asyncio.channel import Channel
from protocol.errors import ErrorCode, ErrorInfo, RequestRefused
from protocol.messages import (
    Ack,
    ArrayShape,
    Capabilities,
    DatasetSummary,
    Heartbeat,
    Result,
    Welcome,
    WorkerHello,
)
from protocol.parsing import encode_small, parse

HEARTBEAT_INTERVAL = 2.0
NODE = "model"
DATASET = "sim"
VARIANTS = 4
"""Sim ``i`` trains its state to all ``(i % VARIANTS) + 1``: the mean is known in advance."""
CAPABILITIES = Capabilities(cpus=1, memory_bytes=1 << 30, torch="x", python="3.11", cloudpickle="3")


def side(state_bytes: int) -> int:
    """The width of the square ``Linear`` whose weight is ``state_bytes`` of float32."""
    return max(1, math.isqrt(state_bytes // 4))


def state_nbytes(state_bytes: int) -> int:
    """The bytes of the tensors of the model state (weight and bias)."""
    width = side(state_bytes)
    return 4 * (width * width + width)


def rows_of(i: int) -> int:
    return 100 + i % 3


def trained(width: int, variant: int) -> dict[str, torch.Tensor]:
    """Variant ``variant``'s trained state: every number ``variant + 1``."""
    value = float(variant + 1)
    return {"weight": torch.full((width, width), value), "bias": torch.full((width,), value)}


def expected_mean(n: int) -> float:
    """The rows-weighted mean of the N sims' trained states (each a constant)."""
    weights = [rows_of(i) for i in range(n)]
    return sum(w * (i % VARIANTS + 1) for i, w in enumerate(weights)) / sum(weights)


class SimAgent:
    """The job side of one simulated agent: answers as an agent with a daemon would, in memory.

    Args:
        i: its number (``sim-<i>``).
        states: the trained states by variant, shared by every sim (encoding does not copy them).
        initial: what ``get_state`` answers before any ``set_state``.
    """

    def __init__(self, i: int, states: list[dict[str, torch.Tensor]], initial: Any) -> None:
        self.i = i
        self.rows = rows_of(i)
        self.trained = states[i % VARIANTS]
        self.state: Any = initial

    async def handle(self, message: Any) -> Any:
        if message.kind in ("open_job", "close_job"):
            return Ack()
        if message.kind == "call":
            return Result(result=self.call(message.request))
        raise RequestRefused(
            ErrorInfo(code=ErrorCode.BAD_REQUEST, message=f"sim takes no {message.kind!r}")
        )

    def call(self, request: dict[str, Any]) -> Any:
        cmd = request.get("cmd")
        if cmd == "stage":
            return {"rows": self.rows}
        if cmd == "get_state":
            return {node: self.state for node in request["node_ids"]}
        if cmd == "set_state":
            self.state = request["states"][NODE]
            return None
        if cmd == "batched_fit":
            self.state = self.trained
            return {
                "rows": self.rows,
                "states": {NODE: self.trained} if request.get("return_states", True) else {},
                "loss": 1.0 / (1 + self.i % VARIANTS),
                "epoch_losses": [1.0],
                "output": None,
            }
        raise RequestRefused(
            ErrorInfo(code=ErrorCode.BAD_REQUEST, message=f"sim runs no command {cmd!r}")
        )


class Fleet:
    """N simulated agents on this event loop: dial, hello, heartbeat, answer job messages.

    Args:
        url: the ``/worker`` endpoint (or a bare server).
        welcome: expect a ``Welcome`` after the hello (the bare anchor sends nothing).
        state_bytes: the size of the model state a sim trains.
        bare: answer every message of ``state_bytes`` with as many bytes (the anchor's round),
            instead of speaking the protocol.
    """

    def __init__(
        self,
        url: str,
        welcome: bool,
        state_bytes: int,
        bare: bool = False,
        heartbeat: float = HEARTBEAT_INTERVAL,
    ) -> None:
        self.url = url
        self.heartbeat = heartbeat
        self.welcome = welcome
        self.bare = bare
        self.state_bytes = state_bytes
        width = side(state_bytes)
        self.states = [trained(width, k) for k in range(VARIANTS)]
        self.initial = {"weight": torch.zeros(width, width), "bias": torch.zeros(width)}
        self.payload = bytes(state_nbytes(state_bytes))
        self.connections: list[ClientConnection] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def open(self, n: int, batch: int) -> float:
        """Connect ``n`` agents, ``batch`` handshakes at a time; seconds until all welcomed."""
        gate = asyncio.Semaphore(batch)
        start = time.perf_counter()
        await asyncio.gather(*(self._open_one(i, gate) for i in range(n)))
        return time.perf_counter() - start

    def dataset(self, i: int) -> DatasetSummary:
        """Sim ``i``'s dataset as its hello announces it: rows of the model's width, labels."""
        rows, width = rows_of(i), side(self.state_bytes)
        x = ArrayShape(shape=[rows, width], dtype="float32")
        return DatasetSummary(rows=rows, x=x, y=ArrayShape(shape=[rows, width], dtype="float32"))

    def _hello(self, i: int) -> bytes:
        hello = WorkerHello(
            worker_id=f"sim-{i}",
            tags=["sim"],
            capabilities=CAPABILITIES,
            datasets={DATASET: self.dataset(i)},
        )
        return encode_small(hello)

    async def _open_one(self, i: int, gate: asyncio.Semaphore) -> None:
        async with gate:
            # As the real agent dials: its keepalive pings on too (20 s), here never due.
            ws = await connect(
                self.url,
                compression=None,
                max_size=None if self.bare else MAX_SIZE,
                open_timeout=30,
                ping_interval=20.0,
                ping_timeout=20.0,
            )
            self.connections.append(ws)
            await ws.send(self._hello(i))
            if self.welcome:
                async with asyncio.timeout(30):
                    reply = parse(await ws.recv(decode=False))
                if not isinstance(reply, Welcome) or reply.worker_id != f"sim-{i}":
                    raise RuntimeError(
                        f"sim-{i}: the coordinator answered the hello with {reply!r}"
                    )
        agent = SimAgent(i, self.states, self.initial)
        self._spawn(self._bare(ws) if self.bare else self._live(ws, agent))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _live(self, ws: ClientConnection, agent: SimAgent) -> None:
        channel = Channel(ws, f"sim-{agent.i}", agent.handle)
        reader = asyncio.ensure_future(channel.run())
        await self._heartbeat(reader, lambda: channel.send(Heartbeat(sent_at=time.time())))

    async def _bare(self, ws: ClientConnection) -> None:
        async def answer() -> None:
            async for message in ws:
                if len(message) == len(self.payload):
                    await ws.send(self.payload)

        reader = asyncio.ensure_future(answer())
        heartbeat = encode_small(Heartbeat(sent_at=time.time()))
        await self._heartbeat(reader, lambda: ws.send(heartbeat))

    async def _heartbeat(
        self, reader: asyncio.Future[None], send: Callable[[], Awaitable[None]]
    ) -> None:
        try:
            await asyncio.wait({reader}, timeout=random.uniform(0, self.heartbeat))
            while not reader.done():
                await send()
                await asyncio.wait({reader}, timeout=self.heartbeat * random.uniform(0.9, 1.1))
        except Exception:  # the connection closed under a send: counted in dropped()
            pass
        finally:
            reader.cancel()

    def dropped(self) -> list[str]:
        """Why each connection that is no longer open closed (before :meth:`close`)."""
        return [
            f"{ws.close_code} {ws.close_reason}"
            for ws in self.connections
            if ws.state is not State.OPEN
        ]

    async def close(self, batch: int) -> None:
        for task in list(self._tasks):
            task.cancel()
        gate = asyncio.Semaphore(batch)

        async def close_one(ws: ClientConnection) -> None:
            async with gate:
                await ws.close()

        await asyncio.gather(*(close_one(ws) for ws in self.connections), return_exceptions=True)
