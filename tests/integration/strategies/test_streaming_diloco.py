"""Streaming DiLoCo on live workers over their torch group (issue 55, item 3): the model in
fragments synchronised at staggered steps, each exchange overlapping the next inner steps and
mixed in when it lands, equals a plain-torch loop doing the same fragment schedule; with one
fragment, no overlap and no mixing the loop is DiLoCo's own."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import somatize as sz
from tests.coordinator.strategies.data_parallel.test_data_parallel import (
    dataset,
    graph_for,
    model,
)
from tests.coordinator.strategies.data_parallel.test_diloco import diloco_by_hand
from tests.integration.cluster import Cluster, cluster
from tests.utils import UNIT

pytestmark = pytest.mark.integration

FRAGMENTS_OF_THE_MLP = [(0, 81), (81, 163)]
"""The MLP's parameters (6·16, 16, 16·3, 3 values: 163), flattened end to end, cut in two runs
of 81 and 82 values: the first weight's 96 values fall in both."""


# A keyword of its own for each of Streaming DiLoCo's options.
def streaming_by_hand(  # noqa: PLR0913
    x,
    y,
    replicas: int,
    every: int,
    fragments: list[tuple[int, int]],
    *,
    overlap: int,
    mixing: float,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    epochs: int = 3,
    batch_size: int = 32,
    validation=None,
    reads: tuple[int, ...] = (),
    validations: list | None = None,
):
    """Streaming DiLoCo (Douillard et al. 2025) in plain torch, on ``graph.fit``'s shuffled
    global batches split over ``replicas`` as DiLoCo's are, Adam inner steps. The model's
    parameters laid end to end in one vector (``parameters_to_vector``), fragment ``p`` holds
    its values ``fragments[p] = (begin, end)`` and synchronises after each step ``s``
    (counted over the run, from 1) with ``s % every == p * every // len(fragments)``, every
    fragment after the last step. A synchronisation takes the mean over replicas of
    θ_global − θ_local for the fragment's values; ``overlap`` steps later (at once after the
    last step, where what is in flight lands first) the fragment's own Nesterov SGD steps its
    θ_global with it, and each replica's values become ``mixing``·local + (1 −
    ``mixing``)·global — θ_global itself after the last step, so that every replica ends
    with the global model. After each step of ``reads`` the global model (every fragment's
    θ_global as it stands, nothing synchronised for it) is evaluated on ``validation``: its
    ``(step, loss)`` appended to ``validations``."""
    xt, yt = torch.as_tensor(x - x.mean(0)), torch.as_tensor(y)
    global_net = copy.deepcopy(model())
    start = parameters_to_vector(global_net.parameters()).detach()
    held = [start[begin:end].clone() for begin, end in fragments]  # each fragment's θ_global
    outers = [
        torch.optim.SGD([g], lr=outer_lr, momentum=outer_momentum, nesterov=True) for g in held
    ]
    nets = [copy.deepcopy(global_net) for _ in range(replicas)]
    inner = [torch.optim.Adam(net.parameters(), lr=1e-2) for net in nets]
    order = torch.Generator().manual_seed(11)
    steps = -(-len(xt) // batch_size)
    total = epochs * steps
    offsets = [p * every // len(fragments) for p in range(len(fragments))]
    in_flight: dict[int, tuple[int, torch.Tensor]] = {}

    def land(p: int, mean: torch.Tensor, alpha: float) -> None:
        begin, end = fragments[p]
        held[p].grad = mean.clone()
        outers[p].step()
        held[p].grad = None
        with torch.no_grad():
            for net in nets:
                local = parameters_to_vector(net.parameters())
                local[begin:end] = alpha * local[begin:end] + (1 - alpha) * held[p]
                vector_to_parameters(local, net.parameters())

    def mean_of(p: int) -> torch.Tensor:
        begin, end = fragments[p]
        with torch.no_grad():
            deltas = [held[p] - parameters_to_vector(net.parameters())[begin:end] for net in nets]
            return torch.stack(deltas).mean(0)

    s = 0
    for _ in range(epochs):
        rows = torch.randperm(len(xt), generator=order)
        for step in range(steps):
            s += 1
            batch = rows[step * batch_size : (step + 1) * batch_size].numpy()
            for r, part in enumerate(np.array_split(batch, replicas)):
                inner[r].zero_grad()
                loss = torch.nn.functional.cross_entropy(nets[r](xt[part]), yt[part])
                (loss * (len(part) * replicas / len(batch))).backward()
                inner[r].step()
            closing = s == total
            for p in sorted(in_flight):
                due, mean = in_flight[p]
                if closing or due == s:
                    del in_flight[p]
                    land(p, mean, 0.0 if closing else mixing)
            syncing = (
                range(len(fragments))
                if closing
                else [p for p, o in enumerate(offsets) if s % every == o % every]
            )
            for p in syncing:
                if overlap and not closing:
                    in_flight[p] = (s + overlap, mean_of(p))
                else:
                    land(p, mean_of(p), 0.0 if closing else mixing)
            if s in reads and validations is not None:
                read = copy.deepcopy(global_net)
                vector_to_parameters(torch.cat(held), read.parameters())
                xv, yv = (torch.as_tensor(a) for a in validation)
                with torch.no_grad():
                    loss = torch.nn.functional.cross_entropy(read(xv), yv)
                validations.append((s, float(loss)))
    vector_to_parameters(torch.cat(held), global_net.parameters())
    return global_net.state_dict()


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[tuple[Cluster, sz.Client]]:
    directory = tmp_path_factory.mktemp("streaming")
    with cluster(directory, {"w1": (), "w2": ()}) as c, sz.connect(c.url) as connected:
        yield c, connected


def test_one_fragment_without_overlap_is_diloco_in_the_hand_loops_too():
    x, y = dataset()
    streamed = streaming_by_hand(x, y, 2, 3, [(0, 163)], overlap=0, mixing=0.0)
    expected, _ = diloco_by_hand(x, y, "adam", 2, 3, outer_lr=0.7, outer_momentum=0.9)
    for key, value in expected.items():
        torch.testing.assert_close(streamed[key], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("overlap", "mixing"), [(0, 0.0), (1, 0.5)])
def test_fragments_synced_at_staggered_steps_equal_the_hand_loop(live, overlap, mixing):
    """Two fragments, H = 4: fragment 0 after steps 4, 8, ...; fragment 1 after 2, 6, ...;
    with overlap 1 and mixing 0.5 each exchange lands a step later, mixed; both equal the loop,
    and neither is DiLoCo's model. The first weight is cut between the fragments; the placed
    event's peak bytes are the larger fragment's, half the model's within a value."""
    _, client = live
    x, y = dataset()
    strategy = sz.DiLoCo(
        2, 4, 0.7, 0.9, collective="torch", fragments=2, overlap=overlap, mixing=mixing
    )
    job = client.submit(graph_for("adam", shuffle=True), x, y, strategy=strategy)
    fitted = job.result(timeout=120 * UNIT)
    placed = next(e for e in job.events(timeout=30 * UNIT) if e.event == "placed")
    expected = streaming_by_hand(x, y, 2, 4, FRAGMENTS_OF_THE_MLP, overlap=overlap, mixing=mixing)
    for key, value in expected.items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
    plain, _ = diloco_by_hand(x, y, "adam", 2, 4, outer_lr=0.7, outer_momentum=0.9)
    assert not torch.allclose(plain["0.weight"], expected["0.weight"], rtol=0, atol=1e-5)
    assert placed.data["collective"] == "torch"
    assert placed.data["fragments"] == 2 and placed.data["sync_bytes"] == 4 * 82
    assert placed.data["model_sync_bytes"] == 4 * (6 * 16 + 16 + 16 * 3 + 3)


def test_validation_reads_the_global_model_without_synchronising(live):
    """validate_every=5 and a validation set (so also each epoch's end, 7, 14 and 21): the
    fragments synchronise on their own schedule only, and each validation is the loss of the
    global model its fragments hold then, as the hand loop that evaluates it and synchronises
    nothing for it; the model is the loop's."""
    _, client = live
    x, y = dataset()
    graph = graph_for("adam", shuffle=True, validate_every=5)
    strategy = sz.DiLoCo(2, 4, 0.7, 0.9, collective="torch", fragments=2, overlap=1, mixing=0.5)
    job = client.submit(graph, x, y, strategy=strategy, validation=(x[:64], y[:64]))
    fitted = job.result(timeout=120 * UNIT)
    validations: list = []
    centred = (x[:64] - x.mean(0), y[:64])  # the Center filter's fitted mean
    reads = (5, 7, 10, 14, 15, 20, 21)
    expected = streaming_by_hand(
        x,
        y,
        2,
        4,
        FRAGMENTS_OF_THE_MLP,
        overlap=1,
        mixing=0.5,
        validation=centred,
        reads=reads,
        validations=validations,
    )
    for key, value in expected.items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
    by_step = dict(validations)
    assert [v["step"] for v in fitted.validations] == [5, 10, 15, 20]
    assert [v["val_loss"] for v in fitted.validations] == pytest.approx(
        [by_step[s] for s in (5, 10, 15, 20)], abs=1e-5
    )
    assert [row["val_loss"] for row in fitted.history] == pytest.approx(
        [by_step[s] for s in (7, 14, 21)], abs=1e-5
    )
    # The reads synchronised nothing: the same job without validation ends the same
    unread = client.submit(graph_for("adam", shuffle=True), x, y, strategy=strategy)
    for key, value in unread.result(timeout=120 * UNIT).states["mlp"].items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-6)


def test_streaming_is_refused_where_it_cannot_run(live):
    _, client = live
    x, y = dataset()
    graph = graph_for("adam", shuffle=True)
    with pytest.raises(ValueError, match="runs on the torch collective"):
        sz.DiLoCo(2, 4, fragments=2, collective="coordinator")
    with pytest.raises(ValueError, match="never whole on every replica: it does not take elastic"):
        sz.DiLoCo(2, 4, fragments=2, elastic=True)
    with pytest.raises(ValueError, match="fragments must be at most sync_every"):
        sz.DiLoCo(2, 4, fragments=5)
    with pytest.raises(sz.ClientError, match="fragments=164: the model has 163 trainable"):
        client.submit(graph, x, y, strategy=sz.DiLoCo(2, 200, fragments=164))
