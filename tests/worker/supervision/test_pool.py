"""worker.supervision.pool: how many spare daemons an agent keeps warm, and in what order they are
started and handed out (the daemons themselves stand in: their start is a future the test
completes)."""

from __future__ import annotations

import asyncio
import os
from typing import ClassVar

from worker.config import AgentConfig
from worker.confinement.sandbox import NO_SANDBOX, Sandbox
from worker.supervision.pool import SANDBOXED_SPARES, SPARE_NICE, DaemonPool

URL = "ws://127.0.0.1:1"


class _Daemon:
    """A daemon whose start waits until the test says it is up."""

    made: ClassVar[list[_Daemon]] = []

    def __init__(self) -> None:
        self.nice = 0
        self.up: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.running = False
        self.closed = False
        _Daemon.made.append(self)

    async def start(self) -> None:
        await self.up
        self.running = True

    async def close(self, timeout: float) -> None:  # noqa: ASYNC109 (the supervisor's)
        self.closed = True

    async def foreground(self) -> None:
        self.nice = 0


def _pool(sandbox: Sandbox, **options: object) -> DaemonPool:
    config = AgentConfig(URL, sandbox=sandbox, fork_server=False, **options)
    pool = DaemonPool(config, accepting=lambda: True)
    pool._supervisor = lambda threads: _Daemon()  # type: ignore[method-assign,assignment,return-value]
    return pool


async def _settled() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_sandboxed_agent_keeps_two_spares_and_hands_out_one_that_is_up():
    async def scenario() -> None:
        _Daemon.made.clear()
        pool = _pool(Sandbox("bwrap"))
        assert pool.depth == SANDBOXED_SPARES == 2
        pool.prewarm()
        pool.prewarm()  # two kept, no more
        assert len(_Daemon.made) == 2
        _Daemon.made[1].up.set_result(None)
        await _settled()
        # A job takes the one that is up, though the other was started first.
        taken = await pool.take(None)
        assert taken is _Daemon.made[1] and taken.running
        # (a root agent starts spares nice, and gives a job its daemon back at full priority)
        assert _Daemon.made[0].nice == (SPARE_NICE if os.geteuid() == 0 else 0)
        assert taken.nice == 0
        pool.prewarm()
        assert len(_Daemon.made) == 3
        # A job right after waits for the oldest still starting.
        _Daemon.made[0].up.set_result(None)
        assert await pool.take(None) is _Daemon.made[0]
        _Daemon.made[2].up.set_result(None)
        await pool.close_spare()
        assert _Daemon.made[2].closed

    asyncio.run(scenario())


def test_a_forking_agent_keeps_one_and_none_with_spares_off():
    async def scenario() -> None:
        _Daemon.made.clear()
        pool = _pool(NO_SANDBOX)
        assert pool.depth == 1
        pool.prewarm()
        _Daemon.made[0].up.set_result(None)
        await _settled()
        assert len(_Daemon.made) == 1
        assert _pool(Sandbox("bwrap"), spares=3).depth == 3
        assert _pool(Sandbox("bwrap"), spare=False).depth == 0
        await pool.close_spare()
        assert _Daemon.made[0].closed

    asyncio.run(scenario())


def test_a_job_gets_a_spare_that_is_up_else_a_new_daemon_and_the_spares_are_made_up():
    async def scenario() -> None:
        _Daemon.made.clear()
        pool = _pool(NO_SANDBOX)
        pool.prewarm()
        _Daemon.made[0].up.set_result(None)
        await _settled()
        # The spare, started: the pool starts the next one.
        daemon, started = await pool.for_job(None)
        assert daemon is _Daemon.made[0] and started and len(_Daemon.made) == 2
        # Other threads than the spare's: a new daemon, for the job to start; the spare is kept.
        daemon, started = await pool.for_job(3)
        assert daemon is _Daemon.made[2] and not started and pool.has_spare
        _Daemon.made[1].up.set_result(None)
        await pool.close_spare()

    asyncio.run(scenario())
