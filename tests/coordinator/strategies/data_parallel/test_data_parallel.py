"""DataParallel against an independent plain-torch loop: in-memory workers here, live ones in
tests/integration/strategies/test_data_parallel_live.py. Both use :func:`reference_training`."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import numpy as np
import pytest
import torch

import somatize as sz
from coordinator.context import InMemoryContext
from coordinator.strategies import DataParallel, JobInputs, StrategyFailed, StrategyOptionsError
from coordinator.strategies.steps import TrainingSettings
from coordinator.strategies.steps import global_batches as schedule
from protocol.filters import dump_filter
from protocol.options.strategies import DataParallelOptions
from somatize.remote.client import graph_info
from tests.utils import Center
from worker.daemon.main import Daemon


def dataset(n: int = 203, d: int = 6, classes: int = 3, seed: int = 4):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, d)) * 2 + 1).astype(np.float32)
    y = (x @ rng.normal(size=(d, classes))).argmax(1).astype(np.int64)
    return x, y


def model(seed: int = 0, d: int = 6) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


OPTIMIZERS = {
    "sgd": ({"momentum": 0.9}, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    "adam": ({}, lambda p: torch.optim.Adam(p, lr=0.01)),
}


def graph_for(
    optimizer: str,
    epochs: int = 3,
    batch_size: int = 32,
    shuffle: bool = False,
    module: torch.nn.Module | None = None,
    **settings: Any,
):
    """Center >> the MLP (``module``: another with its parameters and maths) as a TorchFilter
    (with ``settings`` besides: ``max_steps``, say)."""
    options, _ = OPTIMIZERS[optimizer]
    net = sz.TorchFilter(
        model() if module is None else module,
        loss="cross_entropy",
        optimizer=optimizer,
        lr=0.05 if optimizer == "sgd" else 0.01,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=shuffle,
        seed=11,
        optimizer_options=options,
        **settings,
    )
    return Center().named("center") >> net.named("mlp")


def reference_training(
    x,
    y,
    optimizer: str,
    epochs: int = 3,
    batch_size: int = 32,
    shuffle: bool = False,
    *,
    module: torch.nn.Module | None = None,
):
    """Single-process SGD on the global batches: ``batch_size`` rows at a time, in order or
    (``shuffle``) in the order of one ``torch.randperm`` per epoch from a generator seeded with
    the filter's seed, 11 — the documented rule. ``module``: another model than :func:`model`."""
    _, make = OPTIMIZERS[optimizer]
    net = copy.deepcopy(model() if module is None else module)
    opt = make(net.parameters())
    xt, yt = torch.as_tensor(x - x.mean(0)), torch.as_tensor(y)
    order = torch.Generator().manual_seed(11)
    for _ in range(epochs):
        rows = torch.randperm(len(xt), generator=order) if shuffle else torch.arange(len(xt))
        for start in range(0, len(xt), batch_size):
            opt.zero_grad()
            batch = rows[start : start + batch_size]
            loss = torch.nn.functional.cross_entropy(net(xt[batch]), yt[batch])
            loss.backward()
            opt.step()
    return net.state_dict()


def inputs(graph: sz.Graph, x, y) -> JobInputs:
    return JobInputs(
        graph.node_ids, {n: dump_filter(f) for n, f in graph.items()}, x, y, graph_info(graph)
    )


def run_in_memory(graph, x, y, workers: int):
    events = []

    async def emit(event, data):
        events.append(data)

    ctx = InMemoryContext(workers, Daemon)
    states = asyncio.run(
        DataParallel(DataParallelOptions(workers=workers)).run(ctx, inputs(graph, x, y), emit)
    )
    return states, events


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_data_parallel_equals_single_process_training(workers, optimizer):
    x, y = dataset()
    states, events = run_in_memory(graph_for(optimizer), x, y, workers)
    expected = reference_training(x, y, optimizer)
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(states["mlp"][key]), value, rtol=0, atol=1e-5)
    np.testing.assert_allclose(states["center"]["mean"], x.mean(0), rtol=1e-6)
    steps = [e for e in events if e.get("phase") == "training"]
    assert len(steps) == 3 * 7  # ceil(203 / 32) steps per epoch
    assert steps[-1]["step"] == steps[-1]["steps"] == 21 and steps[-1]["epoch"] == 3
    # Each step says its global batch's rows: six of 32 and one of 11 an epoch (issue 18).
    assert [e["rows"] for e in steps[:7]] == [32] * 6 + [203 - 6 * 32]


def test_the_schedule_splits_each_global_batch_unevenly_and_covers_every_row_once_an_epoch():
    training = TrainingSettings(epochs=2, batch_size=10, shuffle=True, seed=5)
    plan = list(schedule(23, 3, training))
    assert [len(s) for _, _, slices in plan[:2] for s in slices] == [4, 3, 3] * 2
    assert [len(s) for s in plan[2][2]] == [1, 1, 1]  # the last batch: 3 rows, one each
    for epoch in (0, 1):
        rows = np.concatenate([np.concatenate(s) for e, _, s in plan if e == epoch])
        assert sorted(rows.tolist()) == list(range(23))
    # The same permutation graph.fit draws: a generator seeded with `seed`, one randperm an epoch.
    order = torch.Generator().manual_seed(5)
    first = torch.randperm(23, generator=order).numpy()
    assert (
        np.concatenate([np.concatenate(s) for e, _, s in plan if e == 0]).tolist() == first.tolist()
    )


def test_data_parallel_with_shuffling_equals_graph_fit():
    x, y = dataset(n=90)
    graph = graph_for("sgd", epochs=2, batch_size=16, shuffle=True)
    states, _ = run_in_memory(graph, x, y, 2)
    expected = graph.fit(x, y).states
    for key, value in expected["mlp"].items():
        torch.testing.assert_close(torch.as_tensor(states["mlp"][key]), value, rtol=0, atol=1e-5)


def test_jobs_data_parallel_cannot_run_are_refused_up_front():
    x, y = dataset(n=10)
    plain = sz.Graph([Center().named("c")])
    with pytest.raises(StrategyOptionsError, match="has none; use Local"):
        DataParallel(DataParallelOptions(workers=2)).validate(inputs(plain, x, y))
    late = sz.TorchFilter(model()).named("m") >> Center().named("c")
    with pytest.raises(StrategyOptionsError, match=r"\['c'\] come after 'm'"):
        DataParallel(DataParallelOptions(workers=2)).validate(inputs(late, x, y))
    with pytest.raises(StrategyOptionsError, match="y is missing"):
        DataParallel(DataParallelOptions(workers=2)).validate(inputs(graph_for("sgd"), x, None))
    with pytest.raises(StrategyOptionsError, match="workers must be a positive integer, not 0"):
        DataParallel.from_options({"workers": 0})


def test_a_replica_with_no_rows_in_a_step_still_takes_the_step():
    x, y = dataset(n=65)  # the last batch of each epoch has 1 row: replica 2 sits it out
    states, _ = run_in_memory(graph_for("sgd"), x, y, 2)
    expected = reference_training(x, y, "sgd")
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(states["mlp"][key]), value, rtol=0, atol=1e-5)


def test_in_process_replicas_reduce_through_the_coordinator_and_refuse_the_torch_collective():
    x, y = dataset()
    ctx = InMemoryContext(2, Daemon)
    strategy = DataParallel(DataParallelOptions(workers=2))
    job = inputs(graph_for("sgd", epochs=1), x, y)

    async def emit(event, data):
        pass

    async def prepared():
        return await strategy.prepare(ctx, job, emit)

    assert asyncio.run(prepared()) == {
        "collective": "coordinator",
        "collective_reason": "the workers are in-process and share one process",
        "step_bytes": 4 * (6 * 16 + 16 + 16 * 3 + 3),  # the MLP's 163 fp32 gradients a step
    }
    with pytest.raises(StrategyFailed) as failed:
        asyncio.run(
            DataParallel(DataParallelOptions(workers=2, collective="torch")).run(
                InMemoryContext(2, Daemon), job, emit
            )
        )
    assert failed.value.info.code == "collective_failed"
    assert "collective='torch': the workers are in-process" in str(failed.value)


class _Reading(Daemon):
    """A daemon that notes the state reads it answers, and (``drift``) moves its weights by
    ``drift`` before a digest is taken: a replica that has diverged."""

    def __init__(self, reads: list[tuple[int, bool]], index: int, drift: float = 0.0) -> None:
        super().__init__()
        self.reads, self.index, self.drift = reads, index, drift

    def on_get_state(self, req):
        self.reads.append((self.index, req.digests))
        if req.digests and self.drift:
            with torch.no_grad():
                self.engine.nodes.node("mlp").filter.module[0].weight.add_(self.drift)
        return super().on_get_state(req)


def _run_reading(drift: float = 0.0) -> tuple[Any, list[tuple[int, bool]]]:
    reads: list[tuple[int, bool]] = []
    made = iter(range(3))

    def make() -> Daemon:
        i = next(made)
        return _Reading(reads, i, drift if i == 2 else 0.0)

    x, y = dataset()

    async def emit(event, data):
        pass

    run = DataParallel(DataParallelOptions(workers=3)).run(
        InMemoryContext(3, make), inputs(graph_for("sgd", epochs=1), x, y), emit
    )
    return asyncio.run(run), reads


def test_the_final_states_are_read_whole_from_one_replica_and_the_others_by_their_digests():
    """N replicas' models through the coordinator (and in its memory at once) were N times the
    bytes of one: each replica sends its tensors' SHA-256 instead, and one sends the model."""
    states, reads = _run_reading()
    assert sorted(reads) == [(0, False), (0, True), (1, True), (2, True)]
    expected = reference_training(*dataset(), "sgd", epochs=1)
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(states["mlp"][key]), value, rtol=0, atol=1e-5)


def test_a_replica_whose_weights_differ_at_the_end_fails_the_job_naming_it():
    said = r"replicas diverged: node 'mlp', key '0\.weight' differs between 'mem-0' and 'mem-2'"
    with pytest.raises(StrategyFailed, match=said):
        _run_reading(drift=1e-7)


def test_an_elastic_jobs_replica_lost_as_the_model_is_read_leaves_it_to_a_survivor():
    reads: list[tuple[int, bool]] = []
    events: list[tuple[str, dict]] = []
    holder: dict[str, InMemoryContext] = {}
    made = iter(range(3))

    class Lost(_Reading):
        def on_get_state(self, req):
            if self.index == 0 and not req.digests:  # its worker goes as it sends the model
                holder["ctx"].lose(0)
            return super().on_get_state(req)

    async def emit(event, data):
        events.append((event, data))

    x, y = dataset()
    ctx = holder["ctx"] = InMemoryContext(3, lambda: Lost(reads, next(made)))
    options = DataParallelOptions(workers=3, elastic=True, collective="coordinator")
    job = inputs(graph_for("sgd", epochs=1), x, y)
    states = asyncio.run(DataParallel(options).run(ctx, job, emit))
    assert sorted(reads) == [(0, False), (0, True), (1, False), (1, True), (2, True)]
    lost = [data for event, data in events if event == "worker_lost"]
    assert [(d["replica"], d["worker"]) for d in lost] == [(0, "mem-0")]
    expected = reference_training(x, y, "sgd", epochs=1)
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(states["mlp"][key]), value, rtol=0, atol=1e-5)
