"""One client cannot make another's job fail (issue 32's attack, row 1), nor can worker ids
(issue 53, Medium 5): clients that trickle in chunked uploads hold only what they sent, within
a share of which the clients' pool holds three (two cannot fill it for a third); the workers'
replies — a running job's states, chunked — have a pool of their own, which what workers send
unasked cannot take, each worker id within a share of that.

A real coordinator (``--max-reassembly-bytes``, ``--max-client-reassembly-bytes``) and worker;
the flooding clients and workers speak raw chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from typing import Any

import numpy as np
import pytest
import torch

import somatize as sz
from protocol.asyncio.channel import Channel
from protocol.chunking import CHUNK_MAGIC
from protocol.messages import (
    CHUNK_BYTES,
    Capabilities,
    ClientHello,
    Heartbeat,
    Status,
    WorkerHello,
)
from tests.integration.cluster import Cluster
from tests.utils import UNIT

pytestmark = pytest.mark.integration

POOL = 8 * CHUNK_BYTES
"""--max-reassembly-bytes: each side's pool."""
SHARE = 4 * CHUNK_BYTES
"""--max-client-reassembly-bytes: what one client may hold (and the largest message)."""
CAPS = Capabilities(cpus=1, memory_bytes=1 << 30, torch="x", python="3", cloudpickle="3")


async def _flood(url: str, path: str = "/client") -> list[Any]:
    """Two connections to ``path`` that each announce a message of a share and 64 bytes and
    send 4 MiB of it, then stall. Returns the open sockets (the caller closes them)."""
    import websockets

    held = []
    for connection in range(2):
        ws = await websockets.connect(f"{url}{path}", compression=None, max_size=1 << 24)
        channel = Channel(ws, f"flood {connection}")
        if path == "/client":
            await channel.send(ClientHello(name=f"flood{connection}"))
        else:
            await channel.send(WorkerHello(capabilities=CAPS))  # an id the coordinator gives
        async with asyncio.timeout(10 * UNIT):
            assert (await channel.receive()).kind == "welcome"
        for k in range(4):
            head = struct.pack("<8sQQQ", CHUNK_MAGIC, 7, k * CHUNK_BYTES, SHARE + 64)
            await ws.send(head + bytes(CHUNK_BYTES))
        if path == "/client":
            await channel.send(Status())  # behind its chunks: once answered, they are in
            async with asyncio.timeout(10 * UNIT):
                assert (await channel.receive()).kind == "result"
        else:  # alive, as a worker must be to stay registered
            beats = asyncio.ensure_future(_heartbeats(channel))
            ws.beats = beats  # kept with its socket, cancelled as it closes
            await asyncio.sleep(0.5)
        held.append(ws)
    return held


async def _heartbeats(channel: Channel) -> None:
    with contextlib.suppress(Exception):
        while True:
            await channel.send(Heartbeat(sent_at=time.time()))
            await asyncio.sleep(0.5)


def _start(cluster: Cluster) -> None:
    cluster.start_coordinator(
        [
            *("--max-message-bytes", str(SHARE + CHUNK_BYTES)),
            *("--max-reassembly-bytes", str(POOL)),
            *("--max-client-reassembly-bytes", str(SHARE + CHUNK_BYTES)),
            *("--stall-timeout", "600"),
        ]
    )
    cluster.start_worker("w0")
    cluster.wait_connected("w0")


def _long_job(client: sz.Client, epochs: int = 100) -> sz.Job:
    """A job whose states (2 MiB of weights) come back from its worker chunked."""
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 1024)
    net = sz.TorchFilter(model, loss="mse", epochs=epochs, batch_size=8, lr=1e-3)
    x = np.random.default_rng(0).normal(size=(64, 512)).astype(np.float32)
    y = np.zeros((64, 1024), np.float32)
    return client.submit(sz.Graph([net.named("net")]), x, y, strategy=sz.Local())


def test_two_clients_filling_their_shares_cannot_fail_a_third_or_a_running_job(tmp_path):
    cluster = Cluster(tmp_path / "state")
    try:
        _start(cluster)
        with sz.connect(cluster.url, timeout=30 * UNIT) as client:
            job = _long_job(client)
            # 4 MiB of rows for a tiny model: a chunked submission within one client's share.
            big = np.zeros((CHUNK_BYTES // 2, 1), np.float32)
            small = sz.Graph([sz.TorchFilter(torch.nn.Linear(1, 1), loss="mse", epochs=1)])

            async def flood_and_submit() -> None:
                held = await _flood(cluster.url)
                try:
                    # Two clients hold 8 MiB; the pool holds three shares: a third's chunked
                    # submission is taken, and the running job's replies are received alike.
                    third = await asyncio.to_thread(client.submit, small, big, big)
                    assert await asyncio.to_thread(third.result, 60 * UNIT)
                    fitted = await asyncio.to_thread(job.result, 120 * UNIT)
                    assert fitted.states["net"]["weight"].shape == (1024, 512)
                finally:
                    for ws in held:
                        await ws.close()

            asyncio.run(flood_and_submit())
    finally:
        cluster.close()


def test_worker_ids_sending_unasked_cannot_make_an_honest_workers_replies_busy(tmp_path):
    """Two new worker ids each start an unasked message and stall: the running job's chunked
    replies from an honest worker are charged to the replies' pool, and its job succeeds."""
    cluster = Cluster(tmp_path / "state")
    try:
        _start(cluster)
        with sz.connect(cluster.url, timeout=30 * UNIT) as client:
            job = _long_job(client, epochs=500)  # its states come back once the floods hold

            async def flood_and_wait() -> None:
                # 4 MiB each: together they held the workers' whole pool (8 MiB) before.
                held = await _flood(cluster.url, "/worker")
                try:
                    fitted = await asyncio.to_thread(job.result, 120 * UNIT)
                    assert fitted.states["net"]["weight"].shape == (1024, 512)
                    status = await asyncio.to_thread(client.status)
                    assert len(status["workers"]) == 3  # the floods stayed registered
                finally:
                    for ws in held:
                        ws.beats.cancel()
                        await ws.close()

            asyncio.run(flood_and_wait())
    finally:
        cluster.close()
