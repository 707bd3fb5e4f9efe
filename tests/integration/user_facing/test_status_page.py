"""The coordinator's status page in a real headless browser (Debian's chromium).

The page is opened before any job exists and must then show, without being reloaded, both
workers and the jobs run meanwhile with their final state, progress and error, as the client SDK
reads them. A screenshot of it is kept in ``artifacts/status-page.png`` for a person to look at.
"""

from __future__ import annotations

import contextlib
import io
import json
import struct
from pathlib import Path
from typing import Any

import matplotlib.image
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed

import somatize as sz
from somatize.cli.main import loss_curve
from somatize.cli.progress import event_text
from somatize.cli.tables import datasets_text, device_text, placed_text, queued_text
from tests.coordinator.server.test_http import running
from tests.coordinator.strategies.data_parallel.test_data_parallel import dataset, graph_for
from tests.coordinator.strategies.model_parallel.test_model_parallel import dataset as pipeline_data
from tests.coordinator.strategies.model_parallel.test_model_parallel import graph as pipeline_graph
from tests.integration.browser import CHROMIUM, HEIGHT, WIDTH, BrowserError, Page, chromium
from tests.integration.cluster import cluster, wait_for
from tests.utils import UNIT, Sleepy

pytestmark = pytest.mark.integration

ARTIFACT = Path(__file__).resolve().parents[3] / "artifacts" / "status-page.png"
TABLES = """(() => {
  const connection = document.getElementById("conn-text");
  if (connection === null) return null;  // still about:blank, or not our page
  const table = (id) => {
    const names = Array.from(document.querySelectorAll(`#${id} thead th`), (th) => th.textContent);
    return Array.from(document.querySelectorAll(`#${id} tbody tr`), (tr) =>
      Object.fromEntries(Array.from(tr.cells, (td, i) => [names[i], td.innerText.trim()])));
  };
  return {
    workers: table("workers"),
    jobs: table("jobs"),
    connection: connection.textContent,
    text: document.body.innerText,
  };
})()"""
"""The page as the tests read it: each table's rows as ``{column: text}`` (null before it loads)."""


class Broken(sz.Filter):
    """A filter whose fit fails, for a job with an error to show."""

    def fit(self, x: Any, y: Any = None) -> Any:
        raise ValueError("broken on purpose")


def _needs_chromium() -> None:
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: the status page is tested in Debian's chromium. "
            "Install it with `make browser` (apt-get install --no-install-recommends chromium)."
        )


def _shown(page: Page) -> dict[str, Any]:
    """The page's tables once it loaded and has a status (else ``{}``)."""
    value: dict[str, Any] | None = page.evaluate(TABLES)
    return value if value is not None and value["connection"] == "live" else {}


def test_the_status_page_follows_workers_and_jobs_live(tmp_path):
    _needs_chromium()
    ARTIFACT.unlink(missing_ok=True)  # no stale picture passes for this run's
    browser = chromium(tmp_path / "profile", tmp_path / "chromium.log", 30 * UNIT)
    with cluster(tmp_path, {"w1": ("cpu",), "w2": ("cpu",)}) as c, browser as page:
        page.open(f"http://127.0.0.1:{c.port}/")
        try:
            _follow_two_jobs(c.url, page)
        finally:  # also when a check failed: the picture shows what the page showed
            with contextlib.suppress(BrowserError, TimeoutError, ConnectionClosed):
                ARTIFACT.parent.mkdir(exist_ok=True)
                ARTIFACT.write_bytes(page.screenshot())

    png = ARTIFACT.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24]) == (WIDTH, HEIGHT)
    pixels = matplotlib.image.imread(io.BytesIO(png), format="png")
    colours = np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)
    assert len(colours) > 50, f"a nearly blank screenshot: {len(colours)} colours"


def _follow_two_jobs(url: str, page: Page) -> None:
    """With the page open on a cluster of ``w1`` and ``w2``: run a job that succeeds and one
    that fails, and check the page shows both as the SDK reads them, without a reload."""
    before = wait_for(
        lambda: (s := _shown(page)) and len(s["workers"]) == 2 and s,
        20 * UNIT,
        "the page to list both workers",
    )
    assert {w["Worker"]: w["State"] for w in before["workers"]} == {"w1": "idle", "w2": "idle"}
    assert before["jobs"] == [] and "No job has been submitted yet." in before["text"]
    page.evaluate("window.loadedOnce = true")  # gone if the page were reloaded

    x, y = dataset()
    with sz.connect(url) as client:
        job = client.submit(graph_for("sgd", epochs=1), x, y, strategy=sz.DataParallel(2))
        broken = client.submit(sz.Graph([Broken()]), x, y, strategy=sz.Local())
        job.result(timeout=120 * UNIT)
        with pytest.raises(sz.JobFailed):
            broken.result(timeout=60 * UNIT)
        record, status = job.status(), client.status()

    def ended() -> dict[str, Any] | None:
        s = _shown(page)
        states = {j["Job"]: j["State"] for j in s.get("jobs", [])}
        idle = all(w["State"] == "idle" for w in s.get("workers", []))
        return s if states == {job.id: "succeeded", broken.id: "failed"} and idle else None

    after = wait_for(ended, 20 * UNIT, "the page to show both jobs ended and the workers idle")
    assert page.evaluate("window.loadedOnce") is True  # updated in place
    rows = {j["Job"]: j for j in after["jobs"]}
    done, progress = rows[job.id], record["progress"]
    assert done["Strategy"] == record["strategy"] == "data_parallel"
    assert f"epoch {progress['epochs']}/{progress['epochs']}" in done["Progress"]
    assert f"step {progress['steps']}/{progress['steps']}" in done["Progress"]
    assert float(done["Loss"]) == pytest.approx(progress["loss"], rel=1e-3)
    assert sorted(done["Workers"].split(", ")) == sorted(record["workers"]) == ["w1", "w2"]
    assert done["Error"] == ""
    assert rows[broken.id]["Error"].startswith("filter_error")
    assert "broken on purpose" in rows[broken.id]["Error"]
    cpus = {w["id"]: str(w["capabilities"]["cpus"]) for w in status["workers"]}
    devices = {w["id"]: device_text(w["capabilities"]) for w in status["workers"]}
    for w in after["workers"]:
        assert (w["State"], w["Job"], w["Tags"]) == ("idle", "—", "cpu")
        assert w["CPUs"] == cpus[w["Worker"]]
        assert w["Device"] == devices[w["Worker"]]  # what the worker announced, in words
    # The page words a GPU as `somatize status` does (no GPU here: its own function, asked).
    h200 = {"device": "cuda:0", "device_name": "NVIDIA H200", "device_memory_bytes": 150 << 30}
    shown = page.evaluate(f"deviceText({json.dumps(h200)})")
    assert shown == device_text(h200) == "cuda:0 NVIDIA H200 150.0 GiB"
    # A running job's last epoch's figures (the record keeps them beside its last step).
    running = {
        "phase": "training",
        "epoch": 2,
        "epochs": 3,
        "metrics": {"epoch": 1, "loss": 0.8, "val_loss": 0.71234, "accuracy": 0.6, "lr": 0.1},
    }
    shown = page.evaluate(f"progressText({json.dumps(running)})")
    # (The position in `somatize jobs`' words since issue 18: the phase only without one.)
    assert shown == "epoch 2/3 · val_loss 0.7123 · accuracy 0.6000 · lr 0.100"
    # A worker's datasets too (these workers serve none: the page shows none).
    assert all(w["Datasets"] == "" for w in after["workers"])
    served = {
        "mnist": {"rows": 60000, "kind": "npz", "x": {"shape": [60000, 784], "dtype": "uint8"}},
        "big": {
            "rows": 9,
            "kind": "shards",
            "shards": 3,
            "x": {"shape": [9, 2, 2], "dtype": "float32"},
            "y": {"shape": [9], "dtype": "int64"},
        },
    }
    shown = page.evaluate(f"datasetsText({json.dumps(served)})")
    assert shown == datasets_text(served)
    assert shown == "big 9 2 × 2 float32 → int64 (3 shards), mnist 60000 784 uint8"


def test_a_browser_logs_in_with_the_client_token_as_password(tmp_path):
    _needs_chromium()
    browser = chromium(tmp_path / "profile", tmp_path / "chromium.log", 30 * UNIT)
    with running(tmp_path, client_token="s3cret-client", worker_token="w") as url, browser as page:
        # As a person would type it; the page's own requests then carry the same credentials.
        page.open(url.replace("http://", "http://anyone:s3cret-client@") + "/")
        shown = wait_for(
            lambda: _shown(page),
            20 * UNIT,
            "the page to load its status with the browser's credentials",
        )
        assert "No worker has connected yet." in shown["text"]


JOB_VIEW = """(() => {
  const view = document.getElementById("job-view");
  if (view === null || view.hidden) return null;
  const curve = document.getElementById("job-curve");
  const error = document.getElementById("job-error");
  return {
    title: document.getElementById("job-title").textContent,
    facts: Object.fromEntries(Array.from(document.querySelectorAll("#job-facts dt"),
      (dt) => [dt.textContent, dt.nextElementSibling.innerText.trim()])),
    events: Array.from(document.querySelectorAll("#job-events tbody tr"),
      (tr) => [tr.cells[1].textContent, tr.cells[2].textContent]),
    error: error.hidden ? null : error.innerText,
    curve: curve.hidden ? null : {points: Number(curve.dataset.points), unit: curve.dataset.unit},
    cancel: !document.getElementById("job-cancel").hidden,
  };
})()"""
"""The open job view as the tests read it (null while none is open)."""

WIDE = 1400
"""The width at which nothing may scroll sideways (issue 18)."""


def _open_job(page: Page, job_id: str, until: Any) -> dict[str, Any]:
    """Click the job's row and return its view once ``until(view)`` holds."""
    row = f"document.querySelector('#jobs tr[data-job=\"{job_id}\"]')"
    wait_for(lambda: page.evaluate(f"{row} !== null"), 20 * UNIT, f"the row of job {job_id}")
    page.evaluate(f"{row}.click()")

    def shown() -> dict[str, Any] | None:
        view = page.evaluate(JOB_VIEW)
        return view if view is not None and job_id in view["title"] and until(view) else None

    return wait_for(shown, 20 * UNIT, f"the view of job {job_id}")


def test_the_job_view_shows_events_error_curve_and_cancels(tmp_path):
    """Issue 18: a job's view (its event timeline, error, loss curve, a cancel button), the
    pipeline's steps with their total, and nothing scrolling sideways at 1,400 pixels."""
    _needs_chromium()
    browser = chromium(tmp_path / "profile", tmp_path / "chromium.log", 30 * UNIT)
    with cluster(tmp_path, {"w1": ("cpu",), "w2": ("cpu",)}) as c, browser as page:
        page.open(f"http://127.0.0.1:{c.port}/")
        wait_for(lambda: len(_shown(page).get("workers", [])) == 2, 20 * UNIT, "the workers")
        x, y = dataset()
        stages = [sz.Partition(["center", "a"], worker="w1"), sz.Partition(["b", "c"], worker="w2")]
        with sz.connect(c.url) as client:
            trained = client.submit(graph_for("sgd", epochs=2), x, y, strategy=sz.DataParallel(2))
            pipeline = client.submit(
                pipeline_graph(epochs=1),
                *pipeline_data(),
                strategy=sz.ModelParallel(stages, micro_batches=2, transport="websocket"),
            )
            broken = client.submit(sz.Graph([Broken()]), x, y, strategy=sz.Local())
            trained.wait(timeout=120 * UNIT)
            pipeline.wait(timeout=120 * UNIT)
            with pytest.raises(sz.JobFailed):
                broken.result(timeout=60 * UNIT)
            events = list(trained.events(timeout=10 * UNIT))
            record = pipeline.status()

            ended = {trained.id: "succeeded", pipeline.id: "succeeded", broken.id: "failed"}
            after = wait_for(
                lambda: (
                    (s := _shown(page))
                    and {j["Job"].split()[0]: j["State"] for j in s["jobs"]} == ended
                    and s
                ),
                20 * UNIT,
                "the page to show the three jobs ended",
            )
            rows = {j["Job"].split()[0]: j for j in after["jobs"]}
            steps = record["progress"]["steps"]  # the pipeline's row says its total
            assert f"step {steps}/{steps}" in rows[pipeline.id]["Progress"]
            assert rows[broken.id]["Progress"].startswith("failed ")  # not its last phase
            for p, state, said in [
                ({"phase": "loading", "replicas": 2}, "failed", "failed while loading"),
                ({"epoch": 1, "epochs": 3}, "cancelled", "cancelled at epoch 1/3"),
                ({"epoch": 1, "epochs": 3}, "running", "epoch 1/3"),
            ]:
                assert page.evaluate(f"jobProgressText({json.dumps(p)}, '{state}')") == said

            page.resize(WIDE, HEIGHT)
            wide = page.evaluate(
                "[document.documentElement.scrollWidth, ...Array.from("
                "document.querySelectorAll('.scroll'), (s) => s.scrollWidth - s.clientWidth)]"
            )
            assert wide[0] <= WIDE and all(extra <= 0 for extra in wide[1:]), wide

            failed = _open_job(page, broken.id, lambda v: v["error"] is not None)
            assert (
                failed["error"].startswith("filter_error")
                and "broken on purpose" in failed["error"]
            )
            assert "Traceback" in failed["error"]  # the filter's own, whole
            kinds = ["queued", "placed", "progress", "progress", "failed"]  # loading, training
            assert [e for e, _ in failed["events"]] == kinds
            assert failed["facts"]["State"] == "failed" and not failed["cancel"]

            view = _open_job(page, trained.id, lambda v: v["curve"] is not None)
            assert view["curve"] == {"points": len(loss_curve(events)), "unit": "step"}
            said = {
                text for kind, text in view["events"] if kind == "progress"
            }  # each step in the CLI's words
            for event in events:
                if event.event == "progress":
                    assert event_text(event.data) in said, event.data
            # Issue 17's rows and ends, with validation figures, in the same words.
            row = {"phase": "epoch", "epoch": 2, "loss": 0.75, "lr": 0.05, "val_loss": 0.38114}
            row |= {"accuracy": 0.9125}
            rounds = {"phase": "trained", "round": 10, "rounds": 10, "loss": 0.5}
            rounds |= {"history": [{"round": 10, "loss": 0.5, "val_loss": 0.61}]}
            local = {"phase": "trained", "epochs": 3, "epoch_losses": [1.0, 0.75]}
            local |= {"history": [row]}
            for data in (row, rounds, local):
                shown = page.evaluate(f"progressEventText({json.dumps(data)})")
                assert shown == event_text(data), data
            placed = next(e for e in events if e.event == "placed")
            assert ["placed", placed_text(placed.data)] in view["events"]
            page.resize(WIDE, 1200)  # for a person to look at: the view of a trained job
            ARTIFACT.parent.mkdir(exist_ok=True)
            ARTIFACT.with_name("status-page-job.png").write_bytes(page.screenshot())
            page.resize(WIDTH, HEIGHT)

            # A job that runs until cancelled, from its view: a first click asks, a second does.
            sleepy = client.submit(sz.Graph([Sleepy()]), x, y, strategy=sz.Local(worker="w1"))
            wait_for(lambda: sleepy.status()["state"] == "running", 60 * UNIT, "the job to run")
            _open_job(page, sleepy.id, lambda v: v["cancel"])
            page.evaluate("document.getElementById('job-cancel').click()")
            assert page.evaluate("document.getElementById('job-cancel').textContent") == (
                "Click again to cancel"
            )
            assert sleepy.status()["state"] == "running"
            page.evaluate("document.getElementById('job-cancel').click()")
            wait_for(lambda: sleepy.status()["state"] == "cancelled", 30 * UNIT, "the cancel")
            view = _open_job(page, sleepy.id, lambda v: v["facts"]["State"] == "cancelled")
            assert view["events"][-1] == ["cancelled", "[cancelled] cancelled by the client"]
            assert not view["cancel"]


WORDED = [
    {"phase": "training", "epoch": 2, "epochs": 3, "step": 9, "steps": 12, "loss": 0.7356},
    {"phase": "training", "epoch": 1, "epochs": 1, "step": 66, "loss": 0.5},
    {
        "phase": "round",
        "round": 3,
        "rounds": 10,
        "workers": ["a", "b"],
        "rows": 1347,
        "loss": 1.956,
    },
    {"phase": "round", "round": 1, "rounds": 2, "dropped": {"w3": "lost"}, "loss": 2.0},
    {"phase": "trained", "epochs": 3, "epoch_losses": [1.0, 0.25], "loss": 0.1},
    {"phase": "loading", "replicas": 2},
    {"phase": "fitting", "nodes": ["center", "scale"]},
    {"phase": "staged", "rows": {"a": 1000, "b": 347}, "dropped": {}},
    {"phase": "training", "rows": 1200},
    {"phase": "linked", "transport": "torch", "reason": "why"},
]
"""Progress events of every kind, as the strategies send them."""


def test_the_page_words_progress_as_the_cli_does(tmp_path):
    _needs_chromium()
    browser = chromium(tmp_path / "profile", tmp_path / "chromium.log", 30 * UNIT)
    with running(tmp_path) as url, browser as page:
        page.open(url + "/")
        wait_for(lambda: _shown(page), 20 * UNIT, "the page")
        for data in WORDED:
            assert page.evaluate(f"progressEventText({json.dumps(data)})") == event_text(data)
        queued = {"placement": "2 workers tagged 'dp'", "wait_for_workers": 60.0}
        assert page.evaluate(f"queuedText({json.dumps(queued)})") == queued_text(queued)
