"""Exceptions of the worker side.

Exception tree::

    WorkerError                  root of everything raised by :mod:`worker`
    ├── EngineError              the engine refused a request (unknown node, no gradients, ...):
    │                            carries an :class:`~protocol.errors.ErrorCode`
    └── DaemonError              a request to the filter daemon did not succeed
        ├── DaemonCrashed        the daemon process died before answering (restart it)
        ├── DaemonTimeout        no answer within the request's timeout (the daemon was killed)
        └── DaemonNotRunning     the daemon is not started, or was not restarted after a crash

A :class:`DaemonError` that is not one of its subclasses is a *remote* failure reported by a live
daemon (a filter that raised, a refused command): its ``code``, ``message`` and ``detail`` are the
daemon's :class:`~protocol.errors.ErrorInfo`, ``detail["traceback"]`` holds the user traceback.
"""

from __future__ import annotations

from typing import Any

from protocol.errors import ErrorCode, ErrorInfo


class WorkerError(Exception):
    """Root of the errors raised by :mod:`worker`."""


class _CodedError(WorkerError):
    def __init__(self, code: ErrorCode, message: str, detail: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail: dict[str, Any] = detail or {}

    def info(self) -> ErrorInfo:
        """This error as the payload of an error reply."""
        return ErrorInfo(code=self.code, message=self.message, detail=self.detail)


class EngineError(_CodedError):
    """The engine refused a request; ``code`` says why (see :class:`ErrorCode`)."""


class DaemonError(_CodedError):
    """A daemon request failed; built from the daemon's error reply or by the supervisor."""

    @classmethod
    def from_info(cls, info: ErrorInfo) -> DaemonError:
        return cls(info.code, info.message, dict(info.detail))

    def __str__(self) -> str:
        tb = self.detail.get("traceback")
        return f"{self.message}\n{tb}" if tb else self.message


class DaemonCrashed(DaemonError):
    """The daemon process exited (or was killed) before it answered."""


class DaemonTimeout(DaemonError):
    """The daemon did not answer within the timeout; the supervisor killed it."""


class DaemonNotRunning(DaemonError):
    """A request was made while no daemon is running."""


# -- the engine's, the daemon's and the supervisor's (helper "engine") -------------------------


class DaemonAlreadyRunning(WorkerError, RuntimeError):
    """:meth:`~worker.supervisor.DaemonSupervisor.start` while its daemon runs (use restart)."""
