"""A worker whose network is cut without a close — the coordinator on one end of a veth pair, the
worker in a network namespace on the other, the link taken down — is lost within the heartbeat
timeout and its job fails naming it; the agent notices the dead link on its own, and when the link
returns it reconnects by itself under the same id and is given work again. A cut well below the
timeout costs nothing.

Needs root (network namespaces): without it the test fails saying so, it is never skipped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import somatize as sz
from tests.integration.cluster import Cluster, cluster, wait_for
from tests.integration.netns import Netns, NetnsUnavailable
from tests.utils import UNIT, Sleepy

pytestmark = pytest.mark.integration

CLIENT, WORKER = "netcut-client-token-0123", "netcut-worker-token-3210"


@pytest.fixture
def netns() -> Iterator[Netns]:
    """This run's namespace and veth pair, removed afterwards whatever happened."""
    ns = Netns.numbered()
    try:
        ns.create()
    except NetnsUnavailable as exc:
        pytest.fail(f"this test cuts a link between network namespaces and cannot: {exc}")
    try:
        yield ns
    finally:
        ns.delete()


def _graph() -> sz.Graph:
    torch.manual_seed(0)
    return sz.Graph([sz.TorchFilter(torch.nn.Linear(3, 1), lr=0.1, epochs=2).named("lin")])


def _agent_gave_up(c: Cluster, worker_id: str) -> bool:
    return "answered no ping" in (c.logs / f"worker-{worker_id}.log").read_text()


def test_a_worker_cut_off_without_a_close_is_lost_in_time_and_comes_back_by_itself(tmp_path, netns):
    tokens = {"worker_token": WORKER, "client_token": CLIENT}
    with cluster(tmp_path, {}, host=netns.host_ip, **tokens) as c:
        c.start_worker("w1", prefix=netns.prefix)
        interval, timeout = c.heartbeat
        with c.client(timeout=10 * UNIT) as client:
            # A blip well below the timeout costs nothing: TCP retransmits, heartbeats resume.
            netns.cut()
            time.sleep(min(1.0, timeout / 3))
            restored = time.monotonic()
            netns.restore()
            wait_for(
                lambda: (
                    (c.worker("w1") or {}).get("last_heartbeat_age", 99)
                    < time.monotonic() - restored
                ),
                10 * UNIT,
                "a heartbeat after the blip",
            )
            record = c.worker("w1")
            assert record is not None
            assert record["state"] == "idle" and record["connections"] == 1

            job = client.submit(
                sz.Graph([Sleepy().named("sleepy")]), np.zeros((2, 2)), strategy=sz.Local("w1")
            )
            for event in job.events(timeout=30 * UNIT):  # the filter computes on w1
                if event.event == "progress" and event.data.get("phase") == "training":
                    break

            cut_at = time.monotonic()
            netns.cut()
            wait_for(lambda: c.worker_state("w1") == "lost", timeout + 10 * UNIT, "w1 lost")
            lost_after = time.monotonic() - cut_at
            with pytest.raises(sz.JobFailed) as failure:
                job.result(timeout=10 * UNIT)
            assert failure.value.code == "worker_lost"
            assert "'w1'" in failure.value.message and "no heartbeat" in failure.value.message
            # Silence counts from the last heartbeat (up to one interval before the cut), and the
            # reaper looks every interval.
            assert timeout - interval <= lost_after < timeout + interval + 2 * UNIT

            # The agent saw it too, with the link still down: no pong within the timeout.
            wait_for(lambda: _agent_gave_up(c, "w1"), 10 * UNIT, "the agent to give up the link")
            assert time.monotonic() - cut_at < timeout + interval + 3 * UNIT

            netns.restore()
            record = c.wait_connected("w1")
            assert record["connections"] == 2  # the same record, under the same id

            x = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
            y = x.sum(1, keepdims=True)
            graph = _graph()
            again = client.submit(graph, x, y, strategy=sz.Local("w1"))
            fitted = again.result(timeout=60 * UNIT)
            assert again.status()["workers"] == ["w1"]
        expected = graph.fit(x, y)
        torch.testing.assert_close(
            fitted.states["lin"]["weight"], expected.states["lin"]["weight"], rtol=0, atol=1e-6
        )
