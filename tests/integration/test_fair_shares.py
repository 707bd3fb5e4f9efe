"""One client cannot make another's job fail (issue 32's attack, row 1): a client that fills
the clients' reassembly pool with chunked uploads it trickles in holds only what it sent, and
the workers' replies — a running job's states, chunked — have a pool of their own.

A real coordinator (``--max-reassembly-bytes``, ``--max-client-reassembly-bytes``) and worker;
the flooding client speaks raw chunks.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import numpy as np
import pytest
import torch

import somatize as sz
from protocol.asyncio.channel import Channel
from protocol.chunking import CHUNK_MAGIC
from protocol.messages import CHUNK_BYTES, ClientHello, Status
from tests.integration.cluster import Cluster
from tests.utils import UNIT

pytestmark = pytest.mark.integration

POOL = 8 * CHUNK_BYTES
"""--max-reassembly-bytes: each side's pool."""
SHARE = 4 * CHUNK_BYTES
"""--max-client-reassembly-bytes: what one client may hold (and the largest message)."""


async def _flood(url: str) -> list[Any]:
    """Two connections that each announce a 4 MiB message and send all of it but its last
    chunk, then stall: 8 MiB received, the clients' whole pool. Returns the open sockets (the
    caller closes them)."""
    import websockets

    held = []
    for connection in range(2):
        ws = await websockets.connect(f"{url}/client", compression=None, max_size=1 << 24)
        channel = Channel(ws, f"flood {connection}")
        await channel.send(ClientHello(name=f"flood{connection}"))
        async with asyncio.timeout(10 * UNIT):
            assert (await channel.receive()).kind == "welcome"
        for k in range(4):
            head = struct.pack("<8sQQQ", CHUNK_MAGIC, 7, k * CHUNK_BYTES, SHARE + 64)
            await ws.send(head + bytes(CHUNK_BYTES))
        await channel.send(Status())  # behind its chunks: once answered, they are in
        async with asyncio.timeout(10 * UNIT):
            assert (await channel.receive()).kind == "result"
        held.append(ws)
    return held


def test_a_client_filling_the_clients_pool_cannot_fail_another_clients_running_job(tmp_path):
    cluster = Cluster(tmp_path / "state")
    try:
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
        with sz.connect(cluster.url, timeout=30 * UNIT) as client:
            # A model of 2 MiB of weights: its states come back from the worker chunked.
            torch.manual_seed(0)
            model = torch.nn.Linear(512, 1024)
            net = sz.TorchFilter(model, loss="mse", epochs=100, batch_size=8, lr=1e-3)
            x = np.random.default_rng(0).normal(size=(64, 512)).astype(np.float32)
            y = np.zeros((64, 1024), np.float32)
            job = client.submit(sz.Graph([net.named("net")]), x, y, strategy=sz.Local())
            # 4 MiB of rows for a tiny model: a chunked submission within one client's share.
            big = np.zeros((CHUNK_BYTES // 2, 1), np.float32)
            small = sz.Graph([sz.TorchFilter(torch.nn.Linear(1, 1), loss="mse", epochs=1)])

            async def flood_and_submit() -> None:
                held = await _flood(cluster.url)
                try:
                    # The clients' pool is full: a chunked submission now is busy, said so.
                    with pytest.raises(sz.ClientError, match="all clients' connections") as busy:
                        await asyncio.to_thread(client.submit, small, big, big)
                    assert busy.value.code == "busy"
                    # The running job's chunked replies from its worker are received alike.
                    fitted = await asyncio.to_thread(job.result, 120 * UNIT)
                    assert fitted.states["net"]["weight"].shape == (1024, 512)
                finally:
                    for ws in held:
                        await ws.close()

            asyncio.run(flood_and_submit())
            # Their connections gone, what they held is free: the same submission is taken.
            assert client.submit(small, big, big, strategy=sz.Local()).result(60 * UNIT)
    finally:
        cluster.close()
