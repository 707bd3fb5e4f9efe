"""The client SDK and the ``somatize`` CLI against a real coordinator and real workers.

One cluster per module (``somatize-coordinator`` and two ``somatize-worker`` subprocesses, see
:mod:`tests.integration.cluster`), stopped at the end whatever happened. Every wait is bounded by
a multiple of the test time unit.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import somatize as sz
from tests.integration.cluster import Cluster, wait_for
from tests.utils import UNIT, interruptible, somatize_cli

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent


class Center(sz.Filter):
    """Subtracts the column means (a plain filter, shipped by value from this test module)."""

    def fit(self, x: Any, y: Any = None) -> dict[str, Any]:
        return {"mean": np.asarray(x, dtype=np.float32).mean(0)}

    def forward(self, x: Any, state: Any) -> Any:
        return np.asarray(x, dtype=np.float32) - state["mean"]


class Boom(sz.Filter):
    """A filter whose fit raises."""

    def fit(self, x: Any, y: Any = None) -> Any:
        raise ValueError("boom in Boom.fit")


class Sleepy(sz.Filter):
    """A filter whose fit takes far longer than any test waits."""

    def fit(self, x: Any, y: Any = None) -> Any:
        time.sleep(3600)
        return {}


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(192, 8)).astype(np.float32) + 3.0
    y = (x[:, :3].sum(1) > 9.0).astype(np.int64) + (x[:, 3] > 3.0).astype(np.int64)
    return x, y


def _mlp_graph() -> sz.Graph:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    net = sz.TorchFilter(
        mlp, loss="cross_entropy", optimizer="sgd", lr=0.1, batch_size=32, epochs=3, seed=0
    )
    return Center().named("center") >> net.named("mlp")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A coordinator and workers ``w1``, ``w2`` (tag ``cpu``, ``--device cpu`` whatever the
    machine has), for the whole module."""
    c = Cluster(tmp_path_factory.mktemp("client") / "state", spare_daemons=True)
    try:
        c.start_coordinator()
        c.start_worker("w1", "cpu", device="cpu")
        c.start_worker("w2", "cpu", device="cpu")
        yield c
    finally:
        c.close()


@pytest.fixture
def client(live: Cluster) -> Iterator[sz.Client]:
    with sz.connect(live.url, timeout=20 * UNIT) as c:
        yield c


def _leaves(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(state, dict):
        for key, value in state.items():
            yield from _leaves(value, f"{prefix}.{key}")
    else:
        yield prefix, state


def _max_abs_diff(a: Any, b: Any) -> float:
    a, b = torch.as_tensor(np.asarray(a)), torch.as_tensor(np.asarray(b))
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def test_a_local_job_trains_like_graph_fit(client):
    x, y = _data()
    graph = _mlp_graph()
    job = client.submit(graph, x, y, strategy=sz.Local())

    fitted = job.result(timeout=120 * UNIT)
    reference = graph.fit(x, y)

    assert isinstance(fitted, sz.FittedGraph) and fitted.graph is graph
    assert sorted(fitted.states) == sorted(reference.states) == ["center", "mlp"]
    for node_id in graph.node_ids:
        remote, local = (
            dict(_leaves(fitted.states[node_id])),
            dict(_leaves(reference.states[node_id])),
        )
        assert sorted(remote) == sorted(local), node_id
        for key in local:
            assert _max_abs_diff(remote[key], local[key]) <= 1e-6, (node_id, key)
    np.testing.assert_allclose(fitted.epoch_losses, reference.epoch_losses, rtol=0, atol=1e-6)
    assert len(fitted.epoch_losses) == 3
    out = fitted.forward(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference.forward(x)), atol=1e-5)

    record = job.status()
    assert record["state"] == "succeeded" and record["strategy"] == "local"


def test_events_run_from_queued_to_succeeded_in_order(client):
    x, y = _data()
    job = client.submit(_mlp_graph(), x, y, strategy=sz.Local(worker="w2"))
    events = list(job.events(timeout=120 * UNIT))

    names = [e.event for e in events]
    assert names[:2] == ["queued", "placed"], names
    assert names[-1] == "succeeded" and events[-1].terminal
    assert all(not e.terminal for e in events[:-1])
    assert set(names[2:-1]) <= {"progress"}, names
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert all(a.time <= b.time for a, b in itertools.pairwise(events))
    assert events[1].data["workers"] == ["w2"]
    # Replayed after the end, from any point, the same events.
    assert [e.seq for e in job.events(after_seq=1)] == [e.seq for e in events[1:]]


def test_a_filter_that_raises_fails_the_job_with_its_traceback(client):
    x, y = _data()
    job = client.submit(Center() >> Boom(), x, y)
    with pytest.raises(sz.JobFailed) as exc:
        job.result(timeout=60 * UNIT)
    assert exc.value.job_id == job.id
    assert exc.value.code == "filter_error"
    assert "boom in Boom.fit" in exc.value.message
    assert exc.value.traceback is not None
    assert "ValueError: boom in Boom.fit" in exc.value.traceback
    assert job.status()["state"] == "failed"


def test_cancelling_a_long_job_ends_it_cancelled(client, live):
    x, y = _data()
    job = client.submit(sz.Graph([Sleepy()]), x, y, strategy=sz.Local(worker="w1"))
    for event in job.events(timeout=60 * UNIT):  # until the filter is running on w1
        if event.event == "progress" and event.data.get("phase") == "training":
            break
        assert not event.terminal, event
    job.cancel()
    with pytest.raises(sz.JobFailed, match="was cancelled") as exc:
        job.result(timeout=30 * UNIT)
    assert exc.value.code == "cancelled"
    assert [e.event for e in job.events(timeout=10 * UNIT)][-1] == "cancelled"
    live.wait_connected("w1")  # the worker is idle again: its daemon was stopped


# -- the command line --------------------------------------------------------------------------

JOB_FILE = textwrap.dedent(
    """
    import numpy as np
    import torch
    import somatize as sz

    class Scale(sz.Filter):
        def fit(self, x, y=None):
            return {"scale": np.abs(x).max(0) + 1e-6}

        def forward(self, x, state):
            return (x / state["scale"]).astype(np.float32)

    rng = np.random.default_rng(1)
    x = rng.normal(size=(128, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    torch.manual_seed(0)
    net = sz.TorchFilter(torch.nn.Linear(4, 2), loss="cross_entropy", lr=0.5, epochs={epochs})
    graph = Scale() >> net.named("linear")
    strategy = sz.Local(tag="cpu")
    """
)

FAILING_JOB_FILE = textwrap.dedent(
    """
    import numpy as np
    import somatize as sz

    class Broken(sz.Filter):
        def fit(self, x, y=None):
            raise KeyError("no such column in Broken.fit")

    x = np.zeros((8, 2), dtype=np.float32)
    graph = sz.Graph([Broken()])
    """
)


def _somatize(live: Cluster, *args: str, seconds: float = 120) -> subprocess.CompletedProcess[str]:
    return somatize_cli(live.url, *args, seconds=seconds)


def test_cli_submit_jobs_and_result(live, tmp_path):
    job_file = tmp_path / "job.py"
    job_file.write_text(JOB_FILE.replace("{epochs}", "4"))

    submitted = _somatize(live, "submit", str(job_file))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert job_id and len(job_id.split()) == 1, submitted.stdout
    assert f"job {job_id} succeeded" in submitted.stderr

    listed = _somatize(live, "jobs", seconds=30)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if job_id in line)
    assert "succeeded" in row and "local" in row

    status = _somatize(live, "status", seconds=30)
    assert status.returncode == 0, status.stderr
    assert "w1" in status.stdout and "w2" in status.stdout and job_id in status.stdout
    header = next(line for line in status.stdout.splitlines() if "heartbeat" in line)
    column = [c.strip() for c in header.split("┃")].index("device")
    for worker_id in ("w1", "w2"):  # both train on the cpu (--device cpu)
        row = next(line for line in status.stdout.splitlines() if f"│ {worker_id} " in line)
        assert row.split("│")[column].strip() == "cpu", row

    saved = tmp_path / "states.pt"
    summary = _somatize(live, "result", job_id, seconds=30)
    assert summary.returncode == 0, summary.stderr
    # One line of the states (3 tensors: scale's and linear's weight and bias), not a table.
    assert "states of 2 nodes ['scale', 'linear']: 3 tensors" in summary.stdout
    assert "(2, 4)" not in summary.stdout
    result = _somatize(live, "result", job_id, "--states", "--save", str(saved), seconds=30)
    assert result.returncode == 0, result.stderr
    assert "scale" in result.stdout and "linear" in result.stdout
    assert "weight" in result.stdout and "(2, 4)" in result.stdout
    states = torch.load(saved, weights_only=True)["states"]  # no pickle: issue 18
    assert sorted(states) == ["linear", "scale"]
    assert tuple(states["linear"]["weight"].shape) == (2, 4)


def test_cli_submit_no_wait_then_result_waits(live, tmp_path):
    job_file = tmp_path / "job.py"
    job_file.write_text(JOB_FILE.replace("{epochs}", "2"))
    submitted = _somatize(live, "submit", "--no-wait", str(job_file))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    result = _somatize(live, "result", job_id, "--wait", str(60 * UNIT))
    assert result.returncode == 0, result.stderr
    assert "linear" in result.stdout


def test_cli_submit_of_a_failing_job_exits_1_with_the_traceback(live, tmp_path):
    job_file = tmp_path / "broken.py"
    job_file.write_text(FAILING_JOB_FILE)
    submitted = _somatize(live, "submit", str(job_file))
    assert submitted.returncode == 1, (submitted.stdout, submitted.stderr)
    job_id = submitted.stdout.strip()
    assert f"job {job_id} failed: [filter_error]" in submitted.stderr
    assert "no such column in Broken.fit" in submitted.stderr
    assert "Traceback" in submitted.stderr and "KeyError" in submitted.stderr

    result = _somatize(live, "result", job_id, seconds=30)
    assert result.returncode == 1
    assert "filter_error" in result.stderr


def test_cli_result_of_an_unknown_job_exits_2(live):
    result = _somatize(live, "result", "no-such-job", seconds=30)
    assert result.returncode == 2
    assert "unknown_job" in result.stderr and "Traceback" not in result.stderr


def test_a_job_runs_on_the_device_it_asks_for_and_one_no_worker_has_is_refused(client):
    x, y = _data()
    job = client.submit(_mlp_graph(), x, y, strategy=sz.DataParallel(2, device="cpu"))
    job.result(timeout=120 * UNIT)
    assert sorted(job.status()["workers"]) == ["w1", "w2"]

    with pytest.raises(sz.ClientError) as refused:
        client.submit(_mlp_graph(), x, y, strategy=sz.Local(device="cuda"))
    assert refused.value.code == "no_workers"
    assert "no worker has device 'cuda' (workers: " in refused.value.message
    assert "w1 cpu" in refused.value.message and "w2 cpu" in refused.value.message
    assert refused.value.detail["devices"] == ["cpu"]
    assert client.jobs(limit=1)[0]["id"] == job.id  # the refused one was never stored


def test_ping_goes_through_the_coordinator_and_a_workers_daemon(client):
    assert client.ping() > 0
    assert client.ping("w1") > 0  # client → coordinator → agent → its spare daemon → back
    with pytest.raises(sz.ClientError, match="no connected worker 'nobody'"):
        client.ping("nobody")
    job = client.submit(_mlp_graph(), *_data())
    job.wait(timeout=60 * UNIT)
    record = job.status()
    assert record["id"] == job.id and record["state"] == "succeeded"


def test_cli_plots_a_jobs_loss_curve_and_watches_the_job_list(live, client, tmp_path):
    x, y = _data()
    job = client.submit(_mlp_graph(), x, y, strategy=sz.DataParallel(workers=2))
    job.wait(timeout=120 * UNIT)
    png = tmp_path / "loss.png"
    plotted = _somatize(live, "result", job.id, "--plot", str(png), seconds=60)
    assert plotted.returncode == 0, plotted.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Every step's loss beside the epochs' rows: 3 epochs of 192 rows in batches of 32.
    assert "saved the curves (18 steps and 3 epochs)" in plotted.stderr

    env = {**os.environ, "SOMATIZE_COORDINATOR": live.url, "COLUMNS": "200"}
    before = _open_connections(live)
    watcher = subprocess.Popen(
        interruptible([str(BIN / "somatize"), "jobs", "--watch"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        # Interrupt it once it is watching (connected), not while Python still imports it.
        wait_for(lambda: _open_connections(live) > before, 60 * UNIT, "the watcher to connect")
        time.sleep(1.5 * UNIT)  # at least one refresh of the live table
        watcher.send_signal(signal.SIGINT)
        out, _ = watcher.communicate(timeout=20 * UNIT)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.communicate()  # reaped, its pipes closed: nothing left for a later test
    assert watcher.returncode == 130
    assert job.id in out


def test_a_job_waiting_for_workers_says_what_it_waits_for(live, client, tmp_path):
    """A job whose placement no idle worker fits stays queued, and the CLI says why."""
    job_file = tmp_path / "job.py"
    job_file.write_text(
        JOB_FILE.replace("{epochs}", "1").replace('sz.Local(tag="cpu")', 'sz.Local(tag="gpu")')
    )
    # No worker is tagged gpu: the job would be refused, unless it waits (issue 18).
    waits = ("--wait-for-workers", "600")
    submitted = _somatize(live, "submit", "--no-wait", *waits, str(job_file), seconds=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    try:
        listed = _somatize(live, "jobs", seconds=30)
        row = next(line for line in listed.stdout.splitlines() if job_id in line)
        assert "queued" in row and "waiting for 1 worker tagged 'gpu'" in row, row
        # the queue in the order jobs go: its place, and why it waits (issue 54)
        queue = _somatize(live, "queue", seconds=30)
        assert queue.returncode == 0, queue.stderr
        row = next(line for line in queue.stdout.splitlines() if job_id in line)
        assert "#1" in row and "no_worker" in row, queue.stdout
        assert "clients" in queue.stdout  # the admin's view: each client's share and use
        wait = next(r for r in client.queue()["jobs"] if r["id"] == job_id)["wait"]
        assert (wait["position"], wait["reason"]) == (1, "no_worker")
    finally:
        client.job(job_id).cancel()


def _open_connections(live: Cluster) -> int:
    """The coordinator's ``somatize_connections`` gauge (its open WebSocket connections)."""
    url = f"http://127.0.0.1:{live.port}/metrics"
    with urllib.request.urlopen(url, timeout=5 * UNIT) as response:
        text = response.read().decode()
    line = next(x for x in text.splitlines() if x.startswith("somatize_connections "))
    return int(line.split()[1])


def test_prune_removes_ended_jobs_and_the_retention_keeps_the_newest(tmp_path):
    """Three ended jobs: ``somatize prune --keep 2 --dry-run`` names the oldest and removes
    nothing; ``somatize prune ID`` removes it (record, events, checkpoints: ``unknown_job``
    then) and a running one is kept; status says the state directory's size; a coordinator
    started with ``--retain-jobs 1`` removes all but the newest at once."""
    from tests.utils import Center, Sleepy

    c = Cluster(tmp_path / "state")
    try:
        c.start_coordinator()
        c.start_worker("w1")
        c.start_worker("w2")
        with c.client(timeout=30 * UNIT) as client:
            graph = sz.Graph([Center().named("c")])
            ended = []  # one after the other: the oldest to end is the first (on two workers
            for _ in range(3):  # the second could end before it)
                ended.append(client.submit(graph, np.ones((4, 2), np.float32)))
                ended[-1].result(timeout=60 * UNIT)
            running = client.submit(sz.Graph([Sleepy().named("s")]), np.ones((4, 2)))
            wait_for(lambda: running.status()["state"] == "running", 60 * UNIT, "it to run")
            dry = _somatize(c, "prune", "--keep", "2", "--dry-run")
            assert dry.returncode == 0, dry.stderr
            assert dry.stdout.startswith("would remove 1 ended jobs") and ended[0].id in dry.stdout
            assert ended[0].status()["state"] == "succeeded"
            pruned = _somatize(c, "prune", ended[0].id, running.id)
            assert pruned.returncode == 0, pruned.stderr
            assert pruned.stdout.startswith("removed 1 ended jobs") and ended[0].id in pruned.stdout
            assert f"{running.id}: not an ended job of yours here: kept" in pruned.stderr
            with pytest.raises(sz.ClientError) as gone:
                ended[0].status()
            assert gone.value.code == "unknown_job"
            wait_for(lambda: "state_bytes" in client.status(), 30 * UNIT, "the state's size")
            status = _somatize(c, "status")
            assert "state directory: " in status.stdout and " MB (somatize prune " in status.stdout
            running.cancel()
            wait_for(lambda: running.status()["state"] == "cancelled", 30 * UNIT, "cancelled")
        c.stop_coordinator()
        c.start_coordinator(["--retain-jobs", "1"])
        with c.client(timeout=30 * UNIT) as client:
            newest = running.id  # cancelled last
            wait_for(lambda: [j["id"] for j in client.jobs()] == [newest], 30 * UNIT, "retention")
    finally:
        c.close()
