"""A coordinator and workers on this machine, as real processes: the embedded default.

``somatize demo`` runs on one, and so do the integration tests: ``somatize-coordinator`` and
``somatize-worker`` are started exactly as a person would start them on separate machines, on
loopback, each in a session of its own so that stopping one also stops its filter daemons. Every
process is stopped when the cluster closes, whatever happened (``with LocalCluster(...)``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TextIO, TypeVar

from somatize.errors import ClusterError
from somatize.remote.client import Client, connect

T = TypeVar("T")

BIN = Path(sys.executable).parent
"""Where the console scripts of this environment are."""


LISTENING = re.compile(r"^somatize-coordinator listening on \S+:(\d+)\s*$", re.MULTILINE)
"""The coordinator's line saying the port it bound (:mod:`coordinator.cli`): started with
``--listen HOST:0`` it binds one the system gives, which no one else can take between a pick
and the bind."""
_PEER_ADDRESS = re.compile(r"serving peer links on \S+ \(announced as (ws://\S+)\)")
"""A worker's line saying where other workers dial it (:mod:`worker.peer_server`)."""
NO_SANDBOX = "no sandbox for job code works here"
"""What a worker says when ``--sandbox auto`` finds no sandbox
(:mod:`worker.confinement.sandbox`)."""


def said_in_log(
    proc: subprocess.Popen[bytes], log: Path, line: re.Pattern[str], seconds: float, start: int = 0
) -> str:
    """What ``proc`` says in its ``log`` after byte ``start`` on a ``line`` (its first group),
    once it says it (within ``seconds``).

    Raises:
        ClusterError: it exited first, or did not say it in time.
    """

    def said() -> str | None:
        if proc.poll() is not None:
            raise ClusterError(f"{log.stem} exited with status {proc.returncode}; see {log}")
        if not log.exists():
            return None
        with open(log, "rb") as text:
            text.seek(start)
            found = line.search(text.read().decode(errors="replace"))
        return None if found is None else found.group(1)

    return wait_for(said, seconds, f"{log.stem} to say where it listens")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, on ``host`` (loopback by default)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for(condition: Callable[[], T | None], seconds: float, what: str) -> T:
    """Poll ``condition`` until it returns something truthy, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {seconds:.0f}s waiting for {what}")
        time.sleep(0.05)


class LocalCluster:
    """One coordinator and its workers as subprocesses on 127.0.0.1.

    Args:
        state_dir: the coordinator's ``--state-dir`` (default: a temporary directory).
        port: the coordinator's port (default: the one it binds when first started, as it
            says; the same one after a restart).
        heartbeat_interval, heartbeat_timeout: the coordinator's heartbeat contract.
        job_threads: torch threads of each job daemon.
        logs: where each process's output goes (default: ``<state_dir>/../logs``).
        startup: seconds a process may take to come up.
        host: the address the coordinator listens on and everyone dials (default loopback).
            Beyond loopback the coordinator wants both tokens.
        worker_token, client_token: the bearer tokens of ``/worker`` and ``/client`` (given to
            the processes in their environment, never on a command line).
        call_timeout: the coordinator's ``--call-timeout`` (default: its own).
        spare_daemons: whether each worker keeps a filter daemon started for its next job
            (``--spare-daemon``). Off, a job waits for its daemons to start (a torch import,
            about 2 s) and nothing idle holds CPU or memory: what many short clusters want.
        spares: how many each worker keeps (``--spare-daemons``; default one: a cluster on one
            machine shares its cores and memory with them; ``None``: the worker's own default,
            two when sandboxed).
        sandbox: each worker's ``--sandbox`` (:mod:`worker.confinement.sandbox`). With ``"auto"``
            (the default) on a machine where no sandbox works (no bubblewrap, not root), a
            cluster of one's own runs its workers ``--sandbox none`` rather than none at all,
            and says so on stderr once: the job code is the user's own.
        fork_server_share: a folder where this cluster's workers share fork servers' imports
            with the workers of other clusters given the same folder (a test suite's clusters,
            one after another: a server outlives its cluster for the next); it is the caller's
            to remove, which ends those servers. Default: a folder of the cluster's own,
            removed at :meth:`close`.
        fork_server_linger: how long such a shared server waits, serving no worker, for the next
            cluster's (``--fork-server-linger``; ``None``: the workers' default, a minute).
    """

    # The SDK's public keyword API: each argument a documented keyword of its own.
    def __init__(  # noqa: PLR0913
        self,
        state_dir: Path | None = None,
        *,
        port: int | None = None,
        heartbeat_interval: float = 0.5,
        heartbeat_timeout: float = 3.0,
        job_threads: int = 1,
        logs: Path | None = None,
        startup: float = 60.0,
        host: str = "127.0.0.1",
        worker_token: str | None = None,
        client_token: str | None = None,
        call_timeout: float | None = None,
        spare_daemons: bool = True,
        spares: int | None = 1,
        sandbox: str = "auto",
        fork_server_share: Path | None = None,
        fork_server_linger: float | None = None,
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="somatize-") if state_dir is None else None
        base = Path(self._tmp.name) if self._tmp is not None else None
        self.state_dir = state_dir if state_dir is not None else Path(str(base)) / "state"
        self.host = host
        self._at(port or 0)
        self.heartbeat = (heartbeat_interval, heartbeat_timeout)
        self.worker_token = worker_token
        self.client_token = client_token
        self.call_timeout = call_timeout
        self.job_threads = job_threads
        self.spare_daemons = spare_daemons
        self.spares = spares
        self.sandbox = sandbox
        self.logs = logs if logs is not None else self.state_dir.parent / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.startup = startup
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.peer_addresses: dict[str, str] = {}  # worker id → its /peer endpoint's ws://
        # Where its workers share a fork server's imports; removed at close where made here.
        self._forks = None if fork_server_share is None else str(fork_server_share)
        self._own_forks = fork_server_share is None
        self.fork_server_linger = fork_server_linger

    def _at(self, port: int) -> None:
        """Say the coordinator is at ``port`` (``0``: not known until it starts)."""
        self.port = port
        self._authority = f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"
        self.url = f"ws://{self._authority}"

    # -- processes ------------------------------------------------------------------------------

    def _spawn(
        self, name: str, argv: list[str], env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        # The child keeps its own copy of the log's descriptor: the parent's closes right away.
        with open(self.logs / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **env} if env else None,
            )

    def start_coordinator(self, args: Sequence[str] = ()) -> None:
        """Start the coordinator (with more ``somatize-coordinator`` ``args``) and wait until
        ``/healthz`` answers."""
        interval, timeout = self.heartbeat
        argv = [
            str(BIN / "somatize-coordinator"),
            *("--listen", f"{self.host}:{self.port}", "--state-dir", str(self.state_dir)),
            *("--heartbeat-interval", str(interval), "--heartbeat-timeout", str(timeout)),
            *("--job-threads", str(self.job_threads), "--grace", "2"),
        ]
        if self.call_timeout is not None:
            argv += ["--call-timeout", str(self.call_timeout)]
        argv += args
        tokens = {"SOMATIZE_WORKER_TOKEN": self.worker_token, "SOMATIZE_TOKEN": self.client_token}
        env = {name: value for name, value in tokens.items() if value is not None}
        said = self._log_size("coordinator")
        self.coordinator = self._spawn("coordinator", argv, env)
        if self.port == 0:  # it binds one and says which: no port picked here for it to race for
            log = self.logs / "coordinator.log"
            self._at(int(said_in_log(self.coordinator, log, LISTENING, self.startup, said)))
        self._wait(self.coordinator, "coordinator", self.healthy)

    def start_worker(
        self,
        worker_id: str,
        *tags: str,
        threads: int | None = None,
        data: Mapping[str, Path] | None = None,
        peer_link: bool = False,
        prefix: Sequence[str] = (),
        device: str | None = None,
        args: Sequence[str] = (),
        connect: str | None = None,
    ) -> None:
        """Start a worker agent and wait until the coordinator lists it connected: idle, or
        busy when a job took it at once (a job waiting for a replacement, or a queued one).

        ``data`` maps dataset names to ``.npz`` files the worker trains on (``--data NAME=PATH``);
        ``peer_link`` makes it listen for other workers' tensors (``--peer-listen``) on a free
        loopback port; ``prefix`` goes before the command (``ip netns exec NS``: the worker in
        another network namespace); ``device`` is its ``--device`` (``auto`` when ``None``);
        ``args`` are more ``somatize-worker`` arguments; ``connect`` the URL it dials (default
        :attr:`url`: a worker in a namespace may reach the coordinator at another address).
        """
        url = connect or self.url
        argv = [*prefix, str(BIN / "somatize-worker"), "--connect", url, "--id", worker_id]
        argv += ["--identity-file", str(self.logs.parent / "identities" / f"{worker_id}.key")]
        argv += ["--threads", str(threads or self.job_threads)]
        if device is not None:
            argv += ["--device", device]
        if not self.spare_daemons:
            argv += ["--spare-daemon", "off"]
        elif self.spares is not None and "--spare-daemons" not in args:
            argv += ["--spare-daemons", str(self.spares)]
        if "--sandbox" not in args:
            argv += ["--sandbox", self.sandbox]
        if not {"--fork-server", "--fork-server-share"} & set(args):
            argv += ["--fork-server-share", self._fork_server_share()]
            if self.fork_server_linger is not None:
                argv += ["--fork-server-linger", f"{self.fork_server_linger:g}"]
        if peer_link:
            argv += ["--peer-listen", "127.0.0.1:0"]  # it binds one, and says which
        for tag in tags:
            argv += ["--tag", tag]
        for name, path in (data or {}).items():
            argv += ["--data", f"{name}={path}"]
        argv += args
        token = {"SOMATIZE_WORKER_TOKEN": self.worker_token} if self.worker_token else None
        try:
            self._start_worker(worker_id, argv, token, peer_link)
        except ClusterError:
            log = self.logs / f"worker-{worker_id}.log"
            refused = NO_SANDBOX in log.read_text(errors="replace")
            if self.sandbox != "auto" or "--sandbox" in args or not refused:
                raise
            print(
                f"no sandbox for job code works on this machine (see {log}): this cluster's "
                "workers run job code as your user (--sandbox none)",
                file=sys.stderr,
            )
            self.sandbox = "none"
            argv[argv.index("--sandbox") + 1] = "none"
            self._start_worker(worker_id, argv, token, peer_link)

    def _fork_server_share(self) -> str:
        """The folder where this cluster's workers share one fork server's imports (torch, a
        first optimizer: seconds of CPU each worker would spend again), only this user's."""
        if self._forks is None:
            self._forks = tempfile.mkdtemp(prefix="somatize-forks-")
        return self._forks

    def _start_worker(
        self, worker_id: str, argv: list[str], env: Mapping[str, str] | None, peer_link: bool
    ) -> None:
        said = self._log_size(f"worker-{worker_id}")
        proc = self._spawn(f"worker-{worker_id}", argv, env)
        self.workers[worker_id] = proc
        if peer_link:
            log = self.logs / f"worker-{worker_id}.log"
            address = said_in_log(proc, log, _PEER_ADDRESS, self.startup, said)
            self.peer_addresses[worker_id] = address
        connected = ("idle", "busy")
        self._wait(proc, f"worker-{worker_id}", lambda: self.worker_state(worker_id) in connected)

    def _wait(self, proc: subprocess.Popen[bytes], name: str, ready: Callable[[], bool]) -> None:
        def up() -> bool:
            if proc.poll() is not None:
                raise ClusterError(
                    f"{name} exited with status {proc.returncode}; see {self.logs / name}.log"
                )
            return ready()

        wait_for(up, self.startup, f"{name} to start (its log: {self.logs / name}.log)")

    def _log_size(self, name: str) -> int:
        """The bytes in ``name``'s log so far (a process started again appends to it)."""
        path = self.logs / f"{name}.log"
        return path.stat().st_size if path.exists() else 0

    def healthy(self) -> bool:
        """``GET /healthz`` answers 200."""
        try:
            with urllib.request.urlopen(f"http://{self._authority}/healthz", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def worker_state(self, worker_id: str) -> str | None:
        """The coordinator's view of a worker (``idle``, ``busy``, ``lost``...), if it knows it."""
        return (self.worker(worker_id) or {}).get("state")

    def worker(self, worker_id: str) -> dict[str, Any] | None:
        """The coordinator's record of a worker, if it knows it."""
        with self.client() as client:
            for worker in client.status()["workers"]:
                if worker["id"] == worker_id:
                    return dict(worker)
        return None

    def client(self, timeout: float = 10.0) -> Client:
        """A client of this cluster's coordinator (with the client token, if there is one)."""
        return connect(self.url, self.client_token, timeout=timeout)

    def send_signal(self, proc: subprocess.Popen[bytes], sig: int) -> None:
        """Signal a process and everything in its session (an agent's daemons too)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def stop_coordinator(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Stop the coordinator with ``sig``; its exit status."""
        assert self.coordinator is not None
        self.send_signal(self.coordinator, sig)
        code = self.coordinator.wait(timeout=timeout)
        self.coordinator = None
        return code

    def print_log_tails(self, lines: int = 30, file: TextIO | None = None) -> None:
        """Print the last ``lines`` of every process's log (to stderr): what a failure shows."""
        for log in sorted(self.logs.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            print(f"--- tail of {log.name} ---", *tail, sep="\n", file=file or sys.stderr)

    def close(self, timeout: float = 10.0) -> None:
        """Stop every process: SIGTERM, then SIGKILL what is still there after ``timeout``."""
        procs = [*self.workers.values(), *([self.coordinator] if self.coordinator else [])]
        for proc in procs:
            self.send_signal(proc, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.send_signal(proc, signal.SIGKILL)
                proc.wait(timeout=timeout)
        self.workers.clear()
        self.coordinator = None
        if self._forks is not None and self._own_forks:
            shutil.rmtree(self._forks, ignore_errors=True)
            self._forks = None
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
