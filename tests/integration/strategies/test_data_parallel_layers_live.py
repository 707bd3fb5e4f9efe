"""DataParallel over BatchNorm and Dropout on live workers: on both collectives a BatchNorm
model succeeds with replica 0's buffers broadcast each step (the plain torch simulation of
:mod:`tests.coordinator.strategies.data_parallel.test_layers`), Dropout reruns give the same result,
and ``somatize submit`` says up front why neither equals ``graph.fit`` exactly."""

from __future__ import annotations

import textwrap

import pytest
import torch

import somatize as sz
from tests.coordinator.strategies.data_parallel.test_layers import (
    bn_model,
    dropout_model,
    graph_of,
    replicas_reference,
)
from tests.integration.cluster import cluster
from tests.training_reference import classes
from tests.utils import UNIT, somatize_cli

pytestmark = pytest.mark.integration

BATCHNORM_JOB = textwrap.dedent(
    """
    import numpy as np
    import torch
    import somatize as sz

    rng = np.random.default_rng(1)
    x = rng.normal(size=(96, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)]
    model = torch.nn.Sequential(*layers)
    graph = sz.Graph([sz.TorchFilter(model, loss="cross_entropy", epochs=1).named("net")])
    strategy = sz.DataParallel(2)
    """
)


def test_live_batchnorm_and_dropout_in_data_parallel(tmp_path):
    x, y = classes()
    expected = replicas_reference(bn_model(), x, y, workers=2)
    with cluster(tmp_path, {"w1": (), "w2": ()}) as c, sz.connect(c.url) as client:
        for collective in ["torch", "coordinator"]:
            strategy = sz.DataParallel(2, collective=collective)
            job = client.submit(graph_of(bn_model()), x, y, strategy=strategy)
            (note,) = job.notes
            assert "BatchNorm1d normalise each replica's slice" in note
            states = job.result(timeout=120 * UNIT).states["net"]
            for key, value in expected.items():
                torch.testing.assert_close(states[key], value, rtol=0, atol=1e-5)
            placed = next(e for e in job.events() if e.event == "placed")
            assert placed.data["collective"] == collective and placed.data["notes"] == [note]
        runs = []
        for _ in range(2):
            job = client.submit(graph_of(dropout_model()), x, y, strategy=sz.DataParallel(2))
            runs.append(job.result(timeout=120 * UNIT).states["net"])
            assert "Dropout draw their random masks" in job.notes[0]
        for key, value in runs[0].items():
            assert torch.equal(runs[1][key], value), key

        job_file = tmp_path / "job.py"
        job_file.write_text(BATCHNORM_JOB)
        submitted = somatize_cli(c.url, "submit", str(job_file), seconds=120)
    assert submitted.returncode == 0, submitted.stderr
    assert "note: DataParallel will not equal graph.fit exactly: BatchNorm1d" in submitted.stderr
