"""Agents sharing one fork server's imports (``--fork-server-share``): a sibling per agent."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.data.datasets import environment as dataset_environment
from protocol.filters import dump_filter
from tests.utils import UNIT
from tests.worker.daemon.supervised import Center, Collect, gone, wait_gone
from worker.daemon import fork_server
from worker.errors import DaemonError
from worker.supervision.forked import ForkServer
from worker.supervision.supervisor import DaemonSupervisor

pytestmark = pytest.mark.integration


def _parent_of(pid: int | None) -> int:
    assert pid is not None
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_agents_sharing_a_folder_fork_from_one_servers_siblings_which_outlive_it(tmp_path):
    """The first agent starts the server; a second with the same daemons' environment gets a
    sibling of it (the server's child: no torch imported again), whose daemons serve, write to
    the second agent's log, and go on when the first agent's server is killed. An agent whose
    daemons start otherwise starts a server of its own."""

    async def fit(supervisor: DaemonSupervisor) -> None:
        await supervisor.request_dict({"cmd": "load", "filters": {"c": dump_filter(Center())}})
        fit = await supervisor.request_dict({"cmd": "fit", "node_id": "c", "x": torch.ones(3, 2)})
        torch.testing.assert_close(fit["states"]["c"]["mean"], torch.ones(2))

    async def scenario() -> None:
        env = DaemonSupervisor().environment()
        first = ForkServer(sys.executable, env, tmp_path)
        second = ForkServer(sys.executable, env, tmp_path)
        other = ForkServer(sys.executable, {**env, "OMP_NUM_THREADS": "3"}, tmp_path)
        try:
            await asyncio.to_thread(first.start)
            await asyncio.to_thread(second.start)
            await asyncio.to_thread(other.start)
            assert _parent_of(first.pid) == os.getpid() == _parent_of(other.pid)
            assert _parent_of(second.pid) == first.pid  # forked: the imports shared
            assert len(list(tmp_path.glob("*.sock"))) == 2  # (and a lock beside each)
            assert os.readlink(f"/proc/{second.pid}/fd/2") == os.readlink("/proc/self/fd/2")
            supervisor = DaemonSupervisor(threads=1, default_timeout=20 * UNIT, fork_server=second)
            async with supervisor:
                assert _parent_of(supervisor.pid) == second.pid
                await fit(supervisor)
                assert first.pid is not None
                os.kill(first.pid, signal.SIGKILL)  # the first agent's server: a fault took it
                assert await asyncio.to_thread(wait_gone, first.pid, 10 * UNIT)
                await asyncio.sleep(1.0)  # (the sibling's look at its agent: every 0.5 s)
                assert second.alive and supervisor.running
                await fit(supervisor)
            later = DaemonSupervisor(threads=1, default_timeout=20 * UNIT, fork_server=second)
            async with later:  # the sibling still forks
                assert _parent_of(later.pid) == second.pid
                await fit(later)
            sibling = second.pid
            await asyncio.to_thread(second.close)
            assert await asyncio.to_thread(wait_gone, sibling, 10 * UNIT)
        finally:
            for server in (first, second, other):
                await asyncio.to_thread(server.close)
                await asyncio.to_thread(server.kill)  # a shared one would linger otherwise

    asyncio.run(scenario())


def test_agents_of_a_folder_starting_at_once_import_torch_once(tmp_path):
    """Two agents that share a folder start their fork servers at the same moment (a local
    cluster's workers): one starts the server, the other waits for its imports and takes a
    sibling of it, where both found no server listening yet and each imported torch."""

    async def scenario() -> None:
        env = DaemonSupervisor().environment()
        both = [ForkServer(sys.executable, env, tmp_path) for _ in range(2)]
        try:
            await asyncio.gather(*(asyncio.to_thread(forks.start) for forks in both))
            a, b = (forks.pid for forks in both)
            assert {_parent_of(a), _parent_of(b)} in ({os.getpid(), a}, {os.getpid(), b})
        finally:
            for forks in both:
                await asyncio.to_thread(forks.close)
                await asyncio.to_thread(forks.kill)  # a shared one would linger otherwise

    asyncio.run(scenario())


def test_a_forked_daemons_full_collection_leaves_the_servers_heap_shared():
    """The server freezes what its imports made (``gc.freeze``): a daemon's full collection
    walks only its own objects and copies none of the server's pages. Without it (measured
    on a fork of a warmed-up process), it walked ~306,000 objects and made ~80 MiB of the heap
    the fork's own.
    A daemon started anew, by contrast, tracks its imports' objects itself."""

    async def collected(supervisor: DaemonSupervisor) -> dict[str, int]:
        async with supervisor:
            await supervisor.request_dict({"cmd": "load", "filters": {"g": dump_filter(Collect())}})
            fit = await supervisor.request_dict({"cmd": "fit", "node_id": "g", "x": torch.ones(1)})
            return {k: int(v) for k, v in fit["states"]["g"].items()}

    async def scenario() -> tuple[dict[str, int], dict[str, int]]:
        server = ForkServer(sys.executable, DaemonSupervisor().environment())
        try:
            await asyncio.to_thread(server.start)
            forked = DaemonSupervisor(threads=1, default_timeout=20 * UNIT, fork_server=server)
            anew = DaemonSupervisor(threads=1, default_timeout=20 * UNIT)
            return await collected(forked), await collected(anew)
        finally:
            await asyncio.to_thread(server.close)

    forked, anew = asyncio.run(scenario())
    assert forked["frozen"] > 100_000 and anew["frozen"] == 0
    assert forked["tracked"] < anew["tracked"] / 4
    assert forked["private_kib"] < 32 * 1024, forked


def test_agents_with_datasets_of_their_own_share_a_server_and_each_daemon_reads_its_own(
    tmp_path,
):
    """A daemon reads its datasets' paths only once it runs: agents that differ in them alone
    share one server (no torch imported again for the second), and each forked daemon stages
    its own agent's datasets, not the other's."""
    share = tmp_path / "share"
    share.mkdir()
    paths = {}
    for name, rows in (("three", 3), ("five", 5)):
        paths[name] = tmp_path / f"{name}.npz"
        np.savez(paths[name], x=np.zeros((rows, 2), np.float32))

    async def rows_staged(supervisor: DaemonSupervisor, dataset: str) -> int:
        reply = await supervisor.request_dict({"cmd": "stage", "name": "t", "dataset": dataset})
        return int(reply["rows"])

    async def scenario() -> None:
        envs = {
            name: DaemonSupervisor(env=dataset_environment({name: path})).environment()
            for name, path in paths.items()
        }
        assert envs["three"] != envs["five"]
        first = ForkServer(sys.executable, envs["three"], share)
        second = ForkServer(sys.executable, envs["five"], share)
        try:
            await asyncio.to_thread(first.start)
            await asyncio.to_thread(second.start)
            assert _parent_of(second.pid) == first.pid  # a sibling: one server's imports
            assert len(list(share.glob("*.sock"))) == 1
            for name, forks, rows in (("three", first, 3), ("five", second, 5)):
                supervisor = DaemonSupervisor(
                    threads=1,
                    env=dataset_environment({name: paths[name]}),
                    default_timeout=20 * UNIT,
                    fork_server=forks,
                )
                async with supervisor:
                    assert _parent_of(supervisor.pid) == forks.pid  # forked, not started anew
                    assert await rows_staged(supervisor, name) == rows
                    other = "five" if name == "three" else "three"
                    with pytest.raises(DaemonError, match=f"has no dataset {other!r}"):
                        await rows_staged(supervisor, other)
            # A daemon whose environment differs in more than its datasets is not forked.
            with pytest.raises(OSError, match="not the fork server's"):
                first.fork(1, {**envs["three"], "OMP_NUM_THREADS": "3"})
        finally:
            for forks in (first, second):
                await asyncio.to_thread(forks.close)
                await asyncio.to_thread(forks.kill)

    asyncio.run(scenario())


def test_a_shared_server_outlives_its_agent_for_the_next_and_ends_with_its_folder(tmp_path):
    """The agent that started a shared server closes it, as an agent stopping does: the server
    stays, and an agent that comes later forks from a sibling of it, no torch imported again.
    Removing the folder ends it (a local cluster's close; the tests' process exiting)."""

    async def scenario() -> None:
        share = tmp_path / "share"
        share.mkdir()
        env = DaemonSupervisor().environment()
        first = ForkServer(sys.executable, env, share)
        later = ForkServer(sys.executable, env, share)
        try:
            await asyncio.to_thread(first.start)
            server = first.pid
            assert server is not None
            await asyncio.to_thread(first.close)
            await asyncio.sleep(1.0)  # (the server's look at its agent: every 0.5 s)
            assert not gone(server)
            await asyncio.to_thread(later.start)
            assert _parent_of(later.pid) == server  # a sibling of the server left running
            supervisor = DaemonSupervisor(threads=1, default_timeout=20 * UNIT, fork_server=later)
            async with supervisor:
                assert _parent_of(supervisor.pid) == later.pid
                await supervisor.request_dict({"cmd": "load", "filters": {}})
            await asyncio.to_thread(later.close)
            shutil.rmtree(share)
            assert await asyncio.to_thread(wait_gone, server, 10 * UNIT)
        finally:
            for forks in (first, later):
                await asyncio.to_thread(forks.kill)

    asyncio.run(scenario())


@pytest.mark.parametrize("told", [None, 600.0])
def test_a_shared_server_with_nobody_to_serve_waits_a_linger_then_is_not_wanted(
    tmp_path, monkeypatch, told
):
    """Its agent gone and no sibling of it running, a shared server listens on for
    :data:`~worker.daemon.fork_server.LINGER_SECONDS`, or the linger it was told, counted from
    when it last served someone; another server's socket at its place ends it at once."""
    now = [1000.0]
    monkeypatch.setattr(fork_server.time, "monotonic", lambda: now[0])
    path = str(tmp_path / "forks.sock")
    shared = (
        fork_server._Shared.listen(path) if told is None else fork_server._Shared.listen(path, told)
    )
    linger = fork_server.LINGER_SECONDS if told is None else told
    assert shared is not None
    try:
        assert shared.wanted(serving=False)
        now[0] += linger - 1
        assert shared.wanted(serving=False)
        assert shared.wanted(serving=True)  # a sibling came: the wait starts again after it
        now[0] += linger - 1
        assert shared.wanted(serving=False)
        now[0] += linger
        assert not shared.wanted(serving=False)
        now[0] = 0.0
        assert shared.wanted(serving=True)
        os.unlink(path)
        assert not shared.wanted(serving=True)  # its folder removed
    finally:
        shared.listener.close()


def test_a_share_whose_socket_path_is_too_long_leaves_the_server_unshared(tmp_path, capsys):
    """A Unix socket's address holds ~108 bytes: a deeper share folder gets no shared server
    (said on its log), rather than a server that dies before its agent's first fork."""
    path = str(tmp_path / ("d" * 120) / "forks.sock")
    assert fork_server._Shared.listen(path) is None
    assert f"fork server: not shared at {path}: AF_UNIX path too long" in capsys.readouterr().err
