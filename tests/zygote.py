"""The suite's zygotes: the coordinators, worker agents and ``somatize`` commands the tests start,
forked from processes that imported them once.

A ``somatize-coordinator`` spends about 1.1 s of CPU importing itself (pydantic building the
protocol's models, websockets, numpy, cryptography) and a ``somatize-worker`` 0.6 s, before
either does anything; a ``somatize submit`` or ``result`` 2.5 s (torch: the job file's filters,
the result's tensors). A run of the suite starts some 130, 220 and 50 of them, on two cores.
Forked from a process that holds those imports, each starts in milliseconds, and runs the same
function its console script would: its own session, its stdin, stdout and stderr, working
folder, environment and ``sys.argv`` as given; it exits through the interpreter's own shutdown.

There are two zygotes (:data:`ZYGOTES`). The agents' imports no torch: the tests assert that an
agent never maps it. The other imports torch, for the ``somatize`` commands and the
coordinators: a coordinator imports torch (2 s of CPU) for any run it computes on, shuffles or
reads a checkpoint of, two in three of the suite's; the tests that check what a coordinator
imports itself start theirs exec'd (``Cluster(fork=False)``).

What a fork cannot give a process is what it read as its zygote started, before its ``main``:
the interpreter's flags and ``PYTHON*`` variables, the dynamic loader's (``LD_PRELOAD``: the
tcmalloc tests), the allocator's and, in the zygote that imported torch, OpenMP's and torch's. A
request whose environment differs from its zygote's in any of those (:data:`ZYGOTES`) is
refused, and :func:`spawn` and :func:`run` return ``None``: the caller execs the console script
as before. So is a command that is none of
the console scripts (``ip netns exec NS …``: a worker in another network namespace).

A zygote is its forked processes' parent: it reaps each, and sends its exit status down a pipe
whose other end the test holds (:class:`Forked`, as much of :class:`subprocess.Popen` as the
suite uses). ``tests/conftest.py`` starts them once per run (:func:`start`), before ``pytest -n``
starts its test processes, which inherit where they listen (:data:`ZYGOTE`); each exits when the
process that started it is gone. ``SOMATIZE_TEST_EXEC=1`` starts none: every process is exec'd.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import io
import locale
import os
import select
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ZYGOTE = "SOMATIZE_TEST_ZYGOTE"
"""The variable that names the folder of the zygotes' sockets, for the test processes."""
_PROCESS = ("PYTHON", "LD_", "MALLOC_", "GLIBC_TUNABLES")
"""Prefixes of the variables every process reads as it starts: the interpreter's, the dynamic
loader's, the allocator's."""
_TORCH = ("OMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH_", "CUDA_")
"""Those a process that imports torch reads then: OpenMP's (GNU's, which this torch build
loads: not ``KMP_*``, which sklearn's import sets), the BLAS', torch's. (Not
``TORCHINDUCTOR_*``: torch's compiler reads them when it is first used, and sets its cache
folder there in the process that used it.)"""
ZYGOTES = {
    "agents": (("worker.cli",), _PROCESS),
    "torch": (("torch", "coordinator.cli", "somatize.cli.main"), _PROCESS + _TORCH),
}
"""Each zygote by name: what it imports before it forks, and the prefixes of the variables its
imports read (:data:`_PROCESS`, :data:`_TORCH`): a request whose environment differs from the
zygote's in one of them is exec'd."""
ENTRY_POINTS = {
    "somatize-coordinator": ("torch", "coordinator.cli:main"),
    "somatize-worker": ("agents", "worker.cli:main"),
    "somatize": ("torch", "somatize.cli.main:run"),
}
"""The console scripts forked, by name: the zygote that forks each, and the function it runs."""
_STATUS = struct.Struct("i")
_LOST = -255
"""The return code of a forked process whose zygote died before saying how it ended."""


class Forked:
    """A process the zygote forked: its pid, and its return code once it ended (negative: the
    signal that ended it), read from the zygote's status pipe ``status``."""

    def __init__(self, args: Sequence[str], pid: int, status: int) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self._status = status

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._status], [], [], 0)[0]:
            self._read()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._status], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: no signal to a pid that may be another's by now
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self) -> None:
        data = os.read(self._status, _STATUS.size)
        os.close(self._status)
        self.returncode = _STATUS.unpack(data)[0] if len(data) == _STATUS.size else _LOST


def spawn(
    argv: Sequence[str], env: Mapping[str, str], output: int, cwd: Path | None = None
) -> Forked | None:
    """``argv`` forked by its zygote, in its own session, with ``env``, in ``cwd`` (default
    this process's), stdin from ``/dev/null`` and stdout and stderr to the descriptor
    ``output``; ``None`` where no zygote starts it (module docstring): the caller starts it
    itself."""
    with open(os.devnull, "rb") as null:
        return _request(argv, env, [null.fileno(), output, output], cwd)


def run(
    argv: Sequence[str], env: Mapping[str, str], timeout: float
) -> subprocess.CompletedProcess[str] | None:
    """What ``subprocess.run(argv, env=env, timeout=timeout, capture_output=True, text=True)``
    gives, the process forked by its zygote; ``None`` where no zygote starts it.

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout`` (it is killed).
    """
    out, out_end = os.pipe()
    err, err_end = os.pipe()
    try:
        with open(os.devnull, "rb") as null:
            forked = _request(argv, env, [null.fileno(), out_end, err_end], None)
    finally:
        os.close(out_end)
        os.close(err_end)
    if forked is None:
        os.close(out)
        os.close(err)
        return None
    deadline = time.monotonic() + timeout
    said: dict[int, bytearray] = {out: bytearray(), err: bytearray()}
    with selectors.DefaultSelector() as selector:
        for fd in said:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(deadline - time.monotonic()):
                chunk = os.read(key.fd, 65536)
                said[key.fd] += chunk
                if not chunk:
                    selector.unregister(key.fd)
                    os.close(key.fd)
        for fd in selector.get_map():
            os.close(fd)
    stdout, stderr = (_text(said[fd]) for fd in (out, err))
    try:
        code = forked.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        forked.kill()
        forked.wait()
        raise subprocess.TimeoutExpired(list(argv), timeout, stdout, stderr) from None
    return subprocess.CompletedProcess(list(argv), code, stdout, stderr)


def _text(data: bytes) -> str:
    """``data`` as ``text=True`` reads it: the locale's encoding, universal newlines."""
    return io.TextIOWrapper(io.BytesIO(data), encoding=locale.getpreferredencoding(False)).read()


def _request(
    argv: Sequence[str], env: Mapping[str, str], stdio: list[int], cwd: Path | None
) -> Forked | None:
    """``argv`` forked by its zygote with ``stdio`` as its descriptors 0, 1 and 2; ``None``
    where none forks it."""
    from worker.daemon.fork_server import recv_message, send_message

    folder = os.environ.get(ZYGOTE)
    entry = ENTRY_POINTS.get(Path(argv[0]).name)
    if not folder or entry is None:
        return None
    request = {"argv": list(argv), "env": dict(env), "cwd": str(cwd or os.getcwd())}
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(60)
            sock.connect(os.path.join(folder, f"{entry[0]}.sock"))
            send_message(sock, request, stdio)
            got = recv_message(sock)
    except (OSError, ValueError):
        return None  # not there (any more): exec
    if got is None:
        return None
    reply, fds = got
    if "pid" not in reply or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        return None  # refused: an environment it cannot give
    return Forked(argv, int(reply["pid"]), fds[0])


def start() -> None:
    """Start the zygotes (once per run: where they are named already, nothing) and, once they
    listen, name the folder of their sockets in this process's environment, for the processes
    it starts; they are told to end when this process exits."""
    if os.environ.get(ZYGOTE) or os.environ.get("SOMATIZE_TEST_EXEC") == "1":
        return
    folder = tempfile.mkdtemp(prefix="somatize-test-zygotes-")
    started = []
    for name in ZYGOTES:
        with open(os.path.join(folder, f"{name}.log"), "ab") as log:
            started.append(
                subprocess.Popen(
                    [sys.executable, __file__, name, os.path.join(folder, f"{name}.sock")],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    cwd=Path(__file__).parent.parent,
                )
            )
    atexit.register(_stop, started, folder)
    deadline = time.monotonic() + 10
    for name, proc in zip(ZYGOTES, started, strict=True):
        where = os.path.join(folder, f"{name}.sock")
        while not os.path.exists(where) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # it binds first, then imports: requests wait in its backlog
    os.environ[ZYGOTE] = folder


def _stop(started: list[subprocess.Popen[bytes]], folder: str) -> None:
    """Stop the zygotes; one that had stopped before it was told says why, its log kept."""
    gone = [name for name, proc in zip(ZYGOTES, started, strict=True) if proc.poll() is not None]
    for proc in started:
        proc.terminate()
    for proc in started:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    for name in gone:
        log = os.path.join(folder, f"{name}.log")
        print(f"the {name} zygote ended before the run did: see {log}", file=sys.stderr)
    if not gone:
        shutil.rmtree(folder, ignore_errors=True)


# -- the zygote's side ------------------------------------------------------------------------


def _serve(name: str, where: str) -> dict[str, Any]:
    """Import what zygote ``name`` holds, then fork a process for each request at ``where``
    until the zygote's parent is gone; returns only in a forked child, the request it is to
    run."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(where)
    listener.listen(64)  # bound before the imports: the first clusters wait, not exec
    for module in ZYGOTES[name][0]:
        importlib.import_module(module)
    gc.freeze()  # what the imports made stays on pages the children share
    start_env = dict(os.environ)
    children: dict[int, tuple[int, int]] = {}  # pidfd → pid, the write end of its status pipe
    with selectors.DefaultSelector() as selector:  # epoll: as many children as there are
        selector.register(listener, selectors.EVENT_READ)
        while os.getppid() == parent:
            for key, _ in selector.select(1.0):
                try:
                    if key.fileobj is not listener:
                        _reap(key.fd, children, selector)
                        continue
                    child = _fork(name, listener, start_env, children)
                    if child is not None:
                        return child  # in the forked child, which closes the selector here
                    for pidfd in children.keys() - selector.get_map().keys():
                        selector.register(pidfd, selectors.EVENT_READ)
                except Exception:  # said, and the next request served
                    traceback.print_exc()
    sys.exit(0)


def _fork(
    name: str,
    listener: socket.socket,
    start_env: dict[str, str],
    children: dict[int, tuple[int, int]],
) -> dict[str, Any] | None:
    """Take the next request at ``listener`` and fork its process (or refuse it); the request
    in the forked child, ``None`` in the zygote."""
    from worker.daemon.fork_server import recv_message, send_message

    conn, _ = listener.accept()
    with conn:
        conn.settimeout(10)
        got = recv_message(conn)
        if got is None:
            return None
        request, fds = got
        refused = _refused(name, request, fds, start_env)
        if refused:
            print(f"zygote: exec, not fork: {refused}", file=sys.stderr, flush=True)
            for fd in fds:
                os.close(fd)
            send_message(conn, {"refused": refused})
            return None
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            os.close(write_end)
            listener.close()
            for pidfd, (_, status) in children.items():
                os.close(pidfd)
                os.close(status)
            _become(request, fds)
            return request
        for fd in fds:
            os.close(fd)
        children[os.pidfd_open(pid)] = (pid, write_end)
        try:
            send_message(conn, {"pid": pid}, [read_end])
        finally:  # (its client gone: the child ends as its cluster does)
            os.close(read_end)
    return None


def _reap(pidfd: int, children: dict[int, tuple[int, int]], selector: Any) -> None:
    """Reap the child whose ``pidfd`` said it ended, and send its exit status on."""
    selector.unregister(pidfd)
    pid, status = children.pop(pidfd)
    os.close(pidfd)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    try:
        os.write(status, _STATUS.pack(code))
    except BrokenPipeError:
        pass  # nobody waits for it any more
    finally:
        os.close(status)


def _refused(
    name: str, request: dict[str, Any], fds: list[int], start_env: dict[str, str]
) -> str | None:
    """Why zygote ``name`` leaves ``request`` to an exec, or ``None``."""
    argv, env = request.get("argv"), request.get("env")
    if not isinstance(argv, list) or not argv or not isinstance(env, dict) or len(fds) != 3:
        return f"a malformed request: {request!r} with {len(fds)} descriptors"
    if ENTRY_POINTS.get(Path(argv[0]).name, ("",))[0] != name:
        return f"{argv[0]} is none of this zygote's console scripts"
    read_at_start = ZYGOTES[name][1]
    for variable in sorted({*env, *start_env}):
        if variable.startswith(read_at_start) and env.get(variable) != start_env.get(variable):
            return f"{variable} differs from the zygote's ({env.get(variable)!r})"
    return None


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """In a forked child: what ``subprocess.Popen(argv, env=..., cwd=..., stdin=..., stdout=...,
    stderr=..., start_new_session=True)`` would have given the console script."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])


if __name__ == "__main__":
    sys.path[0] = os.path.dirname(sys.executable)  # a console script's, not this folder
    child = _serve(sys.argv[1], sys.argv[2])
    module, function = ENTRY_POINTS[Path(child["argv"][0]).name][1].split(":")
    sys.exit(getattr(importlib.import_module(module), function)())
