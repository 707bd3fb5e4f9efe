"""The worker agent's connection against a coordinator stand-in, over real sockets.

Registration (the hello, a refusal, the backoff), liveness (heartbeats, the dead-link watch) and
the connection's end (dropped, shut down), with real filter daemons; the stand-in and the shared
helpers are in :mod:`tests.worker.standin`. Every test checks that no process of it is left
behind; every timeout is a multiple of ``timeout_unit()``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import platform
import random
import time

import cloudpickle
import pytest
import torch

from protocol.errors import ErrorCode, ErrorInfo
from protocol.messages import Shutdown
from tests.utils import UNIT, Center
from tests.worker.standin import (
    HEARTBEAT,
    Sleep,
    StandIn,
    call,
    call_error,
    drive,
    gone,
    listening,
    no_process_left,
    open_job,
    running,
)
from worker.agent import Agent, AgentConfig, Backoff, RegistrationRefused, worker_url

pytestmark = pytest.mark.integration

__all__ = ["no_process_left"]  # the autouse fixture: no daemon is left behind

# -- pure parts ---------------------------------------------------------------------------------


def test_backoff_doubles_to_the_cap_with_full_jitter_and_resets():
    top = Backoff(base=0.1, cap=5.0, rng=lambda: 1.0)
    assert [top.next_delay() for _ in range(8)] == pytest.approx(
        [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    )
    top.reset()
    assert top.next_delay() == pytest.approx(0.1)

    jittered = Backoff(base=0.1, cap=5.0, rng=random.Random(0).random)
    for _ in range(2000):  # far past the cap: the exponent must not overflow
        ceiling = jittered.ceiling()
        assert 0.0 <= jittered.next_delay() <= ceiling <= 5.0


def test_worker_url_appends_the_worker_path_only_when_there_is_none():
    assert worker_url("ws://host:8765") == "ws://host:8765/worker"
    assert worker_url("ws://host:8765/") == "ws://host:8765/worker"
    assert worker_url("wss://host/custom/path") == "wss://host/custom/path"
    assert worker_url("host:8765") == "ws://host:8765/worker"
    with pytest.raises(ValueError, match="not a coordinator URL"):
        worker_url("http://host:8765")


# -- registration -------------------------------------------------------------------------------


def test_the_hello_carries_the_id_tags_capabilities_and_token():
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in, worker_id="w-7", tags=["eu", "cpu"], token="s3cret") as agent:
            await stand_in.next_channel()
            await asyncio.wait_for(agent.connected.wait(), 10 * UNIT)
            assert agent.worker_id == "w-7"

    drive(main)
    (hello,) = stand_in.hellos
    assert hello.worker_id == "w-7" and hello.tags == ["eu", "cpu"]
    assert stand_in.upgrades == [("/worker", "Bearer s3cret")]
    caps = hello.capabilities
    assert caps.cpus == len(os.sched_getaffinity(0))
    assert caps.memory_bytes > 0
    assert caps.python == platform.python_version()
    assert caps.cloudpickle == cloudpickle.__version__
    assert torch.__version__.startswith(caps.torch.split("+")[0]) and caps.torch
    assert caps.platform == platform.platform()


def test_a_version_mismatch_on_hello_stops_the_agent_without_retrying():
    refusal = ErrorInfo(
        code=ErrorCode.VERSION_MISMATCH,
        message="protocol version mismatch: peer speaks 0, this side speaks 1",
    )
    stand_in = StandIn(refuse=refusal)

    async def main() -> None:
        async with listening(stand_in) as url:
            agent = Agent(AgentConfig(url), backoff=Backoff(0.01, 0.01))
            with pytest.raises(RegistrationRefused) as info:
                await asyncio.wait_for(agent.run(), 10 * UNIT)
            assert info.value.info.code == ErrorCode.VERSION_MISMATCH
            assert not agent.connected.is_set()

    drive(main)
    assert len(stand_in.hellos) == 1


def test_stop_interrupts_the_reconnection_backoff():
    async def main() -> None:
        async with listening(StandIn()) as url:
            pass  # the port is closed again: every attempt is refused
        agent = Agent(AgentConfig(url), backoff=Backoff(10 * UNIT, 10 * UNIT))
        run = asyncio.ensure_future(agent.run())
        await asyncio.sleep(0.2 * UNIT)  # let it fail once and enter the (long) backoff
        started = time.monotonic()
        agent.stop()
        await asyncio.wait_for(run, 5 * UNIT)
        assert time.monotonic() - started < 2 * UNIT

    drive(main)


# -- liveness -----------------------------------------------------------------------------------


def test_heartbeats_keep_flowing_while_a_daemon_computes():
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in):
            channel = await stand_in.next_channel()
            await open_job(channel, "j", sleep=Sleep(4 * HEARTBEAT))
            started = time.monotonic()
            result = await call(channel, "j", "fit", node_id="sleep", x=[1.0])
            ended = time.monotonic()
            assert result["states"] == {"sleep": {"slept": 4 * HEARTBEAT}}

        during = [(t, beat) for t, beat in stand_in.heartbeats if started <= t <= ended]
        assert len(during) >= 3, during
        assert all(beat.job_id == "j" for _, beat in during)
        times = [started, *(t for t, _ in during), ended]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert max(gaps) < 2 * HEARTBEAT, gaps

    drive(main)


def test_a_coordinator_that_answers_no_ping_is_given_up_within_the_timeout_and_dialled_again(
    caplog,
):
    timeout = 4 * HEARTBEAT
    stand_in = StandIn(heartbeat_timeout=timeout)
    frozen_at = 0.0

    async def main() -> None:
        nonlocal frozen_at
        async with running(stand_in, close_timeout=0.5 * UNIT) as agent:
            first = await stand_in.next_channel()
            await open_job(first, "j", center=Center())
            pid = agent.jobs["j"].pid
            assert pid is not None
            # A frozen peer: it reads nothing more, so no pong, no close frame, no FIN.
            first.transport.transport.pause_reading()  # type: ignore[attr-defined]
            frozen_at = time.time()
            second = await stand_in.next_channel()
            assert gone(pid)  # the job's daemon went with the connection
            error = await call_error(second, "j", "ping")
            assert error.code == ErrorCode.UNKNOWN_JOB  # a job does not outlive its connection
            first.transport.transport.abort()  # type: ignore[attr-defined]

    drive(main)
    # When the agent gave up: its log record's time. The last pong came up to one interval
    # before the freeze, and the check runs every interval.
    (gave_up,) = [r for r in caplog.records if "answered no ping" in r.getMessage()]
    assert timeout - HEARTBEAT <= gave_up.created - frozen_at < timeout + 2 * HEARTBEAT + UNIT / 2
    first_hello, second_hello = stand_in.hellos
    assert first_hello.worker_id is None
    assert second_hello.worker_id == "w-assigned-1"


# -- the connection -----------------------------------------------------------------------------


def test_a_dropped_connection_closes_the_daemons_and_reconnects_with_the_same_id():
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in) as agent:
            first = await stand_in.next_channel()
            await open_job(first, "j", center=Center())
            pid = agent.jobs["j"].pid
            assert pid is not None

            first.transport.transport.abort()  # type: ignore[attr-defined]  # no closing handshake
            second = await stand_in.next_channel()
            assert gone(pid)
            error = await call_error(second, "j", "ping")
            assert error.code == ErrorCode.UNKNOWN_JOB

    drive(main)
    first_hello, second_hello = stand_in.hellos
    assert first_hello.worker_id is None
    assert second_hello.worker_id == "w-assigned-1"
    assert stand_in.upgrades == [("/worker", None)] * 2  # no token, no Authorization header


def test_a_shutdown_message_makes_the_agent_reconnect():
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in, worker_id="w-1"):
            first = await stand_in.next_channel()
            await first.send(Shutdown(id=first.next_id(), reason="restarting"))
            await stand_in.next_channel()
            await asyncio.wait_for(first.closed.wait(), 5 * UNIT)

    drive(main)
    assert [hello.worker_id for hello in stand_in.hellos] == ["w-1", "w-1"]
