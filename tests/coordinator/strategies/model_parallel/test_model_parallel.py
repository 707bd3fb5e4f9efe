"""ModelParallel against single-process training of the unsplit model (a plain torch loop here),
on in-memory stages; live stages are in tests/integration/strategies/test_model_parallel_live.py."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

import somatize as sz
from coordinator.context import InMemoryContext, Target, WorkerIdentity
from coordinator.strategies import JobInputs, ModelParallel, StrategyFailed, StrategyOptionsError
from coordinator.strategies.model_parallel.model_parallel import StagePlacement, check_partitions
from protocol.filters import dump_filter
from protocol.options.strategies import ModelParallelOptions, PartitionOptions
from somatize.remote.client import graph_info
from tests.utils import Center
from worker.daemon.main import Daemon


def layers(seed: int = 0) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    return [
        torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.Tanh()),
        torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh()),
        torch.nn.Linear(8, 2),
    ]


def dataset(n: int = 60, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, 5)) + 2).astype(np.float32)
    y = (x[:, :2] * np.array([1.0, -0.5], dtype=np.float32)).astype(np.float32)
    return x, y


def graph(optimizer: str = "sgd", epochs: int = 2, batch_size: int = 16) -> sz.Graph:
    a, b, c = layers()
    settings = {"optimizer": optimizer, "lr": 0.05 if optimizer == "sgd" else 0.01}
    return (
        Center().named("center")
        >> sz.TorchFilter(a, **settings).named("a")
        >> sz.TorchFilter(b, **settings).named("b")
        >> sz.TorchFilter(
            c, loss="mse", batch_size=batch_size, epochs=epochs, shuffle=False, **settings
        ).named("c")
    )


def reference(x, y, optimizer: str = "sgd", epochs: int = 2, batch_size: int = 16):
    """The unsplit model trained in one process: rows in order, one step per global batch."""
    model = torch.nn.Sequential(*copy.deepcopy(layers()))
    make = torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam
    opts = [make(m.parameters(), lr=0.05 if optimizer == "sgd" else 0.01) for m in model]
    xt, yt = torch.as_tensor(x - x.mean(0)), torch.as_tensor(y)
    for _ in range(epochs):
        for start in range(0, len(xt), batch_size):
            for opt in opts:
                opt.zero_grad()
            out = model(xt[start : start + batch_size])
            torch.nn.functional.mse_loss(out, yt[start : start + batch_size]).backward()
            for opt in opts:
                opt.step()
    return {name: m.state_dict() for name, m in zip("abc", model, strict=True)}


SPLITS = {
    2: [("center", "a"), ("b", "c")],
    3: [("center", "a"), ("b",), ("c",)],
}


def run_in_memory(g: sz.Graph, x, y, stages: int, micro: int, order: str = "gpipe"):
    parts = [
        PartitionOptions(node_ids=nodes, tag=f"stage{i}") for i, nodes in enumerate(SPLITS[stages])
    ]
    workers = [WorkerIdentity(f"w{i}", frozenset({f"stage{i}"})) for i in range(stages)]
    events: list[dict] = []

    async def emit(event, data):
        events.append(data)

    inputs = JobInputs(g.node_ids, {n: dump_filter(f) for n, f in g.items()}, x, y, graph_info(g))
    strategy = ModelParallel(
        ModelParallelOptions(partitions=parts, micro_batches=micro, schedule=order)
    )
    strategy.validate(inputs)
    states = asyncio.run(strategy.run(InMemoryContext(workers, Daemon), inputs, emit))
    return states, events


@pytest.mark.parametrize(("stages", "micro"), [(2, 1), (2, 4), (3, 1), (3, 4)])
def test_pipeline_training_equals_the_unsplit_model(stages, micro):
    x, y = dataset()
    states, events = run_in_memory(graph(), x, y, stages, micro)
    expected = reference(x, y)
    for node in "abc":
        for key, value in expected[node].items():
            torch.testing.assert_close(torch.as_tensor(states[node][key]), value, rtol=0, atol=1e-5)
    np.testing.assert_allclose(states["center"]["mean"], x.mean(0), rtol=1e-6)
    steps = [e for e in events if e.get("phase") == "training"]
    assert len(steps) == 2 * 4 and steps[-1]["step"] == steps[-1]["steps"] == 8
    assert [e["rows"] for e in steps] == [16, 16, 16, 12] * 2  # 60 rows in batches of 16


def test_1f1b_and_adam_and_uneven_micro_batches_also_equal_the_unsplit_model():
    x, y = dataset(n=45)  # batches of 16, 16, 13: micro-batches of 6/5/5 ... uneven
    states, _ = run_in_memory(graph("adam"), x, y, 3, 3, order="1f1b")
    expected = reference(x, y, "adam")
    for node in "abc":
        for key, value in expected[node].items():
            torch.testing.assert_close(torch.as_tensor(states[node][key]), value, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("partitions", "message"),
    [
        ([], "at least one partition"),
        ([("a", "b"), ("b", "c")], "node 'b' is in partitions 0 and 1"),
        ([("a",), ("c",)], r"nodes \['b'\] are in no partition"),
        (
            [("a", "c"), ("b",)],
            r"contiguous runs in graph order: node 'c' \(partition 0\) comes after 'b' "
            r"\(partition 1\)",
        ),
        ([("b", "c"), ("a",)], "node 'b' \\(partition 0\\) comes after 'a' \\(partition 1\\)"),
        ([("a", "b", "z"), ("c",)], "partition 0 names 'z', which is not in the graph"),
        ([("a", "b", "c"), ()], "partition 1 is empty"),
    ],
)
def test_invalid_partitions_are_refused_naming_the_node_and_partitions(partitions, message):
    parts = [StagePlacement(tuple(nodes), Target(tag="t")) for nodes in partitions]
    with pytest.raises(StrategyOptionsError, match=message):
        check_partitions(["a", "b", "c"], parts)


def test_options_are_checked_and_the_sdk_spec_round_trips():
    spec = sz.ModelParallel(
        [sz.Partition(["a"], tag="s0"), sz.Partition(["b"], worker="w1")], 4
    ).spec()
    strategy = ModelParallel.from_options(spec.options)
    assert strategy.options.micro_batches == 4
    assert [p.target for p in strategy.partitions] == [Target(tag="s0"), Target(id="w1")]
    assert strategy.placement().describe() == "2 workers: tag 's0', worker 'w1'"
    with pytest.raises(StrategyOptionsError, match="micro_batches must be a positive integer"):
        ModelParallel.from_options({**spec.options, "micro_batches": 0})
    with pytest.raises(StrategyOptionsError, match="pinned to a worker id or a tag"):
        ModelParallel.from_options({"partitions": [{"node_ids": ["a"]}]})
    with pytest.raises(ValueError, match="exactly one"):
        sz.Partition(["a"], worker="w", tag="t")


@pytest.mark.parametrize(
    "split",
    [
        [("center",), ("a", "b", "c")],  # issue 18: a plain filter alone on stage 0
        [("center", "a", "b", "c")],  # one stage
    ],
)
def test_a_tiling_with_one_training_stage_equals_the_unsplit_model(split):
    """One stage trains: it is first and last, and runs the training loop on the output of the
    stages before it (it was refused, and before that it leaked a daemon's validation)."""
    kept = dict(SPLITS)
    SPLITS[len(split)] = split
    try:
        x, y = dataset()
        states, events = run_in_memory(graph(), x, y, len(split), 4)
    finally:
        SPLITS.clear()
        SPLITS.update(kept)
    expected = reference(x, y)
    for node in "abc":
        for key, value in expected[node].items():
            torch.testing.assert_close(torch.as_tensor(states[node][key]), value, rtol=0, atol=1e-5)
    np.testing.assert_allclose(states["center"]["mean"], x.mean(0), rtol=1e-6)
    trained = [e for e in events if e.get("phase") == "trained"]
    assert len(trained) == 1 and len(trained[0]["epoch_losses"]) == 2


def test_in_process_stages_go_over_the_strategy_and_refuse_the_torch_transport():
    x, y = dataset()
    _, events = run_in_memory(graph(), x, y, 2, 2)  # auto: no group can form in one process
    assert not [e for e in events if e.get("phase") == "linked"]  # no peer links either
    parts = [PartitionOptions(node_ids=nodes, tag=f"stage{i}") for i, nodes in enumerate(SPLITS[2])]
    workers = [WorkerIdentity(f"w{i}", frozenset({f"stage{i}"})) for i in range(2)]
    g = graph()
    inputs = JobInputs(g.node_ids, {n: dump_filter(f) for n, f in g.items()}, x, y, graph_info(g))

    async def emit(event, data):
        pass

    strategy = ModelParallel(
        ModelParallelOptions(partitions=parts, micro_batches=2, transport="torch")
    )
    with pytest.raises(StrategyFailed) as failed:
        asyncio.run(strategy.run(InMemoryContext(workers, Daemon), inputs, emit))
    assert failed.value.info.code == "collective_failed"
    assert "transport='torch': the workers are in-process and share one process" in str(
        failed.value
    )
