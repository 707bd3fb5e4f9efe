"""The agent's filter daemons: every one it started, and the spare kept warm for the next job.

Importing torch in a new daemon takes seconds. With ``spare`` on, :class:`DaemonPool` starts the
next job's daemon ahead of its ``open_job`` (off the critical path), and hands it over when the
job asks for the default thread count; the spare also answers ``probe``. The pool knows every
daemon until it is closed, so a forced exit can kill them all (:meth:`DaemonPool.kill_all`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable

from protocol.daemon import PingRequest
from worker.config import AgentConfig
from worker.datasets import environment as dataset_environment
from worker.errors import DaemonError
from worker.job_cgroup import CgroupParent
from worker.job_limits import JobLimits
from worker.supervisor import DaemonSupervisor
from worker.tasks import owned_task

__all__ = ["DaemonPool"]

log = logging.getLogger(__name__)


class DaemonPool:
    """Starts, hands out and closes the agent's daemons.

    Args:
        config: the agent's settings (interpreter, threads, datasets, spare, timeouts).
        accepting: whether jobs may open now; no spare is started while not.
    """

    def __init__(self, config: AgentConfig, accepting: Callable[[], bool]) -> None:
        self._config = config
        self._accepting = accepting
        self._spare: asyncio.Task[DaemonSupervisor] | None = None
        self._daemons: set[DaemonSupervisor] = set()  # until closed, open or not: kill_all()
        self.cgroups: CgroupParent | None = None
        """Where each daemon gets a cgroup of its own; ``None``: a process group only."""

    @property
    def has_spare(self) -> bool:
        """Whether a spare daemon is started (or starting)."""
        return self._spare is not None

    def new(self, threads: int | None) -> DaemonSupervisor:
        """A daemon for a job (not started yet); ``threads`` ``None``: the agent's default."""
        config = self._config
        supervisor = DaemonSupervisor(
            python=config.python,
            threads=threads or config.threads,
            env=dataset_environment(config.datasets),
            default_timeout=config.startup_timeout,
            device=config.device,
            passed_env=config.daemon_env,
            limits=JobLimits(config.max_job_memory, config.max_job_procs),
            cgroups=self.cgroups,
        )
        self._daemons.add(supervisor)
        return supervisor

    def prewarm(self) -> None:
        """Start the next job's daemon now, off the critical path of its ``open_job``."""
        if not self._config.spare or self._spare is not None or not self._accepting():
            return
        supervisor = self.new(None)

        async def start() -> DaemonSupervisor:
            await supervisor.start()
            return supervisor

        self._spare = owned_task(start())

    async def take(self, threads: int | None) -> DaemonSupervisor | None:
        """The warm daemon when it has the thread count asked for and came up; else ``None``."""
        task = self._spare
        if task is None or (threads or self._config.threads) != self._config.threads:
            return None
        self._spare = None
        try:
            supervisor = await asyncio.shield(task)
        except DaemonError as exc:
            log.warning("the spare filter daemon failed to start: %s", exc)
            return None
        if not supervisor.running:
            await self.close(supervisor)
            return None
        return supervisor

    async def ping_spare(self) -> DaemonSupervisor | None:
        """Ping the spare daemon (starting one first); ``None`` when the pool keeps none.

        Raises:
            DaemonError: the spare did not start or answer; it is dropped (the next probe or
                job starts another).
        """
        self.prewarm()
        spare = self._spare
        if spare is None:
            return None
        try:
            supervisor = await asyncio.shield(spare)
            await supervisor.request(PingRequest(id=0, cmd="ping"), self._config.startup_timeout)
        except DaemonError:
            if self._spare is spare:
                self._spare = None
                with contextlib.suppress(DaemonError):
                    await self.close(await asyncio.shield(spare))
            raise
        return supervisor

    async def close_spare(self) -> None:
        """Close the spare daemon, if any (the connection is going)."""
        task, self._spare = self._spare, None
        if task is None:
            return
        try:
            supervisor = await asyncio.shield(task)
        except (DaemonError, asyncio.CancelledError):
            return
        await self.close(supervisor)

    async def close(self, supervisor: DaemonSupervisor) -> None:
        """Close one daemon (within ``close_timeout``) and forget it."""
        try:
            await supervisor.close(self._config.close_timeout)
        finally:
            self._daemons.discard(supervisor)

    def find_cgroups(self) -> None:
        """Make the agent's cgroup directory, if ``job_cgroups`` and the machine let it, and
        say which isolation its daemons get (blocking file I/O: run it off the loop)."""
        if not self._config.job_cgroups or self.cgroups is not None:
            return
        found = CgroupParent.find()
        if isinstance(found, str):
            log.warning("job daemons are isolated by process group only: %s", found)
        else:
            self.cgroups = found
            log.info("each job daemon gets a cgroup of its own under %s", found.path)

    def release(self) -> None:
        """Remove the agent's cgroup directory (once every daemon is closed)."""
        if self.cgroups is not None:
            self.cgroups.remove()

    def kill_all(self) -> None:
        """SIGKILL every daemon now, without waiting: the forced exit of a second signal."""
        for supervisor in list(self._daemons):
            pid = supervisor.pid
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
