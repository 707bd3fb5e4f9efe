"""Issue 15: DataParallel over data that lives on the workers (``sz.WorkerData``).

Three live workers, each serving its own ``local`` dataset of another kind and size (an
``.npz`` of 50 rows, a memory-mapped ``x.npy``/``y.npy`` directory of 70, three shards of 83).
With either collective, over 2 and 3 of them, in order and shuffled, the trained model equals
an independent plain torch loop over the global batches as the README defines them: step ``s``
of an epoch takes rows ``[s·b, (s+1)·b)`` of every replica's own order (``0, 1, ...`` or
``numpy.random.default_rng([seed, epoch, place]).permutation``, ``place`` the replica's rank
by worker id), the global batch is their union and the loss its mean; the Center in front is
fitted on every replica's rows and averaged by rows, which is the mean of all of them.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import somatize as sz
from tests.coordinator.strategies.data_parallel.test_data_parallel import (
    OPTIMIZERS,
    dataset,
    graph_for,
    model,
)
from tests.integration.cluster import cluster
from tests.utils import UNIT

pytestmark = pytest.mark.integration

BOUNDS = {"w1": (0, 50), "w2": (50, 120), "w3": (120, 203)}
BATCH = 16
EPOCHS = 2
SEED = 11  # graph_for's


def _write(directory: Path, x: np.ndarray, y: np.ndarray) -> dict[str, dict[str, Path]]:
    """w1's rows as an .npz, w2's as x.npy/y.npy, w3's as three shards (an .npz, two dirs)."""
    part = {w: (x[lo:hi], y[lo:hi]) for w, (lo, hi) in BOUNDS.items()}
    np.savez(directory / "w1.npz", x=part["w1"][0], y=part["w1"][1])
    for name, (px, py) in (("w2", part["w2"]), *((f"w3/{s}", _cut(part["w3"], s)) for s in "bc")):
        (directory / name).mkdir(parents=True)
        np.save(directory / name / "x.npy", px)
        np.save(directory / name / "y.npy", py)
    np.savez(directory / "w3" / "a.npz", x=part["w3"][0][:20], y=part["w3"][1][:20])
    return {w: {"local": directory / (f"{w}.npz" if w == "w1" else w)} for w in BOUNDS}


def _cut(part: tuple[np.ndarray, np.ndarray], shard: str) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = {"b": (20, 51), "c": (51, None)}[shard]
    return part[0][lo:hi], part[1][lo:hi]


def reference(x, y, workers: list[str], optimizer: str, shuffle: bool):
    """A plain torch loop over the global batches of the replicas' own rows (module doc)."""
    own = [(x[slice(*BOUNDS[w])], y[slice(*BOUNDS[w])]) for w in sorted(workers)]
    mean = np.concatenate([px for px, _ in own]).mean(0)  # the Center, averaged by rows
    net = copy.deepcopy(model())
    opt = OPTIMIZERS[optimizer][1](net.parameters())
    steps = max(math.ceil(len(px) / BATCH) for px, _ in own)
    for epoch in range(EPOCHS):
        orders = [
            np.random.default_rng([SEED, epoch, place]).permutation(len(px))
            if shuffle
            else np.arange(len(px))
            for place, (px, _) in enumerate(own)
        ]
        for step in range(steps):
            picks = [order[step * BATCH : (step + 1) * BATCH] for order in orders]
            xb = np.concatenate([px[p] for (px, _), p in zip(own, picks, strict=True)])
            yb = np.concatenate([py[p] for (_, py), p in zip(own, picks, strict=True)])
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(
                net(torch.as_tensor(xb - mean)), torch.as_tensor(yb)
            )
            loss.backward()
            opt.step()
    return net.state_dict(), steps * EPOCHS


def test_data_parallel_on_worker_data_equals_a_plain_loop_over_the_replicas_own_batches(tmp_path):
    """Both collectives on one cluster: 3 replicas with Adam shuffled, 2 with SGD in order."""
    x, y = dataset()
    paths = _write(tmp_path, x, y)
    with cluster(tmp_path, {w: () for w in BOUNDS}, data=paths) as c, sz.connect(c.url) as client:
        runs = [("torch", 3, "adam", True), ("coordinator", 3, "sgd", False)]
        runs += [("torch", 2, "sgd", False), ("coordinator", 2, "adam", True)]
        for collective, workers, optimizer, shuffle in runs:
            graph = graph_for(optimizer, epochs=EPOCHS, batch_size=BATCH, shuffle=shuffle)
            strategy = sz.DataParallel(workers, collective=collective)
            job = client.submit(graph, sz.WorkerData("local"), strategy=strategy)
            fitted = job.result(timeout=120 * UNIT)
            record = job.status()
            expected, steps = reference(x, y, record["workers"], optimizer, shuffle)
            for key, value in expected.items():
                torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
            assert record["progress"]["step"] == record["progress"]["steps"] == steps
            placed = next(e for e in job.events(timeout=10 * UNIT) if e.event == "placed")
            assert placed.data["collective"] == collective
        # Elastic would replace a replica with a worker holding other rows: refused at submit.
        elastic = sz.DataParallel(2, elastic=True)
        with pytest.raises(sz.ClientError, match="cannot be elastic: a replacement") as refused:
            client.submit(graph, sz.WorkerData("local"), strategy=elastic)
        assert refused.value.code == "bad_request"
