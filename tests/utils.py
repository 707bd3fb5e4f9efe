"""What many test modules share: the unit of test time and the filters their jobs run.

Every timeout in the tests is a multiple of one unit, scaled by ``SOMATIZE_TEST_TIMEOUT_SCALE``
(default 1) so a slow machine stretches them all at once instead of a test growing bare sleeps.

The filters are pickled by value (this module is the user's own code to
:func:`protocol.filters.dump_filter`), so a worker runs them without importing ``tests``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import somatize as sz
from somatize.cli.cluster import LISTENING, said_in_log


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
    its output captured, within ``seconds * UNIT``."""
    env = {**os.environ, "SOMATIZE_COORDINATOR": url, "COLUMNS": "200"}
    env.pop("SOMATIZE_TOKEN", None)
    return subprocess.run(
        [str(Path(sys.executable).parent / "somatize"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=seconds * UNIT,
        check=False,
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
    return b"worker.daemon.fork_server" in _cmdline(pid)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def agent_daemons(agent: int) -> set[int]:
    """The filter daemons of the agent ``agent``: those it started itself (``python -m
    worker.daemon``), and those its fork server forked for it — its own server (its child), or
    the sibling server forked for it where a local cluster's workers share one
    (``--fork-server-share``), which is the shared server's child, not the agent's. A sibling
    writes to its agent's log (its fd 2, passed to it), as does every daemon it forks; the
    shared server's other children are other agents' siblings and daemons.

    A child is named by what it runs, not by being a child: between its fork and its exec a new
    fork server still shows the agent's command line, and must not count as a daemon."""
    log = _stderr_of(agent)
    servers = set()
    found = set()
    for pid in child_pids(agent):
        if is_fork_server(pid):
            servers.add(pid)
        elif b"\0worker.daemon\0" in _cmdline(pid):
            found.add(pid)
    for pid in _pids():
        parent = _parent_of(pid)
        if (
            parent is not None
            and is_fork_server(pid)
            and is_fork_server(parent)
            and _stderr_of(pid) == log != _stderr_of(parent)
        ):
            servers.add(pid)  # its sibling, forked by the server it shares
    for server in servers:
        found |= {pid for pid in child_pids(server) if _stderr_of(pid) == log}
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
