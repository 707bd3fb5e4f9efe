"""The agent's side of the filter daemon: start it, talk to it, and survive it.

:class:`DaemonSupervisor` runs ``python -m worker.daemon`` as a child process (made, forked or
fresh, by :func:`~worker.supervision.start.start_daemon`) and sends it one request at a time
(:mod:`protocol.daemon`), with an id and a timeout, from an asyncio (uvloop) event loop. User
code runs in the daemon, so every way it can fail becomes an exception here and never a silent
success:

* the filter raised → :class:`~worker.errors.DaemonError` carrying the daemon's error (code,
  message, traceback); the daemon is still up;
* the daemon died (segfault, ``os._exit``, OOM kill) → :class:`~worker.errors.DaemonCrashed` at
  once, noticed through EOF on its stdout rather than by waiting for the timeout;
* no answer in time → :class:`~worker.errors.DaemonTimeout`, and the daemon is killed: it is stuck
  in user code, and a late answer must never be taken for the answer to a later request;
* a request while no daemon runs → :class:`~worker.errors.DaemonNotRunning`.

:meth:`DaemonSupervisor.restart` brings a fresh daemon up and replays the last successful ``load``.

The event loop never blocks on the daemon: its process and pipes are a
:class:`~worker.supervision.process.DaemonProcess`, which moves frames without blocking; this module
decides what they mean.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

from pydantic import ValidationError

from protocol.codec import decode, encode
from protocol.daemon import (
    DaemonRequest,
    ErrorReply,
    LoadRequest,
    OkReply,
    PingRequest,
    ShutdownRequest,
    reply_adapter,
    request_fields,
)
from protocol.errors import ErrorCode, FrameError, RequestRefused
from worker.confinement.cgroup import CgroupParent
from worker.confinement.limits import (
    NO_LIMITS,
    POLL_SECONDS,
    JobLimits,
    Usage,
    group_usage,
    job_usage,
    over,
)
from worker.confinement.procfs import descendants
from worker.confinement.sandbox import NO_SANDBOX, Sandbox
from worker.daemon.allocator import GLIBC, Allocator
from worker.daemon.requests import parse_command
from worker.errors import (
    DaemonAlreadyRunning,
    DaemonCrashed,
    DaemonError,
    DaemonNotRunning,
    DaemonTimeout,
)
from worker.supervision.forked import ForkServer
from worker.supervision.process import REAP_SECONDS, DaemonProcess, describe_exit
from worker.supervision.start import environment, start_daemon, unnice

__all__ = ["DaemonSupervisor"]

log = logging.getLogger(__name__)

_PING = PingRequest(id=0, cmd="ping")
_SHUTDOWN = ShutdownRequest(id=0, cmd="shutdown")


class DaemonSupervisor:
    """Runs one filter daemon and sends it requests, one at a time, from an event loop.

    Args:
        python: the interpreter that runs the daemon (a job's own venv, for instance).
        threads: torch threads of the daemon, its share of the machine (default: all cores).
        env: what the agent sets for the daemon (its datasets), over what it inherits: only
            the allow-list of :mod:`worker.confinement.environment` (never a token) and
            ``passed_env``.
        passed_env: more variables of the agent's environment to pass on (``--daemon-env``).
        limits: what the daemon's process group may hold (``--max-job-memory``,
            ``--max-job-procs``); over them it is killed, its request failing
            ``resource_limit``.
        cgroups: where each daemon gets a cgroup of its own (:mod:`worker.confinement.cgroup`);
            ``None``: a process group only.
        default_timeout: seconds a request (and the startup) may take when no timeout is given.
        device: the resolved device the daemon trains on (``--device``): ``"cpu"``,
            ``"cuda:N"`` or ``"mps"``.
        fork_server: forks the daemon on a CPU worker (:mod:`worker.supervision.forked`) while it
        runs —
            or what gives it once it is up (the agent's, while it starts); ``None``, gone, or
            another device: the daemon starts anew.
        allocator: the ``malloc`` the daemon runs with (:mod:`worker.daemon.allocator`; a
            forked one, its fork server's).

    Use as ``async with DaemonSupervisor() as daemon:`` or call :meth:`start` and :meth:`close`.
    """

    def __init__(
        self,
        python: str = sys.executable,
        *,
        threads: int | None = None,
        env: Mapping[str, str] | None = None,
        default_timeout: float = 60.0,
        device: str = "cpu",
        passed_env: Sequence[str] = (),
        limits: JobLimits = NO_LIMITS,
        cgroups: CgroupParent | None = None,
        fork_server: ForkServer | Callable[[], Awaitable[ForkServer | None]] | None = None,
        sandbox: Sandbox = NO_SANDBOX,
        allocator: Allocator = GLIBC,
        relay_tensors: bool = False,
    ) -> None:
        self.python = python
        self.relay_tensors = relay_tensors
        """Its replies' tensors read as :class:`~protocol.arrays.RelayedTensor` (an agent's,
        which passes them on: no torch imported for them)."""
        self.allocator = allocator
        self.sandbox = sandbox
        self.fork_server = fork_server if sandbox.forks else None
        self.device = device
        self.threads = threads if threads is not None else (os.cpu_count() or 1)
        self.env = dict(env or {})
        self.passed_env = tuple(passed_env)
        self.limits = limits
        self.cgroups = cgroups
        self.nice = 0
        """The niceness a daemon is started with (a spare's, beside a running job)."""
        self._watch: asyncio.Task[None] | None = None
        self.default_timeout = default_timeout
        self._child: DaemonProcess | None = None
        self._lock = asyncio.Lock()
        self._next_id = 0
        self._last_load: LoadRequest | None = None
        self._last_exit: dict[str, Any] = {}

    # -- properties ---------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True while a started daemon has not exited, crashed or been killed."""
        return self._child is not None and self._child.alive

    @property
    def pid(self) -> int | None:
        """The pid of the running daemon, ``None`` if there is none."""
        return self._child.pid if self._child is not None and self._child.alive else None

    @property
    def shared_bytes(self) -> int:
        """Bytes the current daemon and this side moved through shared memory (both ways)."""
        shared = self._child.shared if self._child is not None else None
        return sum(region.nbytes for region in shared or ())

    async def foreground(self) -> None:
        """A spare started nice is a job's now: its processes get the default niceness back
        (a root agent's; elsewhere it was never started nice)."""
        child = self._child
        if not self.nice or child is None:
            return
        self.nice = 0
        cgroup = child.cgroup

        def members() -> list[int]:  # (blocking: /proc or the cgroup's file)
            return cgroup.pids() if cgroup is not None else [child.pid, *descendants(child.pid)]

        await asyncio.to_thread(lambda: unnice(members()))

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the daemon (:func:`~worker.supervision.start.start_daemon`) and wait until it
        answers a ``ping`` (torch imported, ready).

        Raises:
            DaemonAlreadyRunning: a daemon is already running (use :meth:`restart`).
            DaemonCrashed: it could not be spawned, or died while starting (its stderr, in the
                worker log, says why: a missing package, a bad interpreter...).
            DaemonTimeout: it did not become ready within ``default_timeout``.
        """
        async with self._lock:
            await self._start()

    async def restart(self) -> None:
        """Kill the daemon if it runs, start a new one and replay the last successful ``load``.

        The filters are back, their states are not: fitted states and optimizer moments died with
        the old process (set them again with ``set_state`` if you have them).

        Raises:
            DaemonError: the new daemon failed to start, or the replayed ``load`` failed.
        """
        async with self._lock:
            if self._child is not None:
                await self._kill(self._child)
            await self._start()
            if self._last_load is not None:
                await self._request(self._last_load, self.default_timeout)

    async def close(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109 (the API's own bound)
        """Ask the daemon to shut down, wait up to ``timeout`` seconds, then kill it."""
        child = self._child
        if child is None:
            return
        try:
            async with asyncio.timeout(timeout), self._lock:
                if child.alive:
                    with contextlib.suppress(DaemonError):
                        await self._request(_SHUTDOWN, timeout)
                    await asyncio.shield(child.exited)
        except TimeoutError:
            log.warning("filter daemon %d did not shut down within %ss", child.pid, timeout)
        finally:
            await self._kill(child)
            if self._child is child:
                self._child = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- requests -----------------------------------------------------------------------------

    async def request(
        self,
        req: DaemonRequest,
        timeout: float | None = None,  # noqa: ASYNC109 (per request, and it kills on expiry)
    ) -> Any:
        """Send one request and return the ``result`` of its reply.

        Args:
            req: a request model of :mod:`protocol.daemon`; its ``id`` is replaced by the
                supervisor's own numbering.
            timeout: seconds to wait for the reply (default: ``default_timeout``).

        Raises:
            DaemonError: the daemon answered with an error (``code``, ``message``, ``detail``
                with the traceback of a filter that raised); the daemon is still running.
            DaemonCrashed: the daemon died before answering.
            DaemonTimeout: no reply within ``timeout``; the daemon was killed.
            DaemonNotRunning: no daemon is running (never started, closed, crashed, killed).
            FrameError: ``req`` holds a value the codec cannot carry (nothing was sent).

        Cancelling the call kills the daemon, for the same reason as a timeout.
        """
        async with self._lock:
            return await self._request(req, self.default_timeout if timeout is None else timeout)

    async def request_dict(
        self,
        command: Mapping[str, Any],
        timeout: float | None = None,  # noqa: ASYNC109 (as request's)
    ) -> Any:
        """:meth:`request` for a command given as a dict (``{"cmd": "fit", "node_id": ...}``,
        as a job's calls reach the agent): validated into its model first.

        Raises:
            DaemonError: as :meth:`request`; a command that does not validate is refused with
                the ``BAD_REQUEST`` the daemon itself would answer (naming the field), and
                nothing is sent.
        """
        async with self._lock:
            await self._live_child(str(command.get("cmd")))  # a dead daemon is told first
            try:
                req = parse_command(command)
            except RequestRefused as exc:
                raise DaemonError.from_info(exc.info) from exc
            return await self._request(req, self.default_timeout if timeout is None else timeout)

    async def _live_child(self, cmd: str) -> DaemonProcess:
        """The running daemon, to answer ``cmd``.

        Raises:
            DaemonNotRunning: there is none (saying how the last one ended, if it did).
        """
        child = self._child
        if child is None or not child.alive:
            if child is not None:
                await self._kill(child)  # and reap it, so the error can say how it ended
            detail = {"cmd": cmd, **self._last_exit}
            raise DaemonNotRunning(
                ErrorCode.DAEMON_CRASHED, f"no filter daemon is running to answer {cmd}", detail
            )
        return child

    async def _request(self, req: DaemonRequest, seconds: float) -> Any:
        cmd = req.cmd
        child = await self._live_child(cmd)
        self._next_id += 1
        message = request_fields(req)
        request_id = message["id"] = self._next_id
        parts = encode(message)
        future: asyncio.Future[OkReply | ErrorReply] = asyncio.get_running_loop().create_future()
        child.pending = (request_id, cmd, future)
        try:
            child.send(parts)
            async with asyncio.timeout(seconds):
                reply = await future
        except TimeoutError:
            child.take_pending()
            if child.eof:  # it died just now: say so rather than "timeout"
                raise self._crashed(child, cmd, await asyncio.shield(child.exited)) from None
            await self._kill(child)
            raise DaemonTimeout(
                ErrorCode.TIMEOUT,
                f"the filter daemon did not answer {cmd} within {seconds}s; it was killed",
                {"cmd": cmd, "timeout": seconds, "pid": child.pid},
            ) from None
        except asyncio.CancelledError:
            # The daemon is still busy with this request: kill it, or its late reply would be
            # taken for the answer to the next one.
            if child.take_pending() is not None:
                child.kill()
            raise
        if isinstance(reply, ErrorReply):
            raise DaemonError.from_info(reply.error)
        if isinstance(req, LoadRequest):
            self._last_load = req
        return reply.result

    # -- callbacks from the DaemonProcess (event loop thread) ------------------------------------

    def _on_frame(self, child: DaemonProcess, frame: memoryview) -> None:
        if child.killed:
            return  # whatever it says now answers nothing: its request already failed
        try:
            reply = reply_adapter.validate_python(decode(frame, relay=self.relay_tensors))
        except (FrameError, ValidationError) as exc:
            self._protocol_violation(child, f"unreadable reply: {exc}")
            return
        pending = child.pending
        if pending is None or reply.id not in (pending[0], -1):
            expected = "no reply" if pending is None else f"a reply to request {pending[0]}"
            self._protocol_violation(
                child, f"got a reply to request {reply.id}, expected {expected}"
            )
            return
        child.take_pending()
        if not pending[2].done():
            pending[2].set_result(reply)

    def _protocol_violation(self, child: DaemonProcess, message: str) -> None:
        """The daemon wrote something that is not the reply we wait for: the stream cannot be
        trusted any more, so the request fails and the daemon is killed."""
        log.error("filter daemon %d: %s; killing it", child.pid, message)
        pending = child.take_pending()
        child.kill()
        if pending is not None and not pending[2].done():
            pending[2].set_exception(
                DaemonError(ErrorCode.BAD_FRAME, message, {"cmd": pending[1], "pid": child.pid})
            )

    def _on_exit(self, child: DaemonProcess, returncode: int) -> None:
        how, detail = describe_exit(returncode)
        self._last_exit = {"pid": child.pid, **detail}
        pending = child.take_pending()
        if pending is not None and not pending[2].done():
            pending[2].set_exception(self._crashed(child, pending[1], returncode))
        elif not child.killed and returncode != 0:
            log.error("filter daemon %d %s while idle", child.pid, how)

    def _crashed(self, child: DaemonProcess, cmd: str, returncode: int) -> DaemonCrashed:
        how, detail = describe_exit(returncode)
        if child.over_limit is not None:
            return DaemonCrashed(
                ErrorCode.RESOURCE_LIMIT,
                f"the filter daemon (pid {child.pid}) was killed while running {cmd}: "
                f"{child.over_limit}",
                {"cmd": cmd, "pid": child.pid, **detail},
            )
        return DaemonCrashed(
            ErrorCode.DAEMON_CRASHED,
            f"the filter daemon (pid {child.pid}) {how} before answering {cmd}",
            {"cmd": cmd, "pid": child.pid, **detail},
        )

    # -- internals ----------------------------------------------------------------------------

    async def _start(self) -> None:
        if self._child is not None and self._child.alive:
            raise DaemonAlreadyRunning("the filter daemon is already running; use restart()")
        started = await start_daemon(
            self.python,
            self.environment(),
            threads=self.threads,
            device=self.device,
            fork_server=self.fork_server,
            cgroups=self.cgroups,
            sandbox=self.sandbox,
            tmpfs_bytes=self.limits.memory_bytes,
            nice=self.nice,
        )
        self._child = DaemonProcess(
            started.process,
            on_frame=self._on_frame,
            on_broken=self._protocol_violation,
            on_exit=self._on_exit,
            shared=started.shared,
            cgroup=started.cgroup,
            confinement=started.confinement,
        )
        self._last_exit = {}
        log.info("filter daemon %d started (%s)", started.process.pid, " ".join(started.argv))
        if self.limits.any:
            self._watch = asyncio.ensure_future(self._watch_limits(self._child))
        await self._request(_PING, self.default_timeout)

    def environment(self) -> dict[str, str]:
        """The daemon's environment (:func:`worker.supervision.start.environment`): the
        allow-list, what the agent sets, its allocator's preload and this source tree."""
        return environment(self.env, self.passed_env, self.allocator, self.limits.memory_bytes)

    async def _watch_limits(self, child: DaemonProcess) -> None:
        """Kill ``child``'s process group once it holds more than :attr:`limits` allow."""
        while not child.exited.done():
            usage = await asyncio.to_thread(_usage, child)  # reads /proc: off the loop
            why = over(usage, self.limits)
            if why is not None and not child.exited.done():
                log.warning("filter daemon %d: %s; killing it", child.pid, why)
                child.kill_over_limit(why)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(child.exited), POLL_SECONDS)

    async def _kill(self, child: DaemonProcess) -> None:
        """Kill ``child`` if it still runs and wait until it is reaped."""
        if not child.exited.done():
            child.kill()
            try:
                await asyncio.wait_for(asyncio.shield(child.exited), REAP_SECONDS * 2)
            except TimeoutError:
                log.error("filter daemon %d could not be reaped after SIGKILL", child.pid)


def _usage(child: DaemonProcess) -> Usage:
    """What ``child`` and what it forked hold: its cgroup's members, else its process group."""
    if child.cgroup is not None:
        return job_usage(child.cgroup.pids())
    return group_usage(child.pid)
