"""The coordinator with real agents and daemons: lost workers, bad input, versions, restarts."""

from __future__ import annotations

import asyncio
import signal
import time

import numpy as np
import pytest
import torch
import websockets

import somatize as sz
from protocol.asyncio.channel import Channel
from protocol.codec import encode_frame
from protocol.errors import ErrorCode
from protocol.messages import ClientHello, Status
from tests.integration.cluster import cluster, wait_for
from tests.utils import UNIT, Center, Sleepy

pytestmark = pytest.mark.integration


def _quick_graph() -> sz.Graph:
    torch.manual_seed(0)
    return Center().named("center") >> sz.TorchFilter(
        torch.nn.Linear(3, 1), lr=0.1, epochs=2
    ).named("lin")


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype(np.float32)
    return x, x.sum(1, keepdims=True)


def test_a_worker_killed_mid_job_fails_the_job_naming_it_and_nothing_else(tmp_path):
    with cluster(tmp_path, {"w1": (), "w2": ()}) as c, sz.connect(c.url) as client:
        job = client.submit(
            sz.Graph([Sleepy().named("sleepy")]), np.zeros((4, 2)), strategy=sz.Local(worker="w1")
        )
        for event in job.events(timeout=30 * UNIT):
            if event.event == "progress" and event.data.get("phase") == "training":
                break
        killed_at = time.monotonic()
        c.send_signal(c.workers["w1"], signal.SIGKILL)
        with pytest.raises(sz.JobFailed) as failure:
            job.result(timeout=30 * UNIT)
        took = time.monotonic() - killed_at
        assert failure.value.code == "worker_lost"
        assert "'w1'" in failure.value.message
        assert took < c.heartbeat[1] + 5 * UNIT
        # The coordinator and the other worker are unaffected.
        x, y = _data()
        graph = _quick_graph()
        fitted = client.submit(graph, x, y, strategy=sz.Local()).result(timeout=60 * UNIT)
        expected = graph.fit(x, y)
        torch.testing.assert_close(
            fitted.states["lin"]["weight"], expected.states["lin"]["weight"], rtol=0, atol=1e-6
        )
        workers = {w["id"]: w for w in client.status()["workers"]}
        assert workers["w1"]["state"] == "lost"
        assert workers["w2"]["state"] == "idle"


def _raw_client(url: str):
    """A client speaking the wire by hand, to send what the SDK never would."""

    async def connect():
        ws = await websockets.connect(f"{url}/client", compression=None, max_size=1 << 24)
        return ws

    return connect()


def test_malformed_messages_and_unknown_kinds_get_errors_and_the_connection_stays(tmp_path):
    async def main(url):
        ws = await _raw_client(url)
        try:
            await exchange(ws)
        finally:
            await ws.close()

    async def exchange(ws):
        channel = Channel(ws, "raw client")
        await channel.send(ClientHello(name="fuzzy"))
        welcome = await channel.receive()
        assert welcome.kind == "welcome"
        for payload, code, text in [
            (b"\xff\xff\xff\x7fnot a frame", ErrorCode.BAD_FRAME, "frame"),
            (
                encode_frame({"v": 1, "kind": "fire_the_workers", "id": 9}),
                ErrorCode.BAD_REQUEST,
                "unknown message kind",
            ),
            (
                encode_frame({"v": 1, "kind": "get_result", "id": 10}),
                ErrorCode.BAD_REQUEST,
                "job_id",
            ),
            (
                encode_frame(
                    {
                        "kind": "welcome",
                        "id": 11,
                        "heartbeat_interval": 1.0,
                        "heartbeat_timeout": 2.0,
                        "server": "me",
                    }
                ),
                ErrorCode.BAD_REQUEST,
                "takes no 'welcome' from a client",
            ),
        ]:
            await ws.send(payload)
            reply = await asyncio.wait_for(channel.receive(), 10 * UNIT)
            assert reply.kind == "error", reply
            assert reply.error.code == code
            assert text in reply.error.message
        # Still the same, working connection.
        await channel.send(Status(id=12))
        status = await asyncio.wait_for(channel.receive(), 10 * UNIT)
        assert status.kind == "result" and status.reply_to == 12

    with cluster(tmp_path, {}) as c:
        asyncio.run(main(c.url))
        assert c.healthy()


def test_a_hello_of_another_protocol_version_is_refused_naming_both(tmp_path):
    async def main(url):
        ws = await _raw_client(url)
        try:
            await exchange(ws)
        finally:
            await ws.close()

    async def exchange(ws):
        await ws.send(
            encode_frame({"v": 99, "kind": "client_hello", "id": 1, "from_the": "future"})
        )
        channel = Channel(ws, "old client")
        reply = await asyncio.wait_for(channel.receive(), 10 * UNIT)
        assert reply.kind == "error"
        assert reply.error.code == ErrorCode.VERSION_MISMATCH
        assert "99" in reply.error.message and "1" in reply.error.message
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10 * UNIT)

    with cluster(tmp_path, {}) as c:
        asyncio.run(main(c.url))


def test_a_restarted_coordinator_keeps_finished_results_and_workers_come_back(tmp_path):
    x, y = _data()
    graph = _quick_graph()
    with cluster(tmp_path, {"w1": ("cpu",)}) as c:
        with sz.connect(c.url) as client:
            job = client.submit(graph, x, y)
            before = job.result(timeout=60 * UNIT).states
            running = client.submit(sz.Graph([Sleepy().named("sleepy")]), np.zeros((2, 2)))
            wait_for(
                lambda: running.status()["state"] == "running", 30 * UNIT, "the second job to run"
            )
        assert c.stop_coordinator(signal.SIGKILL) != 0  # no chance to clean up
        c.start_coordinator()
        with sz.connect(c.url) as client:
            after = client.job(job.id).states(timeout=10 * UNIT)
            for key, value in before["lin"].items():
                assert torch.equal(after["lin"][key], value)
            # The job it was running is queued again (a Local job has no checkpoint: from the
            # start); cancelled here, it ends in its events like any other.
            again = client.job(running.id)
            assert again.status()["state"] in ("queued", "running")
            requeued = next(
                e
                for e in again.events(timeout=10 * UNIT)
                if e.event == "queued" and "requeued" in e.data
            )
            assert requeued.data["requeued"] == "the coordinator restarted"
            again.cancel()
            wait_for(lambda: again.status()["state"] == "cancelled", 30 * UNIT, "the cancel")
        c.wait_connected("w1")  # the agent reconnected by itself, under its id
        with sz.connect(c.url) as client:
            again = client.submit(graph, x, y).result(timeout=60 * UNIT)
        torch.testing.assert_close(
            again.states["lin"]["weight"], before["lin"]["weight"], rtol=0, atol=0
        )


def test_sigterm_drains_the_coordinator_failing_the_running_job_with_the_reason(tmp_path):
    with cluster(tmp_path, {"w1": ()}) as c:
        with sz.connect(c.url) as client:
            job = client.submit(sz.Graph([Sleepy().named("sleepy")]), np.zeros((2, 2)))
            wait_for(lambda: job.status()["state"] == "running", 30 * UNIT, "the job to run")
        started = time.monotonic()
        assert c.stop_coordinator(signal.SIGTERM) == 0
        assert time.monotonic() - started < 20 * UNIT  # the grace (2 s) plus closing, not forever
        c.start_coordinator()
        with sz.connect(c.url) as client:
            record = client.job(job.id).status()
        assert record["state"] == "failed"
        assert record["error"]["code"] == "shutting_down"
        assert "shut down" in record["error"]["message"]


def test_a_large_input_travels_in_chunks_while_heartbeats_keep_the_worker_alive(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1 << 20, 16)).astype(np.float32)  # 64 MiB: 64 chunks each way
    y = x[:, :1] * 2.0
    graph = sz.Graph(
        [sz.TorchFilter(torch.nn.Linear(16, 1), lr=0.01, batch_size=None, epochs=1).named("lin")]
    )
    with (
        cluster(tmp_path, {"w1": ()}, heartbeat_interval=0.2, heartbeat_timeout=1.5) as c,
        sz.connect(c.url) as client,
    ):
        fitted = client.submit(graph, x, y).result(timeout=120 * UNIT)
        expected = graph.fit(x, y)
        torch.testing.assert_close(
            fitted.states["lin"]["weight"], expected.states["lin"]["weight"], rtol=0, atol=1e-6
        )
        workers = {w["id"]: w for w in client.status()["workers"]}
        assert workers["w1"]["state"] == "idle"  # never declared lost while 64 MiB moved


def test_a_silent_worker_is_lost_after_the_heartbeat_timeout_and_comes_back_under_its_id(
    tmp_path,
):
    with cluster(tmp_path, {"w1": ()}) as c, sz.connect(c.url) as client:
        job = client.submit(sz.Graph([Sleepy().named("sleepy")]), np.zeros((2, 2)))
        wait_for(lambda: job.status()["state"] == "running", 30 * UNIT, "the job to run")
        frozen_at = time.monotonic()
        c.send_signal(c.workers["w1"], signal.SIGSTOP)  # alive, connected, and silent
        try:
            with pytest.raises(sz.JobFailed) as failure:
                job.result(timeout=30 * UNIT)
            took = time.monotonic() - frozen_at
        finally:
            c.send_signal(c.workers["w1"], signal.SIGCONT)
        assert failure.value.code == "worker_lost"
        assert "no heartbeat" in failure.value.message
        interval, timeout = c.heartbeat
        # Silence counts from the last heartbeat, up to one interval before the freeze.
        assert timeout - interval <= took < timeout + 5 * UNIT
        # Thawed, the agent finds its connection closed and dials again, under the same id.
        wait_for(
            lambda: (c.worker("w1") or {}).get("connections") == 2,
            30 * UNIT,
            "w1 to reconnect",
        )
        record = c.wait_connected("w1")
        assert record["state"] == "idle" and record["reason"] == ""
        x = _data()[0]
        again = client.submit(
            sz.Graph([Center().named("center")]), x, strategy=sz.Local("w1")
        ).result(timeout=60 * UNIT)
        np.testing.assert_allclose(again.states["center"]["mean"], x.mean(0), rtol=1e-6)
