"""The harness of :mod:`benchmarks.attacks`: the cluster the attacks land on, what they measure
and the pipeline job the peer attacks try to spoil.

A :class:`Site` holds the cluster the live scenarios share (:meth:`Site.cluster`, started by the
first that asks): a ``somatize-coordinator`` holding both tokens, two different secrets, with its
default limits, and two ``somatize-worker --threads 1`` agents :data:`WORKERS` listening for peer
links. :class:`Attack` is the row a scenario returns.
"""

from __future__ import annotations

import contextlib
import secrets
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

import somatize as sz
from benchmarks.faults.harness import Skipped, largest_difference, progressed, until
from protocol.codec import encode_frame
from protocol.errors import ErrorCode, RemoteError
from protocol.messages import CHUNK_BYTES, Capabilities
from somatize.cli.cluster import LocalCluster
from tests.coordinator.strategies.model_parallel.test_model_parallel import (
    dataset,
    graph,
    reference,
)

WORKERS = ("w0", "w1")
ATTEMPTS = 20
"""Attempts of each repeated attack: its time to refuse is their median and maximum."""
WAIT = 60.0
"""The longest any single wait may take before the run fails."""
EPOCHS = 40
"""The pipeline job's epochs: ~160 steps, long enough for the attacks to land while it trains."""
MATCH = 1e-5
"""The largest difference from the in-process reference the pipeline's result may show."""
PARTITIONS = [sz.Partition(["center", "a"], worker="w0"), sz.Partition(["b", "c"], worker="w1")]
HEALTH_POLL = 0.05
"""Seconds between the ``GET /healthz`` of :func:`polled`."""
CAPS = Capabilities(cpus=1, memory_bytes=1 << 30, torch="x", python="3", cloudpickle="3")
"""What a hand-made worker hello declares."""
WS_OPTIONS: dict[str, Any] = {
    "compression": None,
    "max_size": 4 * CHUNK_BYTES,
    "open_timeout": WAIT,
}
"""Of a hand-made WebSocket (:func:`websockets.connect`), as the agents' own."""
T = TypeVar("T")


@dataclass(frozen=True)
class Memory:
    """VmRSS of the attacked process just before the first attempt and after the last."""

    process: str
    before_kib: int
    after_kib: int


@dataclass
class Attack:
    """One row of the table.

    Attributes:
        row: the issue's row(s) it answers ("1", "1/2").
        name: the attack, briefly.
        how: how the benchmark made it.
        behaviour: what the system did (asserted by the scenario).
        refusals: seconds each refused attempt took, first byte to refusal.
        refused: what those seconds are, e.g. "dial → `unauthorized`" ("" when nothing was
            refused: the attack got nothing instead).
        test: the test that asserts the same behaviour.
        memory: the attacked process's RSS, where the row is about memory.
        figures: other figures, as Markdown.
    """

    row: str
    name: str
    how: str
    behaviour: str
    refusals: list[float]
    refused: str
    test: str
    memory: Memory | None = None
    figures: list[str] = field(default_factory=list)


class Site:
    """What the scenarios run on: the shared cluster, started when first asked for."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.worker_token = secrets.token_urlsafe(16)
        self.client_token = secrets.token_urlsafe(16)
        self._stack = contextlib.ExitStack()
        self._cluster: LocalCluster | None = None
        self._starts = 0

    @property
    def cluster(self) -> LocalCluster:
        if self._cluster is None:
            self._starts += 1
            state = self.directory / f"cluster-{self._starts}" / "state"
            c = self._stack.enter_context(
                LocalCluster(
                    state,
                    job_threads=1,
                    worker_token=self.worker_token,
                    client_token=self.client_token,
                )
            )
            c.start_coordinator()
            for worker_id in WORKERS:
                c.start_worker(worker_id, threads=1, peer_link=True)
            self._cluster = c
        return self._cluster

    def client(self) -> sz.Client:
        return self.cluster.client(timeout=WAIT)

    def settle(self) -> None:
        """Wait until the cluster's workers are idle, their spare daemons up (if it runs)."""
        if self._cluster is None:
            return
        c = self._cluster
        until(lambda: all(c.worker_state(w) == "idle" for w in WORKERS), "w0 and w1 idle")
        with self.client() as client:
            for worker_id in WORKERS:
                client.ping(worker_id)

    def close(self, failed: bool = False) -> None:
        """Stop the cluster (the next scenario starts another); the logs' tails if ``failed``."""
        if failed and self._cluster is not None:
            for log in sorted(self._cluster.logs.glob("*.log")):
                lines = log.read_text(errors="replace").splitlines()[-20:]
                print(f"--- tail of {log}", *lines, sep="\n", file=sys.stderr)
        self._stack.close()
        self._cluster = None


# -- measuring -----------------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    """The process's resident set (``VmRSS`` of ``/proc/PID/status``), KiB.

    Raises:
        Skipped: there is no ``/proc`` here (not Linux): the row cannot be measured.
    """
    status = Path(f"/proc/{pid}/status")
    if not Path("/proc/self/status").exists():
        raise Skipped("no /proc here, where the RSS figures are read")
    for line in status.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def pid_of(proc: subprocess.Popen[bytes] | None) -> int:
    """The pid of a process of the cluster that must be running."""
    if proc is None or proc.poll() is not None:
        raise RuntimeError("the attacked process is not running")
    return proc.pid


def refused(exc: RemoteError, code: ErrorCode, *words: str) -> None:
    """Check a refusal's code and that its message says ``words``."""
    missing = [w for w in words if w not in exc.info.message]
    if exc.code != code or missing:
        raise AssertionError(f"expected {code} saying {missing}; got [{exc.code}] {exc}")


async def timed_refusals(
    attempt: Callable[[int], Coroutine[Any, Any, Any]], check: Callable[[RemoteError], None]
) -> list[float]:
    """Make ``ATTEMPTS`` attempts; each must be refused (``check`` on it): their seconds."""
    took = []
    for n in range(ATTEMPTS):
        started = time.perf_counter()
        try:
            answer = await attempt(n)
        except RemoteError as exc:
            took.append(time.perf_counter() - started)
            check(exc)
            continue
        raise AssertionError(f"attempt {n} was not refused: {answer!r}")
    return took


def polled(url: str, work: Callable[[], T]) -> tuple[list[float], T]:
    """Do ``work`` while a thread ``GET``s ``url`` every :data:`HEALTH_POLL` s: each answer's
    latency (a failed one: infinite), and what ``work`` returned."""
    latencies: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(HEALTH_POLL):
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(url, timeout=WAIT) as answer:
                    ok = answer.status == 200
            except OSError:
                ok = False
            latencies.append(time.perf_counter() - started if ok else float("inf"))

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        return latencies, work()
    finally:
        stop.set()
        poller.join(WAIT)


def spread(seconds: list[float]) -> str:
    return f"{1e3 * statistics.median(seconds):.1f} / {1e3 * max(seconds):.1f} ms"


# -- the pipeline job the peer attacks land on ---------------------------------------------------


def pipeline_job(client: sz.Client) -> sz.Job:
    """A 2-stage ModelParallel job on w0 → w1 over the peer links, past its first step."""
    x, y = dataset()
    strategy = sz.ModelParallel(PARTITIONS, 2, transport="websocket")
    job = client.submit(graph(epochs=EPOCHS), x, y, strategy=strategy)
    progressed(job, "step", 1)
    return job


def exact(job: sz.Job) -> float:
    """Check the attacked job is still running, then that it succeeds equal to the unsplit
    model trained in one process; the largest difference."""
    if job.status()["state"] != "running":
        raise AssertionError("the job ended before the attacks did: they landed on nothing")
    fitted = job.result(timeout=WAIT)
    x, y = dataset()
    expected = reference(x, y, epochs=EPOCHS)
    if not all(torch.isfinite(torch.as_tensor(v)).all() for v in fitted.states["c"].values()):
        raise AssertionError("a weight of the attacked job is not finite")
    diff = largest_difference(fitted.states, expected)
    if not diff <= MATCH:
        raise AssertionError(f"the attacked job's result differs from the reference by {diff}")
    return diff


def nan_gradients() -> bytes:
    return encode_frame(torch.full((16, 8), float("nan")))
