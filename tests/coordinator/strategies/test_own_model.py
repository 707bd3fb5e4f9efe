"""Your own model in every strategy, in process (InMemoryContext, real daemons' engines): a
dict batch through DataParallel, FedAvg and a pipeline whose first stage takes the dict, a
``step=`` function and a model that computes its own loss through DataParallel — each against
the plain torch loop of :mod:`tests.somatize.own_models`; and what the coordinator refuses at
submit."""

from __future__ import annotations

import dataclasses

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
from tests.somatize.test_own_model import (
    SETTINGS,
    assert_stopped_like_the_loop,
    close,
    cross_entropy,
    stopped_loop,
    stopped_run,
)
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
    # The step function's metric, each epoch's mean over rows as the plain loop has it.
    assert [p["token_accuracy"] for p in epochs] == pytest.approx(
        [h["token_accuracy"] for h in history], abs=1e-6
    )

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


def test_fedavg_with_a_step_function_reports_its_metric_per_round():
    x, _ = token_rows(100)
    graph = sz.Graph([sz.TorchFilter(TokenTagger(), step=masked_token_step, **SETTINGS)])
    _, progress, _ = run(
        FedAvg(FedAvgOptions(rounds=1, local_epochs=2)), graph, x, None, InMemoryContext(2, Daemon)
    )
    # By hand: each half trained alone; the round's figures are the halves' last local
    # epochs', weighted by rows (50 and 50).
    halves = [slice(0, 50), slice(50, 100)]
    trained = [
        plain_loop(
            TokenTagger(),
            {k: v[h] for k, v in x.items()},
            None,
            lambda m, b, _: masked_token_step(m, b),
        )
        for h in halves
    ]
    (row,) = [p for p in progress if p.get("phase") == "round"]
    want = sum(history[-1]["token_accuracy"] for _, history in trained) / 2
    assert row["token_accuracy"] == pytest.approx(want, abs=1e-6)
    assert row["loss"] == pytest.approx(sum(h[-1]["loss"] for _, h in trained) / 2, abs=1e-6)


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


def _trained(progress: list[dict]) -> dict:
    """A run's last progress event: its history and validations."""
    return next(p for p in progress if p.get("phase") == "trained")


@pytest.mark.parametrize("strategy", ["local", "data_parallel_2", "data_parallel_3"])
def test_max_steps_and_validate_every_run_as_the_plain_loop(strategy):
    from coordinator.strategies import Local
    from protocol.options.strategies import LocalOptions

    net, x, y, x_val, y_val = stopped_run()
    graph = sz.Graph([net])
    job = dataclasses.replace(inputs(graph, x, y), x_val=x_val, y_val=y_val)
    workers = int(strategy[-1]) if strategy.startswith("data_parallel") else 1
    chosen = (
        Local(LocalOptions())
        if strategy == "local"
        else DataParallel(DataParallelOptions(workers=workers))
    )
    states, progress, _ = run(chosen, graph, x, y, InMemoryContext(workers, Daemon), job)
    model, losses, scores = stopped_loop(x, y, x_val, y_val)
    trained = _trained(progress)
    assert_stopped_like_the_loop(trained["history"], trained["validations"], losses, scores)
    close(states["mlp"], model)
    if strategy != "local":  # where it stopped, as each step's event said
        steps = [p for p in progress if p.get("phase") == "training" and "step" in p]
        assert (steps[-1]["step"], steps[-1]["steps"], steps[-1]["epochs"]) == (20, 20, 2)
        assert [p["step"] for p in progress if p.get("phase") == "validation"] == [5, 10, 15]


def test_steps_limits_are_refused_where_a_strategy_cannot_keep_them():
    x, y = token_rows()
    stopped = inputs(sz.Graph([sz.TorchFilter(MaskedPool(), max_steps=7)]), x, y)
    every = inputs(sz.Graph([sz.TorchFilter(MaskedPool(), validate_every=3)]), x, y)
    for name in ("local", "data_parallel", "diloco"):
        assert steps_limits_problem(name, stopped) is None
    for name in ("local", "data_parallel", "diloco"):  # DiLoCo synchronises there
        assert steps_limits_problem(name, every) is None
    assert steps_limits_problem("fedavg", stopped) == (
        "node 'masked_pool' has max_steps=7: a federated job's horizon is its rounds (each "
        "client trains its epochs every round): give rounds= and epochs= instead"
    )
    assert "model_parallel does not honour it yet" in str(
        steps_limits_problem("model_parallel", stopped)
    )
    assert steps_limits_problem("fedavg", every) == (
        "node 'masked_pool' has validate_every=3: a federated job's horizon is its rounds (each "
        "client trains its epochs every round): give rounds= and epochs= instead"
    )
