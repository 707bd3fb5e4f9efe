"""The supervisor when its daemon dies, hangs or is orphaned, and its start/shutdown lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from protocol.daemon import PingRequest, ShutdownRequest
from protocol.errors import ErrorCode
from protocol.filters import dump_filter
from tests.utils import UNIT
from tests.worker.daemon.supervised import (
    Center,
    Die,
    Draw,
    Driver,
    Hang,
    driving,
    gone,
    wait_gone,
)
from worker.errors import DaemonCrashed, DaemonNotRunning, DaemonTimeout
from worker.supervision.forked import ForkServer
from worker.supervision.supervisor import DaemonSupervisor

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fork_server() -> Iterator[ForkServer]:
    """The fork server of the module's forked daemons (worker.supervision.forked): its start
    imports torch, ~3.5 s of CPU, once for them all."""
    server = ForkServer(sys.executable, DaemonSupervisor().environment())
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module", params=["spawned", "forked"])
def crashing(request: pytest.FixtureRequest) -> Iterator[Driver]:
    """One daemon the destructive tests kill, hang and restart in turn (each test starts by
    making sure it runs): started anew, or forked by the module's :func:`fork_server`."""
    if request.param == "spawned":
        with driving() as driver:
            yield driver
        return
    with driving(fork_server=request.getfixturevalue("fork_server")) as driver:
        yield driver


# -- the daemon dying, hanging, orphaned -------------------------------------------------------


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("sigkill", {"signal": "SIGKILL", "returncode": -signal.SIGKILL}),
        ("exit", {"returncode": 3}),
        ("segfault", {"signal": "SIGSEGV", "returncode": -signal.SIGSEGV}),
    ],
)
def test_a_filter_that_kills_its_daemon_is_a_crash_reported_at_once(crashing, how, expected):
    crashing.ensure_running()
    crashing.load(center=Center(), die=Die(how))
    pid = crashing.supervisor.pid
    assert pid is not None

    started = time.monotonic()
    with pytest.raises(DaemonCrashed) as info:
        crashing("fit", node_id="die", x=[1.0], timeout=30 * UNIT)
    assert time.monotonic() - started < 5 * UNIT  # EOF, not the timeout
    assert info.value.code == ErrorCode.DAEMON_CRASHED
    assert info.value.detail.items() >= {"cmd": "fit", "pid": pid, **expected}.items()
    assert not crashing.supervisor.running and crashing.supervisor.pid is None
    assert gone(pid)
    with pytest.raises(DaemonNotRunning):
        crashing("ping")

    crashing.run(crashing.supervisor.restart())
    assert crashing.supervisor.pid not in (None, pid)
    # The filters are back (the load was replayed), their states are not.
    x = torch.ones(2, 2)
    torch.testing.assert_close(
        crashing("fit", node_id="center", x=x)["states"]["center"]["mean"], torch.ones(2)
    )


def test_a_hanging_filter_times_out_the_daemon_is_killed_and_restart_replays_the_load(crashing):
    crashing.ensure_running()
    crashing.load(center=Center(), hang=Hang())
    pid = crashing.supervisor.pid
    assert pid is not None

    started = time.monotonic()
    with pytest.raises(DaemonTimeout) as info:
        crashing("fit", node_id="hang", x=[1.0], timeout=UNIT)
    elapsed = time.monotonic() - started
    assert UNIT <= elapsed < 6 * UNIT
    assert info.value.code == ErrorCode.TIMEOUT
    assert info.value.detail["cmd"] == "fit"
    assert not crashing.supervisor.running
    assert gone(pid)

    crashing.run(crashing.supervisor.restart())
    assert crashing("fit", node_id="center", x=torch.ones(2, 2))["rows"] == 2
    error = crashing.error("forward", node_id="hang", x=[1.0])  # the node is loaded again
    assert error.code == ErrorCode.NOT_FITTED


def test_cancelling_a_request_kills_the_daemon(crashing):
    crashing.ensure_running()
    crashing.load(hang=Hang())
    pid = crashing.supervisor.pid
    assert pid is not None

    async def cancel_mid_request() -> None:
        task = asyncio.ensure_future(
            crashing.supervisor.request_dict({"cmd": "fit", "node_id": "hang", "x": [1]}, 30 * UNIT)
        )
        await asyncio.sleep(0.2 * UNIT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    crashing.run(cancel_mid_request())
    crashing.wait_until(lambda: gone(pid), 5 * UNIT)
    with pytest.raises(DaemonNotRunning):
        crashing("ping")
    crashing.run(crashing.supervisor.restart())
    assert crashing("ping") is None


def test_a_daemon_killed_while_idle_is_noticed(crashing):
    crashing.ensure_running()
    pid = crashing.supervisor.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    crashing.wait_until(lambda: not crashing.supervisor.running, 5 * UNIT)
    with pytest.raises(DaemonNotRunning) as info:
        crashing("ping")
    assert info.value.detail["signal"] == "SIGKILL"
    crashing.run(crashing.supervisor.restart())
    assert crashing("ping") is None


_ORPHANING_PARENT = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path

    from protocol.filters import dump_filter
    from worker.supervision.forked import ForkServer
    from worker.supervision.supervisor import DaemonSupervisor

    class Hang:
        def __init__(self, marker):
            self.marker = marker

        def fit(self, x, y=None):
            import time
            Path(self.marker).touch()
            while True:
                time.sleep(0.05)

        def forward(self, x, state):
            return x

    async def main():
        forks = None
        if sys.argv[2] == "forked":
            forks = ForkServer(sys.executable, DaemonSupervisor().environment())
            forks.start()
        daemon = DaemonSupervisor(threads=1, fork_server=forks)
        await daemon.start()
        filters = {"hang": dump_filter(Hang(sys.argv[1]))}
        await daemon.request_dict({"cmd": "load", "filters": filters})
        print(daemon.pid, flush=True)
        await daemon.request_dict({"cmd": "fit", "node_id": "hang", "x": [1]}, timeout=3600)

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("started", ["spawned", "forked"])
def test_a_daemon_whose_parent_dies_exits_even_inside_a_filter(tmp_path, started):
    """The agent SIGKILLed while its daemon is inside a filter: the daemon exits (a forked
    one's server goes first, the daemon follows)."""
    marker = tmp_path / "inside-fit"
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHANING_PARENT, str(marker), started], stdout=subprocess.PIPE
    )
    pid = None
    try:
        assert parent.stdout is not None
        ready, _, _ = select.select([parent.stdout], [], [], 30 * UNIT)
        assert ready, "the intermediate process did not report its daemon"
        pid = int(parent.stdout.readline())
        deadline = time.monotonic() + 10 * UNIT
        while not marker.exists():
            assert time.monotonic() < deadline, "the daemon never entered the filter"
            time.sleep(0.02)
        parent.kill()
        parent.wait()
        assert wait_gone(pid, 5 * UNIT), "the orphaned daemon is still running"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
        if pid is not None and not gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_forked_daemon_is_the_servers_child_and_outlives_nothing_of_a_dead_server():
    """Forked daemons serve as spawned ones do; when the fork server dies its daemons end (the
    supervisor sees the crash), and later daemons start anew until a new server is up."""

    async def scenario() -> None:
        server = ForkServer(sys.executable, DaemonSupervisor().environment())
        await asyncio.to_thread(server.start)
        assert server.alive and server.pid is not None
        try:
            supervisor = DaemonSupervisor(threads=1, default_timeout=20 * UNIT, fork_server=server)
            async with supervisor:
                pid = supervisor.pid
                assert pid is not None and _parent_of(pid) == server.pid
                filters = {"center": dump_filter(Center())}
                await supervisor.request_dict({"cmd": "load", "filters": filters})
                fit = await supervisor.request_dict(
                    {"cmd": "fit", "node_id": "center", "x": torch.ones(3, 2)}
                )
                torch.testing.assert_close(fit["states"]["center"]["mean"], torch.ones(2))
                os.kill(server.pid, signal.SIGKILL)
                for _ in range(int(2000 * UNIT)):  # a loaded machine: its 0.2 s watchdog, then exit
                    if not supervisor.running and gone(pid):
                        break
                    await asyncio.sleep(0.01)
                assert not supervisor.running and gone(pid)  # its watchdog ended it
                assert not server.alive
                with pytest.raises(DaemonNotRunning):
                    await supervisor.request(PingRequest(id=0, cmd="ping"))
                await supervisor.restart()  # the server is gone: started anew
                assert _parent_of(supervisor.pid) == os.getpid()
        finally:
            await asyncio.to_thread(server.close)

    asyncio.run(scenario())


def test_two_daemons_forked_by_one_server_draw_different_unseeded_numbers(fork_server):
    """Every forked daemon reseeds torch's and numpy's generators from the OS: two jobs'
    unseeded ``torch.rand`` differ (issue 32), as two spawned daemons' do."""

    async def draw(server: ForkServer) -> dict[str, torch.Tensor]:
        supervisor = DaemonSupervisor(threads=1, default_timeout=20 * UNIT, fork_server=server)
        async with supervisor:
            assert _parent_of(supervisor.pid) == server.pid
            await supervisor.request_dict({"cmd": "load", "filters": {"d": dump_filter(Draw())}})
            fit = await supervisor.request_dict({"cmd": "fit", "node_id": "d", "x": [1.0]})
            return dict(fit["states"]["d"])

    async def scenario() -> None:
        first, second = await draw(fork_server), await draw(fork_server)
        for generator in ("torch", "numpy"):
            assert not torch.equal(first[generator], second[generator]), generator

    asyncio.run(scenario())


def test_a_forked_daemon_holds_none_of_its_servers_descriptors(fork_server):
    """Issue 53, a Low: a forked daemon kept the fork server's wake-up pipe open (a job could
    write to it). Its descriptors are its pipes, its shared regions and what it opened."""

    async def scenario() -> None:
        supervisor = DaemonSupervisor(threads=1, default_timeout=20 * UNIT, fork_server=fork_server)
        async with supervisor:
            assert supervisor.pid is not None and fork_server.pid is not None
            daemon, forks = _pipes_of(supervisor.pid), _pipes_of(fork_server.pid)
        assert forks, "the server's own pipes and socket were not seen"
        assert not daemon & forks, daemon & forks

    asyncio.run(scenario())


def _pipes_of(pid: int) -> set[str]:
    """The pipes and sockets process ``pid`` holds open (``pipe:[inode]``)."""
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith(("pipe:", "socket:")):
                found.add(target)
    return found


def _parent_of(pid: int | None) -> int:
    assert pid is not None
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


# -- lifecycle ----------------------------------------------------------------------------------


def test_a_command_for_no_daemon_is_not_running_before_it_is_invalid():
    async def scenario() -> None:
        supervisor = DaemonSupervisor(threads=1)
        with pytest.raises(DaemonNotRunning) as info:
            await supervisor.request_dict({"cmd": "launch"})
        assert info.value.detail["cmd"] == "launch"

    asyncio.run(scenario())


def test_start_ping_shutdown_on_a_plain_asyncio_loop():
    async def scenario() -> None:
        supervisor = DaemonSupervisor(threads=1, default_timeout=20 * UNIT)
        assert not supervisor.running and supervisor.pid is None
        with pytest.raises(DaemonNotRunning):
            await supervisor.request(PingRequest(id=0, cmd="ping"))
        async with supervisor:
            pid = supervisor.pid
            assert supervisor.running and pid is not None
            with pytest.raises(RuntimeError):
                await supervisor.start()
            assert await supervisor.request(ShutdownRequest(id=0, cmd="shutdown")) is None
            for _ in range(int(500 * UNIT)):
                if not supervisor.running:
                    break
                await asyncio.sleep(0.01)
            assert not supervisor.running
            with pytest.raises(DaemonNotRunning) as info:
                await supervisor.request(PingRequest(id=0, cmd="ping"))
            assert info.value.detail["returncode"] == 0  # a clean exit after the ack
        assert gone(pid)

    asyncio.run(scenario())


def test_a_daemon_that_cannot_start_is_reported():
    async def scenario() -> None:
        missing = DaemonSupervisor(python="/nonexistent/python3")
        with pytest.raises(DaemonCrashed, match="cannot start"):
            await missing.start()
        refused = DaemonSupervisor(threads=0, default_timeout=20 * UNIT)  # --threads 0: usage error
        with pytest.raises(DaemonCrashed) as info:
            await refused.start()
        assert info.value.detail["returncode"] == 2
        await refused.close()

    asyncio.run(scenario())
