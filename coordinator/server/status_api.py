"""The status page's job view: one job's record and events, and its cancel button.

* ``GET /api/jobs/ID`` — ``{"record": ..., "events": [...]}``: what ``somatize result`` and a
  watching client see of the job (its events up to :data:`MAX_EVENTS`, the latest kept);
* ``GET /api/jobs/ID/cancel`` with the header ``X-Requested-By: somatize-status-page`` —
  cancels a queued or running job (``409`` once it ended).

Both see only the jobs the caller's token may see (another client's job is ``404``, as one
that does not exist). Viewing follows ``--public-status``; cancelling always takes a token
(when the coordinator has any). The cancel is a ``GET`` because the server speaks no other
method; the header it requires is what keeps other sites from cancelling through a visitor's
browser: a page elsewhere cannot add a header to a request here (that takes a CORS preflight,
which is an ``OPTIONS`` this server never answers), and an image or a link sends none.
"""

from __future__ import annotations

import asyncio
import http
from typing import TYPE_CHECKING, Any

from protocol.errors import ErrorCode, RequestRefused

if TYPE_CHECKING:
    from coordinator.server.app import Coordinator
    from coordinator.server.clients import ClientIdentity

__all__ = ["CANCEL_HEADER", "MAX_EVENTS", "job_view", "parse_job_path"]

MAX_EVENTS = 20_000
"""Most events a job view is sent (the latest): a curve of a long job stays a page's worth."""

CANCEL_HEADER = ("X-Requested-By", "somatize-status-page")
"""The header a cancel must carry (see the module's docstring)."""


def parse_job_path(path: str) -> tuple[str, bool] | None:
    """``(job id, cancel?)`` of ``/api/jobs/ID`` or ``/api/jobs/ID/cancel``; ``None``: not one."""
    parts = path.split("/")
    if len(parts) not in (4, 5) or parts[:3] != ["", "api", "jobs"] or not parts[3]:
        return None
    if len(parts) == 5 and parts[4] != "cancel":
        return None
    return parts[3], len(parts) == 5


async def job_view(
    server: Coordinator, client: ClientIdentity, job_id: str, cancel: bool
) -> tuple[http.HTTPStatus, dict[str, Any]]:
    """The answer to a job view request of ``client``: its status and JSON body."""
    jobs = server.jobs
    assert jobs is not None
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
