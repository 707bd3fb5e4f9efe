"""benchmarks.own_model: the plain loop it times trains what the job file's graph trains (so its
validation losses can be set side by side), and a DDP replica's half of each batch is the
batching rule's."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks import own_model


def test_the_plain_loop_trains_what_graph_fit_trains(monkeypatch) -> None:
    monkeypatch.setenv("CHAR_LM_ROWS", "96")  # a step and a half of 64 rows
    spec = own_model.load(None)
    config = own_model.settings(spec)
    assert config == {"lr": 3e-3, "batch": 64, "epochs": 1, "seed": 0, "clip": 1.0}
    fitted = spec.graph.fit(spec.x, spec.y)
    model = own_model._example()["make_model"]()
    x, y = torch.from_numpy(spec.x), torch.from_numpy(spec.y)
    batches = own_model.plan(len(x), config["batch"], config["epochs"], config["seed"])
    assert [len(b) for b in batches] == [64, 32]
    own_model.train_steps(model, x, y, batches, config)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(fitted.states["char_lm"][key], value, atol=1e-5, rtol=0)


def test_each_replica_takes_its_slice_of_every_batch() -> None:
    batches = own_model.plan(10, 4, 2, 0)
    assert sorted(np.concatenate([b.numpy() for b in batches[:3]]).tolist()) == list(range(10))
    halves = [np.array_split(b.numpy(), 2) for b in batches]
    assert [len(h[0]) + len(h[1]) for h in halves] == [len(b) for b in batches]
