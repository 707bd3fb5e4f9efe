"""A job that has its workers: what its strategy context is made from, and the live one.

The job manager (:mod:`coordinator.jobs.manager`) makes a :class:`PlacedJob` once a queued job's
workers are chosen and enters its :data:`ContextFactory` (by default
:func:`transport_context`, the live workers over their connections) for the run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

from coordinator.context import StrategyContext
from coordinator.server.registry import WorkerRecord
from coordinator.server.transport import TransportContext

__all__ = ["ContextFactory", "PlacedJob", "transport_context"]


@dataclass(frozen=True)
class PlacedJob:
    """What a job's strategy context is made from, once the job has its workers.

    Attributes:
        job_id: the job.
        workers: the registry records of its workers, in strategy index order.
        timeout: seconds one command may take on a worker.
        threads: torch threads of each job daemon (``None``: the agent's default).
        observe: called with ``(command, seconds)`` for every successful worker command.
        recruit: waits up to the given seconds for a worker to replace a lost one and reserves
            it for the job (:meth:`JobManager.recruit`); ``None`` if none came.
    """

    job_id: str
    workers: list[WorkerRecord]
    timeout: float
    threads: int | None
    observe: Callable[[str, float], None]
    recruit: Callable[[float], Awaitable[WorkerRecord | None]]


ContextFactory = Callable[[PlacedJob], AbstractAsyncContextManager[StrategyContext]]
"""Makes a placed job's strategy context; leaving it closes the job on its workers."""


@asynccontextmanager
async def transport_context(job: PlacedJob) -> AsyncIterator[StrategyContext]:
    """The job's live workers over their connections (:class:`TransportContext`)."""
    ctx = TransportContext(
        job.job_id,
        job.workers,
        job.timeout,
        job.threads,
        observe=job.observe,
        recruit=job.recruit,
    )
    try:
        yield ctx
    finally:
        await ctx.close()
