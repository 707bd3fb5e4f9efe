"""A real cluster on loopback for integration tests: the console scripts as subprocesses.

``somatize-coordinator`` and ``somatize-worker`` run exactly as a user starts them; each test
module gets its own port and state directory, and every process is killed at the end, whatever
happened.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import somatize as sz
from tests.conftest import timeout_unit

UNIT = timeout_unit()
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition: Callable[[], Any], seconds: float, what: str) -> Any:
    """Poll ``condition`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + seconds
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds:.0f}s waiting for {what}")
        time.sleep(0.05)


class Cluster:
    """One coordinator and any number of workers, as subprocesses.

    Args:
        state_dir: the coordinator's ``--state-dir``.
        heartbeat_interval, heartbeat_timeout: passed to the coordinator.
    """

    def __init__(
        self, state_dir: Path, heartbeat_interval: float = 0.5, heartbeat_timeout: float = 3.0
    ):
        self.state_dir = state_dir
        self.port = free_port()
        self.url = f"ws://127.0.0.1:{self.port}"
        self.heartbeat = (heartbeat_interval, heartbeat_timeout)
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.logs = state_dir.parent / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        # The child keeps its own copy of the descriptor: the parent's can close right away.
        with open(self.logs / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def start_coordinator(self) -> None:
        interval, timeout = self.heartbeat
        self.coordinator = self._spawn(
            "coordinator",
            [
                str(BIN / "somatize-coordinator"),
                "--listen",
                f"127.0.0.1:{self.port}",
                "--state-dir",
                str(self.state_dir),
                "--heartbeat-interval",
                str(interval),
                "--heartbeat-timeout",
                str(timeout),
                "--job-threads",
                "1",
                "--grace",
                "2",
            ],
        )
        wait_for(self.healthy, 30 * UNIT, "the coordinator's /healthz")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def start_worker(self, worker_id: str, *tags: str) -> subprocess.Popen[bytes]:
        argv = [
            str(BIN / "somatize-worker"),
            "--connect",
            self.url,
            "--id",
            worker_id,
            "--threads",
            "1",
        ]
        for tag in tags:
            argv += ["--tag", tag]
        proc = self._spawn(f"worker-{worker_id}", argv)
        self.workers[worker_id] = proc
        self.wait_connected(worker_id)
        return proc

    def worker_state(self, worker_id: str) -> dict[str, Any] | None:
        with sz.connect(self.url, timeout=10 * UNIT) as client:
            for worker in client.status()["workers"]:
                if worker["id"] == worker_id:
                    return dict(worker)
        return None

    def wait_connected(self, worker_id: str) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            state = self.worker_state(worker_id)
            return state if state and state["state"] == "idle" else None

        return dict(wait_for(ready, 30 * UNIT, f"worker {worker_id} to register"))

    def send_signal(self, proc: subprocess.Popen[bytes], sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)  # the whole session: an agent's daemons too

    def stop_coordinator(self, sig: int = signal.SIGTERM) -> int:
        assert self.coordinator is not None
        self.send_signal(self.coordinator, sig)
        code = self.coordinator.wait(timeout=30 * UNIT)
        self.coordinator = None
        return code

    def close(self) -> None:
        procs = list(self.workers.values()) + ([self.coordinator] if self.coordinator else [])
        for proc in procs:
            self.send_signal(proc, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=10 * UNIT)
            except subprocess.TimeoutExpired:
                self.send_signal(proc, signal.SIGKILL)
                proc.wait(timeout=10 * UNIT)


@contextlib.contextmanager
def cluster(
    tmp_path: Path, workers: dict[str, tuple[str, ...]], **kwargs: float
) -> Iterator[Cluster]:
    """A started cluster with ``workers`` (id → tags); everything is stopped on exit."""
    c = Cluster(tmp_path / "state", **kwargs)
    try:
        c.start_coordinator()
        for worker_id, tags in workers.items():
            c.start_worker(worker_id, *tags)
        yield c
    finally:
        c.close()
