"""Your own model on live workers: a dict batch through DataParallel on the torch collective,
a ``step=`` function through the coordinator, FedAvg on a dict batch and a torch pipeline whose
first stage takes the dict — each equal to the plain torch loop written in
:mod:`tests.somatize.own_models`."""

from __future__ import annotations

import pytest
import torch

import somatize as sz
from tests.coordinator.strategies.test_own_model import Pooled, Whole, head
from tests.integration.cluster import cluster
from tests.somatize.own_models import (
    MaskedPool,
    TokenTagger,
    masked_token_step,
    plain_loop,
    token_rows,
)
from tests.somatize.test_own_model import SETTINGS, close, cross_entropy
from tests.utils import UNIT

pytestmark = pytest.mark.integration


def test_live_strategies_train_dict_batches_and_step_functions(tmp_path):
    x, y = token_rows()
    workers = {"w0": ("stage0",), "w1": ("stage1",)}
    with cluster(tmp_path, workers) as c, sz.connect(c.url) as client:
        pooled = sz.Graph([sz.TorchFilter(MaskedPool(), loss="cross_entropy", **SETTINGS)])
        strategy = sz.DataParallel(2, collective="torch")
        job = client.submit(pooled, x, y, strategy=strategy)
        fitted = job.result(timeout=120 * UNIT)
        placed = next(e for e in job.events(timeout=30 * UNIT) if e.event == "placed")
        assert placed.data["collective"] == "torch"
        model, _ = plain_loop(MaskedPool(), x, y, cross_entropy)
        close(fitted.states["masked_pool"], model)

        stepped = sz.Graph([sz.TorchFilter(TokenTagger(), step=masked_token_step, **SETTINGS)])
        strategy = sz.DataParallel(2, collective="coordinator")
        fitted = client.submit(stepped, x, strategy=strategy).result(timeout=120 * UNIT)
        model, _ = plain_loop(TokenTagger(), x, None, lambda m, b, _: masked_token_step(m, b))
        close(fitted.states["token_tagger"], model)

        first = sz.TorchFilter(Pooled(), **SETTINGS).named("pooled")
        last = sz.TorchFilter(head(), loss="cross_entropy", **SETTINGS).named("head")
        partitions = [sz.Partition(["pooled"], tag="stage0"), sz.Partition(["head"], tag="stage1")]
        strategy = sz.ModelParallel(partitions, 2, transport="torch")
        fitted = client.submit(first >> last, x, y, strategy=strategy).result(timeout=120 * UNIT)
        expected = plain_loop(Whole(Pooled(), head()), x, y, cross_entropy)[0].state_dict()
        for node in ("pooled", "head"):
            for key, value in fitted.states[node].items():
                want = expected[f"{node}.{key}"]
                torch.testing.assert_close(torch.as_tensor(value), want, atol=1e-5, rtol=0)
