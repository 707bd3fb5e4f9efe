"""Validation data and metrics in every strategy, in process (InMemoryContext): each epoch's
(round's) row — ``loss``, ``lr``, ``val_loss``, ``accuracy`` — in the job's events and its last
event's history, against the independent plain torch loop's own evaluation of its model at
that epoch's end."""

from __future__ import annotations

import asyncio

import pytest
import torch

import somatize as sz
from coordinator.context import InMemoryContext, WorkerIdentity
from coordinator.storage.checkpoints import CheckpointStore, JobCheckpoints
from coordinator.strategies import DataParallel, FedAvg, JobInputs, Local, ModelParallel
from protocol.filters import dump_filter
from protocol.options.strategies import (
    DataParallelOptions,
    FedAvgOptions,
    LocalOptions,
    ModelParallelOptions,
    PartitionOptions,
)
from somatize.remote.client import graph_info
from tests.coordinator.strategies.model_parallel.test_checkpoints import LosesAStage
from tests.coordinator.strategies.test_training_options import OPTIONS
from tests.training_reference import classes, evaluation, mlp, reference_fit
from worker.daemon.main import Daemon

VALIDATION_OPTIONS = OPTIONS | {"clip_grad_norm": None, "metrics": ("accuracy",)}


def net_graph(**options) -> sz.Graph:
    return sz.Graph([sz.TorchFilter(mlp(), **(VALIDATION_OPTIONS | options)).named("mlp")])


def split_graph(**options) -> sz.Graph:
    whole = mlp()
    first = sz.TorchFilter(torch.nn.Sequential(whole[0], whole[1]), **(OPTIONS | options))
    last = sz.TorchFilter(torch.nn.Sequential(whole[2]), **(VALIDATION_OPTIONS | options))
    return first.named("a") >> last.named("b")


def run(strategy, graph, ctx, checkpoints=None):
    x, y = classes()
    x_val, y_val = classes(n=61, seed=2)
    job = JobInputs(
        graph.node_ids,
        {n: dump_filter(f) for n, f in graph.items()},
        x,
        y,
        graph_info(graph),
        x_val=x_val,
        y_val=y_val,
        checkpoints=checkpoints,
    )
    events: list[dict] = []

    async def emit(event, data):
        if event == "progress":
            events.append(data)

    strategy.validate(job)
    states = asyncio.run(strategy.run(ctx, job, emit))
    return states, events


def expected(**options):
    x, y = classes()
    x_val, y_val = classes(n=61, seed=2)
    figures: list[dict[str, float]] = []
    reference = reference_fit(
        mlp(), x, y, cosine=True, at_epoch_end=evaluation(x_val, y_val, figures), **options
    )
    return reference, figures


def check_rows(events, reference, figures, unit="epoch"):
    rows = [e for e in events if e.get("phase") == unit]
    history = next(e for e in events if e.get("phase") == "trained")["history"]
    assert [{k: v for k, v in r.items() if k != "phase"} for r in rows] == history
    per_epoch = len(reference.lrs) // len(figures)
    assert [r[unit] for r in rows] == list(range(1, len(figures) + 1))
    for row, loss, lr, scores in zip(
        rows,
        reference.epoch_losses,
        reference.lrs[per_epoch - 1 :: per_epoch],
        figures,
        strict=True,
    ):
        assert row["loss"] == pytest.approx(loss, abs=1e-5)
        assert row["lr"] == pytest.approx(lr, abs=1e-12)
        assert row["val_loss"] == pytest.approx(scores["val_loss"], abs=1e-5)
        assert row["accuracy"] == pytest.approx(
            scores["accuracy"], abs=1e-6
        )  # float32 vs float64 mean


@pytest.mark.parametrize("workers", [2, 3])
def test_data_parallel_evaluates_the_model_at_each_epochs_end(workers):
    reference, figures = expected(accumulate=2)
    _, events = run(
        DataParallel(DataParallelOptions(workers=workers)),
        net_graph(accumulate=2),
        InMemoryContext(workers, Daemon),
    )
    check_rows(events, reference, figures)


def test_local_evaluates_the_model_at_each_epochs_end():
    reference, figures = expected()
    _, events = run(Local(LocalOptions()), net_graph(), InMemoryContext(1, Daemon))
    check_rows(events, reference, figures)


def test_model_parallel_evaluates_the_whole_pipeline_at_each_epochs_end():
    reference, figures = expected()
    parts = [PartitionOptions(node_ids=(n,), tag=f"s{i}") for i, n in enumerate("ab")]
    workers = [WorkerIdentity(f"w{i}", frozenset({f"s{i}"})) for i in range(2)]
    _, events = run(
        ModelParallel(ModelParallelOptions(partitions=parts, micro_batches=2)),
        split_graph(),
        InMemoryContext(workers, Daemon),
    )
    check_rows(events, reference, figures)


def _pipeline(**options) -> tuple[ModelParallel, list[WorkerIdentity]]:
    parts = [PartitionOptions(node_ids=(n,), tag=f"s{i}") for i, n in enumerate("ab")]
    workers = [WorkerIdentity(f"w{i}", frozenset({f"s{i}"})) for i in range(2)]
    return ModelParallel(
        ModelParallelOptions(partitions=parts, micro_batches=2, **options)
    ), workers


def test_a_pipeline_resumed_mid_epoch_goes_on_with_its_schedule_and_its_history(tmp_path):
    """Resumed after global batch 5 of 13 in epoch 1: the stages' schedulers come back with
    their optimizers, and the history with the checkpoint (epoch 1's loss so far), so every
    row and learning rate is the undisturbed plain loop's."""
    reference, figures = expected()
    store = CheckpointStore(tmp_path)
    strategy, workers = _pipeline(checkpoint_every=5, keep_checkpoints=10)
    saves = JobCheckpoints("job", store, 10, _ignore, None)
    run(strategy, split_graph(), InMemoryContext(workers, Daemon), saves)
    checkpoint = store.read("job", store.positions("job")[0][0])
    assert checkpoint.position == {"step": 5, "epoch": 1}
    again = JobCheckpoints("job", CheckpointStore(tmp_path / "again"), 2, _ignore, checkpoint)
    strategy, workers = _pipeline()
    _, events = run(strategy, split_graph(), InMemoryContext(workers, Daemon), again)
    check_rows(events, reference, figures)
    lrs = [e["lr"] for e in events if e.get("phase") == "training"]
    assert lrs == pytest.approx(reference.lrs[5:], abs=1e-12)


def test_a_stage_failed_over_mid_run_leaves_one_row_an_epoch(tmp_path):
    """Stage 1's worker lost in global batch 18 (epoch 2, after epoch 1's row was given): the
    spare goes back to the checkpoint after batch 15 with the history as it stood there."""
    reference, figures = expected()
    strategy, workers = _pipeline(checkpoint_every=5)
    ctx = LosesAStage([*workers, WorkerIdentity("spare0")], Daemon)
    ctx.lose_at = 35  # stage 1's forwards: two micro-batches a global batch
    store = CheckpointStore(tmp_path)
    _, events = run(strategy, split_graph(), ctx, JobCheckpoints("job", store, 2, _ignore, None))
    assert [w.id for w in ctx.workers] == ["w0", "spare0", "w1"]  # it failed over
    steps = [e["step"] for e in events if e.get("phase") == "training"]
    assert steps[:18] == [*range(1, 18), 16]  # batches 16 and 17 again, from the spare
    check_rows(events, reference, figures)


async def _ignore(event, data):
    return None


def test_fedavg_evaluates_the_global_model_each_round():
    """One client, plain SGD, no schedule: each round is an epoch from the global model (a
    fresh optimizer and the first shuffle each round), evaluated after it."""
    graph = net_graph(optimizer_options={}, scheduler=None, epochs=1)
    _, events = run(FedAvg(FedAvgOptions(rounds=3)), graph, InMemoryContext(1, Daemon))
    x, y = classes()
    x_val, y_val = classes(n=61, seed=2)
    figures: list[dict[str, float]] = []
    net, losses = mlp(), []
    for _ in range(3):
        one = reference_fit(
            net, x, y, momentum=0.0, epochs=1, at_epoch_end=evaluation(x_val, y_val, figures)
        )
        net, losses = one.model, losses + one.epoch_losses
    rows = [e for e in events if e.get("phase") == "round"]
    assert [r["round"] for r in rows] == [1, 2, 3]
    for row, loss, scores in zip(rows, losses, figures, strict=True):
        assert row["loss"] == pytest.approx(loss, abs=1e-5)
        assert row["val_loss"] == pytest.approx(scores["val_loss"], abs=1e-5)
        assert row["accuracy"] == pytest.approx(
            scores["accuracy"], abs=1e-6
        )  # float32 vs float64 mean
    history = next(e for e in events if e.get("phase") == "trained")["history"]
    assert [r["round"] for r in history] == [1, 2, 3]
