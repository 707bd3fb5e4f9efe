"""DataParallel over BatchNorm and Dropout (coordinator collective, in process): it succeeds,
follows the documented buffer rule — replica 0's buffers broadcast to every replica each step,
as DistributedDataParallel's ``broadcast_buffers`` — checked against an independent plain
torch simulation of the replicas; Dropout masks are seeded per replica, so a rerun gives the
same result; and the ``placed`` event says why neither equals ``graph.fit`` exactly."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

import somatize as sz
from coordinator.context import InMemoryContext
from coordinator.strategies import DataParallel, JobInputs
from protocol.filters import dump_filter
from protocol.options.strategies import DataParallelOptions
from somatize.remote.client import graph_info
from tests.training_reference import classes
from worker.daemon.main import Daemon


def bn_model(seed: int = 3) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    )


def dropout_model(seed: int = 3) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3)
    )


def graph_of(module: torch.nn.Module, epochs: int = 2) -> sz.Graph:
    net = sz.TorchFilter(
        module,
        loss="cross_entropy",
        optimizer="sgd",
        lr=0.1,
        optimizer_options={"momentum": 0.9},
        batch_size=32,
        epochs=epochs,
        shuffle=True,
        seed=7,
    )
    return sz.Graph([net.named("net")])


def run(graph: sz.Graph, x, y, workers: int) -> tuple[dict, dict]:
    """The job as the job manager runs it: prepare (its answer is the ``placed`` event's),
    then run."""
    filters = {n: dump_filter(f) for n, f in graph.items()}
    job = JobInputs(graph.node_ids, filters, x, y, graph_info(graph))
    strategy = DataParallel(DataParallelOptions(workers=workers))
    strategy.validate(job)
    ctx = InMemoryContext(workers, Daemon)

    async def emit(event, data):
        return None

    async def both():
        placed = await strategy.prepare(ctx, job, emit)
        return await strategy.run(ctx, job, emit), placed

    states, placed = asyncio.run(both())
    return states, placed


def replicas_reference(module, x, y, workers: int, epochs: int = 2):
    """N replicas of one model in plain torch, stepping together: per step each replica takes
    replica 0's buffers (as they were after the step before), runs its slice of the global
    batch in training mode, and adds its slice's gradient weighted by its rows; replica 0's
    buffers after its forward are the model's."""
    net = copy.deepcopy(module)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    order = torch.Generator().manual_seed(7)

    def buffers():
        return {k: v.clone() for k, v in net.named_buffers()}

    def load(values):
        with torch.no_grad():
            for k, v in net.named_buffers():
                v.copy_(values[k])

    for _ in range(epochs):
        rows = torch.randperm(len(xt), generator=order)
        for s in range(0, len(xt), 32):
            batch = rows[s : s + 32].numpy()
            start, after = buffers(), None
            opt.zero_grad()
            for r, part in enumerate(np.array_split(batch, workers)):
                load(start)  # replica 0's, broadcast before the forward
                index = torch.from_numpy(part)
                loss = torch.nn.functional.cross_entropy(net(xt[index]), yt[index])
                (loss * (len(part) / len(batch))).backward()
                if r == 0:
                    after = buffers()
            load(after)
            opt.step()
    return net.state_dict()


def test_a_batchnorm_model_trains_with_replica_0s_buffers_broadcast_each_step():
    x, y = classes()
    states, placed = run(graph_of(bn_model()), x, y, workers=2)
    expected = replicas_reference(bn_model(), x, y, workers=2)
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(states["net"][key]), value, rtol=0, atol=1e-5)
    (note,) = placed["notes"]
    assert "DataParallel will not equal graph.fit exactly: BatchNorm1d" in note
    assert "replica 0's, broadcast to every replica each step" in note
    # graph.fit normalises each whole batch: another model (the note is not idle talk).
    fitted = graph_of(bn_model()).fit(x, y).states["net"]
    gap = float((fitted["0.weight"] - torch.as_tensor(states["net"]["0.weight"])).abs().max())
    assert gap > 1e-4


def test_dropout_masks_are_seeded_per_replica_so_a_rerun_gives_the_same_result():
    x, y = classes()
    first, placed = run(graph_of(dropout_model()), x, y, workers=2)
    again, _ = run(graph_of(dropout_model()), x, y, workers=2)
    for key, value in first["net"].items():
        assert torch.equal(torch.as_tensor(again["net"][key]), torch.as_tensor(value)), key
    (note,) = placed["notes"]
    assert "Dropout draw their random masks on each replica" in note
    assert "a rerun gives the same result" in note
    fitted = graph_of(dropout_model()).fit(x, y).states["net"]
    gap = float((fitted["0.weight"] - torch.as_tensor(first["net"]["0.weight"])).abs().max())
    assert gap > 1e-4  # masks per replica: not graph.fit's


def test_a_plain_model_gets_no_note_and_sync_batchnorm_is_checked_at_submit():
    x, y = classes()
    plain = torch.nn.Sequential(torch.nn.Linear(6, 3))
    _, placed = run(graph_of(plain, epochs=1), x, y, workers=2)
    assert "notes" not in placed
    # A Dropout with p=0 draws nothing: no note either (a transformer's default config).
    still = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.Dropout(0.0))
    _, placed = run(graph_of(still, epochs=1), x, y, workers=2)
    assert "notes" not in placed
    with pytest.raises(ValueError, match="sync_batchnorm=True needs device='cuda'"):
        sz.DataParallel(2, sync_batchnorm=True)
    with pytest.raises(ValueError, match="needs the torch collective"):
        sz.DataParallel(2, sync_batchnorm=True, device="cuda", collective="coordinator")
    spec = sz.DataParallel(2, sync_batchnorm=True, device="cuda").spec()
    assert DataParallel.from_options(spec.options).options.sync_batchnorm is True
