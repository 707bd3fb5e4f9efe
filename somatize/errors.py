"""Exceptions of the SDK.

Exception tree::

    SomatizeError            root of everything raised by :mod:`somatize`
    ├── GraphError           a graph that cannot be built (duplicate node ids, a filter used twice)
    ├── ClientError          the coordinator refused a request (``code``, ``detail``)
    │   └── ConnectionFailed the coordinator cannot be reached, refused the handshake, or the
    │                        connection was lost (also a :class:`ConnectionError`)
    ├── JobFailed            a job failed or was cancelled (``job_id``, ``code``, ``message``,
    │                        ``detail``: what the coordinator recorded)
    ├── UsageError           a ``somatize`` command that cannot run as asked
    (:mod:`somatize.cli.main`: │                        one line, exit code 2)
    └── ClusterError         a process of a :class:`~somatize.cli.cluster.LocalCluster` did not
    start

A request or a job that does not answer within the time given raises the built-in
:class:`TimeoutError`. Errors raised while a graph trains in-process come from the engine
(:class:`engine.errors.EngineError`) or from the user's own filters, unchanged.
"""

from __future__ import annotations

from typing import Any


class SomatizeError(Exception):
    """Root of the errors raised by :mod:`somatize`."""


class GraphError(SomatizeError, ValueError):
    """A graph that cannot be built as asked."""


class ClientError(SomatizeError):
    """The coordinator answered a request with an error, or could not be asked.

    Attributes:
        code: the error code of the coordinator's reply (:class:`protocol.errors.ErrorCode`
            values), ``None`` when the failure is this side's.
        detail: more about the error, as the coordinator sent it.
    """

    def __init__(
        self, message: str, *, code: str | None = None, detail: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.detail = dict(detail or {})


class ConnectionFailed(ClientError, ConnectionError):
    """The coordinator cannot be reached, refused the handshake, or the connection was lost."""


class JobFailed(SomatizeError):
    """A job failed or was cancelled.

    Attributes:
        job_id: the job.
        code: why, as an error code (``"filter_error"``, ``"worker_lost"``, ``"cancelled"``...).
        message: what happened and where.
        detail: more, as recorded by the coordinator (a filter error's ``"traceback"``...).
    """

    def __init__(
        self, job_id: str, code: str, message: str, detail: dict[str, Any] | None = None
    ) -> None:
        super().__init__(f"job {job_id} {_verb(code)}: [{code}] {message}")
        self.job_id = job_id
        self.code = code
        self.message = message
        self.detail = dict(detail or {})

    @property
    def traceback(self) -> str | None:
        """The remote traceback of a filter that raised, when the coordinator sent one."""
        value = self.detail.get("traceback")
        return value if isinstance(value, str) else None


class UsageError(SomatizeError):
    """A command that cannot run as asked: printed as one line, exit code 2."""


class ClusterError(SomatizeError):
    """A process of the local cluster did not start (its log is named in the message)."""


def _verb(code: str) -> str:
    return "was cancelled" if code == "cancelled" else "failed"
