"""The harness of :mod:`benchmarks.faults`: the clusters the scenarios run on, their waits, the
jobs they submit and the checks of what came through.

A :class:`Site` is a started cluster of one kind (:data:`KINDS`), shared by the scenarios of that
kind; :class:`Outcome` is the row a scenario returns.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import somatize as sz
from somatize.cli.cluster import LocalCluster
from tests.integration.netns import Netns, NetnsUnavailable
from tests.utils import Center

HEARTBEAT_INTERVAL = 0.5
HEARTBEAT_TIMEOUT = 3.0
CALL_TIMEOUT = 3.0
"""``--call-timeout`` of the hung-daemon scenario's coordinator (the others keep the default)."""
BLIP = 1.0
"""Seconds the link is down in the below-the-timeout scenario."""
ELASTIC_DELAY = 0.03
"""Seconds each forward of the elastic rows' model sleeps: 30 steps of ~0.1 s, a kill lands
mid-training."""
ELASTIC_MATCH = 1e-5
"""The largest difference from ``graph.fit`` an elastic run may show (float32 sums in another
order; the same bound as its tests)."""
POLL = 0.02
WAIT = 60.0
"""The longest any single wait of a scenario may take before the run fails."""
TOKENS = {"worker_token": "faults-worker-token-0123", "client_token": "faults-client-token-3210"}


# -- the filters the jobs run (pickled by value into the daemons) --------------------------------


class Sleepy(sz.Filter):
    """Computes for ``seconds``; writes its daemon's pid to ``pid_file`` first, if given."""

    def __init__(self, seconds: float, pid_file: str | None = None) -> None:
        self.seconds = seconds
        self.pid_file = pid_file

    def fit(self, x: Any, y: Any = None) -> Any:
        if self.pid_file is not None:
            Path(self.pid_file).write_text(str(os.getpid()))
        time.sleep(self.seconds)
        return {}


class SlowLinear(torch.nn.Module):
    """A linear layer that takes :attr:`delay` s per forward, so a fault lands mid-step."""

    def __init__(self, n_in: int, n_out: int, delay: float = 0.2) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(n_in, n_out)
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        return self.lin(x)


# -- the harness ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One row of the table.

    Attributes:
        fault: what went wrong.
        injected: how the benchmark made it happen.
        behaviour: what the system did (asserted by the scenario).
        detection_s, detected: seconds from the fault to ``detected`` (``None``: nothing to detect).
        recovery_s, recovered: seconds to ``recovered``, e.g. "link up → w1 idle".
        test: the test that asserts the same behaviour.
        startup: the detection is a process's startup (the restarted coordinator marks what
            was running failed as it opens its store), not a wait for silence or a closed pipe.
        also: other detection times of the same fault, by what detected it (the agent's own).
    """

    fault: str
    injected: str
    behaviour: str
    detection_s: float | None
    detected: str
    recovery_s: float | None
    recovered: str
    test: str
    startup: bool = False
    also: dict[str, float] = field(default_factory=dict)


@dataclass
class Site:
    """What a scenario runs on: a started cluster (shared with the other scenarios of its kind:
    leave it as found, every worker idle), the data each worker was started with, and the
    network namespace of the ``netns`` kind."""

    cluster: LocalCluster
    data: dict[str, dict[str, Path]]
    netns: Netns | None = None

    def client(self) -> sz.Client:
        return self.cluster.client(timeout=WAIT)

    def settle(self) -> None:
        """Wait until every worker is idle with its spare filter daemon up (a ping through each
        waits for it): a scenario's times are then its fault's, not the start-up of a daemon
        that the previous scenario's job made the agent start anew (seconds under load, and
        more than ``--call-timeout`` :data:`CALL_TIMEOUT` for a job opened meanwhile)."""
        with self.client() as client:
            until(lambda: all_idle(client), "every worker idle")
            for worker_id in workers_of(client):
                client.ping(worker_id)

    def restart(self, client: sz.Client, worker_id: str) -> float:
        """Start a killed worker again (as a supervisor would), with its data; seconds until it
        is idle under the same id."""
        before = workers_of(client)[worker_id]["connections"]
        self.cluster.workers[worker_id].wait(timeout=WAIT)  # reaped, not left a zombie
        began = time.time()
        self.cluster.start_worker(worker_id, threads=1, data=self.data.get(worker_id))
        return until(lambda: back(client, worker_id, before + 1), f"{worker_id} back") - began


class Skipped(Exception):
    """A kind of cluster this machine cannot start (its scenarios' rows say why)."""


def _loopback(directory: Path, stack: contextlib.ExitStack) -> Site:
    """Three workers on loopback, each with a ``local`` dataset (for FedAvg)."""
    rng = np.random.default_rng(1)
    data = {}
    directory.mkdir(parents=True, exist_ok=True)
    for i, worker_id in enumerate(("w1", "w2", "w3")):
        x = rng.normal(size=(20 + 10 * i, 4)).astype(np.float32)
        np.savez(directory / f"{worker_id}.npz", x=x, y=x.sum(1, keepdims=True))
        data[worker_id] = {"local": directory / f"{worker_id}.npz"}
    return Site(stack.enter_context(started(directory, data)), data)


def _short_call(directory: Path, stack: contextlib.ExitStack) -> Site:
    """One worker under a coordinator with ``--call-timeout`` :data:`CALL_TIMEOUT`."""
    c = stack.enter_context(started(directory, {"w1": {}}, call_timeout=CALL_TIMEOUT))
    return Site(c, {})


def _netns(directory: Path, stack: contextlib.ExitStack) -> Site:
    """One worker in a network namespace, the coordinator on the host end of its veth pair."""
    ns = Netns.numbered()
    try:
        ns.create()
    except NetnsUnavailable as exc:
        raise Skipped(f"not run: {exc}") from exc
    stack.callback(ns.delete)
    c = stack.enter_context(
        started(directory, {"w1": {}}, prefix=ns.prefix, host=ns.host_ip, **TOKENS)
    )
    return Site(c, {}, ns)


KINDS: dict[str, Callable[[Path, contextlib.ExitStack], Site]] = {
    "loopback": _loopback,
    "short_call": _short_call,
    "netns": _netns,
}
"""The kinds of cluster, by name: a factory that starts one (entering what it must stop into the
stack). Scenarios of a kind share one cluster, started before the first and stopped after the
last (and started afresh after a scenario that failed)."""


def until(condition: Callable[[], Any], what: str, seconds: float = WAIT) -> float:
    """Poll ``condition`` every :data:`POLL` s; the wall time (Unix s) it first held."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {seconds:.0f}s waiting for {what}")
        time.sleep(POLL)
    return time.time()


@contextlib.contextmanager
def started(
    directory: Path,
    workers: dict[str, dict[str, Path]],
    prefix: Sequence[str] = (),
    **options: Any,
) -> Iterator[LocalCluster]:
    """A coordinator and ``workers`` (id → their datasets; started side by side, idle), stopped
    on exit; the logs' tails are printed if something fails meanwhile."""
    options = {
        "heartbeat_interval": HEARTBEAT_INTERVAL,
        "heartbeat_timeout": HEARTBEAT_TIMEOUT,
        "job_threads": 1,
        **options,
    }
    with LocalCluster(directory / "state", **options) as c:
        try:
            c.start_coordinator()
            with ThreadPoolExecutor(len(workers)) as pool:
                starts = [
                    pool.submit(c.start_worker, w, threads=1, data=data, prefix=prefix)
                    for w, data in workers.items()
                ]
                for start in starts:
                    start.result()
            yield c
        except BaseException:
            for log in sorted(c.logs.glob("*.log")):
                lines = log.read_text(errors="replace").splitlines()[-20:]
                print(f"--- tail of {log}", *lines, sep="\n", file=sys.stderr)
            raise


def workers_of(client: sz.Client) -> dict[str, dict[str, Any]]:
    """The coordinator's worker records by id."""
    return {w["id"]: w for w in client.status()["workers"]}


def state(client: sz.Client, worker_id: str) -> str | None:
    return workers_of(client).get(worker_id, {}).get("state")


def back(client: sz.Client, worker_id: str, connections: int) -> bool:
    """The worker is idle on its ``connections``-th connection (so: the same record)."""
    record = workers_of(client).get(worker_id, {})
    return record.get("state") == "idle" and record.get("connections") == connections


def all_idle(client: sz.Client) -> bool:
    return all(w["state"] == "idle" for w in workers_of(client).values())


def failed(job: sz.Job, code: str, *names: str) -> sz.JobEventInfo:
    """The job's end, checked to be a failure with ``code`` whose message names ``names``."""
    end = job.wait(WAIT)
    message = str(end.data.get("message", ""))
    if end.event != "failed" or end.data.get("code") != code:
        raise AssertionError(f"expected {code}, the job ended {end.event}: {end.data}")
    missing = [n for n in names if n not in message]
    if missing:
        raise AssertionError(f"the failure does not name {missing}: {message}")
    return end


def progressed(job: sz.Job, key: str, at_least: int) -> None:
    """Wait until the job's progress reports ``key`` ≥ ``at_least``."""
    until(lambda: (job.status()["progress"] or {}).get(key, 0) >= at_least, f"{key} {at_least}")


def quick_job(client: sz.Client, worker: str) -> None:
    """A plain job on ``worker`` that must succeed with the right answer."""
    x = np.random.default_rng(0).normal(size=(16, 3))
    job = client.submit(sz.Graph([Center().named("c")]), x, strategy=sz.Local(worker))
    fitted = job.result(timeout=WAIT)
    np.testing.assert_allclose(fitted.states["c"]["mean"], x.mean(0), rtol=0, atol=1e-12)


def sleepy_job(client: sz.Client, worker: str, seconds: float = 60.0) -> sz.Job:
    """A job computing on ``worker`` (its ``training`` phase has begun)."""
    job = client.submit(
        sz.Graph([Sleepy(seconds).named("sleepy")]), np.zeros((2, 2)), strategy=sz.Local(worker)
    )
    for event in job.events(timeout=WAIT):
        if event.event == "progress" and event.data.get("phase") == "training":
            return job
    raise AssertionError(f"job {job.id} ended before training")


def agent_gave_up(c: LocalCluster, worker_id: str, after: float) -> float | None:
    """When (Unix s) the agent's log first says it gave up its connection after ``after``."""
    for line in (c.logs / f"worker-{worker_id}.log").read_text(errors="replace").splitlines():
        if "giving up the connection" in line:
            stamp = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if stamp > after:
                return stamp
    return None


def elastic_graph() -> sz.Graph:
    """Center >> a slowed MLP under Adam (its optimizer state must be copied too): 96 rows in
    batches of 16 for 5 epochs, shuffled, 30 steps."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        SlowLinear(6, 16, ELASTIC_DELAY), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    )
    net = sz.TorchFilter(
        mlp, loss="cross_entropy", optimizer="adam", lr=0.01, batch_size=16, epochs=5, seed=11
    )
    return Center().named("center") >> net.named("mlp")


def elastic_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(96, 6)) * 2 + 1).astype(np.float32)
    return x, (x @ rng.normal(size=(6, 3))).argmax(1).astype(np.int64)


def elastic_job(client: sz.Client) -> tuple[sz.Job, list[str]]:
    """An elastic DataParallel(2) job of :func:`elastic_graph` past its third step; its
    workers. On the coordinator's collective, which reports every step (the torch collective
    reports a few a second): each step's progress event is checked."""
    x, y = elastic_data()
    strategy = sz.DataParallel(2, elastic=True, elastic_timeout=WAIT, collective="coordinator")
    job = client.submit(elastic_graph(), x, y, strategy=strategy)
    progressed(job, "step", 3)
    return job, list(job.status()["workers"])


def event(events: list[sz.JobEventInfo], kind: str, **match: Any) -> sz.JobEventInfo:
    """The first of ``events`` of ``kind`` whose data holds ``match``."""
    for e in events:
        if e.event == kind and all(e.data.get(k) == v for k, v in match.items()):
            return e
    raise AssertionError(f"no {kind} event with {match}: {[(e.event, e.data) for e in events]}")


@dataclass
class Elastic:
    """How an elastic job came through the loss of ``victim``: its events, checked."""

    lost: sz.JobEventInfo
    replaced: sz.JobEventInfo
    restored: sz.JobEventInfo
    resumed: sz.JobEventInfo
    """The progress event of the step that failed: done again, on the restored replica."""
    steps: int
    diff: float
    """Largest absolute difference of any state from an in-process ``graph.fit``."""


def largest_difference(states: dict[str, Any], expected: dict[str, Any]) -> float:
    """The largest absolute difference between two graphs' states, over ``expected``'s keys."""
    return max(
        float(np.abs(np.asarray(states[n][k], np.float64) - np.asarray(v, np.float64)).max())
        for n, state_ in expected.items()
        for k, v in state_.items()
    )


def came_through(job: sz.Job, victim: str, replacement: str, survivor: str) -> Elastic:
    """Check an elastic job lost ``victim``, took ``replacement``, restored it from ``survivor``,
    did every step once in order and ended equal to ``graph.fit`` of the same graph and data."""
    fitted = job.result(timeout=WAIT)
    events = list(job.events(timeout=WAIT))
    lost = event(events, "worker_lost", worker=victim, code="worker_lost")
    replaced = event(events, "worker_replaced", lost=victim, worker=replacement)
    restored = event(events, "worker_restored", worker=replacement)
    if restored.data["from"] != survivor:
        raise AssertionError(f"{replacement} restored from {restored.data['from']}, not {survivor}")
    # The training steps' events (the run's last event, its history, repeats the last step).
    training = [e for e in events if e.event == "progress" and e.data.get("phase") == "training"]
    steps = [e.data["step"] for e in training]
    total = int(event(events, "progress", step=1).data["steps"])
    if steps != list(range(1, total + 1)):
        raise AssertionError(f"the steps were not each done once, in order: {steps}")
    x, y = elastic_data()
    graph = elastic_graph()
    net = graph["mlp"]
    assert isinstance(net, sz.TorchFilter)
    initial = {"mlp": {k: v.clone() for k, v in net.module.state_dict().items()}}
    expected = graph.fit(x, y).states
    diff = largest_difference(fitted.states, expected)
    if not diff <= ELASTIC_MATCH:
        raise AssertionError(f"the elastic result differs from graph.fit by {diff:.3g}")
    if not largest_difference(expected, initial) > 1000 * ELASTIC_MATCH:
        raise AssertionError("graph.fit hardly moved the weights: the comparison shows nothing")
    resumed = event(events, "progress", step=lost.data["step"])
    return Elastic(lost, replaced, restored, resumed, total, diff)
