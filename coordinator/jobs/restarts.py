"""When a job that failed goes back to its last checkpoint instead (``max_restarts``), and what
its events say about it.

A fault of the cluster — a worker lost, a daemon crashed, a collective broken or timed out, a
round short of workers — may not happen again on other workers or after a reconnect, so a job
whose strategy allows restarts is queued again, ahead of the others, and resumes from its last
checkpoint (:mod:`coordinator.storage.checkpoints`). A fault of the job itself (a filter that
raised, a model that does not fit) would happen again: it fails the job at once, restarts or
not. The :class:`~coordinator.jobs.manager.JobManager` does the queueing; this module decides and
words.
"""

from __future__ import annotations

from typing import Any

from coordinator.strategies import Strategy
from protocol.errors import ErrorCode, ErrorInfo

__all__ = ["RESTARTABLE", "no_workers_for_restart", "restarting_event", "should_restart"]

RESTARTABLE = frozenset(
    {
        ErrorCode.WORKER_LOST,
        ErrorCode.DAEMON_CRASHED,
        ErrorCode.COLLECTIVE_FAILED,
        ErrorCode.TIMEOUT,
        ErrorCode.NOT_ENOUGH_WORKERS,
    }
)
"""The faults a restart may get past: the cluster's, not the job's."""


def should_restart(info: ErrorInfo, strategy: Strategy, done: int) -> bool:
    """Whether a job that ended with ``info``, restarted ``done`` times so far, restarts."""
    return info.code in RESTARTABLE and done < strategy.max_restarts


def restarting_event(info: ErrorInfo, strategy: Strategy, attempt: int) -> dict[str, Any]:
    """The data of a job's ``restarting`` event: which restart, and the fault it gets past."""
    return {
        "attempt": attempt,
        "max_restarts": strategy.max_restarts,
        "code": str(info.code),
        "message": info.message,
        "restart_timeout": strategy.restart_timeout,
    }


def no_workers_for_restart(info: ErrorInfo, strategy: Strategy, attempt: int) -> ErrorInfo:
    """How a job fails when its restart found no workers in time: with the fault that stopped
    it, saying so."""
    return ErrorInfo(
        code=info.code,
        message=f"{info.message} (restart {attempt} of {strategy.max_restarts} found no "
        f"workers within restart_timeout={strategy.restart_timeout:g}s)",
        detail={**info.detail, "restarts": attempt},
    )
