"""The worker agent against a coordinator stand-in, over real sockets, with real filter daemons.

The stand-in (:class:`StandIn`) is a real peer, not a mock: a ``websockets`` server on loopback
that speaks the real protocol through :class:`~protocol.channel.Channel` — it answers the hello,
records heartbeats, and sends ``open_job``/``call``/``close_job`` as the coordinator would. The
agent runs in-process (on uvloop, as the CLI does) except in the last test, which runs the
``somatize-worker`` console script. Every test checks that no process of it is left behind.

Every timeout is a multiple of ``timeout_unit()`` (``SOMATIZE_TEST_TIMEOUT_SCALE``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import os
import platform
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch
import uvloop
from websockets.asyncio.server import ServerConnection, serve

import somatize as sz
from protocol.asyncio.channel import Channel
from protocol.errors import ErrorCode, ErrorInfo, RemoteError
from protocol.filters import dump_filter
from protocol.messages import (
    CHUNK_BYTES,
    Ack,
    Call,
    CloseJob,
    Error,
    Heartbeat,
    OpenJob,
    Result,
    Shutdown,
    Status,
    Welcome,
    WorkerHello,
)
from tests.conftest import timeout_unit
from worker.agent import Agent, Backoff, RegistrationRefused, worker_url

pytestmark = pytest.mark.integration

UNIT = timeout_unit()
HEARTBEAT = 0.25 * UNIT
"""The heartbeat interval the stand-in asks for."""


# -- filters (pickled by value into the daemons) -------------------------------------------------


class Center(sz.Filter):
    def fit(self, x, y=None):
        return {"mean": x.mean(0)}

    def forward(self, x, state):
        return x - state["mean"]


class Sleep:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def fit(self, x, y=None):
        time.sleep(self.seconds)
        return {"slept": self.seconds}

    def forward(self, x, state):
        return x


class Boom:
    def fit(self, x, y=None):
        return self.explode()

    def explode(self):
        raise ValueError("boom in fit")

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
        raise RemoteError(ErrorInfo(code=ErrorCode.BAD_REQUEST, message=f"no {message.kind}"))

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
        options = {"threads": 1, "backoff": Backoff(0.02 * UNIT, 0.2 * UNIT), **options}
        agent = Agent(url, **options)
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


async def open_job(channel: Channel, job_id: str, **filters: Any) -> None:
    filters_bytes = {node_id: dump_filter(f) for node_id, f in filters.items()}
    reply = await channel.request(
        OpenJob(job_id=job_id, filters=filters_bytes, threads=1), timeout=30 * UNIT
    )
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
    before = children(os.getpid())
    yield
    deadline = time.monotonic() + 5 * UNIT
    while (left := children(os.getpid()) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left behind: {left}"


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
            agent = Agent(url, backoff=Backoff(0.01, 0.01))
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
        agent = Agent(url, backoff=Backoff(10 * UNIT, 10 * UNIT))
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


# -- jobs ---------------------------------------------------------------------------------------


def test_batched_fit_over_the_wire_matches_graph_fit():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 3, generator=g)
    torch.manual_seed(0)
    net = sz.TorchFilter(torch.nn.Linear(4, 3), lr=0.1, batch_size=8, epochs=3, seed=1)
    fitted = (Center().named("center") >> copy.deepcopy(net).named("lin")).fit(x, y)
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in):
            channel = await stand_in.next_channel()
            await open_job(channel, "j", center=Center(), lin=net)
            result = await call(channel, "j", "batched_fit", node_ids=["center", "lin"], x=x, y=y)
        assert result["rows"] == 32 and len(result["epoch_losses"]) == 3
        assert set(result["states"]["lin"]) == set(fitted.states["lin"])
        for key, value in fitted.states["lin"].items():
            torch.testing.assert_close(result["states"]["lin"][key], value, rtol=0, atol=0)
        torch.testing.assert_close(result["states"]["center"]["mean"], x.mean(0))
        assert result["loss"] == pytest.approx(fitted.epoch_losses[-1], rel=1e-6)

    drive(main)


def test_a_filter_that_raises_is_an_error_reply_and_the_next_call_works():
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in, worker_id="w-1"):
            channel = await stand_in.next_channel()
            await open_job(channel, "j", boom=Boom(), center=Center())
            error = await call_error(channel, "j", "fit", node_id="boom", x=torch.ones(2, 2))
            assert error.code == ErrorCode.FILTER_ERROR
            assert "boom in fit" in error.message
            assert "in explode" in error.detail["traceback"]
            assert error.detail["worker_id"] == "w-1" and error.detail["job_id"] == "j"

            result = await call(channel, "j", "fit", node_id="center", x=torch.ones(2, 2))
            torch.testing.assert_close(result["states"]["center"]["mean"], torch.ones(2))

    drive(main)


def test_a_killed_daemon_is_daemon_crashed_until_the_job_is_opened_again():
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in, worker_id="w-crash") as agent:
            channel = await stand_in.next_channel()
            await open_job(channel, "j", die=Die(), center=Center())
            first_pid = agent.jobs["j"].pid
            assert first_pid is not None

            error = await call_error(channel, "j", "fit", node_id="die", x=[1.0])
            assert error.code == ErrorCode.DAEMON_CRASHED
            assert error.detail["signal"] == "SIGKILL"
            assert error.detail["worker_id"] == "w-crash" and error.detail["job_id"] == "j"
            assert gone(first_pid)
            # Never a silent success afterwards, not even for a harmless command.
            again = await call_error(channel, "j", "fit", node_id="center", x=torch.ones(1, 2))
            assert again.code == ErrorCode.DAEMON_CRASHED
            assert again.detail["job_id"] == "j"

            await open_job(channel, "j", center=Center())
            assert agent.jobs["j"].pid not in (None, first_pid)
            result = await call(channel, "j", "fit", node_id="center", x=torch.ones(1, 2))
            assert set(result["states"]) == {"center"}

    drive(main)


def test_unknown_jobs_and_unknown_kinds_get_typed_errors():
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in, worker_id="w-1"):
            channel = await stand_in.next_channel()
            error = await call_error(channel, "nope", "ping")
            assert error.code == ErrorCode.UNKNOWN_JOB
            assert error.detail == {"worker_id": "w-1", "job_id": "nope", "open_jobs": []}
            assert "nope" in error.message and "w-1" in error.message

            assert isinstance(await channel.request(CloseJob(job_id="nope"), 5 * UNIT), Ack)
            with pytest.raises(RemoteError) as info:
                await channel.request(Status(), 5 * UNIT)
            assert info.value.code == ErrorCode.BAD_REQUEST
            assert "status" in info.value.info.message

    drive(main)


def test_close_job_during_a_long_call_fails_the_call():
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in) as agent:
            channel = await stand_in.next_channel()
            await open_job(channel, "j", sleep=Sleep(60))
            pid = agent.jobs["j"].pid
            assert pid is not None
            pending = asyncio.ensure_future(call(channel, "j", "fit", node_id="sleep", x=[1.0]))
            await asyncio.sleep(0.3 * UNIT)  # the daemon is inside fit now
            assert not pending.done()

            started = time.monotonic()
            assert isinstance(await channel.request(CloseJob(job_id="j"), 10 * UNIT), Ack)
            with pytest.raises(RemoteError) as info:
                await asyncio.wait_for(pending, 10 * UNIT)
            assert info.value.code == ErrorCode.CANCELLED
            assert info.value.info.detail["job_id"] == "j"
            assert time.monotonic() - started < 5 * UNIT
            assert gone(pid) and agent.jobs == {}

    drive(main)


def test_stop_answers_a_running_call_with_an_error_and_refuses_new_jobs():
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in) as agent:
            channel = await stand_in.next_channel()
            await open_job(channel, "j", sleep=Sleep(60))
            pid = agent.jobs["j"].pid
            assert pid is not None
            pending = asyncio.ensure_future(call(channel, "j", "fit", node_id="sleep", x=[1.0]))
            await asyncio.sleep(0.3 * UNIT)  # the daemon is inside fit now

            agent.stop()
            # Sent at once: it arrives while the daemons are being closed, before the goodbye.
            late = asyncio.ensure_future(open_job(channel, "k", sleep=Sleep(1)))
            with pytest.raises(RemoteError) as info:
                await asyncio.wait_for(pending, 10 * UNIT)
            assert info.value.code == ErrorCode.CANCELLED  # answered, not cut off
            with pytest.raises(RemoteError) as refused:
                await asyncio.wait_for(late, 10 * UNIT)
            assert refused.value.code == ErrorCode.SHUTTING_DOWN
            await asyncio.wait_for(channel.closed.wait(), 10 * UNIT)
            assert gone(pid)

    drive(main)


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


# -- the console script -------------------------------------------------------------------------


def test_somatize_worker_registers_and_a_sigterm_stops_it_with_no_daemon_left(tmp_path):
    script = Path(sys.executable).parent / "somatize-worker"
    token_file = tmp_path / "token"
    token_file.write_text("t0ken\n")
    log_path = tmp_path / "worker.log"
    stand_in = StandIn()

    async def main() -> None:
        async with listening(stand_in) as url:
            with log_path.open("wb") as log_file:
                proc = await asyncio.create_subprocess_exec(
                    str(script),
                    *("--connect", url, "--id", "cli-1", "--tag", "a", "--tag", "b"),
                    *("--threads", "1", "--token-file", str(token_file)),
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=log_file,
                )
            try:
                channel = await stand_in.next_channel()
                await open_job(channel, "j", center=Center())
                daemons = children(proc.pid)
                assert len(daemons) == 2  # the job's, and the spare started for the next job

                proc.send_signal(signal.SIGTERM)
                async with asyncio.timeout(20 * UNIT):
                    assert await proc.wait() == 0
                await asyncio.wait_for(channel.closed.wait(), 5 * UNIT)
                assert all(gone(pid) for pid in daemons)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()

    drive(main)
    (hello,) = stand_in.hellos
    assert hello.worker_id == "cli-1" and hello.tags == ["a", "b"]
    assert stand_in.upgrades == [("/worker", "Bearer t0ken")]
    log = log_path.read_text()
    for line in ("connected to", "job j: opened", "received SIGTERM", "disconnected from"):
        assert line in log, log


def test_a_second_sigterm_forces_the_exit_and_kills_the_daemons():
    script = Path(sys.executable).parent / "somatize-worker"
    stand_in = StandIn()
    daemons: list[int] = []

    async def main() -> None:
        async with listening(stand_in) as url:
            proc = await asyncio.create_subprocess_exec(
                str(script),
                *("--connect", url, "--id", "cli-2", "--threads", "1", "--log-level", "ERROR"),
                stdin=subprocess.DEVNULL,
            )
            try:
                channel = await stand_in.next_channel()
                await open_job(channel, "j", center=Center())
                daemons.extend(children(proc.pid))  # the job's daemon and the spare
                # A stopped daemon cannot answer "shutdown": the orderly stop now waits for
                # its close timeout (5 s), which the second signal cuts short.
                for daemon in daemons:
                    os.kill(daemon, signal.SIGSTOP)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5 * UNIT)
                assert proc.returncode is None
                started = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                async with asyncio.timeout(5 * UNIT):
                    assert await proc.wait() == 1
                assert time.monotonic() - started < 2 * UNIT
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()

    try:
        drive(main)
    finally:
        deadline = time.monotonic() + 5 * UNIT
        while not all(gone(pid) for pid in daemons) and time.monotonic() < deadline:
            time.sleep(0.02)
        left = [pid for pid in daemons if not gone(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)  # stopped and orphaned, it would outlive the test run
    assert daemons and not left, "the second signal kills the daemons"
