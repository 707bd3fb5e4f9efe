"""The coordinator stand-in the agent's tests talk to, and their shared helpers.

The stand-in (:class:`StandIn`) is a real peer, not a mock: a ``websockets`` server on loopback
that speaks the real protocol through
:class:`~protocol.asyncio.channel.Channel` — it answers the hello, records heartbeats, and sends
``open_job``/``call``/``close_job`` as the coordinator would. The agent runs in-process on uvloop,
as the CLI does (:func:`running`, :func:`drive`). :func:`no_process_left` is the autouse fixture of
the agent's test modules: each imports it.

Every timeout is a multiple of ``timeout_unit()`` (``SOMATIZE_TEST_TIMEOUT_SCALE``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop
from websockets.asyncio.server import ServerConnection, serve

from protocol.asyncio.channel import Channel
from protocol.errors import ErrorCode, ErrorInfo, RemoteError, RequestRefused
from protocol.filters import dump_filter
from protocol.messages import (
    CHUNK_BYTES,
    Ack,
    Call,
    Error,
    Heartbeat,
    OpenJob,
    Result,
    Welcome,
    WorkerHello,
)
from tests.utils import (
    FORK_SERVER_LINGER,
    UNIT,
    is_shared_fork_server,
    shared_fork_servers,
)
from worker.agent import Agent, AgentConfig, Backoff

HEARTBEAT = 0.25 * UNIT
"""The heartbeat interval the stand-in asks for."""


# -- filters (pickled by value into the daemons) -------------------------------------------------


class Sleep:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def fit(self, x, y=None):
        time.sleep(self.seconds)
        return {"slept": self.seconds}

    def forward(self, x, state):
        return x


class Die:
    def fit(self, x, y=None):
        os.kill(os.getpid(), signal.SIGKILL)

    def forward(self, x, state):
        return x


# -- the coordinator stand-in -------------------------------------------------------------------


class StandIn:
    """The coordinator's side of ``/worker``: hello → welcome (or an error), then requests.

    Args:
        refuse: answer every hello with this error instead of a welcome.
        assign: prefix of the ids given to agents that ask for none (``<assign>-<n>``).
        heartbeat_timeout: the welcome's heartbeat timeout.
    """

    def __init__(
        self,
        refuse: ErrorInfo | None = None,
        assign: str = "w-assigned",
        heartbeat_timeout: float = 20 * HEARTBEAT,
    ) -> None:
        self.refuse = refuse
        self.assign = assign
        self.heartbeat_timeout = heartbeat_timeout
        self.hellos: list[WorkerHello] = []
        self.upgrades: list[tuple[str, str | None]] = []  # (path, Authorization header)
        self.heartbeats: list[tuple[float, Heartbeat]] = []  # (monotonic arrival, message)
        self._channels: asyncio.Queue[Channel] = asyncio.Queue()

    async def handle(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        self.upgrades.append((ws.request.path, ws.request.headers.get("Authorization")))
        channel = Channel(ws, "stand-in", self.on_message)
        hello = await channel.receive(first=True)
        assert isinstance(hello, WorkerHello)
        self.hellos.append(hello)
        if self.refuse is not None:
            await channel.send(Error(id=channel.next_id(), reply_to=hello.id, error=self.refuse))
            await ws.close()
            return
        welcome = Welcome(
            id=channel.next_id(),
            reply_to=hello.id,
            worker_id=hello.worker_id or f"{self.assign}-{len(self.hellos)}",
            heartbeat_interval=HEARTBEAT,
            heartbeat_timeout=self.heartbeat_timeout,
            server="stand-in",
        )
        await channel.send(welcome)
        self._channels.put_nowait(channel)
        await channel.run()

    async def on_message(self, message: Any) -> None:
        if isinstance(message, Heartbeat):
            self.heartbeats.append((time.monotonic(), message))
            return
        raise RequestRefused.of(ErrorCode.BAD_REQUEST, f"no {message.kind}")

    async def next_channel(self) -> Channel:
        """The channel of the next agent that completed the hello."""
        async with asyncio.timeout(20 * UNIT):
            return await self._channels.get()


@contextlib.asynccontextmanager
async def listening(stand_in: StandIn) -> AsyncIterator[str]:
    """Serve ``stand_in`` on a free loopback port; yields the coordinator URL."""
    async with serve(
        stand_in.handle, "127.0.0.1", 0, compression=None, max_size=4 * CHUNK_BYTES
    ) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield f"ws://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def running(stand_in: StandIn, **options: Any) -> AsyncIterator[Agent]:
    """An agent connected to ``stand_in``, stopped (and checked to stop cleanly) on exit."""
    async with listening(stand_in) as url:
        backoff = options.pop("backoff", Backoff(0.02 * UNIT, 0.2 * UNIT))
        config = {
            "threads": 1,
            "fork_server_share": shared_fork_servers(),
            "fork_server_linger": FORK_SERVER_LINGER,
            **options,
        }
        agent = Agent(AgentConfig(url, **config), backoff=backoff)
        run = asyncio.ensure_future(agent.run())
        try:
            yield agent
        finally:
            agent.stop()
            async with asyncio.timeout(20 * UNIT):
                await asyncio.wait({run})
        run.result()  # stop() ends run() without an error
        assert agent.jobs == {}


def drive(main: Callable[[], Awaitable[None]], seconds: float = 40) -> None:
    """Run ``main()`` on a uvloop loop, bounded by ``seconds`` units."""

    async def bounded() -> None:
        async with asyncio.timeout(seconds * UNIT):
            await main()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(bounded())


PEER_SECRET = "the-job-peer-secret"
"""The link key of the stand-in's jobs on the agent under test (``OpenJob.peer_secret``)."""


def presented(sender: str, key: str = PEER_SECRET) -> str:
    """What worker ``sender`` presents on a peer link to the worker holding ``key``."""
    from protocol.security.peer_credentials import credential

    return credential(key, sender)


"""The peer secret :func:`open_job` gives a job (as the coordinator gives each job its own)."""


async def open_job(
    channel: Channel, job_id: str, peer_secret: str | None = PEER_SECRET, **filters: Any
) -> None:
    filters_bytes = {node_id: dump_filter(f) for node_id, f in filters.items()}
    message = OpenJob(job_id=job_id, filters=filters_bytes, threads=1, peer_secret=peer_secret)
    reply = await channel.request(message, timeout=30 * UNIT)
    assert isinstance(reply, Ack)


async def call(channel: Channel, job_id: str, cmd: str, **fields: Any) -> Any:
    reply = await channel.request(
        Call(job_id=job_id, request={"cmd": cmd, **fields}, timeout=30 * UNIT), timeout=40 * UNIT
    )
    assert isinstance(reply, Result)
    return reply.result


async def call_error(channel: Channel, job_id: str, cmd: str, **fields: Any) -> ErrorInfo:
    with pytest.raises(RemoteError) as info:
        await call(channel, job_id, cmd, **fields)
    return info.value.info


# -- processes ----------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """``(state, ppid)`` of a process, ``None`` once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def children(parent: int) -> set[int]:
    """Live (not zombie) processes whose parent is ``parent``."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] == parent and stat[0] not in ("Z", "X"):
                found.add(int(entry.name))
    return found


def gone(pid: int) -> bool:
    stat = _stat(pid)
    return stat is None or stat[0] in ("Z", "X")


@pytest.fixture(autouse=True)
def no_process_left() -> Iterator[None]:
    """No process the test started outlives it, but a fork server its agent started in the
    process's shared folder, there for the next test's agents (:func:`shared_fork_servers`)."""
    before = children(os.getpid())
    yield
    deadline = time.monotonic() + 5 * UNIT
    while (left := _unshared(children(os.getpid()) - before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left behind: {left}"


def _unshared(pids: set[int]) -> set[int]:
    return {pid for pid in pids if not is_shared_fork_server(pid)}
