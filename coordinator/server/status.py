"""What the coordinator shows of itself: ``somatize status``, and the status page with its API.

* the **snapshot** (:func:`status_snapshot`): every worker's summary and the latest jobs' records
  (state, progress, error) that the client may see, with the server's name and clock — what a
  client's ``status`` request is answered and ``GET /api/status`` serves;
* the **page** (:data:`PAGE`, served at ``GET /`` by :mod:`coordinator.server.http`): one
  self-contained HTML document made of ``static/status.html``, ``status.css`` and ``status.js``
  (package data), the stylesheet and the script inlined where the HTML links them, so that
  nothing is fetched from anywhere but the coordinator's own API (the :data:`CSP` header forbids
  it) and the page works on a network with no way out. Its script polls ``GET /api/status``
  every second and redraws the workers and jobs tables; a job's row opens its view (``#job=ID``
  in the address: its events, error, loss curve and cancel button). Every value from a worker
  or a job goes into the page as text (``textContent``), never as markup. A browser that was
  asked for a password by the page's ``401`` (HTTP Basic, the client token as password) sends
  the same credentials with its ``fetch`` calls: same origin, same realm;
* the **job view** (:func:`job_view`): ``GET /api/jobs/ID`` — ``{"record": ..., "events":
  [...]}``, what ``somatize result`` and a watching client see of the job (its events up to
  :data:`MAX_EVENTS`, the latest kept); ``GET /api/jobs/ID/cancel`` with the header
  ``X-Requested-By: somatize-status-page`` cancels a queued or running job (``409`` once it
  ended).

Clients see only the jobs their token may see (another client's job is ``404``, as one that does
not exist). Viewing follows ``--public-status``; cancelling always takes a token (when the
coordinator has any). The cancel is a ``GET`` because the server speaks no other method; the
header it requires is what keeps other sites from cancelling through a visitor's browser: a page
elsewhere cannot add a header to a request here (that takes a CORS preflight, which is an
``OPTIONS`` this server never answers), and an image or a link sends none.
"""

from __future__ import annotations

import asyncio
import http
import time
from importlib import resources
from typing import Any

from coordinator.jobs.manager import JobManager
from coordinator.server.clients import ClientIdentity
from coordinator.server.config import SERVER
from coordinator.workers.registry import Registry
from protocol.errors import ErrorCode, RequestRefused

__all__ = [
    "CANCEL_HEADER",
    "CSP",
    "MAX_EVENTS",
    "PAGE",
    "STATUS_JOBS",
    "compact",
    "job_view",
    "parse_job_path",
    "status_snapshot",
    "visible_records",
]

STATUS_JOBS = 50
"""How many of the latest jobs a status snapshot lists."""

MAX_EVENTS = 20_000
"""Most events a job view is sent (the latest): a curve of a long job stays a page's worth."""

CANCEL_HEADER = ("X-Requested-By", "somatize-status-page")
"""The header a cancel must carry (see the module's docstring)."""

CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
"""The page's Content-Security-Policy: its own inline style and script, requests to its origin."""

STYLESHEET_LINK = '<link rel="stylesheet" href="status.css">'
"""Where ``status.html`` links its stylesheet: replaced by the stylesheet itself."""
SCRIPT_LINK = '<script src="status.js"></script>'
"""Where ``status.html`` loads its script: replaced by the script itself."""
SUFFIXES = ("html", "css", "js")
"""The page's files in ``static/``: ``status.html``, ``status.css``, ``status.js``."""


def _page() -> str:
    """``static/status.html`` with its stylesheet and script inlined (see the module docstring).

    Raises:
        ValueError: the HTML does not link each of them exactly once.
    """
    static = resources.files("coordinator.server").joinpath("static")
    html, css, js = (static.joinpath(f"status.{ext}").read_text("utf-8") for ext in SUFFIXES)
    for link in (STYLESHEET_LINK, SCRIPT_LINK):
        if html.count(link) != 1:
            raise ValueError(f"static/status.html must hold {link} exactly once")
    html = html.replace(STYLESHEET_LINK, f"<style>\n{css}</style>")
    return html.replace(SCRIPT_LINK, f"<script>\n{js}</script>")


PAGE = _page()
"""The status page, as ``GET /`` serves it."""


async def visible_records(
    jobs: JobManager, client: ClientIdentity, limit: int
) -> list[dict[str, Any]]:
    """The latest ``limit`` job records ``client`` may see."""
    records = await jobs.records(limit)
    return [compact(r) for r in records if client.may_see(r["summary"].get("owner"))]


def compact(record: dict[str, Any]) -> dict[str, Any]:
    """A job record as a status answer lists it: its last progress event without the lists a
    long run grows (the history but its last row, each step of a chunk, the validations), so
    that an answer of many jobs stays small (a job's own record keeps them all)."""
    progress = dict(record.get("progress") or {})
    for name in ("history", "epoch_losses", "losses", "lrs"):
        if isinstance(progress.get(name), list):
            progress[name] = progress[name][-1:]
    for name in ("validations", "batch_rows"):
        progress.pop(name, None)
    return record | {"progress": progress}


async def status_snapshot(
    registry: Registry, jobs: JobManager, client: ClientIdentity
) -> dict[str, Any]:
    """What ``somatize status`` and the status page show ``client`` (the module docstring):
    the page measures durations against the server's clock, not against the browser's."""
    now = time.monotonic()
    workers = []
    for w in registry:
        # threads: a job daemon's default torch threads there (None: all the worker's cores)
        summary = w.summary(now) | {"threads": registry.thread_share(w)}
        if summary["job_id"] is not None and not await _sees(jobs, client, summary["job_id"]):
            summary["job_id"] = OTHERS  # busy, and whose job is not this client's business
        workers.append(summary)
    held = jobs.pruning.held  # (an admin's business: the whole state directory)
    return {
        "server": SERVER,
        "time": time.time(),
        "workers": workers,
        "jobs": await visible_records(jobs, client, STATUS_JOBS),
    } | ({"state_bytes": held} if client.admin and held is not None else {})


OTHERS = "(another client's)"
"""What a worker's job reads as to a client that may not see that job."""


async def _sees(jobs: JobManager, client: ClientIdentity, job_id: str) -> bool:
    """Whether ``client`` may see job ``job_id`` (one gone from the store: no)."""
    if client.admin:
        return True
    try:
        return client.may_see(await jobs.owner(job_id))
    except RequestRefused:
        return False


def parse_job_path(path: str) -> tuple[str, bool] | None:
    """``(job id, cancel?)`` of ``/api/jobs/ID`` or ``/api/jobs/ID/cancel``; ``None``: not one."""
    parts = path.split("/")
    if len(parts) not in (4, 5) or parts[:3] != ["", "api", "jobs"] or not parts[3]:
        return None
    if len(parts) == 5 and parts[4] != "cancel":
        return None
    return parts[3], len(parts) == 5


async def job_view(
    jobs: JobManager, client: ClientIdentity, job_id: str, cancel: bool
) -> tuple[http.HTTPStatus, dict[str, Any]]:
    """The answer to a job view request of ``client`` (or its cancel): its status and JSON
    body."""
    try:
        owner = await jobs.owner(job_id)
        if not client.admin and not client.may_see(owner):
            raise RequestRefused.of(ErrorCode.UNKNOWN_JOB, f"no job {job_id!r}")
        if cancel:
            await jobs.cancel(job_id)
            return http.HTTPStatus.OK, {"cancelled": job_id}
        record = await jobs.record(job_id)
        events = await asyncio.to_thread(jobs.store.events, job_id)
    except RequestRefused as exc:
        info = exc.info
        status = {
            ErrorCode.UNKNOWN_JOB: http.HTTPStatus.NOT_FOUND,
            ErrorCode.BAD_REQUEST: http.HTTPStatus.CONFLICT,  # it ended: nothing to cancel
        }.get(info.code, http.HTTPStatus.INTERNAL_SERVER_ERROR)
        return status, {"error": {"code": str(info.code), "message": info.message}}
    shown = [
        {"seq": e.seq, "time": e.time, "event": e.kind, "data": e.data}
        for e in events[-MAX_EVENTS:]
    ]
    return http.HTTPStatus.OK, {
        "record": record,
        "events": shown,
        "dropped": len(events) - len(shown),
    }
