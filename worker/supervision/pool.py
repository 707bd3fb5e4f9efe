"""The agent's filter daemons: every one it started, and the spares kept warm for the next jobs.

Importing torch in a new daemon takes seconds. With ``fork_server`` on (a CPU worker, no
sandbox), the pool runs the agent's fork server (:mod:`worker.supervision.forked`), which imported
torch once: each daemon is a fork of it, up in milliseconds; until the server is up, or if it
dies (it is started again), daemons start anew. With ``spare`` on, :class:`DaemonPool` starts the
next jobs' daemons ahead of their ``open_job`` (off the critical path), up to ``spares`` of them
(:meth:`DaemonPool.depth`: one where daemons are forked, two where each starts anew in its
sandbox, seconds each: a job that comes the moment another took a spare finds the other one
up), and hands one over when a job asks for the default thread count; the oldest also answers
``probe``. The pool knows every daemon until it is closed, so a forced exit can
kill them all (:meth:`DaemonPool.kill_all`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
from collections.abc import Callable

from engine.data.datasets import environment as dataset_environment
from protocol.daemon import PingRequest
from worker.config import AgentConfig
from worker.confinement.cgroup import CgroupParent
from worker.confinement.limits import JobLimits
from worker.errors import DaemonError
from worker.supervision.forked import ForkServer
from worker.supervision.supervisor import DaemonSupervisor
from worker.tasks import owned_task

__all__ = ["SANDBOXED_SPARES", "DaemonPool"]

SPARE_NICE = 10
"""Niceness a root agent starts a sandboxed spare with: its seconds of start yield to a
running job's steps (a job taken the moment another was shared two cores with it), until a job
takes it."""
SANDBOXED_SPARES = 2
"""Spares a sandboxed agent keeps by default: each starts anew in its sandbox (seconds)."""

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
        self._spares: collections.deque[asyncio.Task[DaemonSupervisor]] = collections.deque()
        self._daemons: set[DaemonSupervisor] = set()  # until closed, open or not: kill_all()
        self._forks: ForkServer | None = None
        self._starting: ForkServer | None = None  # the one being started, to stop it early
        self._forks_starting: asyncio.Task[None] | None = None
        self.cgroups: CgroupParent | None = None
        """Where each daemon gets a cgroup of its own; ``None``: a process group only."""

    @property
    def has_spare(self) -> bool:
        """Whether a spare daemon is started (or starting)."""
        return bool(self._spares)

    @property
    def depth(self) -> int:
        """How many spares the pool keeps (``spares``, or one where daemons are forked and two
        where each starts anew; none with ``spare`` off)."""
        config = self._config
        if not config.spare:
            return 0
        if config.spares is not None:
            return config.spares
        return 1 if config.sandbox.forks else SANDBOXED_SPARES

    def start_fork_server(self) -> None:
        """Start the fork server in the background, if the agent uses one and it is not up
        (again, after it died); daemons start anew meanwhile."""
        config = self._config
        if not config.fork_server or config.device != "cpu" or not hasattr(os, "fork"):
            return
        if not config.sandbox.forks:  # a sandboxed daemon is started anew, in its sandbox
            return
        if self._forks_starting is not None and not self._forks_starting.done():
            return
        if self._forks is not None and self._forks.alive:
            return
        env = self._supervisor(None).environment()
        forks = self._starting = ForkServer(
            config.python, env, config.fork_server_share, config.fork_server_linger
        )

        async def start() -> None:
            try:
                await asyncio.to_thread(forks.start)
            except OSError as exc:
                if self._starting is forks:  # not stopped meanwhile
                    log.warning("no fork server (%s): each filter daemon starts anew", exc)
                return
            finally:
                if self._starting is forks:
                    self._starting = None
            old, self._forks = self._forks, forks
            if old is not None:
                await asyncio.to_thread(old.close)

        self._forks_starting = owned_task(start())

    async def close_fork_server(self) -> None:
        """Stop the fork server (the agent is going), even while it starts."""
        starting, self._starting = self._starting, None
        if starting is not None:
            await asyncio.to_thread(starting.kill)  # its start() then fails at once
        if self._forks_starting is not None and not self._forks_starting.done():
            with contextlib.suppress(asyncio.CancelledError):
                await self._forks_starting
        forks, self._forks = self._forks, None
        if forks is not None:
            await asyncio.to_thread(forks.close)

    async def for_job(self, threads: int | None) -> tuple[DaemonSupervisor, bool]:
        """The daemon for a job that asks for ``threads`` (``None``: the agent's default), and
        whether it is started: a spare that is up (:meth:`take`), else a new one for the job to
        start (:meth:`new`); then the spares are made up again (:meth:`prewarm`)."""
        supervisor = await self.take(threads)
        started = supervisor is not None
        if supervisor is None:
            supervisor = self.new(threads)
        self.prewarm()
        return supervisor, started

    def new(self, threads: int | None) -> DaemonSupervisor:
        """A daemon for a job (not started yet); ``threads`` ``None``: the agent's default."""
        self.start_fork_server()  # again, if it died
        supervisor = self._supervisor(threads)
        self._daemons.add(supervisor)
        return supervisor

    def _supervisor(self, threads: int | None) -> DaemonSupervisor:
        config = self._config
        return DaemonSupervisor(
            python=config.python,
            threads=threads or config.threads,
            env=dataset_environment(config.datasets),
            default_timeout=config.startup_timeout,
            device=config.device,
            passed_env=config.daemon_env,
            limits=JobLimits(config.max_job_memory, config.max_job_procs),
            cgroups=self.cgroups,
            fork_server=self._fork_server,
            sandbox=config.sandbox,
            allocator=config.daemon_malloc,
            relay_tensors=True,  # the agent passes its daemons' tensors on, computing on none
        )

    async def _fork_server(self) -> ForkServer | None:
        """The fork server once it is up (a daemon asked for while it starts waits for it,
        rather than import torch beside it), or ``None``."""
        starting = self._forks_starting
        if starting is not None and not starting.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(starting)
        forks = self._forks
        return forks if forks is not None and forks.alive else None

    def prewarm(self) -> None:
        """Start the next jobs' daemons, off the critical path of their ``open_job``, until
        :attr:`depth` are kept (together: a job taken the moment another was finds the other
        up, where daemons started one after the other left it starting)."""
        spares = self._spares
        while len(spares) < self.depth and self._accepting():
            supervisor = self.new(None)
            if not self._config.sandbox.forks and os.geteuid() == 0:  # (root: undone at take)
                supervisor.nice = SPARE_NICE

            async def start(supervisor: DaemonSupervisor = supervisor) -> DaemonSupervisor:
                try:
                    await supervisor.start()
                except asyncio.CancelledError:  # given up (the agent stops): its process goes
                    await self.close(supervisor)
                    raise
                return supervisor

            spares.append(owned_task(start()))

    async def take(self, threads: int | None) -> DaemonSupervisor | None:
        """A warm daemon when it has the thread count asked for and came up (one that is up
        before one still starting); else ``None``."""
        spares = self._spares
        if not spares or (threads or self._config.threads) != self._config.threads:
            return None
        task = next((t for t in spares if t.done()), spares[0])
        spares.remove(task)
        try:
            supervisor = await asyncio.shield(task)
        except DaemonError as exc:
            log.warning("the spare filter daemon failed to start: %s", exc)
            return None
        if not supervisor.running:
            await self.close(supervisor)
            return None
        await supervisor.foreground()
        return supervisor

    async def ping_spare(self) -> DaemonSupervisor | None:
        """Ping the spare daemons once every one is up (starting them first): the worker is
        warm for its next jobs; the oldest, or ``None`` when the pool keeps none.

        Raises:
            DaemonError: a spare did not start or answer; it is dropped (the next probe or
                job starts another).
        """
        self.prewarm()
        if not self._spares:
            return None
        for spare in list(self._spares):
            try:
                supervisor = await asyncio.shield(spare)
                timeout = self._config.startup_timeout
                await supervisor.request(PingRequest(id=0, cmd="ping"), timeout)
            except DaemonError:
                if spare in self._spares:
                    self._spares.remove(spare)
                    with contextlib.suppress(DaemonError):
                        await self.close(await asyncio.shield(spare))
                raise
        return await asyncio.shield(self._spares[0]) if self._spares else None

    async def close_spare(self) -> None:
        """Close the spare daemons, if any (the connection is going)."""
        while self._spares:
            task = self._spares.popleft()
            try:
                supervisor = await asyncio.shield(task)
            except (DaemonError, asyncio.CancelledError):
                continue
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
        """SIGKILL every daemon, and the fork server, now, without waiting: the forced exit of
        a second signal."""
        if self._forks is not None and self._forks.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._forks.pid, signal.SIGKILL)
        for supervisor in list(self._daemons):
            pid = supervisor.pid
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
