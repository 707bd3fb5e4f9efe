"""The coordinator's plain HTTP side, on a real :class:`Coordinator` listening on loopback.

``/healthz`` is always open; the status page ``/``, its ``/api/status`` and ``/metrics`` need the
client token when there is one — as a bearer token, or as the password of HTTP Basic so that a
browser can log in — unless the coordinator was started with ``public_status``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

import somatize as sz
from coordinator.server.app import Coordinator
from coordinator.server.clients import ClientIdentity, ClientTokens
from coordinator.server.config import CoordinatorConfig
from tests.utils import UNIT, Center

CLIENT, WORKER = "client-token-0123456789", "worker-token-9876543210"
GUARDED = ["/", "/api/status", "/metrics"]


@contextlib.contextmanager
def running(tmp_path: Path, **kwargs: Any) -> Iterator[str]:
    """A coordinator on a free loopback port, its event loop in a thread; yields its base URL."""
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        coordinator = Coordinator(CoordinatorConfig("127.0.0.1", 0, tmp_path / "state", **kwargs))
        await coordinator.start()
        box["loop"], box["coordinator"] = asyncio.get_running_loop(), coordinator
        ready.set()
        await coordinator.serve_forever()

    def thread_main() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # reported by the test thread below
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=thread_main, name="coordinator")
    thread.start()
    try:
        assert ready.wait(10 * UNIT), "the coordinator did not start"
        assert "error" not in box, f"the coordinator did not start: {box.get('error')!r}"
        yield f"http://127.0.0.1:{box['coordinator'].port}"
    finally:
        if "loop" in box:
            stop = box["coordinator"].stop(grace=1.0)
            asyncio.run_coroutine_threadsafe(stop, box["loop"]).result(10 * UNIT)
        thread.join(10 * UNIT)
        assert not thread.is_alive(), "the coordinator did not stop"


def get(url: str, authorization: str | None = None) -> tuple[int, Any, bytes]:
    """``GET url``: status, headers and body, whatever the status."""
    request = urllib.request.Request(url)
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=5 * UNIT) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers, exc.read()


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_with_a_client_token_the_status_and_metrics_need_it_and_healthz_stays_open(tmp_path):
    with running(tmp_path, worker_token=WORKER, client_token=CLIENT) as url:
        status, _, body = get(url + "/healthz")
        assert (status, body) == (200, b"ok\n")
        for path in GUARDED:
            for refused in (
                None,
                "Bearer wrong",
                f"Bearer {WORKER}",  # a worker's token is not a client's
                CLIENT,  # no scheme
                f"Token {CLIENT}",
                basic("admin", "wrong"),
                basic(CLIENT, ""),  # the token as user name, not password
                "Basic not-base64!",
            ):
                status, headers, body = get(url + path, refused)
                assert status == 401, (path, refused)
                assert headers["WWW-Authenticate"].startswith('Basic realm="somatize"')
                assert b"client token" in body
            for accepted in (f"Bearer {CLIENT}", basic("anyone", CLIENT), basic("", CLIENT)):
                status, _, _ = get(url + path, accepted)
                assert status == 200, (path, accepted)
        assert get(url + "/nowhere", f"Bearer {CLIENT}")[0] == 404


def test_public_status_opens_the_page_and_metrics_but_not_the_websocket_paths(tmp_path):
    with running(tmp_path, worker_token=WORKER, client_token=CLIENT, public_status=True) as url:
        for path in [*GUARDED, "/healthz"]:
            assert get(url + path)[0] == 200, path
        for path in ("/client", "/worker"):
            assert get(url + path)[0] == 401, path
        with pytest.raises(sz.ConnectionFailed, match=r"401|token"):
            sz.connect(url.replace("http", "ws"), timeout=10 * UNIT)


def test_without_tokens_everything_is_open(tmp_path):
    with running(tmp_path) as url:
        for path in [*GUARDED, "/healthz"]:
            assert get(url + path)[0] == 200, path


def test_the_page_and_its_json_are_what_somatize_status_shows(tmp_path):
    with running(tmp_path, client_token=CLIENT, worker_token=WORKER) as url:
        auth = f"Bearer {CLIENT}"
        status, headers, body = get(url + "/", auth)
        assert status == 200
        assert headers["Content-Type"] == "text/html; charset=utf-8"
        assert "default-src 'none'" in headers["Content-Security-Policy"]
        assert headers["Cache-Control"] == "no-store"
        page = body.decode()
        assert "api/status" in page and "<table" in page
        assert "http://" not in page and "https://" not in page  # nothing loaded from elsewhere
        # the state directory is counted just after the start: both sides show it from then on
        deadline = time.monotonic() + 10 * UNIT
        while True:
            _, headers, body = get(url + "/api/status", auth)
            assert headers.get_all("Content-Type") == ["application/json"]
            snapshot = orjson.loads(body)
            if "state_bytes" in snapshot or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        with sz.connect(url.replace("http", "ws"), token=CLIENT, timeout=10 * UNIT) as client:
            shown = client.status()
        keys = {"server", "time", "workers", "jobs", "state_bytes"}
        assert snapshot.keys() == shown.keys() == keys
        assert snapshot["workers"] == shown["workers"] == []
        assert snapshot["jobs"] == shown["jobs"] == []
        assert snapshot["server"].startswith("somatize-coordinator/")
        _, headers, body = get(url + "/metrics", auth)
        assert headers.get_all("Content-Type") == ["text/plain; version=0.0.4; charset=utf-8"]
        assert b"somatize_" in body


def _job_api(url: str, path: str, token: str | None, cancel_header: bool = False) -> Any:
    request = urllib.request.Request(url + path)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    if cancel_header:
        request.add_header("X-Requested-By", "somatize-status-page")
    try:
        with urllib.request.urlopen(request, timeout=5 * UNIT) as response:
            return response.status, orjson.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            body = exc.read()
            return exc.code, orjson.loads(body) if exc.headers["Content-Type"] == (
                "application/json"
            ) else body


def test_the_job_view_shows_and_cancels_a_job_only_to_its_owner(tmp_path):
    """Issue 18: the status page's job view (its events) and its cancel button."""
    tokens = ClientTokens(
        {"alice-token-0123456": ClientIdentity("alice"), "bob-token-65432": ClientIdentity("bob")}
    )
    with running(tmp_path, client_tokens=tokens, worker_token=WORKER) as url:
        with sz.connect(url.replace("http", "ws"), token="alice-token-0123456") as client:
            job = client.submit(sz.Graph([Center()]), np.zeros((4, 2), np.float32))  # no worker
            job_id = job.id
        status, view = _job_api(url, f"/api/jobs/{job_id}", "alice-token-0123456")
        assert status == 200 and view["record"]["state"] == "queued" and view["dropped"] == 0
        assert [e["event"] for e in view["events"]] == ["queued"]
        assert view["events"][0]["data"] == {"placement": "1 worker"}
        assert _job_api(url, f"/api/jobs/{job_id}", "bob-token-65432")[0] == 404
        assert _job_api(url, "/api/jobs/no-such-job", "alice-token-0123456")[0] == 404
        assert _job_api(url, f"/api/jobs/{job_id}", None)[0] == 401
        # A cancel needs the page's header: a link or an image elsewhere cannot send one.
        assert _job_api(url, f"/api/jobs/{job_id}/cancel", "alice-token-0123456")[0] == 403
        assert _job_api(url, f"/api/jobs/{job_id}/cancel", "bob-token-65432", True)[0] == 404
        assert _job_api(url, f"/api/jobs/{job_id}/cancel", "alice-token-0123456", True) == (
            200,
            {"cancelled": job_id},
        )
        status, ended = _job_api(url, f"/api/jobs/{job_id}/cancel", "alice-token-0123456", True)
        assert status == 409 and "already ended (cancelled)" in ended["error"]["message"]
        _, view = _job_api(url, f"/api/jobs/{job_id}", "alice-token-0123456")
        assert [e["event"] for e in view["events"]] == ["queued", "cancelled"]
        assert _job_api(url, f"/api/jobs/{job_id}/nope", "alice-token-0123456")[0] == 404


def test_a_public_status_shows_a_job_to_anyone_but_cancels_only_with_the_token(tmp_path):
    with running(tmp_path, client_token=CLIENT, worker_token=WORKER, public_status=True) as url:
        with sz.connect(url.replace("http", "ws"), token=CLIENT) as client:
            job_id = client.submit(sz.Graph([Center()]), np.zeros((4, 2), np.float32)).id
        assert _job_api(url, f"/api/jobs/{job_id}", None)[0] == 200
        assert _job_api(url, f"/api/jobs/{job_id}/cancel", None, True)[0] == 401
        assert _job_api(url, f"/api/jobs/{job_id}/cancel", CLIENT, True)[0] == 200


def test_a_status_answer_stays_small_however_large_the_jobs_graphs(tmp_path):
    """Issue 32: 4,096 node ids of 256 characters made a 3.2 MB job record and a status answer
    of 100 MB. A record keeps the first 32 ids (64 characters each at most) and their count."""
    graph = sz.Graph([Center().named(f"{k:04d}" + "n" * 252) for k in range(4096)])
    with running(tmp_path) as url:
        with sz.connect(url.replace("http", "ws")) as client:
            ids = [client.submit(graph, np.zeros((4, 2), np.float32)).id for _ in range(3)]
            listed = client.jobs(limit=3)
        status, _, body = get(url + "/api/status")
    assert status == 200 and len(body) < 64 * 1024, len(body)
    assert {job["id"] for job in listed} == set(ids)
    summary = listed[0]["summary"]
    assert summary["nodes"] == 4096 and len(summary["node_ids"]) == 32
    assert summary["node_ids"][0] == "0000" + "n" * 60 + "… (192 more characters)"
