"""The agent's side of the filter daemon: spawn it, talk to it, and survive it.

:class:`DaemonSupervisor` runs ``python -m worker.daemon`` as a child process and sends it one
request at a time (:mod:`protocol.daemon`), with an id and a timeout, from an asyncio (uvloop)
event loop. User code runs in the daemon, so every way it can fail becomes an exception here and
never a silent success:

* the filter raised → :class:`~worker.errors.DaemonError` carrying the daemon's error (code,
  message, traceback); the daemon is still up;
* the daemon died (segfault, ``os._exit``, OOM kill) → :class:`~worker.errors.DaemonCrashed` at
  once, noticed through EOF on its stdout rather than by waiting for the timeout;
* no answer in time → :class:`~worker.errors.DaemonTimeout`, and the daemon is killed: it is stuck
  in user code, and a late answer must never be taken for the answer to a later request;
* a request while no daemon runs → :class:`~worker.errors.DaemonNotRunning`.

:meth:`DaemonSupervisor.restart` brings a fresh daemon up and replays the last successful ``load``.

The event loop never blocks on the pipes: both ends are non-blocking and driven by
``loop.add_reader``/``add_writer``, a bounded amount of bytes per callback. A reply is read
straight into a writable buffer of its own (so decoded tensors are zero-copy views over it), and
a request is written with ``os.writev`` from the codec's memoryviews (tensor bytes go from their own
memory into the pipe, never joined). Frames of 256 KiB to 32 MiB go through two shared-memory
regions instead (:class:`~protocol.daemon.SharedRegion`, one per direction, created here and
inherited by the daemon): one copy in, one copy out, no kernel pipe pages. Only process creation
and reaping, which can block, run in the default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from pydantic import BaseModel, ValidationError

from protocol.codec import decode, encode
from protocol.daemon import ErrorReply, OkReply, reply_adapter, request_fields
from protocol.errors import ErrorCode, FrameError
from worker.errors import DaemonCrashed, DaemonError, DaemonNotRunning, DaemonTimeout
from worker.pipe import FrameReader, FrameWriter
from worker.shared_memory import SharedRegion

__all__ = ["DaemonSupervisor"]

log = logging.getLogger(__name__)

PIPE_BYTES = 1 << 20
"""Pipe capacity asked for (Linux ``F_SETPIPE_SZ``): fewer wake-ups per large frame than 64 KiB."""

IO_BUDGET = 256 << 10
"""Bytes moved per readiness callback at most: a 100 MB frame goes by in ~400 short callbacks
(well under a millisecond each) instead of hogging the event loop; larger slices measured no
faster."""

REAP_SECONDS = 5.0
"""How long a daemon that closed its stdout gets to exit before it is killed."""

# The directory holding the ``worker`` and ``protocol`` packages: put on the child's PYTHONPATH so
# ``python -m worker.daemon`` imports this very code whatever the cwd and the interpreter.
_SOURCE_ROOT = str(Path(__file__).resolve().parent.parent)


class _Child:
    """One daemon process and the non-blocking I/O on its two pipes.

    Each frame read goes to the supervisor's ``_on_frame``. EOF on the daemon's stdout means the
    process is gone (nothing else holds that pipe): it is reaped in the executor, :attr:`exited`
    gets its return code and the supervisor's ``_on_exit`` fails the pending request, if any.
    """

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        supervisor: DaemonSupervisor,
        shared: tuple[SharedRegion, SharedRegion] | None = None,
    ) -> None:
        assert popen.stdin is not None and popen.stdout is not None
        self.popen = popen
        self.pid = popen.pid
        self._supervisor = supervisor
        self._loop = asyncio.get_running_loop()
        self._write_fd = popen.stdin.fileno()
        self._read_fd = popen.stdout.fileno()
        self.shared = shared
        """``(to the daemon, from the daemon)`` shared-memory regions, or ``None``: pipes only."""
        self._reader = FrameReader(shared=shared[1] if shared else None)
        self._writer = self._new_writer()
        self._writing = False
        self.eof = False
        self.killed = False
        self.pending: tuple[int, str, asyncio.Future[OkReply | ErrorReply]] | None = None
        """``(id, cmd, future)`` of the request awaiting its reply."""
        self.exited: asyncio.Future[int] = self._loop.create_future()
        for fd in (self._read_fd, self._write_fd):
            os.set_blocking(fd, False)
            with contextlib.suppress(OSError, AttributeError):  # not Linux, or over the limit
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self._loop.add_reader(self._read_fd, self._on_readable)

    @property
    def alive(self) -> bool:
        return not (self.eof or self.killed) and self.popen.returncode is None

    # -- writing ------------------------------------------------------------------------------

    def _new_writer(self) -> FrameWriter:
        return FrameWriter(shared=self.shared[0] if self.shared else None)

    def send(self, parts: list[bytes | memoryview]) -> None:
        """Queue one frame and write what the pipe takes now; the rest goes when it drains."""
        self._writer.add(parts)
        self._on_writable()
        if not self._writer.done and not self._writing and not self.eof:
            self._loop.add_writer(self._write_fd, self._on_writable)
            self._writing = True

    def _on_writable(self) -> None:
        moved = 0
        try:
            while not self._writer.done and moved < IO_BUDGET:
                n = os.writev(self._write_fd, self._writer.buffers())
                self._writer.advance(n)
                moved += n
        except BlockingIOError:
            return
        except OSError as exc:
            # EPIPE: the daemon is gone. EOF on its stdout reports how; make sure it comes.
            log.debug("filter daemon %d: write failed: %s", self.pid, exc)
            self._writer = self._new_writer()
            self.kill()
        if self._writer.done and self._writing:
            self._loop.remove_writer(self._write_fd)
            self._writing = False

    # -- reading ------------------------------------------------------------------------------

    def _on_readable(self) -> None:
        moved = 0
        while moved < IO_BUDGET:
            try:
                n = os.readv(self._read_fd, [self._reader.buffer()[:IO_BUDGET]])
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("filter daemon %d: read failed: %s", self.pid, exc)
                n = 0
            if n == 0:
                self._on_eof()
                return
            moved += n
            try:
                frame = self._reader.advance(n)
            except FrameError as exc:
                self._supervisor._protocol_violation(self, f"unreadable reply stream: {exc}")
                return
            if frame is not None:
                self._supervisor._on_frame(self, frame)
                if self.eof:
                    return

    def _on_eof(self) -> None:
        self.eof = True
        self._loop.remove_reader(self._read_fd)
        if self._writing:
            self._loop.remove_writer(self._write_fd)
            self._writing = False
        reap = self._loop.run_in_executor(None, _reap, self.popen)
        reap.add_done_callback(self._on_reaped)

    def _on_reaped(self, reap: asyncio.Future[int]) -> None:
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                stream.close()
        for region in self.shared or ():
            region.close()
        if reap.cancelled() or reap.exception() is not None:
            log.error("filter daemon %d could not be reaped: %r", self.pid, reap)
            returncode = -signal.SIGKILL
        else:
            returncode = reap.result()
        if not self.exited.done():
            self.exited.set_result(returncode)
        self._supervisor._on_exit(self, returncode)

    # -- ending -------------------------------------------------------------------------------

    def kill(self) -> None:
        """SIGKILL the daemon (no-op once reaped); EOF and reaping follow through the reader."""
        self.killed = True
        if self.popen.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.kill()

    def take_pending(self) -> tuple[int, str, asyncio.Future[OkReply | ErrorReply]] | None:
        """Detach the pending request: whoever takes it is the one who resolves its future."""
        pending, self.pending = self.pending, None
        return pending


def _reap(popen: subprocess.Popen[bytes]) -> int:
    """Wait for a daemon that closed its stdout; kill it if it lingers. Runs in an executor."""
    try:
        return popen.wait(timeout=REAP_SECONDS)
    except subprocess.TimeoutExpired:
        log.warning("filter daemon %d closed its stdout but did not exit; killing it", popen.pid)
        popen.kill()
        return popen.wait()


def _spawn(
    argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()
) -> subprocess.Popen[bytes]:
    """Start the daemon process (blocking: fork/exec; run in an executor)."""
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=None,  # inherited: user prints and tracebacks go to the worker's log
        env=env,
        close_fds=True,
        pass_fds=pass_fds,
        # Its own session: a Ctrl-C meant for the agent must not hit the daemon mid-request;
        # the agent decides when it stops (and the daemon's watchdog follows the agent).
        start_new_session=True,
    )


def _shared_regions() -> tuple[SharedRegion, SharedRegion] | None:
    """The two regions of a new daemon (to it, from it), or ``None`` without memfds."""
    to_daemon = SharedRegion.create("somatize-to-daemon")
    from_daemon = SharedRegion.create("somatize-from-daemon")
    if to_daemon is None or from_daemon is None:
        for region in (to_daemon, from_daemon):
            if region is not None:
                region.close()
        return None
    return to_daemon, from_daemon


def _describe_exit(returncode: int) -> tuple[str, dict[str, Any]]:
    """``("killed by SIGSEGV", {...})`` / ``("exited with status 3", {...})``."""
    detail: dict[str, Any] = {"returncode": returncode}
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        detail["signal"] = name
        return f"killed by {name}", detail
    return f"exited with status {returncode}", detail


class DaemonSupervisor:
    """Runs one filter daemon and sends it requests, one at a time, from an event loop.

    Args:
        python: the interpreter that runs the daemon (a job's own venv, for instance).
        threads: torch threads of the daemon, its share of the machine (default: all cores).
        env: variables added to the inherited environment of the daemon.
        default_timeout: seconds a request (and the startup) may take when no timeout is given.

    Use as ``async with DaemonSupervisor() as daemon:`` or call :meth:`start` and :meth:`close`.
    """

    def __init__(
        self,
        python: str = sys.executable,
        threads: int | None = None,
        env: Mapping[str, str] | None = None,
        default_timeout: float = 60.0,
    ) -> None:
        self.python = python
        self.threads = threads if threads is not None else (os.cpu_count() or 1)
        self.env = dict(env or {})
        self.default_timeout = default_timeout
        self._child: _Child | None = None
        self._lock = asyncio.Lock()
        self._next_id = 0
        self._last_load: dict[str, Any] | None = None
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

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the daemon and wait until it answers a ``ping`` (torch imported, ready).

        Raises:
            RuntimeError: a daemon is already running (use :meth:`restart`).
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
                await self._request(dict(self._last_load), self.default_timeout)

    async def close(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109 (the API's own bound)
        """Ask the daemon to shut down, wait up to ``timeout`` seconds, then kill it."""
        child = self._child
        if child is None:
            return
        try:
            async with asyncio.timeout(timeout), self._lock:
                if child.alive:
                    with contextlib.suppress(DaemonError):
                        await self._request({"cmd": "shutdown"}, timeout)
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
        req: Mapping[str, Any] | BaseModel,
        timeout: float | None = None,  # noqa: ASYNC109 (per request, and it kills on expiry)
    ) -> Any:
        """Send one request and return the ``result`` of its reply.

        Args:
            req: a request model of :mod:`protocol.daemon`, or the same as a dict
                (``{"cmd": "fit", "node_id": ..., "x": ...}``); its ``id`` is set here.
                The daemon validates it, so an invalid request comes back as a ``BAD_REQUEST``.
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
        message = dict(request_fields(req) if isinstance(req, BaseModel) else req)
        async with self._lock:
            return await self._request(
                message, self.default_timeout if timeout is None else timeout
            )

    async def _request(self, message: dict[str, Any], seconds: float) -> Any:
        child = self._child
        cmd = str(message.get("cmd"))
        if child is None or not child.alive:
            if child is not None:
                await self._kill(child)  # and reap it, so the error can say how it ended
            detail = {"cmd": cmd, **self._last_exit}
            raise DaemonNotRunning(
                ErrorCode.DAEMON_CRASHED, f"no filter daemon is running to answer {cmd}", detail
            )
        self._next_id += 1
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
        if cmd == "load":
            self._last_load = {k: v for k, v in message.items() if k != "id"}
        return reply.result

    # -- callbacks from _Child (event loop thread) --------------------------------------------

    def _on_frame(self, child: _Child, frame: memoryview) -> None:
        if child.killed:
            return  # whatever it says now answers nothing: its request already failed
        try:
            reply = reply_adapter.validate_python(decode(frame))
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

    def _protocol_violation(self, child: _Child, message: str) -> None:
        """The daemon wrote something that is not the reply we wait for: the stream cannot be
        trusted any more, so the request fails and the daemon is killed."""
        log.error("filter daemon %d: %s; killing it", child.pid, message)
        pending = child.take_pending()
        child.kill()
        if pending is not None and not pending[2].done():
            pending[2].set_exception(
                DaemonError(ErrorCode.BAD_FRAME, message, {"cmd": pending[1], "pid": child.pid})
            )

    def _on_exit(self, child: _Child, returncode: int) -> None:
        how, detail = _describe_exit(returncode)
        self._last_exit = {"pid": child.pid, **detail}
        pending = child.take_pending()
        if pending is not None and not pending[2].done():
            pending[2].set_exception(self._crashed(child, pending[1], returncode))
        elif not child.killed and returncode != 0:
            log.error("filter daemon %d %s while idle", child.pid, how)

    def _crashed(self, child: _Child, cmd: str, returncode: int) -> DaemonCrashed:
        how, detail = _describe_exit(returncode)
        return DaemonCrashed(
            ErrorCode.DAEMON_CRASHED,
            f"the filter daemon (pid {child.pid}) {how} before answering {cmd}",
            {"cmd": cmd, "pid": child.pid, **detail},
        )

    # -- internals ----------------------------------------------------------------------------

    async def _start(self) -> None:
        if self._child is not None and self._child.alive:
            raise RuntimeError("the filter daemon is already running; use restart()")
        argv = [self.python, "-m", "worker.daemon", "--threads", str(self.threads)]
        shared = _shared_regions()
        fds: tuple[int, ...] = ()
        if shared is not None:
            fds = (shared[0].fd, shared[1].fd)
            argv += ["--shared", f"{fds[0]},{fds[1]}"]
        env = {**os.environ, **self.env}
        paths = env.get("PYTHONPATH", "").split(os.pathsep) if env.get("PYTHONPATH") else []
        if _SOURCE_ROOT not in paths:
            env["PYTHONPATH"] = os.pathsep.join([_SOURCE_ROOT, *paths])
        loop = asyncio.get_running_loop()
        try:
            popen = await loop.run_in_executor(None, _spawn, argv, env, fds)
        except OSError as exc:
            for region in shared or ():
                region.close()
            raise DaemonCrashed(
                ErrorCode.DAEMON_CRASHED,
                f"cannot start the filter daemon with {self.python}: {exc}",
                {"argv": argv},
            ) from exc
        self._child = _Child(popen, self, shared)
        self._last_exit = {}
        log.info("filter daemon %d started (%s)", popen.pid, " ".join(argv))
        await self._request({"cmd": "ping"}, self.default_timeout)

    async def _kill(self, child: _Child) -> None:
        """Kill ``child`` if it still runs and wait until it is reaped."""
        if not child.exited.done():
            child.kill()
            try:
                await asyncio.wait_for(asyncio.shield(child.exited), REAP_SECONDS * 2)
            except TimeoutError:
                log.error("filter daemon %d could not be reaped after SIGKILL", child.pid)
