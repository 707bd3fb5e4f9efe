"""DataParallel with ``sharding`` (FSDP2) on live workers over gloo: each replica holds a shard
of the model, gradients and optimizer state, and the result is still the plain torch loop's
(issue 33).

An MLP with momentum SGD, a cosine schedule, clipping and accumulation, validated (every
replica its part of the rows, through its shards: 33 rows over 2 replicas are 2 batches of 16
on one and 1 on the other, which forwards one again for the group) and checkpointed (each
replica saving its shards with torch.distributed.checkpoint) every epoch, over 2 and 3
replicas (uneven shards: 16 rows over 3); one validated on a single row (the other replica has
none, and forwards a training row counted for nothing); and a small TransformerEncoder with
Adam, each encoder layer a unit of its own, its parameters kept gathered from forward to
backward (``sharding="gradients"``); and one on the workers' own rows, validated on each
worker's own split (9, 21 and 37 rows: 1, 2 and 3 batches of 16). Each is checked against a
loop written here or in :mod:`tests.training_reference`, never against the code under test.
"""

from __future__ import annotations

import contextlib
import copy
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch

import somatize as sz
from coordinator.storage.store import DB_NAME
from tests.integration.cluster import cluster
from tests.training_reference import FILTER, classes, evaluation, mlp, reference_fit
from tests.utils import UNIT, somatize_cli

pytestmark = pytest.mark.integration

OPTIONS = FILTER | {"scheduler": "cosine", "clip_grad_norm": 0.5, "accumulate": 3}


def _close(states: dict, expected: dict, atol: float = 1e-5) -> None:
    assert states.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(states[key]), value, rtol=0, atol=atol)


def _encoder() -> torch.nn.Module:
    torch.manual_seed(5)
    # No biases: attention's key bias has a gradient of zero up to rounding, which Adam would
    # scale up to whole steps (a rounding difference from the reduction's order, amplified).
    layer = torch.nn.TransformerEncoderLayer(
        d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True, bias=False
    )
    return torch.nn.Sequential(
        torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 4, 3),
    )


def _adam_reference(module, x, y, epochs: int, batch_size: int, lr: float, *, seen=None):
    """Adam on cross-entropy over the batches in order: the plain loop; ``seen`` (an
    :func:`tests.training_reference.evaluation`) sees the model after each epoch."""
    net = copy.deepcopy(module)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    for _ in range(epochs):
        for start in range(0, len(xt), batch_size):
            opt.zero_grad()
            batch = slice(start, start + batch_size)
            torch.nn.functional.cross_entropy(net(xt[batch]), yt[batch]).backward()
            opt.step()
        if seen is not None:
            seen(net)
    return net.state_dict()


OWN = {"w1": (40, 21), "w2": (56, 37), "w3": (24, 9)}
"""Each worker's own rows and own validation rows."""


def _own_data(directory) -> dict[str, tuple]:
    """Each worker's ``local`` dataset, an .npz with a ``val`` split: its arrays by worker."""
    data = {}
    for k, (worker, (n, n_val)) in enumerate(OWN.items()):
        x, y = classes(n=n, seed=30 + k)
        x_val, y_val = classes(n=n_val, seed=40 + k)
        np.savez(directory / f"{worker}.npz", x=x, y=y, x_val=x_val, y_val=y_val)
        data[worker] = (x, y, x_val, y_val)
    return data


def _own_reference(data: dict[str, tuple], workers: list[str], epochs: int):
    """Momentum SGD over the global batches of the replicas' own rows in order (step ``s``
    takes rows ``[16s, 16s + 16)`` of each), the loss their mean; after each epoch the model's
    mean cross-entropy over every replica's validation rows together."""
    own = [data[w] for w in sorted(workers)]
    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=FILTER["lr"], momentum=0.9)
    x_val = torch.as_tensor(np.concatenate([d[2] for d in own]))
    y_val = torch.as_tensor(np.concatenate([d[3] for d in own]))
    steps = max(-(-len(d[0]) // 16) for d in own)
    val_losses = []
    for _ in range(epochs):
        for step in range(steps):
            part = slice(16 * step, 16 * step + 16)
            xb = torch.as_tensor(np.concatenate([d[0][part] for d in own]))
            yb = torch.as_tensor(np.concatenate([d[1][part] for d in own]))
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xb), yb).backward()
            opt.step()
        with torch.no_grad():
            val_losses.append(float(torch.nn.functional.cross_entropy(net(x_val), y_val)))
    return net.state_dict(), val_losses


def test_sharded_replicas_train_what_the_plain_loop_trains(tmp_path):
    x, y = classes()
    x_val, y_val = classes(n=33, seed=9)
    seen: list[dict[str, float]] = []
    at_epoch_end = evaluation(x_val, y_val, seen)
    expected = reference_fit(
        mlp(), x, y, accumulate=3, clip=0.5, cosine=True, at_epoch_end=at_epoch_end
    )
    workers = {"w1": (), "w2": (), "w3": ()}
    own = _own_data(tmp_path)
    paths = {w: {"local": tmp_path / f"{w}.npz"} for w in workers}
    with (
        cluster(tmp_path, workers, data=paths) as c,
        sz.connect(c.url, timeout=60 * UNIT) as client,
    ):
        for replicas in (2, 3):
            graph = sz.Graph([sz.TorchFilter(mlp(), **OPTIONS).named("mlp")])
            strategy = sz.DataParallel(replicas, sharding="full", collective="torch")
            job = client.submit(graph, x, y, strategy=strategy, validation=(x_val, y_val))
            fitted = job.result(timeout=180 * UNIT)
            _close(fitted.states["mlp"], expected.state())
            _kept_as_pieces(c.state_dir, job.id, replicas)
            saved = tmp_path / f"result-{replicas}.pt"  # joined by the CLI, as by the SDK
            shown = somatize_cli(c.url, "result", job.id, "--save", str(saved))
            assert shown.returncode == 0, shown.stderr
            _close(torch.load(saved, weights_only=True)["states"]["mlp"], expected.state())
            val = [row["val_loss"] for row in fitted.history]
            np.testing.assert_allclose(val, [s["val_loss"] for s in seen], rtol=0, atol=1e-5)
            events = list(job.events(timeout=10 * UNIT))
            placed = next(e for e in events if e.event == "placed").data
            assert placed["collective"] == "torch" and placed["sharding"] == "full"
            # Linear(6, 16) and Linear(16, 3): each replica holds ceil(rows / N) rows of each
            # weight and bias, 4 bytes a value (by hand: 8·6+8+2·16+2 and 6·6+6+1·16+1).
            values = {2: 90, 3: 59}[replicas]
            assert placed["replica_bytes"] == {"parameters": 4 * values, "gradients": 4 * values}
            # What each replica holds, as it says: its rows of each tensor (by hand, 2
            # replicas: 8·6+8+2·16+2 and 8·6+8+1·16+1; 3: 6·6+6+16+1 twice and 4·6+4+16+1).
            sharded = next(e.data for e in events if e.data.get("phase") == "sharded")
            held = {2: [90, 73], 3: [59, 59, 45]}[replicas]
            ids = sorted(k for k in sharded if k not in ("phase", "sharding"))
            assert [sharded[w]["parameter_bytes"] for w in ids] == [4 * v for v in held]
            assert all(sharded[w]["units"] == 3 for w in ids)  # two Linear layers, the chain
            saved = [e for e in events if e.event == "checkpoint"]
            assert len(saved) >= FILTER["epochs"]  # every epoch's end, each replica's shards

        # SGD without momentum keeps no state per parameter: what the replicas gather is its
        # groups' settings alone. One validation row: replica 1 has none of its own.
        plain = FILTER | {"optimizer_options": {}, "epochs": 1}
        graph = sz.Graph([sz.TorchFilter(mlp(), **plain).named("mlp")])
        strategy = sz.DataParallel(2, sharding="full", collective="torch")
        one_row: list[dict[str, float]] = []
        job = client.submit(graph, x, y, strategy=strategy, validation=(x_val[:1], y_val[:1]))
        fitted = job.result(timeout=180 * UNIT)
        plain_loop = reference_fit(
            mlp(),
            x,
            y,
            momentum=0.0,
            epochs=1,
            at_epoch_end=evaluation(x_val[:1], y_val[:1], one_row),
        )
        _close(fitted.states["mlp"], plain_loop.state())
        [row] = fitted.history
        assert row["val_loss"] == pytest.approx(one_row[0]["val_loss"], abs=1e-5)

        # The workers' own rows, validated on their own split: 3 replicas, in order.
        graph = sz.Graph(
            [sz.TorchFilter(mlp(), **FILTER | {"shuffle": False, "epochs": 2}).named("mlp")]
        )
        strategy = sz.DataParallel(3, sharding="full", collective="torch")
        validation = sz.WorkerData("local", split="val")
        job = client.submit(graph, sz.WorkerData("local"), strategy=strategy, validation=validation)
        fitted = job.result(timeout=180 * UNIT)
        expected_state, val_losses = _own_reference(own, job.status()["workers"], epochs=2)
        _close(fitted.states["mlp"], expected_state)
        got = [row["val_loss"] for row in fitted.history]
        np.testing.assert_allclose(got, val_losses, rtol=0, atol=1e-5)

        # A TransformerEncoder, each layer a unit, Adam, parameters kept from forward to
        # backward (and after an evaluation's forward): 3 replicas, in order, validated.
        rng = np.random.default_rng(2)
        xs = rng.normal(size=(90, 4, 8)).astype(np.float32)
        ys = rng.integers(0, 3, size=90)
        xs_val = rng.normal(size=(40, 4, 8)).astype(np.float32)
        ys_val = rng.integers(0, 3, size=40)
        net = sz.TorchFilter(
            _encoder(),
            loss="cross_entropy",
            optimizer="adam",
            lr=1e-2,
            batch_size=16,
            epochs=2,
            shuffle=False,
        )
        strategy = sz.DataParallel(
            3,
            sharding="gradients",
            shard_units=[torch.nn.TransformerEncoderLayer],
            collective="torch",
            checkpoint_every=0,
        )
        job = client.submit(
            sz.Graph([net.named("enc")]), xs, ys, strategy=strategy, validation=(xs_val, ys_val)
        )
        fitted = job.result(timeout=180 * UNIT)
        events = list(job.events(timeout=10 * UNIT))
        sharded = next(e.data for e in events if e.data.get("phase") == "sharded")
        assert sharded["sharding"] == "gradients"
        assert {v["units"] for k, v in sharded.items() if k.startswith("w")} == {3}  # 2 layers
        seen_val: list[dict[str, float]] = []
        reference = _adam_reference(
            _encoder(), xs, ys, 2, 16, 1e-2, seen=evaluation(xs_val, ys_val, seen_val)
        )
        got = [row["val_loss"] for row in fitted.history]
        np.testing.assert_allclose(got, [s["val_loss"] for s in seen_val], rtol=0, atol=1e-5)
        _close(fitted.states["enc"], reference)

        # A result whose pieces are gone is said so, and the coordinator answers on.
        (c.state_dir / "results" / job.id / "1.pieces").unlink()
        with pytest.raises(sz.ClientError, match="its sharded result cannot be read"):
            job.states(timeout=0)
        assert client.job(job.id).status()["state"] == "succeeded"


def _kept_as_pieces(state_dir: Path, job_id: str, replicas: int) -> None:
    """The coordinator kept a sharded job's result as its replicas' pieces, one file each, and
    its row in the store says so, holding no weights (the MLP's are 652 bytes of float32)."""
    kept = sorted(p.name for p in (state_dir / "results" / job_id).iterdir())
    assert kept == [f"{r}.pieces" for r in range(replicas)]
    with contextlib.closing(sqlite3.connect(state_dir / DB_NAME)) as db:
        kind, size = db.execute(
            "SELECT kind, length(data) FROM results WHERE job_id = ?", (job_id,)
        ).fetchone()
    assert kind == "pieces" and size < 400, (kind, size)


class _Recording(torch.nn.Linear):
    """A Linear that records, in a buffer, whether its weight was bf16 when it ran."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.register_buffer("ran_bf16", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ran_bf16.fill_(float(self.weight.dtype == torch.bfloat16))
        return super().forward(x)


def _recording_mlp() -> torch.nn.Sequential:
    torch.manual_seed(4)
    return torch.nn.Sequential(_Recording(6, 16), torch.nn.Tanh(), _Recording(16, 3))


def _bf16_reference(module, x, y, epochs: int, batch_size: int, lr: float) -> dict:
    """SGD with fp32 weights, each step run in bf16 (weights and inputs cast, the logits cast
    back to fp32 for the loss): the plain loop FSDP2's bf16 policy stands for, on the whole
    batch at once."""
    net = copy.deepcopy(module)
    layers = [net[0], net[2]]
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    for _ in range(epochs):
        for start in range(0, len(xt), batch_size):
            h = xt[start : start + batch_size].to(torch.bfloat16)
            for k, layer in enumerate(layers):
                h = torch.nn.functional.linear(
                    h, layer.weight.to(torch.bfloat16), layer.bias.to(torch.bfloat16)
                )
                if k == 0:
                    h = torch.tanh(h)
            loss = torch.nn.functional.cross_entropy(h.float(), yt[start : start + batch_size])
            net.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in net.parameters():
                    p -= lr * p.grad
    return net.state_dict()


def test_bf16_replicas_gather_and_run_in_bf16_and_keep_fp32_weights(tmp_path):
    x, y = classes(n=96)
    options = {"loss": "cross_entropy", "optimizer": "sgd", "lr": 0.1, "batch_size": 16}
    options |= {"epochs": 2, "shuffle": False, "precision": "bf16"}
    with (
        cluster(tmp_path, {"w1": (), "w2": ()}) as c,
        sz.connect(c.url, timeout=60 * UNIT) as client,
    ):
        graph = sz.Graph([sz.TorchFilter(_recording_mlp(), **options).named("mlp")])
        strategy = sz.DataParallel(2, sharding="full", collective="torch", checkpoint_every=0)
        fitted = client.submit(graph, x, y, strategy=strategy).result(timeout=180 * UNIT)
    states = fitted.states["mlp"]
    # Each layer ran with bf16 weights (gathered in bf16 by the policy); the weights kept are
    # fp32, and they are the plain loop's up to bf16's rounding of the half batches' sums.
    assert float(states["0.ran_bf16"]) == float(states["2.ran_bf16"]) == 1.0
    reference = _bf16_reference(_recording_mlp(), x, y, epochs=2, batch_size=16, lr=0.1)
    for key in ("0.weight", "0.bias", "2.weight", "2.bias"):
        got = torch.as_tensor(states[key])
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, reference[key], rtol=0, atol=1e-3)
