"""Issue 14, rows 1–3 on a live cluster: forged peer links and relays against a running
ModelParallel job, which still succeeds with the weights ``graph.fit`` gives.

A real coordinator and two real workers on loopback. While the job trains, an outsider dials
the receiving stage's ``/peer`` with hellos naming the job (no secret, guessed ones) and a
worker holding the worker token — but on no job — asks the coordinator to relay forged
gradients to it. Every attempt is refused with a typed error, the refusals are quick, and the
job's result is the reference's to 1e-5, every weight finite.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
import uvloop
import websockets

import somatize as sz
from protocol.asyncio.channel import Channel
from protocol.asyncio.handshake import send_hello
from protocol.codec import encode_frame
from protocol.errors import ErrorCode, RemoteError
from protocol.messages import Deliver, PeerHello, Welcome, WorkerHello
from tests.coordinator.strategies.model_parallel.test_model_parallel import (
    dataset,
    graph,
    reference,
)
from tests.integration.cluster import cluster, wait_for
from tests.utils import UNIT
from worker.capabilities import Capabilities

pytestmark = pytest.mark.integration

EPOCHS = 40
"""Long enough (~160 steps) for the attacks to land while the job trains."""
PARTITIONS = [sz.Partition(["center", "a"], worker="w0"), sz.Partition(["b", "c"], worker="w1")]
_CAPS = Capabilities(cpus=1, memory_bytes=1 << 30, torch="x", python="3", cloudpickle="3")


class Attacker(threading.Thread):
    """Runs ``attack(job_id)`` on its own uvloop loop until stopped; records each refusal's
    code and how long it took."""

    def __init__(self, attack: Any, job_id: str) -> None:
        super().__init__(daemon=True)
        self.attack, self.job_id = attack, job_id
        self.stop = threading.Event()
        self.refusals: list[tuple[str, float]] = []
        self.accepted: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(self.attack(self))
        except BaseException as exc:  # reported by the test
            self.error = exc


def _forged_gradients() -> bytes:
    return encode_frame(torch.full((16, 8), float("nan")))


def _attacked_pipeline(
    client: Any, x: np.ndarray, y: np.ndarray, attack: Any
) -> tuple[Any, Attacker]:
    """A ModelParallel job over websocket links, and ``attack`` run against it until 20 of
    its attempts were refused, while it trains; none may have got through."""
    strategy = sz.ModelParallel(PARTITIONS, 2, transport="websocket")
    job = client.submit(graph(epochs=EPOCHS), x, y, strategy=strategy)
    wait_for(lambda: (job.status()["progress"] or {}).get("step", 0) >= 1, 60 * UNIT, "a step")
    attacker = Attacker(attack, job.id)
    attacker.start()
    try:
        wait_for(lambda: len(attacker.refusals) >= 20 or attacker.error, 60 * UNIT, "attacks")
    finally:
        attacker.stop.set()
        attacker.join(30 * UNIT)
    assert attacker.error is None, attacker.error
    assert job.status()["state"] == "running", "the attacks landed while the job trained"
    assert attacker.accepted == []
    return job, attacker


def _check_result(job: sz.Job, x: np.ndarray, y: np.ndarray) -> None:
    fitted = job.result(timeout=180 * UNIT)
    expected = reference(x, y, epochs=EPOCHS)
    for node in "abc":
        for key, value in expected[node].items():
            got = torch.as_tensor(fitted.states[node][key])
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, value, rtol=0, atol=1e-5)


def test_forged_peer_hellos_are_refused_while_a_pipeline_trains_exactly(tmp_path):
    x, y = dataset()
    with (
        cluster(tmp_path, {"w0": (), "w1": ()}, peer_links=True) as c,
        sz.connect(c.url) as client,
    ):
        target = c.peer_addresses["w1"]

        async def attack(me: Attacker) -> None:
            while not me.stop.is_set():
                started = time.monotonic()
                guess = secrets.token_urlsafe(32) if len(me.refusals) % 2 else ""
                async with websockets.connect(f"{target}/peer", open_timeout=10 * UNIT) as ws:
                    channel = Channel(ws, "outsider")
                    reader = asyncio.ensure_future(channel.run())
                    hello = PeerHello(worker_id="w0", job_id=me.job_id, secret=guess)
                    try:
                        await channel.request(hello, 10 * UNIT)
                        me.accepted.append("hello")
                        forged = Deliver(
                            job_id=me.job_id, to="w1", key="grad/1/0", payload=_forged_gradients()
                        )
                        await channel.request(forged, 10 * UNIT)
                        me.accepted.append("deliver")
                    except RemoteError as exc:
                        me.refusals.append((exc.code, time.monotonic() - started))
                    await asyncio.wait_for(reader, 10 * UNIT)  # the agent closes the link
                await asyncio.sleep(0.02)

        job, attacker = _attacked_pipeline(client, x, y, attack)
        assert {code for code, _ in attacker.refusals} == {ErrorCode.UNAUTHORIZED}
        assert max(seconds for _, seconds in attacker.refusals) < 5 * UNIT
        linked = [e for e in job.events() if e.data.get("phase") == "linked"]
        assert linked and linked[0].data["direct"], "the stages link directly"
        _check_result(job, x, y)
        assert c.healthy()


def test_a_worker_on_no_job_cannot_have_the_coordinator_relay_to_the_jobs_workers(tmp_path):
    x, y = dataset()
    token, client_token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    tokens = {"worker_token": token, "client_token": client_token}
    with (
        cluster(tmp_path, {"w0": (), "w1": ()}, **tokens) as c,
        c.client() as client,
    ):

        async def attack(me: Attacker) -> None:
            headers = {"Authorization": f"Bearer {token}"}
            async with websockets.connect(f"{c.url}/worker", additional_headers=headers) as ws:
                channel = Channel(ws, "rogue worker")
                hello = WorkerHello(id=channel.next_id(), worker_id="rogue", capabilities=_CAPS)
                await send_hello(channel, hello, Welcome, 10 * UNIT, first=True)
                reader = asyncio.ensure_future(channel.run())
                while not me.stop.is_set():
                    started = time.monotonic()
                    for to in ("w1", "w0"):
                        forged = Deliver(
                            job_id=me.job_id, to=to, key="grad/1/0", payload=_forged_gradients()
                        )
                        try:
                            await channel.request(forged, 10 * UNIT)
                            me.accepted.append(to)
                        except RemoteError as exc:
                            assert "is not on job" in exc.info.message
                            assert me.job_id in exc.info.message
                            me.refusals.append((exc.code, time.monotonic() - started))
                    await asyncio.sleep(0.02)
                reader.cancel()

        job, attacker = _attacked_pipeline(client, x, y, attack)
        assert {code for code, _ in attacker.refusals} == {ErrorCode.BAD_REQUEST}
        linked = [e for e in job.events() if e.data.get("phase") == "linked"]
        assert linked and linked[0].data["relay"], "without peer links the coordinator relays"
        _check_result(job, x, y)
        assert c.healthy()
