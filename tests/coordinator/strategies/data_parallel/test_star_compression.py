"""DataParallel through the coordinator with compressed gradients, in memory (real daemons):
both legs of the star compressed equal a plain-torch loop that compresses them alike
(DoubleSqueeze with int8), and a replica whose compressed gradients cannot be decoded fails the
job naming its worker."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from coordinator.context import InMemoryContext
from coordinator.strategies import StrategyFailed
from coordinator.strategies.data_parallel.data_parallel import DataParallel
from protocol.compressed_trees import MARKER
from protocol.options.strategies import DataParallelOptions
from tests.coordinator.strategies.data_parallel.test_data_parallel import (
    OPTIMIZERS,
    dataset,
    graph_for,
    inputs,
    model,
    reference_training,
)
from tests.coordinator.strategies.data_parallel.test_diloco import travelled
from worker.daemon.main import Daemon


def star_by_hand(x, y, optimizer: str, replicas: int, compression: str, epochs: int = 3):
    """Synchronous SGD on ``graph.fit``'s global batches of 32 in order, each cut in
    ``numpy.array_split`` slices: each slice's gradient (of its mean loss) travels as
    :func:`~tests.coordinator.strategies.data_parallel.test_diloco.travelled` has it (int8 with
    the replica's residual), the mean weighted by slice size travels back the same way (int8
    with the coordinator's residual), and the optimizer steps on it."""
    _, make = OPTIMIZERS[optimizer]
    net = model().double()
    opt = make(net.parameters())
    xt, yt = torch.as_tensor(x - x.mean(0)), torch.as_tensor(y)
    residuals: dict[object, torch.Tensor] = {}
    for _ in range(epochs):
        for start in range(0, len(xt), 32):
            batch = np.arange(start, min(start + 32, len(xt)))
            total, rows = None, 0
            for r, part in enumerate(np.array_split(batch, replicas)):
                net.zero_grad()
                torch.nn.functional.cross_entropy(net(xt[part]), yt[part]).backward()
                grads = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
                sent = travelled(grads, compression, residuals, r)
                if total is None:  # Σ wᵢ gᵢ in float32, fused as the coordinator sums
                    total = torch.mul(sent, len(part))
                else:
                    total.add_(sent, alpha=len(part))
                rows += len(part)
            mean = travelled(total.div_(rows), compression, residuals, "coordinator")
            offset = 0
            for p in net.parameters():
                p.grad = mean[offset : offset + p.numel()].view_as(p).to(p.dtype)
                offset += p.numel()
            opt.step()
    return net.state_dict()


def float64_dataset():
    """The dataset in float64, for a float64 model: the replicas' gradients then match the hand
    loop's to ~1e-16, far from flipping an int8 code (a float32 model's ~1e-7 flip a few
    codes over a run, each worth a whole step of its chunk)."""
    x, y = dataset()
    return x.astype(np.float64), y


def run(options: DataParallelOptions, optimizer: str, daemon=Daemon):
    x, y = float64_dataset()
    events: list[tuple[str, dict]] = []

    async def emit(event, data):
        events.append((event, data))

    ctx = InMemoryContext(options.workers, daemon)
    graph = graph_for(optimizer, module=model().double())
    states = asyncio.run(DataParallel(options).run(ctx, inputs(graph, x, y), emit))
    return states, events


@pytest.mark.parametrize("compression", ["fp16", "bf16", "int8"])
def test_both_legs_compressed_equal_the_hand_loop_that_compresses_alike(compression):
    x, y = float64_dataset()
    options = DataParallelOptions(workers=2, collective="coordinator", compression=compression)
    states, _ = run(options, "sgd")
    expected = star_by_hand(x, y, "sgd", 2, compression)
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(states["mlp"][key]), value, rtol=0, atol=1e-7)
    exact = reference_training(x, y, "sgd", module=model().double())
    assert not torch.allclose(exact["2.weight"], expected["2.weight"], rtol=0, atol=1e-6)


class _Garbling(Daemon):
    """A daemon whose compressed gradients claim a row more than they hold."""

    def on_gradients(self, req):
        reply = super().on_gradients(req)
        message = reply["gradients"]
        assert MARKER in message
        message["layout"][0][2][0] += 1  # the first weight, (16, 6), claimed (17, 6)
        return reply


def test_compressed_gradients_that_cannot_be_decoded_fail_the_job_naming_the_worker():
    options = DataParallelOptions(workers=2, collective="coordinator", compression="fp16")
    with pytest.raises(StrategyFailed) as failed:
        run(options, "sgd", daemon=_Garbling)
    message = str(failed.value)
    assert "worker 'mem-0' sent gradients that cannot be decoded" in message
    # Checked against the model's parameters before anything is decoded.
    assert "'mlp'/'0.weight' of shape [17, 6] is not a parameter of the model's node" in message


class _Inflating(Daemon):
    """A daemon whose int8 gradients carry, beside the model's, 4M values of a parameter the
    model does not have, consistent with their own layout (what a hostile worker sends to make
    the coordinator decode far more than the model)."""

    def on_gradients(self, req):
        reply = super().on_gradients(req)
        message = reply["gradients"]
        extra = 1 << 22
        message["layout"].append(["mlp", "planted", [extra]])
        message["values"] = torch.cat([message["values"], torch.ones(extra, dtype=torch.int8)])
        chunks = -(-message["values"].numel() // 4096)
        message["scales"] = torch.ones(chunks, dtype=torch.float32)
        return reply


class _NotFinite(Daemon):
    """A daemon whose gradients hold a NaN on its third step (a hostile or diverged replica):
    the second made of a job's, mem-1."""

    made = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        type(self).made += 1
        self.poisons = type(self).made % 2 == 0
        self.steps = 0

    def on_gradients(self, req):
        reply = super().on_gradients(req)
        self.steps += 1
        if self.poisons and self.steps == 3:
            sent = reply["gradients"]
            if MARKER in sent:  # int8: a scale that is NaN
                sent["scales"][0] = float("nan")
            else:
                next(iter(sent["mlp"].values())).view(-1)[0] = float("nan")
        return reply


def test_compressed_gradients_beyond_the_model_are_refused_before_they_are_decoded():
    options = DataParallelOptions(workers=2, collective="coordinator", compression="int8")
    with pytest.raises(StrategyFailed) as failed:
        run(options, "sgd", daemon=_Inflating)
    message = str(failed.value)
    assert failed.value.info.code == "aggregation_mismatch"
    assert "worker 'mem-0' sent gradients that cannot be decoded" in message
    assert "'mlp'/'planted' of shape [4194304] is not a parameter" in message


@pytest.mark.parametrize("compression", [None, "int8"])
def test_gradients_that_are_not_finite_fail_the_job_naming_the_worker(compression):
    """Issue 53, Medium 3: a NaN in one replica's gradients once let a job succeed with NaN
    weights; it fails the job aggregation_mismatch, naming the replica, at that step."""
    _NotFinite.made = 0
    options = DataParallelOptions(workers=2, collective="coordinator", compression=compression)
    with pytest.raises(StrategyFailed) as failed:
        run(options, "sgd", daemon=_NotFinite)
    assert failed.value.info.code == "aggregation_mismatch"
    message = str(failed.value)
    assert "worker 'mem-1' sent gradients that are not finite (NaN or infinity)" in message
    assert "node 'mlp'" in message
