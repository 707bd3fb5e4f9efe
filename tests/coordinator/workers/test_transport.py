"""``TransportContext`` over real WebSocket connections to stand-in agents: a command waiting
for its input from another worker fails as soon as that worker is lost (issue 32), not at the
call timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import websockets

from coordinator.errors import WorkerCallError
from coordinator.workers.registry import WorkerRecord
from coordinator.workers.transport import TransportContext
from protocol.asyncio.channel import Channel
from protocol.daemon import StageForwardRequest
from protocol.errors import ErrorCode
from protocol.messages import CloseJob, Result
from tests.utils import UNIT
from worker.capabilities import Capabilities

CAPS = Capabilities(cpus=1, memory_bytes=1 << 30, torch="2", python="3.11", cloudpickle="3")
CALL_TIMEOUT = 60.0
"""The job's call timeout: far longer than any wait these tests allow."""


@asynccontextmanager
async def agent(
    worker_id: str, on_call: Callable[[Any], Awaitable[Any]]
) -> AsyncIterator[tuple[WorkerRecord, Channel]]:
    """A worker's record on the coordinator's side of a loopback connection, and the stand-in
    agent's end of it, whose calls ``on_call`` answers."""
    ready: asyncio.Future[Channel] = asyncio.get_running_loop().create_future()

    async def serve(ws: Any) -> None:
        channel = Channel(ws, f"worker {worker_id}")
        ready.set_result(channel)
        await channel.run()

    server = await websockets.serve(serve, "127.0.0.1", 0, compression=None)
    port = server.sockets[0].getsockname()[1]
    ws = await websockets.connect(f"ws://127.0.0.1:{port}", compression=None)
    own = Channel(ws, f"agent {worker_id}", on_call)
    reader = asyncio.ensure_future(own.run())
    try:
        record = WorkerRecord(id=worker_id, tags=frozenset(), capabilities=CAPS, channel=None)
        record.channel = await asyncio.wait_for(ready, 10 * UNIT)
        yield record, own
    finally:
        await own.close()
        reader.cancel()
        server.close()
        await server.wait_closed()


async def never_answers(message: Any) -> Any:
    if isinstance(message, CloseJob):
        return Result(result=None)
    await asyncio.sleep(3600)  # a stage waiting in its mailbox for an input that never comes


async def answers(message: Any) -> Any:
    return Result(result={"loss": 0.5, "rows": 4})


def forward() -> StageForwardRequest:
    return StageForwardRequest(node_ids=["b"], micro=0)


def test_a_stage_waiting_for_a_lost_stages_input_fails_at_once_naming_the_lost_worker():
    async def main() -> None:
        async with agent("w0", answers) as (w0, w0_end), agent("w1", never_answers) as (w1, _):
            ctx = TransportContext("job", [w0, w1], timeout=CALL_TIMEOUT)
            try:
                # w0 answers its command, then leaves; w1 waits for w0's activation.
                assert (await ctx.routed(0, forward(), output_to=(1, "act/0/0")))["rows"] == 4
                waiting = asyncio.ensure_future(ctx.routed(1, forward(), input_from="act/0/0"))
                await asyncio.sleep(0.2 * UNIT)
                assert not waiting.done()
                left = time.monotonic()
                await w0_end.close()
                with pytest.raises(WorkerCallError) as caught:
                    await asyncio.wait_for(waiting, 10 * UNIT)
                assert time.monotonic() - left < 5 * UNIT  # not the call timeout
                assert caught.value.worker_id == "w0"
                assert caught.value.info.code is ErrorCode.WORKER_LOST
                assert "waiting for act/0/0" in caught.value.info.message
                assert w1.connected  # the waiting worker itself is still there
            finally:
                await ctx.close()

    asyncio.run(main())


def test_a_routed_command_whose_inputs_worker_stays_gets_its_answer():
    async def main() -> None:
        async with agent("w0", answers) as (w0, _), agent("w1", answers) as (w1, _):
            ctx = TransportContext("job", [w0, w1], timeout=CALL_TIMEOUT)
            try:
                got = await ctx.routed(1, forward(), input_from="act/0/0")
                assert got == {"loss": 0.5, "rows": 4}
            finally:
                await ctx.close()

    asyncio.run(main())
