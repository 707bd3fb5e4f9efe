"""What many test modules share: the unit of test time and the filters their jobs run.

Every timeout in the tests is a multiple of one unit, scaled by ``SOMATIZE_TEST_TIMEOUT_SCALE``
(default 1) so a slow machine stretches them all at once instead of a test growing bare sleeps.

The filters are pickled by value (this module is the user's own code to
:func:`protocol.filters.dump_filter`), so a worker runs them without importing ``tests``.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

import somatize as sz
from somatize.cli.cluster import LISTENING, said_in_log
from tests import zygote


def timeout_unit() -> float:
    """One unit of test time, in seconds."""
    return float(os.environ.get("SOMATIZE_TEST_TIMEOUT_SCALE", "1"))


UNIT = timeout_unit()
""":func:`timeout_unit`, read once when the tests are collected."""

_WITH_DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def interruptible(argv: list[str]) -> list[str]:
    """``argv`` run with SIGINT at its default, so a test's Ctrl-C reaches it.

    A shell without job control starts background commands with SIGINT ignored, and an ignored
    signal stays ignored across ``exec``: a suite started that way (``make test &`` in a script)
    would see its Ctrl-C tests fail for that reason alone. The program keeps this pid.
    """
    return [sys.executable, "-c", _WITH_DEFAULT_SIGINT, *argv]


def somatize_cli(url: str, *args: str, seconds: float = 60) -> subprocess.CompletedProcess[str]:
    """``somatize ARGS`` against the coordinator at ``url`` (no token from the environment),
    its output captured, within ``seconds * UNIT``: forked by the suite's zygote
    (:mod:`tests.zygote`) where it can be."""
    env = {**os.environ, "SOMATIZE_COORDINATOR": url, "COLUMNS": "200"}
    env.pop("SOMATIZE_TOKEN", None)
    argv = [str(Path(sys.executable).parent / "somatize"), *args]
    forked = zygote.run(argv, env, seconds * UNIT)  # tests.zygote: torch imported already
    if forked is not None:
        return forked
    return subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=seconds * UNIT, check=False
    )


def said_port(proc: subprocess.Popen[bytes], log: Path, seconds: float = 30) -> int:
    """The port a coordinator started with ``--listen HOST:0`` bound, as its ``log`` says
    (no port picked beforehand for another test to take first)."""

    return int(said_in_log(proc, log, LISTENING, seconds * UNIT))


def stop_groups(*procs: subprocess.Popen[bytes]) -> None:
    """SIGTERM each process's group (started with ``start_new_session``), SIGKILL what is still
    there after ``10 * UNIT`` seconds."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=10 * UNIT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Center(sz.Filter):
    """Subtracts the column means seen in fit."""

    def fit(self, x, y=None):
        return {"mean": x.mean(0)}

    def forward(self, x, state):
        return x - state["mean"]


class Sleepy(sz.Filter):
    """A fit that takes a minute: a job that stays running while a test breaks something."""

    def fit(self, x, y=None):
        time.sleep(60)
        return {}


class Boom:
    """A plain filter whose fit raises ``ValueError("boom in fit")`` one call deep (in
    ``explode``), so the traceback shows a frame of the filter's own."""

    def fit(self, x, y=None):
        return self.explode()

    def explode(self):
        raise ValueError("boom in fit")

    def forward(self, x, state):
        return x


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made with openssl for one day."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


SHARED_FORK_SERVERS: Final = "SOMATIZE_TEST_FORK_SERVERS"
"""The variable naming the run's :func:`shared_fork_servers` folder to the processes it starts."""

FORK_SERVER_LINGER: Final = 300.0
"""How long a shared fork server of the suite waits, serving no agent, for the next test's
(``--fork-server-linger``): the tests that need a server of some environment come minutes
apart, and a server gone after the workers' default minute is imported again (~3.5 s of CPU),
as much as five times a run."""


@functools.cache
def shared_fork_servers() -> Path:
    """The folder where the run's clusters and in-process agents share fork servers
    (``--fork-server-share``): one torch import for all the tests that want a server of the same
    environment, where each cluster would pay its own (about 3.5 s of CPU).

    The first process to ask makes it and names it in its environment
    (:data:`SHARED_FORK_SERVERS`): ``pytest -n``'s test processes inherit the folder their
    controller made at start (``tests/conftest.py``), so the two share one server where each
    imported its own. It is removed when the process that made it exits, which ends them."""
    given = os.environ.get(SHARED_FORK_SERVERS)
    if given:
        return Path(given)
    folder = Path(tempfile.mkdtemp(prefix="somatize-test-forks-"))
    atexit.register(shutil.rmtree, folder, True)
    os.environ[SHARED_FORK_SERVERS] = str(folder)
    return folder


def child_pids(parent: int) -> set[int]:
    """Live (not zombie) processes whose parent is ``parent``."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == parent and fields[0] not in ("Z", "X"):
            found.add(int(entry.name))
    return found


def is_fork_server(pid: int) -> bool:
    """Whether ``pid`` is an agent's fork server (``python -m worker.daemon.fork_server``)."""
    return b"worker.daemon.fork_server" in cmdline(pid)


def is_shared_fork_server(pid: int) -> bool:
    """Whether ``pid`` is a fork server shared in :func:`shared_fork_servers`' folder: one
    that outlives the test whose agent started it, for the next test's."""
    return is_fork_server(pid) and str(shared_fork_servers()).encode() in cmdline(pid)


def cmdline(pid: int) -> bytes:
    """Process ``pid``'s arguments as ``/proc`` has them, each ended by a NUL (``b""`` once it
    is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def agent_daemons(agent: int) -> set[int]:
    """The filter daemons of the agent ``agent``: those it started itself (``python -m
    worker.daemon``), and those its fork server forked for it — its own server (its child), or
    the sibling server forked for it where workers share one (``--fork-server-share``), which is
    the shared server's child, not the agent's. Each writes to its agent's log (fd 2): a sibling
    is given it, and every daemon inherits it. So the agent's daemons are its own server's
    children with its log, and its siblings' children; a sibling is a child with its log of a
    shared server it did not start (one whose parent is not a fork server: another agent
    started it, or an earlier one, a test or a worker gone since).

    A child is named by what it runs, not by being a child: between its fork and its exec a new
    fork server still shows the agent's command line, and must not count as a daemon."""
    log = _stderr_of(agent)

    def logged(server: int) -> set[int]:
        return {pid for pid in child_pids(server) if _stderr_of(pid) == log}

    own = set()
    found = set()
    for pid in child_pids(agent):
        if is_fork_server(pid):
            own.add(pid)
            found |= logged(pid)
        elif b"\0worker.daemon\0" in cmdline(pid):
            found.add(pid)
    for pid in _pids():
        parent = _parent_of(pid)
        if (
            pid not in own
            and parent is not None
            and is_fork_server(pid)
            and not is_fork_server(parent)
        ):
            for sibling in logged(pid):  # a shared server's child that writes to this log
                found |= logged(sibling)
    return found


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None


def _stderr_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/fd/2")
    except OSError:
        return None


class RecordingSink:
    """A :class:`protocol.chunking.StreamSink` that keeps the buffer it gave out (``landed``)
    and records each ``received`` count (``seen``): how its message arrived."""

    def __init__(self) -> None:
        self.landed: memoryview | None = None
        self.seen: list[int] = []

    def buffer(self, nbytes: int) -> memoryview:
        self.landed = memoryview(bytearray(nbytes))
        return self.landed

    def received(self, nbytes: int) -> None:
        self.seen.append(nbytes)
