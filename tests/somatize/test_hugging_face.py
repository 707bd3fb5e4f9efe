"""A Hugging Face model as its users write it: a 2-layer GPT-2 of width 64 built from a config
(no download) that computes its own loss from the batch's ``labels`` (``loss="model"``), fed
from a ``datasets.Dataset`` built from in-memory rows (no hub) and from a dict of arrays;
in process and under DataParallel, each equal to its plain torch loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from datasets import Dataset

import somatize as sz
from coordinator.context import InMemoryContext
from coordinator.strategies import DataParallel
from protocol.options.strategies import DataParallelOptions
from somatize.remote.client import graph_info
from tests.coordinator.strategies.test_training_options import run
from tests.somatize.own_models import plain_loop
from tests.somatize.test_own_model import SETTINGS, close
from worker.daemon.main import Daemon

VOCAB, LENGTH, ROWS = 40, 12, 48


def gpt2() -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=64,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,  # no randomness: the replicas and the plain loop draw nothing
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(11)
    return transformers.GPT2LMHeadModel(config)


def token_batch() -> dict[str, np.ndarray]:
    ids = np.random.default_rng(4).integers(0, VOCAB, size=(ROWS, LENGTH)).astype(np.int64)
    return {"input_ids": ids, "labels": ids}


def own_loss(net, xb, _):
    return net(**xb).loss, {}


def filter_of() -> sz.TorchFilter:
    return sz.TorchFilter(gpt2(), loss="model", **(SETTINGS | {"lr": 0.05}))


def test_a_gpt2_trains_on_a_hugging_face_dataset_as_its_plain_loop():
    batch = token_batch()
    rows = Dataset.from_dict({k: v.tolist() for k, v in batch.items()}).with_format("torch")
    graph = sz.Graph([filter_of()])
    fitted = graph.fit(rows)
    model, history = plain_loop(gpt2(), batch, None, own_loss, lr=0.05)
    close(fitted.states[graph.node_ids[0]], model, atol=2e-5)
    assert fitted.epoch_losses[-1] < fitted.epoch_losses[0]
    assert [row["loss"] for row in fitted.history] == pytest.approx(
        [h["loss"] for h in history], abs=1e-5
    )
    # Its dropout layers draw nothing (p=0): DataParallel has nothing to warn about.
    assert graph_info(graph)[graph.node_ids[0]].randomness == []


def test_a_gpt2_trains_with_data_parallel_as_its_plain_loop():
    batch = token_batch()
    graph = sz.Graph([filter_of()])
    states, _, _ = run(
        DataParallel(DataParallelOptions(workers=2)), graph, batch, None, InMemoryContext(2, Daemon)
    )
    model, _ = plain_loop(gpt2(), batch, None, own_loss, lr=0.05)
    close(states[graph.node_ids[0]], model, atol=2e-5)
