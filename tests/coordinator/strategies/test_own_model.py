"""Your own model in every strategy, in process (InMemoryContext, real daemons' engines): a
dict batch through DataParallel, FedAvg and a pipeline whose first stage takes the dict, a
``step=`` function and a model that computes its own loss through DataParallel — each against
the plain torch loop of :mod:`tests.somatize.own_models`; and what the coordinator refuses at
submit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import somatize as sz
from coordinator.context import InMemoryContext, WorkerIdentity
from coordinator.jobs.submission import (
    labels_unused_problem,
    lone_steps_problem,
    steps_limits_problem,
)
from coordinator.strategies import DataParallel, FedAvg, ModelParallel
from coordinator.strategies.base import StrategyOptionsError
from protocol.options.strategies import (
    DataParallelOptions,
    FedAvgOptions,
    ModelParallelOptions,
    PartitionOptions,
)
from protocol.rules.rows import model_loss_with_labels
from tests.coordinator.strategies.test_training_options import inputs, run
from tests.somatize.own_models import (
    CLASSES,
    VOCAB,
    WIDTH,
    MaskedPool,
    SelfScoring,
    TokenTagger,
    masked_token_step,
    plain_loop,
    token_rows,
)
from tests.somatize.test_own_model import SETTINGS, close, cross_entropy
from worker.daemon.main import Daemon


@pytest.mark.parametrize("workers", [2, 3])
def test_data_parallel_trains_a_dict_batch_as_the_plain_loop(workers):
    x, y = token_rows()
    graph = sz.Graph([sz.TorchFilter(MaskedPool(), loss="cross_entropy", **SETTINGS)])
    states, _, _ = run(
        DataParallel(DataParallelOptions(workers=workers)),
        graph,
        x,
        y,
        InMemoryContext(workers, Daemon),
    )
    model, _ = plain_loop(MaskedPool(), x, y, cross_entropy)
    close(states["masked_pool"], model)


def test_data_parallel_trains_a_step_function_and_a_model_with_its_own_loss():
    x, y = token_rows()
    stepped = sz.Graph([sz.TorchFilter(TokenTagger(), step=masked_token_step, **SETTINGS)])
    states, progress, _ = run(
        DataParallel(DataParallelOptions(workers=2)), stepped, x, None, InMemoryContext(2, Daemon)
    )
    model, history = plain_loop(TokenTagger(), x, None, lambda m, b, _: masked_token_step(m, b))
    close(states["token_tagger"], model)
    epochs = [p for p in progress if p.get("phase") == "epoch"]
    assert [p["loss"] for p in epochs] == pytest.approx([h["loss"] for h in history], abs=1e-6)

    own = sz.Graph([sz.TorchFilter(SelfScoring(), loss="model", **SETTINGS)])
    states, _, _ = run(
        DataParallel(DataParallelOptions(workers=2)),
        own,
        x | {"labels": y},
        None,
        InMemoryContext(2, Daemon),
    )
    model, _ = plain_loop(MaskedPool(), x, y, cross_entropy)
    close({k.removeprefix("inner."): v for k, v in states["self_scoring"].items()}, model)


def test_fedavg_averages_two_workers_trained_on_their_shares_of_a_dict_batch():
    x, y = token_rows(100)
    graph = sz.Graph([sz.TorchFilter(MaskedPool(), loss="cross_entropy", **SETTINGS)])
    states, _, _ = run(
        FedAvg(FedAvgOptions(rounds=1, local_epochs=2)), graph, x, y, InMemoryContext(2, Daemon)
    )
    # By hand (McMahan et al.): each worker trains its contiguous half from the same start
    # with a fresh optimizer; the states are averaged weighted by rows (50 and 50).
    halves = [slice(0, 50), slice(50, 100)]
    trained = [
        plain_loop(MaskedPool(), {k: v[h] for k, v in x.items()}, y[h], cross_entropy)[0]
        for h in halves
    ]
    mean = {
        k: (trained[0].state_dict()[k] + trained[1].state_dict()[k]) / 2
        for k in states["masked_pool"]
    }
    for key, value in mean.items():
        torch.testing.assert_close(
            torch.as_tensor(states["masked_pool"][key]), value, atol=1e-5, rtol=0
        )


class Pooled(torch.nn.Module):
    """The first stage of a pipeline: ``(ids, mask) -> features``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        summed = (self.embed(ids) * mask.unsqueeze(-1)).sum(1)
        return torch.tanh(summed / mask.sum(1, keepdim=True))


class Whole(torch.nn.Module):
    def __init__(self, pooled: Pooled, head: torch.nn.Linear) -> None:
        super().__init__()
        self.pooled, self.head = pooled, head

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.pooled(ids, mask))


def head() -> torch.nn.Linear:
    torch.manual_seed(8)
    return torch.nn.Linear(WIDTH, CLASSES)


def test_a_pipelines_first_stage_takes_the_dict_batch():
    x, y = token_rows()
    first = sz.TorchFilter(Pooled(), **SETTINGS).named("pooled")
    last = sz.TorchFilter(head(), loss="cross_entropy", **SETTINGS).named("head")
    parts = [PartitionOptions(node_ids=(n,), tag=f"s{i}") for i, n in enumerate(["pooled", "head"])]
    workers = [WorkerIdentity(f"w{i}", frozenset({f"s{i}"})) for i in range(2)]
    states, _, _ = run(
        ModelParallel(ModelParallelOptions(partitions=parts, micro_batches=2)),
        first >> last,
        x,
        y,
        InMemoryContext(workers, Daemon),
    )
    model, _ = plain_loop(Whole(Pooled(), head()), x, y, cross_entropy)
    expected = model.state_dict()
    for key, value in states["pooled"].items():
        torch.testing.assert_close(
            torch.as_tensor(value), expected[f"pooled.{key}"], atol=1e-5, rtol=0
        )
    for key, value in states["head"].items():
        torch.testing.assert_close(
            torch.as_tensor(value), expected[f"head.{key}"], atol=1e-5, rtol=0
        )


def test_what_cannot_run_is_refused_at_submit():
    x, y = token_rows(20)
    classify = sz.Graph([sz.TorchFilter(MaskedPool(), loss="cross_entropy")])
    with pytest.raises(StrategyOptionsError, match=r"y is missing \(node .masked_pool. needs them"):
        DataParallel(DataParallelOptions(workers=2)).validate(inputs(classify, x, None))
    own = sz.Graph([sz.TorchFilter(SelfScoring(), loss="model")])
    DataParallel(DataParallelOptions(workers=2)).validate(inputs(own, x, None))  # no y: fine
    parts = [PartitionOptions(node_ids=("self_scoring",), tag="s0")]
    with pytest.raises(StrategyOptionsError, match=r"computes its own \(loss=.model. or step=\)"):
        ModelParallel(ModelParallelOptions(partitions=parts)).validate(inputs(own, x, None))
    # What the engine would refuse mid-run, refused at submit in its words.
    assert labels_unused_problem(inputs(own, x, None)) is None
    assert labels_unused_problem(inputs(own, x, y)) == model_loss_with_labels("self_scoring")
    stepped = sz.TorchFilter(TokenTagger(), step=masked_token_step).named("tagger")
    assert lone_steps_problem(inputs(sz.Graph([stepped]), x, None)) is None
    before = sz.TorchFilter(torch.nn.Linear(2, 2)).named("before")
    assert "a filter with a step trains alone" in str(
        lone_steps_problem(inputs(before >> stepped, x, None))
    )
    assert np.asarray(y).shape == (20,)


def test_sequence_logits_train_through_data_parallel():
    x, _ = token_rows()
    ids = x["ids"]
    graph = sz.Graph([sz.TorchFilter(TokenTagger(), loss="cross_entropy", **SETTINGS)])
    states, _, _ = run(
        DataParallel(DataParallelOptions(workers=2)),
        graph,
        ids[:, :-1],
        ids[:, 1:],
        InMemoryContext(2, Daemon),
    )

    def every_token(net, xb, yb):
        logits = net(*xb)
        return F.cross_entropy(logits.reshape(-1, VOCAB), yb.reshape(-1)), {}

    model, _ = plain_loop(TokenTagger(), (ids[:, :-1],), ids[:, 1:], every_token)
    close(states["token_tagger"], model)


def test_local_stops_after_max_steps_and_other_strategies_refuse_it_at_submit():
    from coordinator.strategies import Local
    from protocol.options.strategies import LocalOptions

    x, y = token_rows()  # 150 rows: 10 steps an epoch
    graph = sz.Graph([sz.TorchFilter(MaskedPool(), loss="cross_entropy", max_steps=7, **SETTINGS)])
    states, _, _ = run(Local(LocalOptions()), graph, x, y, InMemoryContext(1, Daemon))
    # graph.fit stops after max_steps as a plain loop does (tests/somatize/test_own_model.py);
    # Local runs the same loop on a worker.
    expected = graph.fit(x, y)
    assert [row["epoch"] for row in expected.history] == [1]
    for key, value in expected.states["masked_pool"].items():
        torch.testing.assert_close(torch.as_tensor(states["masked_pool"][key]), value)
    job = inputs(graph, x, y)
    assert steps_limits_problem("local", job) is None
    assert steps_limits_problem("data_parallel", job) == (
        "node 'masked_pool' has max_steps=7, which data_parallel does not honour yet "
        "(graph.fit and Local do): give it epochs instead"
    )
    every = sz.Graph([sz.TorchFilter(MaskedPool(), validate_every=3)])
    assert "graph.fit alone validates between them" in str(
        steps_limits_problem("local", inputs(every, x, y))
    )
