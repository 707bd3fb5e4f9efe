"""The agent's fork server: ``python -m worker.daemon.fork_server --socket FD``.

A filter daemon started anew spends seconds of CPU before it can answer: the interpreter, the
torch import, the first optimizer's lazy imports (:func:`worker.daemon.main.warm_up`). The fork
server pays that once. It is started by the agent with a daemon's environment, imports and warms
up as a daemon would, freezes what that made (``gc.freeze``: no child's collection walks or
writes to it), and then, for every daemon the agent asks for, forks: the child is a daemon at
once (:func:`worker.daemon.main.run`), sharing the server's memory copy-on-write.

It talks to the agent over one ``SOCK_SEQPACKET`` socket (message boundaries kept), JSON
messages with file descriptors beside them (``SCM_RIGHTS``):

* server → agent, once: ``{"ready": pid}``;
* agent → server: ``{"fork": seq, "threads": n, "env": {NAME: VALUE}}`` with the child's stdin
  and stdout (two pipe ends) and, optionally, its two shared-memory regions; ``env`` sets the
  variables of :data:`AT_FORK` in the child (the rest of its environment is the server's);
  server → agent:
  ``{"forked": seq, "pid": pid}`` (or ``{"failed": seq, "error": ...}``);
* server → agent, whenever a child ends: ``{"exited": pid, "returncode": rc}`` (``rc`` as
  :attr:`subprocess.Popen.returncode` gives it), once its process group is killed — what its
  filters forked — and it is reaped.

Workers started side by side on one machine by one user (a local cluster: ``somatize demo``,
the tests) may share the imports (``--share PATH``, the agent's ``--fork-server-share DIR``): the
server also listens on a Unix socket at ``PATH``, named for its daemons' environment, and an
agent whose daemons would start with that same environment (but for :data:`AT_FORK`: workers
with datasets of their own share one) connects there instead of starting a server of its own.
For each such agent it forks a *sibling*: a fork server of the same imports, serving that agent
over the connection (``{"agent": pid}`` with the agent's log as the one descriptor beside it,
answered ``{"ready": pid}``), with the same messages as above. A sibling is
in a session of its own, ends when its agent closes the connection or dies, and outlives the
server it was forked from (whose agent a fault may kill); only a connection from the server's own
user is served. A shared server outlives its own agent too, for the agents that come later (the
next cluster a test starts in the same folder): it goes on forking siblings while its socket is
still at ``PATH`` and, once no sibling of it runs, for ``--linger`` seconds more
(:data:`LINGER_SECONDS` unless told); removing the folder ends it within a second.

The server forks only while it runs no thread of its own beyond what importing torch starts
(as every ``DataLoader`` worker forked after ``import torch`` does), and has not used a CUDA
device or an OpenMP pool (its torch runs one thread and never computes): what a fork cannot
carry over, it never made. Unshared, it exits when the agent closes the socket or dies (its
parent changes); a child whose server is gone is re-parented, and its own watchdog ends it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import select
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Final, NoReturn

from engine.data.datasets import ENV as DATASETS_ENV

__all__ = ["AT_FORK", "MAX_FDS", "recv_message", "send_message"]

MAX_FDS = 4
"""File descriptors one fork request carries at most: stdin, stdout, two shared regions."""
MAX_MESSAGE = 65536
"""Bytes one message takes at most (a fork request carries a worker's datasets' paths)."""
AT_FORK: Final = frozenset({DATASETS_ENV})
"""The variables of a daemon's environment that each fork request sets in its child, the rest
being the server's: those a daemon reads only once it runs, never while it imports (its
datasets, :mod:`engine.data.datasets`). Agents that differ in them alone share a server."""
EXIT_CHILD_FAILED = 70
"""A child that could not become a daemon exits with this (its traceback in the log)."""
LINGER_SECONDS = 60.0
"""How long a shared server whose agent is gone waits, with no sibling of it running, for the
next agent to come, unless told (``--linger``; the agent's ``--fork-server-linger``)."""
POLL_SECONDS = 0.5
"""How often the server looks at its agent, its socket's place and its idle time."""


def send_message(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """One JSON message, with ``fds`` passed along.

    Raises:
        OSError: the socket's, or a message over :data:`MAX_MESSAGE` bytes.
    """
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE:
        raise OSError(f"a fork server message of {len(data)} bytes (at most {MAX_MESSAGE})")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The next message and the descriptors that came with it (close-on-exec); ``None`` at EOF.

    Raises:
        ValueError: not a JSON object.
    """
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
    if not data:
        for fd in fds:
            os.close(fd)
        return None
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError(f"not a message: {data[:80]!r}")
    return message, fds


def main(argv: Sequence[str] | None = None) -> NoReturn:
    parser = argparse.ArgumentParser(
        prog="python -m worker.daemon.fork_server", description=__doc__
    )
    parser.add_argument("--socket", type=int, required=True, help="the agent's socket (an fd)")
    parser.add_argument(
        "--share", metavar="PATH", help="also fork sibling servers for agents connecting here"
    )
    parser.add_argument(
        "--linger",
        type=float,
        default=LINGER_SECONDS,
        metavar="SECONDS",
        help="how long a shared server serving nobody waits for the next agent "
        f"(default {LINGER_SECONDS:g})",
    )
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.socket)
    os.set_inheritable(sock.fileno(), False)
    parent = os.getppid()
    # Listening before the imports: an agent that comes meanwhile waits for them, not again.
    shared = _Shared.listen(args.share, args.linger) if args.share else None

    # What every daemon needs, once: the allocator's settings, torch, the first optimizer.
    from protocol.asyncio.memory import keep_freed_memory

    keep_freed_memory()
    import torch

    imported = _threads()  # torch's own native helper thread: what DataLoader workers fork too
    torch.set_num_threads(1)  # no intra-op pool to carry over a fork
    from worker.daemon import main as daemon

    daemon.warm_up()
    # Everything imported so far outlives every fork: out of the collector's sight, a child's
    # collections neither walk it (a fifth of a second of CPU each full one) nor write to its
    # pages, which the children then share for as long as they live.
    gc.collect()
    gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes select via the pipe
    ready = {"ready": os.getpid(), "threads": _threads(), "after_import": imported}
    send_message(sock, ready)
    try:
        status = _serve(sock, (wake_r, wake_w), lambda: os.getppid() == parent, shared)
    except Exception:
        traceback.print_exc()
        status = 1
    if shared is not None:  # no agent comes to a server that is gone
        shared.leave()
    sys.stderr.flush()
    os._exit(status)


class _Shared:
    """Where the agents that share this server's imports connect: a socket listening at
    ``path``, only its user able to open it, how long the server has had nobody to serve, and
    how long it waits so (``linger`` seconds)."""

    def __init__(self, listener: socket.socket, path: str, linger: float) -> None:
        self.listener = listener
        self.path = path
        self.linger = linger
        self._inode = os.stat(path).st_ino
        self._idle_since: float | None = None

    @classmethod
    def listen(cls, path: str, linger: float = LINGER_SECONDS) -> _Shared | None:
        """Listen at ``path``; ``None`` where another server listens there already, or no
        socket can be there (a path over the ~108 bytes of a Unix socket's address): the server
        then serves its own agent alone, as the agents that find no server there start theirs."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with contextlib.suppress(FileNotFoundError):
                if not _answers(path):
                    os.unlink(path)  # a server that died left it
            listener.bind(path)
        except OSError as exc:
            print(f"fork server: not shared at {path}: {exc}", file=sys.stderr, flush=True)
            listener.close()
            return None
        os.chmod(path, 0o600)
        listener.listen(8)
        return cls(listener, path, linger)

    def wanted(self, serving: bool) -> bool:
        """Whether to go on listening once the server's own agent is gone: while its socket is
        still the one at :attr:`path` and, where it serves nobody (``serving``: a sibling of
        it runs), for :attr:`linger` seconds."""
        if not self._ours():
            return False
        if serving:
            self._idle_since = None
            return True
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        return now - self._idle_since < self.linger

    def leave(self) -> None:
        """Remove the socket, where it is still this server's."""
        if self._ours():
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def _ours(self) -> bool:
        """Whether the socket at :attr:`path` is still this server's (not removed with its
        folder, nor replaced by another server's)."""
        try:
            return os.stat(self.path).st_ino == self._inode
        except OSError:
            return False


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
    return True


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _serve(
    sock: socket.socket,
    wake: tuple[int, int],
    agent_alive: Callable[[], bool],
    shared: _Shared | None = None,
) -> int:
    """Fork a daemon for each request and report each one's end, until EOF or the agent is gone
    (``agent_alive`` says); ``wake``: the signal wake-up pipe (read end, write end);
    ``shared``: where the agents sharing this server connect, each given a sibling, for as long
    as it is wanted there (:meth:`_Shared.wanted`), the agent gone or not."""
    siblings: set[int] = set()
    agent: socket.socket | None = sock  # None once the agent is gone
    status = 0
    while agent is not None or (shared is not None and shared.wanted(bool(siblings))):
        watched = [wake[0]]
        watched += [agent.fileno()] if agent is not None else []
        watched += [shared.listener.fileno()] if shared is not None else []
        readable, _, _ = select.select(watched, [], [], POLL_SECONDS)
        if wake[0] in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake[0], 512)
        _reap(sock, siblings)
        if shared is not None and shared.listener.fileno() in readable:
            sibling = _sibling(shared.listener, sock, wake)
            if sibling is not None:
                siblings.add(sibling)
        if agent is None:
            continue
        if not agent_alive():
            agent, status = None, 3  # the agent is gone
            continue
        if agent.fileno() not in readable:
            continue
        try:
            received = recv_message(agent)
        except ValueError as exc:
            print(f"fork server: {exc}", file=sys.stderr, flush=True)
            continue
        if received is None:
            agent = None  # the agent closed the socket
            continue
        message, fds = received
        _fork(agent, message, fds, wake)
    return status


def _fork(
    sock: socket.socket, message: dict[str, Any], fds: list[int], wake: tuple[int, int]
) -> None:
    seq = message.get("fork")
    threads = message.get("threads")
    env = message.get("env", {})
    if (
        not isinstance(threads, int)
        or threads < 1
        or len(fds) not in (2, 4)
        or not isinstance(env, dict)
        or not set(env) <= AT_FORK
        or not all(isinstance(value, str) for value in env.values())
    ):
        for fd in fds:
            os.close(fd)
        send_message(sock, {"failed": seq, "error": f"a bad fork request: {message}"})
        return
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        send_message(sock, {"failed": seq, "error": f"fork: {exc}"})
        return
    if pid == 0:
        _become_daemon(sock, wake, threads, fds, env)
    for fd in fds:
        os.close(fd)
    send_message(sock, {"forked": seq, "pid": pid})


def _become_daemon(
    sock: socket.socket, wake: tuple[int, int], threads: int, fds: list[int], env: dict[str, str]
) -> NoReturn:
    """In the child: a session of its own, none of the server's descriptors (its socket to the
    agent, both ends of its wake-up pipe: a job could write to them), the pipes as fds 0 and 1,
    the request's ``env`` for :data:`AT_FORK`, then serve as a daemon."""
    try:
        for name in AT_FORK:
            os.environ.pop(name, None)
        os.environ.update(env)
        os.setsid()  # its own process group: the agent kills the daemon and what it forks
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for end in wake:
            os.close(end)
        os.dup2(fds[0], 0)
        os.dup2(fds[1], 1)
        os.close(fds[0])
        os.close(fds[1])
        _reseed()
        from worker.daemon import main as daemon
        from worker.daemon.shared_memory import SharedRegion

        shared = (SharedRegion(fds[2]), SharedRegion(fds[3])) if len(fds) == 4 else None
        daemon.run(threads, "cpu", shared)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
    os._exit(EXIT_CHILD_FAILED)


def _reseed() -> None:
    """Fresh seeds from the OS for the generators the server's imports made (torch's default,
    numpy's global), so that no daemon draws what another of this server draws, nor what a
    job that knows the server's state could predict (``random`` reseeds itself after a
    fork)."""
    seed = int.from_bytes(os.urandom(8), "little")
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def _sibling(listener: socket.socket, sock: socket.socket, wake: tuple[int, int]) -> int | None:
    """Accept one agent at the shared socket and fork it a sibling server; its pid, or ``None``
    where the connection is not one to serve (another user's, a bad hello, a failed fork)."""
    conn, _ = listener.accept()
    with conn:
        uid = _peer_uid(conn)
        try:
            conn.settimeout(5.0)
            hello = recv_message(conn)
        except (OSError, ValueError):
            hello = None
        fds = hello[1] if hello is not None else []
        agent = hello[0].get("agent") if hello is not None else None
        if uid != os.getuid() or not isinstance(agent, int) or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return None
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(fds[0])
            print(f"fork server: no sibling: {exc}", file=sys.stderr, flush=True)
            return None
        if pid == 0:
            conn.settimeout(None)
            _become_sibling(conn, agent, fds[0], (listener, sock), wake)
        os.close(fds[0])
        return pid


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _become_sibling(
    conn: socket.socket,
    agent: int,
    log: int,
    theirs: tuple[socket.socket, socket.socket],
    wake: tuple[int, int],
) -> NoReturn:
    """In the child: a fork server of ``agent``'s on ``conn``, its output in the agent's
    ``log``, none of the server's descriptors, in a session of its own."""
    status = 1
    try:
        os.setsid()
        for held in theirs:
            held.close()
        for end in wake:
            os.close(end)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        send_message(
            conn, {"ready": os.getpid(), "threads": _threads(), "after_import": _threads()}
        )
        status = _serve(conn, (wake_r, wake_w), lambda: _alive(agent))
    except BaseException:
        traceback.print_exc()
    sys.stderr.flush()
    os._exit(status)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap(sock: socket.socket, siblings: set[int] | None = None) -> None:
    """Report every child that ended: its process group killed first (what its filters forked
    dies with it), then reaped, so its pid — the group's id — is not reused meanwhile. A
    sibling server is only reaped: its daemons go on without it, and its agent hears of it on
    its own connection."""
    while True:
        try:
            found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if found is None:
            return
        if siblings is not None and found.si_pid in siblings:
            siblings.discard(found.si_pid)
            os.waitpid(found.si_pid, 0)
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(found.si_pid, signal.SIGKILL)
        _, status = os.waitpid(found.si_pid, 0)
        returncode = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError):
            send_message(sock, {"exited": found.si_pid, "returncode": returncode})


if __name__ == "__main__":
    main()
