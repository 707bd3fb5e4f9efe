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
    assert "'values' must be 169 values of torch.float16, not 163 of torch.float16" in message
