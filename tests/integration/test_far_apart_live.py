"""What runs for workers far apart, on live workers: DiLoCo gives a plain-torch DiLoCo loop's
answer, and DataParallel's when it synchronises every step with an outer SGD of lr 1 and no
momentum; DataParallel's compressed gradients (torch's DDP communication hooks) train to within
their error of graph.fit's."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import somatize as sz
from tests.coordinator.strategies.data_parallel.test_data_parallel import (
    OPTIMIZERS,
    dataset,
    graph_for,
    model,
    reference_training,
)
from tests.integration.cluster import Cluster, cluster
from tests.utils import UNIT

pytestmark = pytest.mark.integration


def diloco_by_hand(
    x,
    y,
    optimizer: str,
    replicas: int,
    sync_every: int,
    outer_lr: float,
    outer_momentum: float,
    epochs: int = 3,
    batch_size: int = 32,
    shuffle: bool = True,
    validation=None,
):
    """DiLoCo (Douillard et al. 2023, Algorithm 1) in plain torch, on the global batches
    ``graph.fit`` takes: each replica steps on its ``numpy.array_split`` slice with an inner
    optimizer of its own (kept), its loss weighted by its share of the global batch; after every
    ``sync_every`` steps of an epoch and at its end the mean of θ_global − θ_local is the
    gradient of one outer Nesterov-SGD step, and every replica starts again from θ_global.
    With ``validation`` (centred as the training rows), also the global model's loss on it
    at each epoch's end."""
    _, make = OPTIMIZERS[optimizer]
    xt, yt = torch.as_tensor(x - x.mean(0)), torch.as_tensor(y)
    global_net = copy.deepcopy(model())
    outer = torch.optim.SGD(
        global_net.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=True
    )
    nets = [copy.deepcopy(global_net) for _ in range(replicas)]
    inner = [make(net.parameters()) for net in nets]
    order = torch.Generator().manual_seed(11)
    steps = -(-len(xt) // batch_size)
    val_losses = []
    for _ in range(epochs):
        rows = torch.randperm(len(xt), generator=order) if shuffle else torch.arange(len(xt))
        for step in range(steps):
            batch = rows[step * batch_size : (step + 1) * batch_size].numpy()
            for net, opt, part in zip(nets, inner, np.array_split(batch, replicas), strict=True):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(net(xt[part]), yt[part])
                (loss * (len(part) * replicas / len(batch))).backward()
                opt.step()
            if (step + 1) % sync_every and step + 1 != steps:
                continue
            with torch.no_grad():
                for g, *local in zip(
                    global_net.parameters(), *(n.parameters() for n in nets), strict=True
                ):
                    g.grad = torch.stack([g - p for p in local]).mean(0)
            outer.step()
            for net in nets:
                net.load_state_dict(global_net.state_dict())
        if validation is not None:
            xv, yv = (torch.as_tensor(a) for a in validation)
            with torch.no_grad():
                val_losses.append(float(torch.nn.functional.cross_entropy(global_net(xv), yv)))
    return global_net.state_dict(), val_losses


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[tuple[Cluster, sz.Client]]:
    """One cluster of two workers for the module (its start is most of a test's time)."""
    directory = tmp_path_factory.mktemp("far-apart")
    with cluster(directory, {"w1": (), "w2": ()}) as c, sz.connect(c.url) as connected:
        yield c, connected


@pytest.fixture
def client(live) -> sz.Client:
    return live[1]


@pytest.mark.parametrize("collective", ["torch", "coordinator"])
def test_diloco_equals_a_plain_torch_diloco_loop_and_data_parallel_when_it_syncs_every_step(
    client, collective
):
    """203 rows in shuffled batches of 32 (uneven slices), 3 epochs over 2 replicas: Adam
    inner steps with a sync every 3 steps (and at each epoch's end, every 7th step) equal the
    loop above; SGD with momentum synchronised every step by an outer SGD of lr 1 and no
    momentum equals DataParallel's answer, graph.fit's. Over a torch group the replicas take
    the outer step themselves; through the coordinator (workers that cannot reach each other)
    the coordinator averages their weights and takes it: the same answer."""
    x, y = dataset()
    x_val, y_val = dataset(n=50, seed=9)
    strategy = sz.DiLoCo(2, 3, 0.7, 0.9, collective=collective)
    graph = graph_for("adam", shuffle=True)
    job = client.submit(graph, x, y, strategy=strategy, validation=(x_val, y_val))
    fitted = job.result(timeout=120 * UNIT)
    record = job.status()
    placed = placed_event(job)
    every_step = sz.DiLoCo(2, 1, 1.0, 0.0, collective=collective)
    as_dp = client.submit(graph_for("sgd", shuffle=True), x, y, strategy=every_step)
    synced = as_dp.result(timeout=120 * UNIT)
    expected, val_losses = diloco_by_hand(
        x,
        y,
        "adam",
        2,
        sync_every=3,
        outer_lr=0.7,
        outer_momentum=0.9,
        validation=(x_val - x.mean(0), y_val),  # the Center fitted on the training rows
    )
    for key, value in expected.items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
    assert [row["epoch"] for row in fitted.history] == [1, 2, 3]
    for row, val_loss in zip(fitted.history, val_losses, strict=True):
        assert row["val_loss"] == pytest.approx(val_loss, abs=1e-5)
    assert record["strategy"] == "diloco"
    assert record["progress"]["step"] == record["progress"]["steps"] == 21
    assert placed.data["collective"] == collective
    values = 6 * 16 + 16 + 16 * 3 + 3  # the MLP's trainable parameters
    assert (placed.data["sync_bytes"], placed.data["sync_every"]) == (4 * values, 3)
    data_parallel = reference_training(x, y, "sgd", shuffle=True)
    for key, value in data_parallel.items():
        torch.testing.assert_close(synced.states["mlp"][key], value, rtol=0, atol=1e-5)
    # Not DataParallel's: the same job synchronised every 3 steps gives another model.
    apart, _ = diloco_by_hand(x, y, "adam", 2, sync_every=1, outer_lr=0.7, outer_momentum=0.9)
    assert not torch.allclose(apart["2.weight"], expected["2.weight"], atol=1e-4)


def placed_event(job: sz.Job):
    return next(e for e in job.events(timeout=30 * UNIT) if e.event == "placed")


@pytest.mark.parametrize(("compression", "atol"), [("fp16", 2e-3), ("powersgd:1", 0.1)])
def test_compressed_gradients_train_to_within_their_error_of_graph_fit(client, compression, atol):
    """SGD with momentum, 21 steps over 2 replicas: fp16 rounds each gradient (2⁻¹¹
    relative), PowerSGD sends a rank-1 factorisation with error feedback: each ends
    close to graph.fit's model, none equal to it, and the placed event says what ran."""
    x, y = dataset()
    strategy = sz.DataParallel(2, collective="torch", compression=compression)
    job = client.submit(graph_for("sgd"), x, y, strategy=strategy)
    fitted = job.result(timeout=120 * UNIT)
    expected = reference_training(x, y, "sgd")
    differences = [
        float((torch.as_tensor(fitted.states["mlp"][key]) - value).abs().max())
        for key, value in expected.items()
    ]
    assert 0 < max(differences) <= atol, differences
    placed = placed_event(job)
    assert (placed.data["collective"], placed.data["compression"]) == ("torch", compression)
    # fp16: 2 bytes a gradient. PowerSGD rank 1: the 16x6 and 3x16 matrices as their factors,
    # 16 + 6 and 3 + 16 values (under half of 96 and 48), the biases whole; 4 bytes a value.
    by_hand = {"fp16": 2 * (6 * 16 + 16 + 16 * 3 + 3), "powersgd:1": 4 * (22 + 16 + 19 + 3)}
    assert placed.data["step_bytes"] == by_hand[compression]


def test_auto_falls_back_to_the_coordinator_when_the_replicas_group_cannot_form(live):
    """Two workers that reach the rendezvous but one of whose gloo cannot connect (it is told
    to use an interface that does not exist): ``auto`` tries the group, trains through the
    coordinator and says why; so does DiLoCo, which then takes its outer steps there."""
    c, client = live
    c.start_worker("w3", "apart")
    c.start_worker("w4", "apart", prefix=["env", "GLOO_SOCKET_IFNAME=nowhere0"])
    x, y = dataset(n=64)
    graph = graph_for("sgd", epochs=1)
    # The trial group waits for w4 at most collective_timeout (10 s by default).
    strategy = sz.DataParallel(2, tag="apart", collective_timeout=3 * UNIT)
    job = client.submit(graph, x, y, strategy=strategy)
    fitted = job.result(timeout=120 * UNIT)
    placed = placed_event(job)
    assert placed.data["collective"] == "coordinator"
    reason = placed.data["collective_reason"]
    assert "every replica reached the rendezvous" in reason
    # Which replica's failure it names depends on which came first: w4's (no such interface)
    # or w3's (w4 never connected).
    assert "but their group did not form: worker " in reason, reason
    expected = reference_training(x, y, "sgd", epochs=1)
    for key, value in expected.items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
    strategy = sz.DiLoCo(2, 1, 1.0, 0.0, tag="apart", collective_timeout=3 * UNIT)
    diloco = client.submit(graph, x, y, strategy=strategy)
    synced = diloco.result(timeout=120 * UNIT)
    assert placed_event(diloco).data["collective"] == "coordinator"
    for key, value in expected.items():  # H = 1, an outer SGD of lr 1: DataParallel's
        torch.testing.assert_close(synced.states["mlp"][key], value, rtol=0, atol=1e-5)
