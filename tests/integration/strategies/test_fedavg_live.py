"""FedAvg on live workers that train on their own data (``somatize-worker --data local=PATH``):
the same answer as independent local trainings averaged by hand, and a worker killed mid-job
dropped while the others finish."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import somatize as sz
from tests.coordinator.strategies.federated.test_fedavg import (
    SIZES,
    D,
    assert_model,
    center_of,
    graph,
    local_training,
    model,
    reference_rounds,
    shards,
)
from tests.coordinator.strategies.federated.test_privacy import flat, private_graph, update
from tests.integration.cluster import Cluster, cluster, wait_for
from tests.utils import UNIT

pytestmark = pytest.mark.integration

IDS = ("w1", "w2", "w3")


class Pause(sz.Filter):
    """Takes its time fitting, so that a worker can be killed while a job runs."""

    def fit(self, x, y=None):
        time.sleep(0.5)
        return {}

    def forward(self, x, state):
        return x


KINDS = {"w1": "npz", "w2": "npy", "w3": "shards"}
"""The kind of path each worker serves its ``local`` dataset from (issue 15)."""


def write_datasets(directory: Path) -> tuple[list, dict[str, dict[str, Path]]]:
    """Each worker's ``local`` dataset (30, 50 and 80 rows), each of another kind: w1's an
    ``.npz`` file, w2's a directory of ``x.npy``/``y.npy`` (memory-mapped), w3's a directory of
    three shards (an ``.npz`` and two ``.npy`` directories, read in name order)."""
    data = shards()
    (x1, y1), (x2, y2), (x3, y3) = data
    np.savez(directory / "w1.npz", x=x1, y=y1)
    _npy_dir(directory / "w2", x2, y2)
    bounds = [0, 25, 60, len(x3)]
    (directory / "w3").mkdir()
    np.savez(directory / "w3" / "a.npz", x=x3[:25], y=y3[:25])
    for name, lo, hi in (("b", bounds[1], bounds[2]), ("c", bounds[2], bounds[3])):
        _npy_dir(directory / "w3" / name, x3[lo:hi], y3[lo:hi])
    paths = {w: {"local": directory / (f"{w}.npz" if w == "w1" else w)} for w in IDS}
    return data, paths


def _npy_dir(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    path.mkdir()
    np.save(path / "x.npy", x)
    np.save(path / "y.npy", y)


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[tuple[Cluster, list]]:
    """One cluster for the module (its start is most of the time): the tests below run in file
    order, and the last one kills w2."""
    directory = tmp_path_factory.mktemp("fedavg")
    data, paths = write_datasets(directory)
    with cluster(directory, {w: () for w in IDS}, data=paths) as c:
        yield c, data


def rounds_of(job: sz.Job) -> list[dict]:
    return [e.data for e in job.events(timeout=30 * UNIT) if e.data.get("phase") == "round"]


def test_live_fedavg_on_worker_data_equals_the_hand_averaged_local_trainings(live):
    c, data = live
    expected = reference_rounds(data, 3, epochs=2)
    with sz.connect(c.url) as client:
        strategy = sz.FedAvg(rounds=3, local_epochs=2)
        job = client.submit(graph(), sz.WorkerData("local"), strategy=strategy)
        fitted = job.result(timeout=120 * UNIT)
        assert_model(fitted.states, expected[-1][0])
        np.testing.assert_allclose(
            fitted.states["center"]["mean"], center_of(data, [0, 1, 2]), rtol=1e-6
        )
        # Round after round: each round's loss is that of local trainings from the hand-computed
        # model of the round before.
        events = rounds_of(job)
        assert [e["round"] for e in events] == [1, 2, 3]
        for event, (_, loss, _) in zip(events, expected, strict=True):
            assert sorted(event["workers"]) == list(IDS) and event["dropped"] == {}
            assert event["rows"] == sum(SIZES)
            assert event["loss"] == pytest.approx(loss, abs=1e-6)
        assert sorted(job.status()["workers"]) == list(IDS)  # workers=None: every idle one
        # Each worker announced what its dataset holds, never its content.
        for w in client.status()["workers"]:
            local = w["datasets"]["local"]
            rows = SIZES[IDS.index(w["id"])]
            assert (local["kind"], local["rows"]) == (KINDS[w["id"]], rows)
            assert local["x"]["shape"][0] == local["y"]["shape"][0] == rows
            assert local["shards"] == (3 if w["id"] == "w3" else 1)


def test_live_fedavg_with_many_clients_per_worker_and_a_robust_rule(live):
    """Issue 19: each live worker trains 4 clients in turn, each on its own partition of the
    worker's dataset, and the coordinate-wise median of the 12 client models is the new
    model: the median of 12 independent local trainings, one per partition."""
    c, data = live
    parts = [
        (px, py)
        for x, y in data
        for px, py in zip(np.array_split(x, 4), np.array_split(y, 4), strict=True)
    ]
    trained = [local_training(model().state_dict(), px, py, epochs=1)[0] for px, py in parts]
    with sz.connect(c.url) as client:
        for worker_id in IDS:
            wait_for(lambda w=worker_id: c.worker_state(w) == "idle", 15 * UNIT, f"{worker_id}")
        strategy = sz.FedAvg(
            rounds=1, min_workers=3, clients_per_worker=4, aggregator=sz.FedMedian()
        )
        job = client.submit(graph(), sz.WorkerData("local"), strategy=strategy)
        fitted = job.result(timeout=120 * UNIT)
        (event,) = rounds_of(job)
    assert sorted(event["workers"]) == sorted(f"{w}/{j}" for w in IDS for j in range(4))
    assert event["rows"] == sum(SIZES)
    # n = 12 is even: the median is the mean of the two middle values, not torch's lower one.
    middle = {
        k: torch.stack([t[k] for t in trained]).double().sort(0).values[5:7].mean(0)
        for k in trained[0]
    }
    assert_model(fitted.states, {k: v.float() for k, v in middle.items()})


def test_live_fedavg_with_secure_aggregation(live):
    """Issue 19: the workers' daemons mask their models (keys, sealed shares, masks), the
    coordinator sums and unmasks: the row-weighted mean of hand trainings, to within the
    quantization error."""
    c, data = live
    start = model().state_dict()
    trained = [(len(x), flat(start) + update(start, x, y)) for x, y in data]
    mean = sum(n * w for n, w in trained) / sum(n for n, _ in trained)
    expected = {"weight": mean[: 2 * D].reshape(2, D).float(), "bias": mean[2 * D :].float()}
    with sz.connect(c.url) as client:
        for worker_id in IDS:
            wait_for(lambda w=worker_id: c.worker_state(w) == "idle", 15 * UNIT, f"{worker_id}")
        strategy = sz.FedAvg(rounds=1, min_workers=3, secure_aggregation=sz.SecAgg())
        job = client.submit(private_graph(), sz.WorkerData("local"), strategy=strategy)
        fitted = job.result(timeout=120 * UNIT)
        (event,) = rounds_of(job)
    assert event["secure_aggregation"] == {"summed": 3}
    assert_model(fitted.states, expected, atol=2e-6)


def test_live_fedavg_with_client_side_clipping(live):
    """Issue 19: each worker's daemon clips its own update (batched_fit clip_norm) before the
    coordinator sees it; without noise, the mean of the clipped updates worked out by hand."""
    c, data = live
    start = model().state_dict()
    updates = [update(start, x, y) for x, y in data]
    s = float(sorted(float(u.norm()) for u in updates)[1])  # the middle one: one clipped
    mean = flat(start) + sum(u * min(1.0, s / float(u.norm())) for u in updates) / len(updates)
    expected = {"weight": mean[: 2 * D].reshape(2, D).float(), "bias": mean[2 * D :].float()}
    with sz.connect(c.url) as client:
        for worker_id in IDS:
            wait_for(lambda w=worker_id: c.worker_state(w) == "idle", 15 * UNIT, f"{worker_id}")
        privacy = sz.FixedClipping(clip_norm=s, noise_multiplier=0.0, side="client")
        strategy = sz.FedAvg(rounds=1, min_workers=3, privacy=privacy)
        job = client.submit(private_graph(), sz.WorkerData("local"), strategy=strategy)
        fitted = job.result(timeout=120 * UNIT)
        (event,) = rounds_of(job)
    assert event["privacy"]["clip"] == s
    assert_model(fitted.states, expected, atol=2e-6)


def test_local_on_worker_data_trains_where_the_data_is(live):
    """Issue 15: ``Local`` on ``WorkerData`` fits the whole graph on that worker's own rows (w3:
    three shards), as a plain torch loop over them does."""
    c, data = live
    expected, _ = local_training(model().state_dict(), *data[2], epochs=9)
    with sz.connect(c.url) as client:
        job = client.submit(graph(), sz.WorkerData("local"), strategy=sz.Local("w3"))
        fitted = job.result(timeout=60 * UNIT)
        events = job.events(timeout=10 * UNIT)
        training = [e.data for e in events if e.data.get("phase") == "training"]
    assert training[0]["rows"] == SIZES[2]
    assert_model(fitted.states, expected)
    np.testing.assert_allclose(fitted.states["center"]["mean"], data[2][0].mean(0), rtol=1e-6)


def test_live_fedavg_goes_on_without_a_worker_killed_mid_job(live):
    c, data = live
    g = graph(Pause().named("pause"))
    with sz.connect(c.url) as client:
        for worker_id in IDS:  # idle again after the previous job
            wait_for(lambda w=worker_id: c.worker_state(w) == "idle", 15 * UNIT, f"{worker_id}")
        strategy = sz.FedAvg(rounds=5, min_workers=2)
        job = client.submit(g, sz.WorkerData("local"), strategy=strategy)
        wait_for(
            lambda: (job.status()["progress"] or {}).get("round", 0) >= 1, 60 * UNIT, "round 1"
        )
        c.send_signal(c.workers["w2"], signal.SIGKILL)
        fitted = job.result(timeout=60 * UNIT)

        events = rounds_of(job)
        assert [e["round"] for e in events] == [1, 2, 3, 4, 5]
        dropped = [e for e in events if "w2" in e["dropped"]]
        assert len(dropped) == 1, events  # dropped once, then never selected again
        assert dropped[0]["dropped"]["w2"].startswith("worker_lost: ")
        after = events.index(dropped[0])
        assert all("w2" not in e["workers"] for e in events[after:])
        assert all("w2" not in e["selected"] for e in events[after + 1 :])
        # What it learned is what the workers that answered each round learned, averaged.
        answered = {e["round"]: sorted(IDS.index(w) for w in e["workers"]) for e in events}
        expected = reference_rounds(data, 5, epochs=1, select=answered.__getitem__)
        assert_model(fitted.states, expected[-1][0])
