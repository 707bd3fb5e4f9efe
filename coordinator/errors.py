"""Exceptions of the coordinator.

Exception tree::

    CoordinatorError             root of everything raised by :mod:`coordinator`
    ├── StoreError               the job store refused a request or cannot be used
    │   │                        (raised by :mod:`coordinator.storage.store`)
    │   ├── UnknownJob           no job has that id (also a :class:`KeyError`)
    │   ├── DuplicateJob         a job with that id already exists
    │   ├── InvalidJobTransition    the job's state does not allow the request (a terminal job
    │   │                        never changes again)
    │   ├── NoResult             the job has no result: it did not succeed (yet)
    │   ├── ResultTooLarge       a result larger than SQLite can store in one value
    │   └── StoreInUse           another coordinator holds the state directory
    ├── DuplicateWorker          a hello with the id of a worker still connected
    ├── WorkerCallError          a daemon command failed on a worker, or the worker was lost
    │                            (its ``info``: the remote code, message and detail)
    ├── TargetError              no worker of a job answers to a partition's target
    ├── NoReplacement            no worker came to take a lost one's place in time
    ├── StrategyOptionsError     a strategy that does not exist, an option it cannot take,
    │                            or a job it cannot run (refused at submission)
    ├── StrategyFailed           a running strategy cannot go on (``info``: the job's failure)
    ├── AggregationError         contributions that cannot be averaged
    │                            (:mod:`coordinator.strategies.aggregate`)
    └── ScheduleError            a pipeline schedule that cannot run (also a
                                 :class:`ValueError`;
                                 :mod:`coordinator.strategies.model_parallel.schedule`)

Remote failures (a worker's error reply, a filter that raised) are data recorded on the job
(``error{code, message, detail}``): a strategy gets them as :class:`WorkerCallError` and decides
whether it can go on without that worker.
"""

from __future__ import annotations

from typing import Any

from protocol.errors import ErrorCode, ErrorInfo


class CoordinatorError(Exception):
    """Root of the errors raised by coordinator."""


class WorkerCallError(CoordinatorError):
    """A command failed on a worker: the worker's error, or the worker was lost."""

    def __init__(self, worker_id: str, info: ErrorInfo) -> None:
        super().__init__(f"worker {worker_id!r}: {info.message}")
        self.worker_id = worker_id
        self.info = info
        self.code = info.code

    def to_info(self) -> ErrorInfo:
        """The error as a job failure: the worker named in the message and the detail."""
        detail = {**self.info.detail, "worker_id": self.worker_id}
        return ErrorInfo(code=self.info.code, message=str(self), detail=detail)


class TargetError(CoordinatorError):
    """A target that no worker of the context answers to."""


class NoReplacement(CoordinatorError):
    """No worker came to take a lost one's place within the time given."""


class StrategyOptionsError(CoordinatorError):
    """A strategy that does not exist, an option it does not take or cannot accept, or a job it
    cannot run (refused when the job is submitted)."""


class StrategyFailed(CoordinatorError):
    """A running strategy cannot go on; ``info`` is the job's failure (code, message, detail)."""

    def __init__(self, code: ErrorCode, message: str, **detail: Any) -> None:
        super().__init__(message)
        self.info = ErrorInfo(code=code, message=message, detail=detail)


# -- the job store's (coordinator.storage.store) ---------------------------------------------------


class StoreError(CoordinatorError):
    """The job store refused a request or cannot be used."""


class UnknownJob(StoreError, KeyError):
    """No job has this id."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"unknown job {job_id!r}")
        self.job_id = job_id

    def __str__(self) -> str:
        # KeyError.__str__ would print the repr of the message, quotes and all.
        return str(self.args[0])


class DuplicateJob(StoreError):
    """A job with this id already exists."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"a job with id {job_id!r} already exists")
        self.job_id = job_id


class InvalidJobTransition(StoreError):
    """The job's state does not allow the request; a terminal job never changes again.

    Args:
        job_id: the job.
        state: the state it is in.
        transition: what was asked (``start``, ``succeed``, ``progress``...).
        allowed: the states the request needs.
    """

    def __init__(self, job_id: str, state: str, transition: str, allowed: frozenset[str]) -> None:
        needs = " or ".join(sorted(allowed))
        super().__init__(
            f"cannot {transition} job {job_id!r}: it is {state} ({transition} needs {needs})"
        )
        self.job_id = job_id
        self.state = state
        self.transition = transition


class NoResult(StoreError):
    """The job has no result because it has not succeeded."""

    def __init__(self, job_id: str, state: str, error: dict[str, object] | None) -> None:
        message = f"job {job_id!r} has no result: it is {state}"
        if error is not None:
            message += f" ({error.get('code')}: {error.get('message')})"
        super().__init__(message)
        self.job_id = job_id
        self.state = state
        self.error = error


class ResultTooLarge(StoreError):
    """A result larger than SQLite stores in one value (``SQLITE_LIMIT_LENGTH``)."""


class StoreInUse(StoreError):
    """Another coordinator (or another open store in this process) holds the state directory."""


# -- the worker registry's (coordinator.workers.registry) ----------------------------------------


class DuplicateWorker(CoordinatorError):
    """A hello with the id of a worker that is still connected."""
