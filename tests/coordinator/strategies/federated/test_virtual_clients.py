"""Many clients on few workers (``clients_per_worker=K``): a worker trains its K clients in
turn, each on its own contiguous partition of the worker's rows, and the run equals K times as
many workers holding one partition each; a round of 1,000 clients on 2 workers equals 1,000
independent local trainings averaged by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import somatize as sz
from coordinator.context import InMemoryContext
from coordinator.strategies import FedAvg, StrategyFailed, StrategyOptionsError, strategy_from_spec
from protocol.options.strategies import FedAvgOptions
from tests.coordinator.strategies.federated.test_fedavg import (
    D,
    graph,
    job_inputs,
    local_training,
    model,
    own_data_context,
    reference_rounds,
    run,
    shards,
    weighted_average,
)
from worker.daemon.main import Daemon


def partitions(data, k: int):
    """Each worker's rows cut in ``k`` contiguous partitions, as ``np.array_split`` cuts them."""
    out = []
    for x, y in data:
        out += list(zip(np.array_split(x, k), np.array_split(y, k), strict=True))
    return out


def assert_same_states(a, b):
    for node in a:
        for key in a[node]:
            np.testing.assert_allclose(
                np.asarray(a[node][key]), np.asarray(b[node][key]), rtol=0, atol=1e-7
            )


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_k_clients_per_worker_equal_k_times_as_many_workers(fraction):
    data = shards((30, 50))
    spec = sz.FedAvg(3, fraction=fraction, seed=4, clients_per_worker=3).spec()
    virtual, events = run(
        strategy_from_spec("fedavg", spec.options), own_data_context(data), job_inputs(graph())
    )
    alone, alone_events = run(
        FedAvg(FedAvgOptions(rounds=3, fraction=fraction, seed=4)),
        own_data_context(partitions(data, 3)),
        job_inputs(graph()),
    )
    assert_same_states(virtual, alone)
    labels = [f"mem-{i}/{j}" for i in range(2) for j in range(3)]
    for mine, theirs in zip(events, alone_events, strict=True):
        assert mine["workers"] == [labels[int(w.split("-")[1])] for w in theirs["workers"]]
        assert mine["rows"] == theirs["rows"] and mine["loss"] == pytest.approx(theirs["loss"])
    if fraction == 1.0:
        assert events[0]["workers"] == labels


def test_clients_on_sent_rows_partition_each_workers_shard():
    x = np.concatenate([a for a, _ in shards()])[:100]
    y = np.concatenate([b for _, b in shards()])[:100]
    expected = reference_rounds(partitions([(x[:50], y[:50]), (x[50:], y[50:])], 2), 2, epochs=1)
    states, events = run(
        FedAvg(FedAvgOptions(rounds=2, clients_per_worker=2)),
        InMemoryContext(2, Daemon),
        job_inputs(graph(), x, y, dataset=None),
    )
    for key, value in expected[-1][0].items():
        torch.testing.assert_close(torch.as_tensor(states["lin"][key]), value, rtol=0, atol=1e-6)
    assert events[-1]["rows"] == 100 and len(events[-1]["workers"]) == 4


def test_a_round_of_1000_clients_on_2_workers_equals_1000_local_trainings():
    rng = np.random.default_rng(11)
    w = rng.normal(size=(D, 2))
    data = []
    for _ in range(2):
        x = rng.normal(size=(2000, D)).astype(np.float32)
        data.append((x, (x @ w).astype(np.float32)))
    start = model().state_dict()
    trained = [(len(px), local_training(start, px, py, 1)[0]) for px, py in partitions(data, 500)]
    expected = weighted_average(trained)
    states, events = run(
        FedAvg(FedAvgOptions(rounds=1, clients_per_worker=500)),
        own_data_context(data),
        job_inputs(graph()),
    )
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(states["lin"][key]), value, rtol=0, atol=1e-6)
    assert len(events[0]["workers"]) == 1000 and events[0]["rows"] == 4000


def test_a_worker_with_fewer_rows_than_clients_is_left_out_naming_why():
    data = shards((30, 2))
    with pytest.raises(StrategyFailed, match="its dataset has 2 rows, too few for 3 clients"):
        run(
            FedAvg(FedAvgOptions(rounds=1, min_workers=2, clients_per_worker=3)),
            own_data_context(data),
            job_inputs(graph()),
        )
    _, events = run(
        FedAvg(FedAvgOptions(rounds=1, clients_per_worker=3)),
        own_data_context(data),
        job_inputs(graph()),
    )
    assert events[0]["workers"] == ["mem-0/0", "mem-0/1", "mem-0/2"]


def test_clients_per_worker_options_are_checked():
    with pytest.raises(StrategyOptionsError, match="clients_per_worker must be a positive integer"):
        strategy_from_spec("fedavg", {"rounds": 1, "clients_per_worker": 0})
    # Krum(f=1) needs 5 clients a round: 2 workers × 3 clients will do, 2 × 2 will not.
    options = {"rounds": 1, "min_workers": 2, "aggregator": {"name": "krum", "byzantine": 1}}
    strategy_from_spec("fedavg", options | {"clients_per_worker": 3})
    with pytest.raises(StrategyOptionsError, match=r"min_workers 2 × clients_per_worker 2"):
        strategy_from_spec("fedavg", options | {"clients_per_worker": 2})
    with pytest.raises(
        StrategyOptionsError, match=r"too few to give each of 40 clients \(2 workers\)"
    ):
        x, y = shards()[0]
        FedAvg(FedAvgOptions(rounds=1, min_workers=2, clients_per_worker=20)).validate(
            job_inputs(graph(), x, y, None)
        )
    assert "clients_per_worker" not in sz.FedAvg(1).spec().options
    assert sz.FedAvg(1, clients_per_worker=4).spec().options["clients_per_worker"] == 4
