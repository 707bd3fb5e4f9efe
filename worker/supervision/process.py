"""One running filter daemon process and the non-blocking I/O on its two pipes.

:class:`DaemonProcess` moves frames between the event loop and the daemon's stdin/stdout; what
the frames mean is the supervisor's business (:mod:`worker.supervision.supervisor`), told through
three callbacks. Both ends are non-blocking and driven by ``loop.add_reader``/``add_writer``, a
bounded amount of bytes per callback. A reply is read straight into a writable buffer of its own (so
decoded tensors are zero-copy views over it), and a request is written with ``os.writev`` from
the codec's memoryviews (tensor bytes go from their own memory into the pipe, never joined).
Frames of 256 KiB to 32 MiB go through two shared-memory regions instead
(:class:`~worker.daemon.shared_memory.SharedRegion`, one per direction, created when the daemon
was started, :mod:`worker.supervision.start`, and inherited by it): one copy in, one copy out, no
kernel pipe pages. Only reaping, which can block, runs in the default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

from protocol.daemon import ErrorReply, OkReply
from protocol.errors import FrameError
from worker.confinement.cgroup import JobCgroup
from worker.confinement.sandbox import UidConfinement
from worker.daemon.pipe import FrameReader, FrameWriter
from worker.daemon.shared_memory import SharedRegion
from worker.supervision.forked import ForkedChild

__all__ = ["DaemonProcess", "describe_exit", "reap"]

log = logging.getLogger(__name__)

PIPE_BYTES = 1 << 20
"""Pipe capacity asked for (Linux ``F_SETPIPE_SZ``): fewer wake-ups per large frame than 64 KiB."""

IO_BUDGET = 256 << 10
"""Bytes moved per readiness callback at most: a 100 MB frame goes by in ~400 short callbacks
(well under a millisecond each) instead of hogging the event loop; larger slices measured no
faster."""

REAP_SECONDS = 5.0
"""How long a daemon that closed its stdout gets to exit before it is killed."""


class DaemonProcess:
    """One daemon process and the non-blocking I/O on its two pipes.

    Each frame read goes to ``on_frame``; a stream that cannot be split into frames any more to
    ``on_broken``. EOF on the daemon's stdout means the process is gone (nothing else holds that
    pipe): it is reaped in the executor, :attr:`exited` gets its return code and ``on_exit`` is
    called with it (the supervisor fails the pending request, if any). All three run on the
    event loop thread.
    """

    def __init__(
        self,
        popen: subprocess.Popen[bytes] | ForkedChild,
        *,
        on_frame: Callable[[DaemonProcess, memoryview], None],
        on_broken: Callable[[DaemonProcess, str], None],
        on_exit: Callable[[DaemonProcess, int], None],
        shared: tuple[SharedRegion, SharedRegion] | None = None,
        cgroup: JobCgroup | None = None,
        confinement: UidConfinement | None = None,
    ) -> None:
        assert popen.stdin is not None and popen.stdout is not None
        self.popen = popen
        self.pid = popen.pid
        self.confinement = confinement
        """What a ``uid`` sandbox gave the daemon (cleared once it is reaped), or ``None``."""
        self.cgroup = cgroup
        """The daemon's own cgroup (:mod:`worker.confinement.cgroup`), or ``None``: its process
        group."""
        self._on_frame = on_frame
        self._on_broken = on_broken
        self._on_exit = on_exit
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
        self.over_limit: str | None = None  # why it was killed for going over a job limit
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
                self._on_broken(self, f"unreadable reply stream: {exc}")
                return
            if frame is not None:
                self._on_frame(self, frame)
                if self.eof:
                    return

    def _on_eof(self) -> None:
        self.eof = True
        self._loop.remove_reader(self._read_fd)
        if self._writing:
            self._loop.remove_writer(self._write_fd)
            self._writing = False
        if isinstance(self.popen, ForkedChild):  # the fork server's child: it reaps it
            reaping = self._loop.run_in_executor(None, self.popen.reap, self.cgroup, REAP_SECONDS)
        else:
            reaping = self._loop.run_in_executor(
                None, reap, self.popen, self.cgroup, self.confinement
            )
        reaping.add_done_callback(self._on_reaped)

    def _on_reaped(self, reaping: asyncio.Future[int]) -> None:
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                stream.close()
        for region in self.shared or ():
            region.close()
        if reaping.cancelled() or reaping.exception() is not None:
            log.error("filter daemon %d could not be reaped: %r", self.pid, reaping)
            returncode = -signal.SIGKILL
        else:
            returncode = reaping.result()
        if not self.exited.done():
            self.exited.set_result(returncode)
        self._on_exit(self, returncode)

    # -- ending -------------------------------------------------------------------------------

    def kill(self) -> None:
        """SIGKILL the daemon and its process group — what its filters forked — and its cgroup
        when it has one (what left the group too); no-op once reaped. EOF and reaping follow
        through the reader."""
        self.killed = True
        if self.popen.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            if self.cgroup is not None:
                self.cgroup.kill()  # one write to the cgroup filesystem

    def kill_over_limit(self, why: str) -> None:
        """:meth:`kill`, for going over a job limit: the pending request fails with ``why``."""
        self.over_limit = why
        self.kill()

    def take_pending(self) -> tuple[int, str, asyncio.Future[OkReply | ErrorReply]] | None:
        """Detach the pending request: whoever takes it is the one who resolves its future."""
        pending, self.pending = self.pending, None
        return pending


def reap(
    popen: subprocess.Popen[bytes],
    cgroup: JobCgroup | None = None,
    confinement: UidConfinement | None = None,
) -> int:
    """Wait for a daemon that closed its stdout, killing it if it lingers, then kill what is
    left of its process group (what its filters forked) before reaping it: until then its pid,
    which is the group's id, cannot be given to another process. With a ``cgroup``, what is
    left in it is killed too and the cgroup removed; with a ``confinement``, what runs as its
    uid, and its private directory goes. Runs in an executor."""
    deadline = time.monotonic() + REAP_SECONDS
    while not _exited(popen.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    if not _exited(popen.pid):
        log.warning("filter daemon %d closed its stdout but did not exit; killing it", popen.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, signal.SIGKILL)
    if cgroup is not None:
        cgroup.remove()  # kills what left the process group, waits for the cgroup to empty
    if confinement is not None:
        confinement.clear()
    return popen.wait()


def _exited(pid: int) -> bool:
    """Whether ``pid`` (a child) has exited, leaving it unreaped."""
    try:
        found = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already
        return True
    return found is not None


def describe_exit(returncode: int) -> tuple[str, dict[str, Any]]:
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
