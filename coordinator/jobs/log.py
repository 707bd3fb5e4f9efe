"""Each job's life in the coordinator's log: one line per event that changes where it stands.

An operator reading the coordinator's log sees every job come, start, and end, and why:
``job 3f2a queued (digits_job): waiting for 2 workers tagged 'dp'``, ``job 3f2a placed on box-1,
box-2``, ``job 3f2a succeeded after 12.3 s running``, ``job 3f2a failed [worker_lost]: ...``.
Its steps (``progress``) and checkpoints go at DEBUG: they would drown the rest. No I/O here:
:class:`~coordinator.jobs.events.JobEvents` logs what :func:`life_line` says.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["life_line"]

QUIET = frozenset({"progress", "checkpoint"})
"""Events logged at DEBUG only: many per job."""


def life_line(job_id: str, event: str, data: dict[str, Any], ran: float | None) -> tuple[int, str]:
    """The level and line that log ``event`` of ``job_id`` (``ran``: seconds since it was
    placed, when it was)."""
    if event in QUIET:
        return logging.DEBUG, f"job {job_id} {event}: {_pairs(data)}"
    if event == "queued":
        name = f" ({data['name']})" if data.get("name") else ""
        line = f"job {job_id}{name} queued: waiting for {data.get('placement', '?')}"
        if data.get("wait_for_workers"):
            line += f" (at most {data['wait_for_workers']:g} s)"
        if data.get("requeued"):
            line += f"; requeued: {data['requeued']}"
        return logging.INFO, line
    if event == "placed":
        line = f"job {job_id} placed on {', '.join(map(str, data.get('workers') or []))}"
        if data.get("collective"):
            line += f"; gradients by {data['collective']} ({data.get('collective_reason', '')})"
        return logging.INFO, line
    if event == "succeeded":
        after = f" after {ran:.1f} s running" if ran is not None else ""
        return logging.INFO, f"job {job_id} succeeded{after}"
    if event in ("failed", "cancelled"):
        after = f" after {ran:.1f} s running" if ran is not None else ""
        code = data.get("code", "?")
        return logging.INFO, f"job {job_id} {event}{after} [{code}]: {data.get('message', '')}"
    level = logging.WARNING if event == "checkpoint_failed" else logging.INFO
    return level, f"job {job_id} {event}: {_pairs(data)}"


def _pairs(data: dict[str, Any]) -> str:
    """The event's scalars as ``key=value`` (lists and dicts left out: a line, not a dump)."""
    return " ".join(
        f"{k}={v}" for k, v in data.items() if isinstance(v, str | int | float | bool | None)
    )
