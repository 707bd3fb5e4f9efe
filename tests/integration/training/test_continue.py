"""Work is kept and continued: a finished job is continued by a longer one
(``resume_from``) with the result of one long run, a cancelled job's checkpoint is fetched by
the SDK and ``somatize result --checkpoint``, and what cannot be continued is refused at
submit."""

from __future__ import annotations

import pytest
import torch

import somatize as sz
from tests.coordinator.strategies.data_parallel.test_data_parallel import (
    dataset,
    graph_for,
    reference_training,
)
from tests.integration.cluster import cluster, wait_for
from tests.integration.faults.test_resume import _checkpointed_at, paced
from tests.utils import UNIT, somatize_cli

pytestmark = pytest.mark.integration


def test_a_job_continued_with_more_epochs_equals_one_longer_run_and_refusals(tmp_path):
    """2 epochs, then 2 more from its end (momentum and all): the 4-epoch plain torch loop."""
    x, y = dataset()
    strategy = sz.DataParallel(2, collective="coordinator")
    with cluster(tmp_path, {"w1": (), "w2": ()}) as c, sz.connect(c.url) as client:
        first = client.submit(graph_for("sgd", epochs=2, shuffle=True), x, y, strategy=strategy)
        first.result(timeout=120 * UNIT)
        longer = graph_for("sgd", epochs=4, shuffle=True)
        second = client.submit(longer, x, y, strategy=strategy, resume_from=first)
        fitted = second.result(timeout=120 * UNIT)
        events = list(second.events())
        assert second.status()["summary"]["resume_from"] == first.id

        with pytest.raises(sz.ClientError, match="no job 'nope'") as unknown:
            client.submit(longer, x, y, strategy=strategy, resume_from="nope")
        assert unknown.value.code == "unknown_job"
        local = client.submit(graph_for("sgd", epochs=1), x, y, strategy=sz.Local())
        local.result(timeout=120 * UNIT)
        with pytest.raises(sz.ClientError, match="ran local and this one data_parallel"):
            client.submit(longer, x, y, strategy=strategy, resume_from=local.id)
        with pytest.raises(sz.ClientError, match="keeps no checkpoints to start from"):
            client.submit(longer, x, y, strategy=sz.Local(), resume_from=local.id)
    expected = reference_training(x, y, "sgd", epochs=4, shuffle=True)
    for key, value in expected.items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-6)
    resumed = next(e.data for e in events if e.event == "resumed")
    assert resumed["step"] == 14 and resumed["from_job"] == first.id  # 7 steps an epoch
    steps = [e.data["step"] for e in events if e.event == "progress" and "step" in e.data]
    assert steps[0] == 15 and steps[-1] == 28


def test_a_sharded_job_is_continued_from_its_replicas_shards_and_only_sharded(tmp_path):
    """Adam over 2 replicas sharding parameters and moments: 1 epoch, then 2 more over 3
    replicas from its end's shards (each replica reading its rows of every replica's files):
    the 3-epoch plain torch loop. Continuing it unsharded is refused at submit."""
    x, y = dataset()
    two = sz.DataParallel(2, collective="torch", sharding="full")
    workers = {"w1": (), "w2": (), "w3": ()}
    with cluster(tmp_path, workers) as c, sz.connect(c.url) as client:
        first = client.submit(graph_for("adam", epochs=1), x, y, strategy=two)
        first.result(timeout=120 * UNIT)
        longer = graph_for("adam", epochs=3)
        with pytest.raises(sz.ClientError, match="continue it with sharding='full'"):
            unsharded = sz.DataParallel(2, collective="torch")
            client.submit(longer, x, y, strategy=unsharded, resume_from=first)
        three = sz.DataParallel(3, collective="torch", sharding="full")
        second = client.submit(longer, x, y, strategy=three, resume_from=first)
        fitted = second.result(timeout=120 * UNIT)
        events = list(second.events())
    expected = reference_training(x, y, "adam", epochs=3)
    for key, value in expected.items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
    assert next(e.data for e in events if e.event == "resumed")["step"] == 7


def test_a_cancelled_jobs_checkpoint_is_fetched_and_offered(tmp_path):
    x, y = dataset()
    graph = graph_for("sgd", module=paced())
    with cluster(tmp_path, {"w1": (), "w2": ()}) as c, sz.connect(c.url) as client:
        job = client.submit(graph, x, y, strategy=sz.DataParallel(2, checkpoint_every=3))
        _checkpointed_at(job, 6)
        job.cancel()
        wait_for(lambda: job.status()["state"] == "cancelled", 30 * UNIT, "the cancel")
        saved = job.checkpoint()
        assert saved.position["step"] >= 6 and saved.seq >= 2
        assert job.checkpoint(1).position == {"step": 3, "epoch": 1}
        fitted = saved.fitted(graph)
        assert fitted.forward(x).shape == (len(x), 3)
        with pytest.raises(sz.ClientError, match=r"has no checkpoint 99 \(it has \[") as none:
            job.checkpoint(99)
        assert none.value.code == "no_checkpoint"

        shown = somatize_cli(c.url, "result", job.id)
        assert shown.returncode == 1
        assert "cancelled" in shown.stderr
        hint = f"its newest checkpoint is {saved.seq}, at step {saved.position['step']}"
        assert (
            hint in shown.stderr and f"somatize result {job.id} --checkpoint latest" in shown.stderr
        )
        listed = somatize_cli(c.url, "result", job.id, "--checkpoint", "latest")
        assert listed.returncode == 0, listed.stderr
        assert f"checkpoint {saved.seq} at step {saved.position['step']}" in listed.stdout
        assert "mlp" in listed.stdout and "center" in listed.stdout
        bad = somatize_cli(c.url, "result", job.id, "--checkpoint", "first")
        assert bad.returncode == 2 and "'latest' or a checkpoint's number" in bad.stderr
    model = paced().state_dict()
    assert {k: torch.as_tensor(v).shape for k, v in saved.states["mlp"].items()} == {
        k: v.shape for k, v in model.items()
    }
