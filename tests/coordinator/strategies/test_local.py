"""The Local strategy against the in-memory context, and strategy option validation."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import somatize as sz
from coordinator.context import InMemoryContext, WorkerIdentity
from coordinator.strategies import JobInputs, Local, StrategyOptionsError, strategy_from_spec
from protocol.filters import dump_filter
from protocol.options.strategies import LocalOptions
from tests.utils import Center
from worker.daemon.main import Daemon


def test_local_trains_on_one_worker_and_equals_graph_fit():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(50, 3)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    torch.manual_seed(1)
    graph = Center().named("c") >> sz.TorchFilter(
        torch.nn.Linear(3, 2), loss="cross_entropy", lr=0.2, batch_size=10, epochs=3
    ).named("head")
    events: list[tuple[str, dict]] = []

    async def emit(event, data):
        events.append((event, data))

    inputs = JobInputs(graph.node_ids, {n: dump_filter(f) for n, f in graph.items()}, x, y)
    ctx = InMemoryContext(1, Daemon)
    states = asyncio.run(Local(LocalOptions()).run(ctx, inputs, emit))

    expected = graph.fit(x, y).states
    for k, v in expected["head"].items():
        torch.testing.assert_close(states["head"][k], v, rtol=0, atol=1e-6)
    phases = [d["phase"] for e, d in events if e == "progress"]
    assert phases == ["loading", "training", "epoch", "epoch", "epoch", "trained"]
    fitted = graph.fit(x, y)
    assert events[-1][1]["history"] == fitted.history  # a row per epoch, as graph.fit's


def test_placement_by_id_and_tag():
    by_tag = Local(LocalOptions(tag="gpu")).placement()
    assert by_tag.workers == 1
    assert by_tag.accepts(WorkerIdentity("a", frozenset({"gpu"})))
    assert not by_tag.accepts(WorkerIdentity("b", frozenset({"cpu"})))
    by_id = Local(LocalOptions(worker="b")).placement()
    assert by_id.accepts(WorkerIdentity("b")) and not by_id.accepts(WorkerIdentity("a"))
    assert by_id.describe() == "1 worker with id 'b'"


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        (
            "local",
            {"workers": 2},
            r"strategy 'local' takes no option \['workers'\]; "
            r"it takes \['device', 'max_restarts', 'restart_timeout', 'tag', 'worker'\]",
        ),
        ("local", {"tag": 3}, "tag must be a non-empty string or None, not 3"),
        ("gossip", {}, r"unknown strategy 'gossip'; this coordinator runs \[.*'local'.*\]"),
    ],
)
def test_bad_strategy_specs_are_refused_with_what_is_wrong(name, options, message):
    with pytest.raises(StrategyOptionsError, match=message):
        strategy_from_spec(name, options)
