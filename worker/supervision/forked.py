"""The agent's side of its fork server (:mod:`worker.daemon.fork_server`): starting it, asking it
for a daemon, and each forked daemon as the supervisor handles it.

:class:`ForkServer` runs the server process and one reader thread on its socket: replies to the
fork requests go to whoever asked (one at a time, a lock), each child's end to that child's
:class:`ForkedChild`. A :class:`ForkedChild` offers what the supervisor uses of a
:class:`subprocess.Popen` (``pid``, ``stdin``, ``stdout``, ``returncode``, ``poll``, ``wait``):
the child is the server's, not the agent's, so its exit status comes as a message, and
:meth:`ForkedChild.reap` replaces the waiting on it. When the server dies its children are
re-parented and end by their own watchdog; each one's end is then seen as its pid going.

Agents that one user starts side by side (a local cluster's) may share the imports: given a
folder (``--fork-server-share``), an agent joins the server listening there for its daemons'
environment and is served by a sibling of it, forked in milliseconds; where none listens it
starts the server, which listens there for the next.

Every method here blocks (a process start, a socket round trip): their callers run them in an
executor.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from worker.confinement.cgroup import CgroupParent, JobCgroup
from worker.daemon.fork_server import AT_FORK, recv_message, send_message

__all__ = ["ForkServer", "ForkedChild"]

log = logging.getLogger(__name__)

START_SECONDS = 120.0
"""How long the server may take to import torch and say it is ready."""
REPLY_SECONDS = 30.0
"""How long one fork may take to be answered."""
GONE_POLL = 0.05
"""Seconds between two looks for the pid of a child whose server died."""


class ForkedChild:
    """A daemon forked by the server: what the supervisor uses of a ``Popen`` of it."""

    def __init__(self, pid: int, stdin: IO[bytes], stdout: IO[bytes]) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None
        self._ended = threading.Event()

    def ended(self, returncode: int) -> None:
        """The server reaped it (or, the server gone, its pid went)."""
        if self.returncode is None:
            self.returncode = returncode
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until it ended; its return code.

        Raises:
            subprocess.TimeoutExpired: not within ``timeout`` seconds.
        """
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked daemon {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def reap(self, cgroup: JobCgroup | None, seconds: float) -> int:
        """After its stdout closed: wait ``seconds`` for its end, SIGKILL its process group if
        it lingers, remove its ``cgroup`` (what left the group), and its return code. (The
        server kills the group before it reaps, so nothing of it outlives it.)"""
        if not self._ended.wait(seconds):
            log.warning("filter daemon %d closed its stdout but did not exit; killing it", self.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        if cgroup is not None:
            cgroup.remove()
        return self.wait()


class ForkServer:
    """The agent's fork server (module docstring).

    Args:
        python: the interpreter its daemons run on.
        env: a daemon's environment (:func:`worker.confinement.environment.daemon_environment`);
            the server runs with it but for :data:`~worker.daemon.fork_server.AT_FORK`, which
            each :meth:`fork` sets in its child.
        share: a folder where the agents of one machine and user share one server's imports
            (``--fork-server-share``): the agent joins the server listening there for its
            daemons' environment, getting a sibling of it (:mod:`worker.daemon.fork_server`),
            or starts one that listens there.
        linger: how long a server this agent starts there waits, serving no agent, for the
            next (``--fork-server-linger``; ``None``: the server's own default,
            :data:`~worker.daemon.fork_server.LINGER_SECONDS`).
    """

    def __init__(
        self,
        python: str,
        env: Mapping[str, str],
        share: Path | None = None,
        linger: float | None = None,
    ) -> None:
        self.python = python
        self.linger = linger
        self.env, _ = _apart(env)
        key = _environment_key(python, self.env)
        self.shared_at = None if share is None else share / f"{key}.sock"
        self.pid: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # one fork request at a time
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._children: dict[int, ForkedChild] = {}
        self._early: dict[int, int] = {}  # ends that came before their fork's reply was taken
        self._guard = threading.Lock()  # over _children, _early, _dead
        self._dead = False
        self._seq = 0

    @property
    def alive(self) -> bool:
        """Whether it is up and answering."""
        return self._sock is not None and not self._dead

    def start(self) -> None:
        """Start the server and wait until it has imported torch (blocking). Where it is shared,
        the agents of the folder start theirs one at a time (a lock beside the socket): one
        that comes while another's server imports waits and takes a sibling of it, where both
        would have found no server listening yet and imported torch twice (a local cluster's
        workers, started together).

        Raises:
            OSError: it could not start, or died or said nothing within :data:`START_SECONDS`.
        """
        if self.shared_at is None:
            self._start()
            return
        with _one_at_a_time(self.shared_at.with_suffix(".lock"), START_SECONDS):
            if not self._join(self.shared_at):
                self._start()

    def _start(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = [
                self.python,
                "-m",
                "worker.daemon.fork_server",
                "--socket",
                str(theirs.fileno()),
            ]
            if self.shared_at is not None:
                argv += ["--share", str(self.shared_at)]
                if self.linger is not None:
                    argv += ["--linger", str(self.linger)]
            self._process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=sys.stderr.fileno(),  # its prints and its children's go to the log
                env=self.env,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # a Ctrl-C meant for the agent is not its
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        mine.settimeout(START_SECONDS)
        try:
            ready = recv_message(mine)
        except (OSError, ValueError) as exc:
            self._stop(mine)
            raise OSError(f"the fork server did not start: {exc}") from exc
        if ready is None or "ready" not in ready[0]:
            self._stop(mine)
            raise OSError(f"the fork server did not start: it said {ready!r}")
        self._ready(mine, ready[0])
        log.info("fork server %d ready (%s)", self.pid, self.python)

    def _join(self, path: Path) -> bool:
        """Take a sibling of the server shared at ``path`` (blocking); ``False`` where none
        answers there."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(START_SECONDS)  # a server that has just started imports first
            sock.connect(str(path))
            send_message(sock, {"agent": os.getpid()}, [sys.stderr.fileno()])
            ready = recv_message(sock)
        except (OSError, ValueError):
            ready = None
        if ready is None or "ready" not in ready[0]:
            sock.close()
            return False
        self._ready(sock, ready[0])
        log.info("fork server %d ready, shared at %s (%s)", self.pid, path, self.python)
        return True

    def _ready(self, sock: socket.socket, said: dict[str, Any]) -> None:
        sock.settimeout(None)
        self._sock, self.pid = sock, int(said["ready"])
        if said.get("threads") != said.get("after_import"):
            log.warning(
                "fork server %d started threads of its own (%s): forks may not be safe",
                self.pid,
                said,
            )
        threading.Thread(target=self._read, name="fork-server", daemon=True).start()

    def fork(
        self,
        threads: int,
        env: Mapping[str, str],
        shared: Sequence[int] = (),
        cgroups: CgroupParent | None = None,
    ) -> tuple[ForkedChild, JobCgroup | None]:
        """A new daemon of ``threads`` torch threads and environment ``env``, its shared-memory
        regions ``shared`` (two fds, or none), in a cgroup of its own with ``cgroups``
        (blocking).

        Raises:
            OSError: the server is gone or refused, or ``env`` differs from the server's in more
                than :data:`~worker.daemon.fork_server.AT_FORK`; the caller starts the daemon
                otherwise.
        """
        if not self.alive:
            raise OSError("the fork server is not running")
        servers, at_fork = _apart(env)
        if servers != self.env:
            raise OSError("the daemon's environment is not the fork server's")
        cgroup = None if cgroups is None else cgroups.new()
        to_child, from_agent = os.pipe()
        to_agent, from_child = os.pipe()
        stdin, stdout = os.fdopen(from_agent, "wb", buffering=0), os.fdopen(to_agent, "rb", 0)
        try:
            with self._lock:
                self._seq += 1
                assert self._sock is not None
                send_message(
                    self._sock,
                    {"fork": self._seq, "threads": threads, "env": at_fork},
                    [to_child, from_child, *shared],
                )
                reply = self._replies.get(timeout=REPLY_SECONDS)
        except (OSError, queue.Empty) as exc:
            for end in (stdin, stdout):
                end.close()
            if cgroup is not None:
                cgroup.remove()
            raise OSError(f"the fork server did not answer: {exc}") from exc
        finally:
            os.close(to_child)
            os.close(from_child)
        if reply is None or "pid" not in reply:
            for end in (stdin, stdout):
                end.close()
            if cgroup is not None:
                cgroup.remove()
            raise OSError(f"the fork server refused: {reply!r}")
        child = ForkedChild(int(reply["pid"]), stdin, stdout)
        with self._guard:
            early = self._early.pop(child.pid, None)
            if early is not None:
                child.ended(early)
            elif self._dead:
                self._watch_gone(child)
            else:
                self._children[child.pid] = child
        if cgroup is not None and not cgroup.add(child.pid):
            cgroup.remove()
            cgroup = None
        return child, cgroup

    def kill(self) -> None:
        """SIGKILL the server, even while :meth:`start` waits for it (which then fails)."""
        process = self._process
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        elif self.pid is not None:  # a sibling: its shared server's child, not ours
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        """Stop the server (its children, re-parented, end by their watchdogs). A shared server
        this agent started is only left: it goes on serving the agents that come there later,
        and ends by itself (:mod:`worker.daemon.fork_server`)."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        process = self._process
        if self.shared_at is not None and process is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # EOF, whatever the reader thread holds
            sock.close()
            threading.Thread(target=process.wait, name="fork-server-left", daemon=True).start()
            return
        self._stop(sock)

    def _stop(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.close()
        process = self._process
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        elif self.pid is not None:  # a sibling: its shared server reaps it
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def _read(self) -> None:
        """The reader thread: replies to whoever forks, ends to their children."""
        sock = self._sock
        assert sock is not None
        while True:
            try:
                received = recv_message(sock)
            except (OSError, ValueError):
                received = None
            if received is None:
                break
            message, fds = received
            for fd in fds:
                os.close(fd)
            if "exited" in message:
                pid, code = int(message["exited"]), int(message["returncode"])
                with self._guard:
                    child = self._children.pop(pid, None)
                    if child is None:
                        self._early[pid] = code
                if child is not None:
                    child.ended(code)
            else:
                self._replies.put(message)
        # The server is gone: who waits for a reply is told, each child's end is its pid going.
        with self._guard:
            self._dead = True
            orphans, self._children = list(self._children.values()), {}
        self._replies.put(None)
        if self._sock is not None:
            log.warning(
                "fork server %s is gone; daemons are started anew until it is back", self.pid
            )
        for child in orphans:
            self._watch_gone(child)

    @staticmethod
    def _watch_gone(child: ForkedChild) -> None:
        def watch() -> None:
            while os.path.exists(f"/proc/{child.pid}"):
                time.sleep(GONE_POLL)
            child.ended(-signal.SIGKILL)

        threading.Thread(target=watch, name=f"gone-{child.pid}", daemon=True).start()


def _apart(env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """A daemon's environment as the server's part and the part each fork request sets
    (:data:`~worker.daemon.fork_server.AT_FORK`)."""
    servers = {name: value for name, value in env.items() if name not in AT_FORK}
    return servers, {name: value for name, value in env.items() if name in AT_FORK}


@contextlib.contextmanager
def _one_at_a_time(path: Path, seconds: float) -> Iterator[None]:
    """The block run holding an exclusive lock on ``path`` (made, only its user's, where it is
    missing), waited for at most ``seconds``: after that it runs without."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + seconds
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("%s: still locked after %.0f s, starting without it", path, seconds)
                    break
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # and the lock with it


def _environment_key(python: str, env: Mapping[str, str]) -> str:
    """The name a shared server's socket takes: its interpreter, its daemons' environment (but
    for :data:`~worker.daemon.fork_server.AT_FORK`, which ``env`` holds no more), and
    the namespaces and cgroup it runs in (its agent's: a sibling lives where the server does, a
    worker in a network namespace of its own reaches what that namespace reaches), so that an
    agent joins only a server whose daemons start as its own would."""
    described = json.dumps([python, sorted(env.items()), _place()]).encode()
    return hashlib.sha256(described).hexdigest()[:24]


def _place() -> list[str]:
    """This process's namespaces and cgroup, as ``/proc/self`` names them."""
    found = []
    for namespace in ("net", "mnt", "pid", "user", "uts", "ipc", "cgroup"):
        with contextlib.suppress(OSError):
            found.append(os.readlink(f"/proc/self/ns/{namespace}"))
    with contextlib.suppress(OSError):
        found.append(Path("/proc/self/cgroup").read_text())
    return found
