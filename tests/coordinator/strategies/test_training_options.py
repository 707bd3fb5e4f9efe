"""DataParallel, ModelParallel, FedAvg and Local with a learning-rate schedule, clipping and
accumulation, in process (InMemoryContext): each equals ``graph.fit`` equals the independent
plain torch loop of :mod:`tests.training_reference`; and a DataParallel checkpoint keeps the
scheduler's state."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import math

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
from tests.training_reference import FILTER, classes, mlp, reference_fit
from worker.daemon.main import Daemon

OPTIONS = FILTER | {"scheduler": "cosine", "clip_grad_norm": 0.5}


def net_graph(**options) -> sz.Graph:
    return sz.Graph([sz.TorchFilter(mlp(), **(OPTIONS | options)).named("mlp")])


def split_graph(**options) -> sz.Graph:
    """The same MLP as two TorchFilters, one per pipeline stage: each with its own optimizer
    and cosine schedule (the same numbers as one over both), clipping and accumulation the
    last one's."""
    whole = mlp()
    first = sz.TorchFilter(torch.nn.Sequential(whole[0], whole[1]), **(OPTIONS | options))
    last = sz.TorchFilter(torch.nn.Sequential(whole[2]), **(OPTIONS | options))
    return first.named("a") >> last.named("b")


def inputs(graph: sz.Graph, x, y) -> JobInputs:
    filters = {n: dump_filter(f) for n, f in graph.items()}
    return JobInputs(graph.node_ids, filters, x, y, graph_info(graph))


def run(strategy, graph, x, y, ctx, job=None):
    events: list[tuple[str, dict]] = []

    async def emit(event, data):
        events.append((event, data))

    job = inputs(graph, x, y) if job is None else job
    strategy.validate(job)
    states = asyncio.run(strategy.run(ctx, job, emit))
    return states, [d for e, d in events if e == "progress"], events


def assert_close(states, expected, atol=1e-5):
    assert states.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(states[key]), value, rtol=0, atol=atol)


def joined(states) -> dict[str, torch.Tensor]:
    """The split model's states under the whole MLP's keys."""
    return {
        "0.weight": states["a"]["0.weight"],
        "0.bias": states["a"]["0.bias"],
        "2.weight": states["b"]["0.weight"],
        "2.bias": states["b"]["0.bias"],
    }


def test_data_parallel_with_a_cosine_schedule_clipping_and_accumulation_equals_graph_fit():
    x, y = classes()
    graph = net_graph(accumulate=3)
    expected = reference_fit(mlp(), x, y, accumulate=3, clip=0.5, cosine=True)
    fitted = graph.fit(x, y).states["mlp"]
    assert_close(fitted, expected.state())
    states, progress, _ = run(
        DataParallel(DataParallelOptions(workers=2)), graph, x, y, InMemoryContext(2, Daemon)
    )
    assert_close(states["mlp"], expected.state())
    steps = [p for p in progress if p.get("phase") == "training"]
    assert [p["step"] for p in steps] == list(range(1, 16))  # 5 steps of 48 rows an epoch
    assert [p["lr"] for p in steps] == pytest.approx(expected.lrs, abs=1e-12)


def test_an_epoch_wise_schedule_steps_at_each_epochs_end_in_data_parallel():
    x, y = classes()
    graph = net_graph(scheduler_interval="epoch", clip_grad_norm=None, epochs=4)
    expected = reference_fit(mlp(), x, y, cosine=True, interval="epoch", epochs=4)
    states, progress, _ = run(
        DataParallel(DataParallelOptions(workers=3)), graph, x, y, InMemoryContext(3, Daemon)
    )
    assert_close(states["mlp"], expected.state())
    lrs = [p["lr"] for p in progress if p.get("phase") == "training"]
    assert lrs == pytest.approx(expected.lrs, abs=1e-12)
    assert len(set(lrs)) == 4  # one learning rate an epoch


@pytest.mark.parametrize("order", ["gpipe", "1f1b"])
def test_model_parallel_with_a_cosine_schedule_clipping_and_accumulation_equals_graph_fit(order):
    x, y = classes()
    graph = split_graph(accumulate=2)
    expected = reference_fit(mlp(), x, y, accumulate=2, clip=0.5, cosine=True)
    assert_close(joined(graph.fit(x, y).states), expected.state())
    parts = [PartitionOptions(node_ids=(n,), tag=f"s{i}") for i, n in enumerate("ab")]
    workers = [WorkerIdentity(f"w{i}", frozenset({f"s{i}"})) for i in range(2)]
    ctx = InMemoryContext(workers, Daemon)
    states, progress, _ = run(
        ModelParallel(ModelParallelOptions(partitions=parts, micro_batches=2, schedule=order)),
        graph,
        x,
        y,
        ctx,
    )
    assert_close(joined(states), expected.state())
    lrs = [p["lr"] for p in progress if p.get("phase") == "training"]
    assert lrs == pytest.approx(expected.lrs, abs=1e-12)


def test_clipping_in_a_pipeline_is_of_the_whole_models_gradient():
    """Clipped per stage, the result would differ: the stages' norms are added first."""
    x, y = classes()
    graph = split_graph(scheduler=None, clip_grad_norm=0.05, epochs=1)
    expected = reference_fit(mlp(), x, y, clip=0.05, epochs=1)
    parts = [PartitionOptions(node_ids=(n,), tag=f"s{i}") for i, n in enumerate("ab")]
    workers = [WorkerIdentity(f"w{i}", frozenset({f"s{i}"})) for i in range(2)]
    states, _, _ = run(
        ModelParallel(ModelParallelOptions(partitions=parts)),
        graph,
        x,
        y,
        InMemoryContext(workers, Daemon),
    )
    assert_close(joined(states), expected.state())
    per_stage = copy.deepcopy(mlp())
    opt = torch.optim.SGD(per_stage.parameters(), lr=0.1, momentum=0.9)
    order = torch.Generator().manual_seed(7)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    rows = torch.randperm(len(xt), generator=order)
    for s in range(0, len(xt), 16):
        opt.zero_grad()
        b = rows[s : s + 16]
        torch.nn.functional.cross_entropy(per_stage(xt[b]), yt[b]).backward()
        torch.nn.utils.clip_grad_norm_(list(per_stage[0].parameters()), 0.05)
        torch.nn.utils.clip_grad_norm_(list(per_stage[2].parameters()), 0.05)
        opt.step()
    gap = float((joined(states)["0.weight"] - per_stage.state_dict()["0.weight"]).abs().max())
    assert gap > 1e-4  # the test can tell the two apart


def test_local_reports_each_epochs_learning_rate():
    x, y = classes()
    graph = net_graph(accumulate=2)
    expected = reference_fit(mlp(), x, y, accumulate=2, clip=0.5, cosine=True)
    states, progress, _ = run(Local(LocalOptions()), graph, x, y, InMemoryContext(1, Daemon))
    assert_close(states["mlp"], expected.state())
    trained = next(p for p in progress if p.get("phase") == "trained")
    per_epoch = len(expected.lrs) // 3
    lrs = [row["lr"] for row in trained["history"]]
    assert lrs == pytest.approx(expected.lrs[per_epoch - 1 :: per_epoch])


def test_fedavg_clients_continue_the_runs_schedule_from_round_to_round():
    """One client, plain SGD: each round is one epoch from the global model with a fresh
    optimizer, its cosine schedule (over all the rounds' steps) where the last round left it."""
    x, y = classes()
    graph = net_graph(optimizer_options={}, clip_grad_norm=None, epochs=1)
    states, progress, _ = run(
        FedAvg(FedAvgOptions(rounds=3)), graph, x, y, InMemoryContext(1, Daemon)
    )
    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=13 * 3)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    lrs = []
    for _ in range(3):
        rows = torch.randperm(len(xt), generator=torch.Generator().manual_seed(7))
        for s in range(0, len(xt), 16):
            opt.zero_grad()
            b = rows[s : s + 16]
            torch.nn.functional.cross_entropy(net(xt[b]), yt[b]).backward()
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    assert_close(states["mlp"], net.state_dict())
    rounds = [p for p in progress if p.get("phase") == "round"]
    assert [p["lr"] for p in rounds] == pytest.approx(lrs[12::13])


def _decay(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1 / (1 + 0.05 * t))


@pytest.mark.parametrize(
    ("scheduler", "factor"),
    [
        ("cosine", lambda t, total: (1 + math.cos(math.pi * t / total)) / 2),
        (_decay, lambda t, total: 1 / (1 + 0.05 * t)),  # from its base: not chainable
    ],
)
def test_a_client_configs_learning_rate_is_the_base_of_the_runs_schedule(scheduler, factor):
    """FedAvg's client_config (issue 19) sets each round's lr and local epochs; the schedule
    spans every round's epochs and starts each round where the last left it, from that round's
    lr: at the run's step t (from 0, T in all) a round of lr η steps with η · factor(t, T),
    written out here rather than taken from a torch scheduler."""
    x, y = classes()
    graph = net_graph(optimizer_options={}, clip_grad_norm=None, epochs=1, scheduler=scheduler)
    config = [{"lr": 0.1}, {"lr": 0.05, "local_epochs": 2}, {"lr": 0.02}]
    strategy = FedAvg(FedAvgOptions(rounds=3, client_config=config))
    states, progress, _ = run(strategy, graph, x, y, InMemoryContext(1, Daemon))
    net = mlp()
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    total, t, lrs = 13 * 4, 0, []  # 13 steps an epoch, 4 epochs in the three rounds
    for round_config in config:
        opt = torch.optim.SGD(net.parameters(), lr=round_config["lr"])
        order = torch.Generator().manual_seed(7)
        for _ in range(round_config.get("local_epochs", 1)):
            rows = torch.randperm(len(xt), generator=order)
            for s in range(0, len(xt), 16):
                lr = round_config["lr"] * factor(t, total)
                opt.param_groups[0]["lr"] = lr
                opt.zero_grad()
                b = rows[s : s + 16]
                torch.nn.functional.cross_entropy(net(xt[b]), yt[b]).backward()
                opt.step()
                t, lrs = t + 1, [*lrs, lr]
    assert_close(states["mlp"], net.state_dict())
    rounds = [p for p in progress if p.get("phase") == "round"]
    assert [p["lr"] for p in rounds] == pytest.approx([lrs[12], lrs[38], lrs[51]], abs=1e-12)


def test_a_data_parallel_run_resumed_from_a_checkpoint_keeps_its_schedule(tmp_path):
    x, y = classes()
    graph = net_graph(accumulate=2)
    job = inputs(graph, x, y)
    store = CheckpointStore(tmp_path)
    strategy = DataParallel(DataParallelOptions(workers=2, checkpoint_every=4, keep_checkpoints=10))
    saves = JobCheckpoints("job", store, strategy.keep_checkpoints, _ignore, None)
    straight, _, _ = run(
        strategy,
        graph,
        x,
        y,
        InMemoryContext(2, Daemon),
        dataclasses.replace(job, checkpoints=saves),
    )
    checkpoint = store.read("job", store.positions("job")[1][0])  # after step 8 of 21
    assert checkpoint.position["step"] == 8
    again = JobCheckpoints("job", CheckpointStore(tmp_path / "again"), 2, _ignore, checkpoint)
    resumed, progress, _ = run(
        DataParallel(DataParallelOptions(workers=2)),
        graph,
        x,
        y,
        InMemoryContext(2, Daemon),
        dataclasses.replace(job, checkpoints=again),
    )
    assert_close(resumed["mlp"], {k: torch.as_tensor(v) for k, v in straight["mlp"].items()}, 1e-6)
    expected = reference_fit(mlp(), x, y, accumulate=2, clip=0.5, cosine=True)
    assert_close(resumed["mlp"], expected.state())
    lrs = [p["lr"] for p in progress if p.get("phase") == "training"]
    assert lrs == pytest.approx(expected.lrs[8:], abs=1e-12)


async def _ignore(event, data):
    return None
