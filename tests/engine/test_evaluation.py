"""Evaluating a chain: batch by batch, and in lockstep with a group (a sharded replica's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import somatize as sz
from engine.engine import Engine
from engine.evaluation import Evaluation


def _net() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _nodes(module: torch.nn.Module):
    engine = Engine()
    engine.load({"net": sz.TorchFilter(module, loss="mse", batch_size=4)})
    return engine.nodes


def test_a_replica_in_lockstep_forwards_as_often_as_its_group_and_counts_only_its_rows():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 3)).astype(np.float32)  # 2 batches of 4 and 2
    y = rng.normal(size=(6, 2)).astype(np.float32)
    module = _net()
    with torch.no_grad():  # the mean squared error over the rows, written out
        out = module(torch.as_tensor(x))
        expected = float(((out - torch.as_tensor(y)) ** 2).mean())
    calls: list[int] = []

    def through(xb: torch.Tensor) -> torch.Tensor:
        calls.append(len(xb))
        return module(xb)

    asked: list[int] = []

    def lockstep(batches: int) -> int:
        asked.append(batches)
        return 5  # another replica of the group holds 5 batches

    scores = Evaluation(_nodes(module)).evaluate(["net"], x, y, through, lockstep)
    assert asked == [2]
    assert calls == [4, 2, 4, 4, 4]  # its own two, then its first again for the group's three
    assert scores["rows"] == 6
    assert scores["val_loss"] == pytest.approx(expected, rel=1e-6)


def test_without_a_lockstep_each_batch_is_forwarded_once():
    x = np.ones((5, 3), dtype=np.float32)
    y = np.zeros((5, 2), dtype=np.float32)
    module = _net()
    calls: list[int] = []

    def through(xb: torch.Tensor) -> torch.Tensor:
        calls.append(len(xb))
        return module(xb)

    scores = Evaluation(_nodes(module)).evaluate(["net"], x, y, through)
    assert calls == [4, 1] and scores["rows"] == 5
