"""The ``somatize-worker`` console script against a coordinator stand-in: one signal stops it
cleanly, a second forces it out, and no daemon is left behind either way."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from somatize.cli.cluster import wait_for
from tests.utils import UNIT, Center, agent_daemons, cmdline, is_fork_server
from tests.worker.daemon.supervised import wait_gone
from tests.worker.standin import (
    StandIn,
    drive,
    gone,
    listening,
    no_process_left,
    open_job,
)
from worker.supervision.pool import SANDBOXED_SPARES

pytestmark = pytest.mark.integration

__all__ = ["no_process_left"]  # the autouse fixture: no daemon is left behind

# -- the console script -------------------------------------------------------------------------


def test_somatize_worker_registers_and_a_sigterm_stops_it_with_no_daemon_left(tmp_path):
    script = Path(sys.executable).parent / "somatize-worker"
    token_file = tmp_path / "token"
    token_file.write_text("t0ken\n")
    token_file.chmod(0o600)
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
                daemons = agent_daemons(proc.pid)
                # The job's, and the spares started for the next jobs (sandboxed: two).
                assert len(daemons) == 1 + SANDBOXED_SPARES

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


def test_with_spare_daemon_off_a_job_starts_its_own_daemon_and_none_waits_for_the_next():
    stand_in = StandIn()

    async def main() -> None:
        async with (
            listening(stand_in) as url,
            _quiet_worker(url, "--id", "lean", "--spare-daemon", "off") as proc,
        ):
            channel = await stand_in.next_channel()
            assert agent_daemons(proc.pid) == set()  # nothing started before a job asks
            await open_job(channel, "j", center=Center())
            assert len(agent_daemons(proc.pid)) == 1  # the job's own: no spare after it
            await _terminate(proc)

    drive(main)


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
                daemons.extend(agent_daemons(proc.pid))  # the job's daemon and the spare
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


def test_a_fork_server_linger_is_how_long_the_workers_shared_server_waits_for_the_next(
    tmp_path,
):
    """``--fork-server-linger``: the shared fork server a worker starts in its
    ``--fork-server-share`` waits that long, once the worker is gone, for the next worker (here
    a second, not the default minute), then ends, its folder still there."""
    share = tmp_path / "share"
    share.mkdir()
    stand_in = StandIn()
    servers: list[int] = []
    told: list[bytes] = []
    signalled: list[float] = []

    async def main() -> None:
        share_for = ("--fork-server-share", str(share), "--fork-server-linger", "1")
        async with (
            listening(stand_in) as url,
            _quiet_worker(url, "--id", "lingers", "--sandbox", "none", *share_for) as proc,
        ):
            await stand_in.next_channel()
            found = await asyncio.to_thread(
                wait_for, lambda: _servers_sharing(share), 30 * UNIT, "its fork server"
            )
            servers.extend(found)
            told.append(cmdline(found[0]))  # read now: it ends a second after the worker
            signalled.append(time.monotonic())  # its wait starts once the worker is gone
            await _terminate(proc)

    drive(main)
    (server,) = servers
    assert told[0].endswith(b"\0--linger\0" + b"1.0\0"), told
    assert wait_gone(server, 10 * UNIT)
    assert time.monotonic() - signalled[0] >= 1.0  # it waited its linger, not less
    assert share.is_dir()


@contextlib.asynccontextmanager
async def _quiet_worker(url: str, *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """``somatize-worker --connect URL --threads 1 ARGS``, its output discarded; killed on the
    way out if it still runs."""
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "somatize-worker"),
        *("--connect", url, "--threads", "1", *args),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _terminate(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM: the worker stops, cleanly."""
    proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(20 * UNIT):
        assert await proc.wait() == 0


def _servers_sharing(share: Path) -> list[int]:
    """The fork servers listening in ``share``."""
    pids = (int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit())
    return [pid for pid in pids if is_fork_server(pid) and f"{share}/".encode() in cmdline(pid)]


def test_a_shard_that_disagrees_with_the_others_stops_the_worker_at_start_naming_it(tmp_path):
    import numpy as np

    for name, dtype in (("s0", np.float32), ("s1", np.float64)):
        (tmp_path / "data" / name).mkdir(parents=True)
        np.save(tmp_path / "data" / name / "x.npy", np.zeros((3, 2), dtype))
    worker = Path(sys.executable).parent / "somatize-worker"
    argv = [str(worker), "--connect", "ws://127.0.0.1:9", "--data", f"d={tmp_path / 'data'}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60 * UNIT)
    assert done.returncode == 2
    assert "shard s1 holds float64 rows of shape (2,)" in done.stderr


def test_spare_daemon_auto_keeps_none_on_a_small_machine(caplog):
    """``--spare-daemon auto`` (the default): a spare on a machine of 4 GiB or more, or whose
    memory is unknown; none under it, which the log says; on and off as asked."""
    from worker.cli import _spare

    gib = 1 << 30
    assert _spare("auto", 24 * gib) and _spare("auto", 4 * gib) and _spare("auto", 0)
    with caplog.at_level("INFO", logger="worker.cli"):
        assert not _spare("auto", 2 * gib)
    assert "no spare filter daemon: this machine has 2.0 GiB (under 4 GiB)" in caplog.text
    assert _spare("on", 2 * gib) and not _spare("off", 24 * gib)
