"""Exceptions of the worker side.

Exception tree::

    WorkerError                  root of everything raised by :mod:`worker`
    ├── AgentError               a connection attempt failed in a way the agent understands
    │   ├── HandshakeFailed      the hello was answered by something other than a welcome
    │   ├── LinkDead             the coordinator answered no ping within the heartbeat timeout
    │   ├── RegistrationRefused  refused for good (another protocol version, a wrong token)
    │   └── UntrustedCoordinator its TLS certificate fails verification with what the agent
    │                            trusts (retrying would not help: give the right --ca-file)
    ├── InvalidTransition        the agent's lifecycle was asked for a step its state forbids
    ├── PipelineError            a pipeline stage's input or turn could not be had
    │   ├── MailboxDropped       the job's mailbox went while a call waited on it
    │   ├── MailboxFull          a delivery refused: too many held untaken
    │   └── OutOfOrder           a sequenced call cannot run (an earlier one failed, too late)
    ├── DaemonAlreadyRunning     (also a RuntimeError) ``start`` on a supervisor already started
    └── DaemonError              a request to the filter daemon did not succeed
        ├── DaemonCrashed        the daemon process died before answering (restart it)
        ├── DaemonTimeout        no answer within the request's timeout (the daemon was killed)
        └── DaemonNotRunning     the daemon is not started, or was not restarted after a crash

A :class:`DaemonError` that is not one of its subclasses is a *remote* failure reported by a live
daemon (a filter that raised, a refused command): its ``code``, ``message`` and ``detail`` are the
daemon's :class:`~protocol.errors.ErrorInfo`, ``detail["traceback"]`` holds the user traceback.

The engine's refusals are :class:`engine.errors.EngineError`, not one of these.

A request the agent refuses is answered by raising :class:`~protocol.errors.RequestRefused`
(the wire layer's, not one of these): these are the worker's own failures.
"""

from __future__ import annotations

from typing import Any

from protocol.errors import ErrorCode, ErrorInfo


class WorkerError(Exception):
    """Root of the errors raised by :mod:`worker`."""


class AgentError(WorkerError):
    """A connection attempt failed in a way the agent understands (it retries)."""


class HandshakeFailed(AgentError):
    """The coordinator answered the hello with something other than a welcome."""


class LinkDead(AgentError):
    """The coordinator answered no ping for longer than the heartbeat timeout."""


class RegistrationRefused(AgentError):
    """The coordinator refused this worker for good (another protocol version, a wrong token).

    ``info`` is the coordinator's error; :meth:`~worker.agent.Agent.run` raises this instead of
    retrying.
    """

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(f"{info.code}: {info.message}")
        self.info = info


class UntrustedCoordinator(AgentError):
    """The coordinator's TLS certificate fails verification with what the agent trusts: the
    same certificate would fail again, so :meth:`~worker.agent.Agent.run` raises this instead
    of retrying (the message says what to give ``--ca-file``)."""


class InvalidTransition(WorkerError):
    """A lifecycle step its current state does not allow (a bug in the agent, not the peer)."""


class PipelineError(WorkerError):
    """A pipeline stage's input or turn could not be had."""


class MailboxDropped(PipelineError):
    """The job's mailbox was dropped (the job closed, the connection went) while waiting."""


class MailboxFull(PipelineError):
    """A delivery refused: the mailbox already holds its limit of untaken ones."""


class DeliveredTwice(PipelineError):
    """A delivery refused: its key holds a delivery nobody took yet (it is never replaced)."""


class OutOfOrder(PipelineError):
    """A sequenced call cannot run: an earlier one failed, or its turn did not come in time."""


class _CodedError(WorkerError):
    def __init__(self, code: ErrorCode, message: str, detail: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail: dict[str, Any] = detail or {}

    def info(self) -> ErrorInfo:
        """This error as the payload of an error reply."""
        return ErrorInfo(code=self.code, message=self.message, detail=self.detail)


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


class DaemonAlreadyRunning(WorkerError, RuntimeError):
    """:meth:`~worker.supervision.supervisor.DaemonSupervisor.start` while its daemon runs (use
    restart)."""
