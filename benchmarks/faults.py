"""Faults survived: each fault injected on a real local cluster, its detection and recovery timed.

``python -m benchmarks.faults [--out docs/reliability.md] [SCENARIO ...]`` runs every scenario
below (or the named ones) on a :class:`somatize.cluster.LocalCluster` — a real
``somatize-coordinator`` and real ``somatize-worker --threads 1`` processes — with heartbeats every
:data:`HEARTBEAT_INTERVAL` s and a :data:`HEARTBEAT_TIMEOUT` s timeout, then writes the table of
``docs/reliability.md``: the fault, how it was injected, what the system did, and two times:

- *detection*: from the fault to the first sign of it the system gives — the coordinator lists
  the worker ``lost``, or the job's ``failed`` event (its time as the coordinator recorded it);
- *recovery*: from the fault, or from its repair (the link back up, the process restarted as a
  supervisor would), to the system doing work again — the worker back ``idle`` under the same
  id, the job's next round, or the next job succeeding.

Every row says which of these it measured; waits poll every :data:`POLL` s. Each scenario also
asserts what the system must do (as its test does, named in the table) and the run fails
otherwise: a figure is written only for a fault that was survived.

Scenarios share a cluster of their kind (:data:`KINDS`: ``loopback``, three workers with a local
dataset each; ``short_call``, one worker under ``--call-timeout`` :data:`CALL_TIMEOUT`;
``netns``, one worker in a network namespace behind a veth pair, :mod:`tests.integration.netns`,
root only — otherwise its rows say why they did not run), started once, because starting
processes that import torch is most of the time on a small machine; a scenario leaves it as it
found it (a killed worker restarted, every worker idle). Adding a scenario is one function of a
:class:`Site` returning an :class:`Outcome`, decorated with :func:`scenario` and its kind.
Every process is stopped at the end, also on a failure (whose log tails are printed) or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import somatize as sz
from somatize.cluster import LocalCluster
from tests.integration.netns import Netns, NetnsUnavailable

HEARTBEAT_INTERVAL = 0.5
HEARTBEAT_TIMEOUT = 3.0
CALL_TIMEOUT = 3.0
"""``--call-timeout`` of the hung-daemon scenario's coordinator (the others keep the default)."""
BLIP = 1.0
"""Seconds the link is down in the below-the-timeout scenario."""
POLL = 0.02
WAIT = 60.0
"""The longest any single wait of a scenario may take before the run fails."""
TOKENS = {"worker_token": "faults-worker-token-0123", "client_token": "faults-client-token-3210"}
DOC = Path(__file__).resolve().parent.parent / "docs" / "reliability.md"


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


class Center(sz.Filter):
    def fit(self, x: Any, y: Any = None) -> Any:
        return {"mean": x.mean(0)}

    def forward(self, x: Any, state: Any) -> Any:
        return x - state["mean"]


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

SCENARIOS: dict[str, tuple[str, Callable[[Site], Outcome]]] = {}


def scenario(kind: str) -> Callable[[Callable[[Site], Outcome]], Callable[[Site], Outcome]]:
    """Register a scenario run on a cluster of ``kind`` (a key of :data:`KINDS`)."""
    if kind not in KINDS:
        raise ValueError(f"no cluster kind {kind!r}; the kinds are {list(KINDS)}")

    def register(fn: Callable[[Site], Outcome]) -> Callable[[Site], Outcome]:
        SCENARIOS[fn.__name__] = (kind, fn)
        return fn

    return register


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


# -- the scenarios -------------------------------------------------------------------------------


@scenario("loopback")
def worker_killed_mid_step(site: Site) -> Outcome:
    c = site.cluster
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=64)
    torch.manual_seed(0)
    net = sz.TorchFilter(SlowLinear(6, 3), loss="cross_entropy", batch_size=8, epochs=50)
    with site.client() as client:
        job = client.submit(sz.Graph([net.named("slow")]), x, y, strategy=sz.DataParallel(2))
        progressed(job, "step", 2)
        survivor, victim = job.status()["workers"]
        killed = time.time()
        c.send_signal(c.workers[victim], signal.SIGKILL)
        end = failed(job, "worker_lost", f"'{victim}'")
        until(lambda: state(client, survivor) == "idle", f"{survivor} freed")
        back_in = site.restart(client, victim)  # the next scenario trains on it again
    return Outcome(
        "worker process killed mid-step",
        "SIGKILL to one replica of a DataParallel(2) job after step 2",
        "job failed `worker_lost` naming the replica; the other freed at once; the killed one "
        "restarted: idle again under its id (and trained in the next row's FedAvg job)",
        end.time - killed,
        "kill → job failed",
        back_in,
        "restart → idle",
        "test_data_parallel_live.py::test_a_replica_killed_mid_training_fails_the_job_naming_it",
    )


@scenario("loopback")
def worker_killed_mid_round(site: Site) -> Outcome:
    c = site.cluster
    torch.manual_seed(0)
    graph = sz.Graph(
        [
            Sleepy(0.5).named("pause"),
            sz.TorchFilter(torch.nn.Linear(4, 1), lr=0.05, batch_size=8).named("lin"),
        ]
    )
    with site.client() as client:
        strategy = sz.FedAvg(rounds=4, min_workers=2)
        job = client.submit(graph, sz.WorkerData("local"), strategy=strategy)
        progressed(job, "round", 1)
        killed = time.time()
        c.send_signal(c.workers["w2"], signal.SIGKILL)
        lost = until(lambda: state(client, "w2") == "lost", "w2 lost")
        end = job.wait(WAIT)
        if end.event != "succeeded":
            raise AssertionError(f"FedAvg did not go on without w2: {end.data}")
        rounds = [e for e in job.events(timeout=WAIT) if e.data.get("phase") == "round"]
        dropped = [e for e in rounds if "w2" in e.data["dropped"]]
        later = rounds[rounds.index(dropped[0]) + 1 :] if dropped else []
        if len(dropped) != 1 or any("w2" in e.data["selected"] for e in later):
            raise AssertionError(f"w2 should be dropped once, then never selected: {rounds}")
        site.restart(client, "w2")
    return Outcome(
        "worker process killed mid-round",
        "SIGKILL to w2 of a FedAvg(rounds=4, min_workers=2) job on 3 workers after round 1",
        "w2 lost; its round closed with w1, w3 (`dropped: worker_lost` for w2), the rounds "
        "after it without w2; the job succeeded",
        lost - killed,
        "kill → w2 listed lost",
        dropped[0].time - killed,
        "kill → the round done without w2",
        "test_fedavg_live.py::test_live_fedavg_goes_on_without_a_worker_killed_mid_job",
    )


@scenario("loopback")
def worker_killed_mid_pipeline(site: Site) -> Outcome:
    c = site.cluster
    rng = np.random.default_rng(2)
    x = rng.normal(size=(64, 5)).astype(np.float32)
    y = rng.integers(0, 2, size=64)
    torch.manual_seed(0)
    graph = sz.TorchFilter(torch.nn.Linear(5, 6)).named("head") >> sz.TorchFilter(
        torch.nn.Sequential(SlowLinear(6, 6, 0.3), torch.nn.Linear(6, 2)),
        loss="cross_entropy",
        batch_size=8,
        epochs=20,
    ).named("tail")
    parts = [sz.Partition(["head"], worker="w1"), sz.Partition(["tail"], worker="w2")]
    with site.client() as client:
        job = client.submit(graph, x, y, strategy=sz.ModelParallel(parts, micro_batches=2))
        progressed(job, "step", 1)
        killed = time.time()
        c.send_signal(c.workers["w2"], signal.SIGKILL)
        end = failed(job, "worker_lost", "stage 1 ['tail'] on worker 'w2'")
        until(lambda: state(client, "w1") == "idle", "w1 freed")
        back_in = site.restart(client, "w2")
    return Outcome(
        "worker process killed mid-pipeline",
        "SIGKILL to stage-1 worker w2 of a ModelParallel job (2 stages, 2 micro-batches) after "
        "step 1",
        "job failed `worker_lost` naming stage 1 and w2; w1 freed; w2 restarted: idle again "
        "under its id",
        end.time - killed,
        "kill → job failed",
        back_in,
        "restart → w2 idle",
        "test_model_parallel_live.py::test_a_stage_worker_killed_mid_step_fails_the_job_naming_"
        "stage_and_worker",
    )


@scenario("loopback")
def worker_frozen(site: Site) -> Outcome:
    c = site.cluster
    with site.client() as client:
        before = workers_of(client)["w1"]["connections"]
        job = sleepy_job(client, "w1")
        frozen = time.time()
        c.send_signal(c.workers["w1"], signal.SIGSTOP)
        try:
            end = failed(job, "worker_lost", "'w1'", "no heartbeat")
        finally:
            c.send_signal(c.workers["w1"], signal.SIGCONT)
        thawed = time.time()
        back_at = until(lambda: back(client, "w1", before + 1), "w1 back")
        quick_job(client, "w1")
    return Outcome(
        "worker frozen (SIGSTOP)",
        "SIGSTOP to w1's process group (agent and daemons) during a job; SIGCONT once the job "
        "failed",
        "w1 lost for `no heartbeat`; job failed `worker_lost` naming it; thawed, the agent "
        "found its connection closed, reconnected as w1 and ran the next job",
        end.time - frozen,
        "stop → job failed",
        back_at - thawed,
        "SIGCONT → w1 idle",
        "test_coordinator_faults.py::test_a_silent_worker_is_lost_after_the_heartbeat_timeout_and_"
        "comes_back_under_its_id",
    )


@scenario("loopback")
def coordinator_restarted(site: Site) -> Outcome:
    c = site.cluster
    x = np.random.default_rng(3).normal(size=(16, 3))
    with site.client() as client:
        done = client.submit(sz.Graph([Center().named("c")]), x)
        before = done.result(timeout=WAIT).states["c"]["mean"]
        running = sleepy_job(client, "w1")
    c.stop_coordinator(signal.SIGKILL)
    restarted = time.time()
    c.start_coordinator()
    healthy = time.time()
    with site.client() as client:
        record = client.job(running.id).status()
        if record["state"] != "failed" or record["error"]["code"] != "coordinator_restarted":
            raise AssertionError(f"the running job was left {record['state']}: {record}")
        after = client.job(done.id).states(timeout=WAIT)["c"]["mean"]
        np.testing.assert_array_equal(after, before)
        # A new process: a new registry, where each returning worker is on its first connection.
        back_at = until(lambda: all(back(client, w, 1) for w in c.workers), "every worker back")
        quick_job(client, "w1")
    return Outcome(
        "coordinator killed and restarted",
        "SIGKILL to the coordinator during a job, started again at once on the same state",
        "finished job's result intact (equal); the running job marked failed "
        "`coordinator_restarted` at startup; all 3 agents reconnected by themselves under "
        f"their ids; the new process answered /healthz {healthy - restarted:.2f} s after it "
        "was started (importing torch is most of it)",
        record["finished"] - restarted,
        "restart → running job marked failed",
        back_at - restarted,
        "restart → all workers idle",
        "test_coordinator_faults.py::test_a_restarted_coordinator_keeps_finished_results_and_"
        "workers_come_back",
        startup=True,
    )


@scenario("short_call")
def daemon_killed(site: Site) -> Outcome:
    pid_file = site.cluster.state_dir.parent / "pid-killed"
    with site.client() as client:
        graph = sz.Graph([Sleepy(60, str(pid_file)).named("sleepy")])
        job = client.submit(graph, np.zeros((2, 2)))
        until(lambda: pid_file.exists() and pid_file.read_text(), "the filter to start")
        killed = time.time()
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        end = failed(job, "daemon_crashed", "'w1'", "SIGKILL")
        quick_job(client, "w1")
        recovered = time.time()
        if workers_of(client)["w1"]["connections"] != 1:
            raise AssertionError("w1 reconnected: a daemon's death must not cost the connection")
    return Outcome(
        "filter daemon killed",
        "SIGKILL to the job's filter daemon (pid written by the filter) while it computes",
        "job failed `daemon_crashed` naming w1 and SIGKILL; w1 stayed connected, its next job "
        "succeeded (fresh daemon)",
        end.time - killed,
        "kill → job failed",
        recovered - killed,
        "kill → next job succeeded",
        "test_daemon_faults.py::test_a_daemon_killed_mid_job_fails_the_job_naming_worker_and_signal",
    )


@scenario("short_call")
def daemon_hung(site: Site) -> Outcome:
    pid_file = site.cluster.state_dir.parent / "pid-hung"
    with site.client() as client:
        graph = sz.Graph([Sleepy(3600, str(pid_file)).named("hung")])
        job = client.submit(graph, np.zeros((2, 2)))
        hung = until(lambda: pid_file.exists() and pid_file.read_text(), "the filter to start")
        end = failed(job, "timeout", "'w1'", f"within {CALL_TIMEOUT}s")
        quick_job(client, "w1")
        recovered = time.time()
    return Outcome(
        "filter daemon hung past its timeout",
        f"a filter that sleeps for an hour; coordinator `--call-timeout {CALL_TIMEOUT:g}`",
        "the agent killed the daemon at the timeout; job failed `timeout` naming w1; w1 stayed "
        "connected, its next job succeeded",
        end.time - hung,
        "hang → job failed",
        recovered - end.time,
        "failure → next job succeeded",
        "test_daemon_faults.py::test_a_daemon_hung_past_the_call_timeout_is_killed_and_the_job_fails",
    )


@scenario("netns")
def network_cut(site: Site) -> Outcome:
    c, ns = site.cluster, site.netns
    assert ns is not None
    with site.client() as client:
        before = workers_of(client)["w1"]["connections"]
        job = sleepy_job(client, "w1")
        cut = time.time()
        ns.cut()
        lost = until(lambda: state(client, "w1") == "lost", "w1 lost")
        end = failed(job, "worker_lost", "'w1'", "no heartbeat")
        until(lambda: agent_gave_up(c, "w1", cut), "the agent to give up")
        agent = agent_gave_up(c, "w1", cut) or 0.0
        restored = time.time()
        ns.restore()
        back_at = until(lambda: back(client, "w1", before + 1), "w1 back")
        quick_job(client, "w1")
    return Outcome(
        "worker's network cut without a close",
        "worker in a network namespace; the host end of its veth pair set down during a job",
        f"coordinator: w1 lost (`no heartbeat`) at {lost - cut:.2f} s, its job failed "
        f"`worker_lost` naming it at {end.time - cut:.2f} s; agent: gave the dead link up (no "
        f"pong) at {agent - cut:.2f} s; link up: reconnected as w1 by itself, ran the next job",
        lost - cut,
        "cut → w1 listed lost",
        back_at - restored,
        "link up → w1 idle",
        "test_netcut.py::test_a_worker_cut_off_without_a_close_is_lost_in_time_and_comes_back_by_"
        "itself",
        also={"cut → the agent gave the link up": agent - cut},
    )


@scenario("netns")
def network_blip(site: Site) -> Outcome:
    ns = site.netns
    assert ns is not None
    with site.client() as client:
        before = workers_of(client)["w1"]["connections"]
        job = sleepy_job(client, "w1", seconds=BLIP + 2.0)
        ns.cut()
        time.sleep(BLIP)
        restored = time.time()
        ns.restore()

        def heard_since() -> bool:
            age = float(workers_of(client)["w1"]["last_heartbeat_age"])
            return time.time() - age > restored

        heard = until(heard_since, "a heartbeat after the blip")
        end = job.wait(WAIT)
        until(lambda: state(client, "w1") == "idle", "w1 idle")
        if end.event != "succeeded" or workers_of(client)["w1"]["connections"] != before:
            raise AssertionError(f"a blip below the timeout cost something: {end}")
    return Outcome(
        f"network down {BLIP:g} s (below the timeout)",
        f"the host end of the veth pair down for {BLIP:g} s during a job, then up",
        "nothing lost: TCP retransmitted, heartbeats resumed, the job succeeded on the same "
        "connection",
        None,
        "nothing to detect",
        heard - restored,
        "link up → next heartbeat",
        "test_netcut.py::test_a_worker_cut_off_without_a_close_is_lost_in_time_and_comes_back_by_"
        "itself (its first step)",
    )


# -- the report ----------------------------------------------------------------------------------


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _cpu() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def render(
    rows: list[Outcome], skipped: dict[str, str], started_at: dt.datetime, command: str
) -> str:
    """``docs/reliability.md``: the settings, the table, the longest detection."""
    took = (dt.datetime.now(dt.UTC) - started_at).total_seconds()
    load = os.getloadavg()
    detections = [(r.detection_s, r.fault, r.detected) for r in rows if not r.startup]
    detections += [(t, r.fault, what) for r in rows for what, t in r.also.items()]
    measured = [(t, fault, what) for t, fault, what in detections if t is not None]
    longest = max(measured) if measured else None
    lines = [
        "# Reliability: faults injected and survived",
        "",
        "Generated by `python -m benchmarks.faults` (see its docstring for what each time "
        "measures); do not edit by hand.",
        "",
        f"- Date: {started_at:%Y-%m-%d %H:%M} UTC; command: `{command}` ({took:.0f} s in all)",
        f"- Machine: {_cpu()}, {os.cpu_count()} cores, {platform.platform()}, Python "
        f"{platform.python_version()}; load average {load[0]:.1f} at the end (the machine "
        "was shared)",
        f"- Heartbeats every {HEARTBEAT_INTERVAL:g} s, timeout {HEARTBEAT_TIMEOUT:g} s "
        f"(`--heartbeat-interval {HEARTBEAT_INTERVAL:g} --heartbeat-timeout "
        f"{HEARTBEAT_TIMEOUT:g}`); the agents ping the coordinator on the same schedule; "
        "`--call-timeout` default (3600 s) except where stated; one `somatize-worker "
        "--threads 1` per worker, `LocalCluster` on this machine (netns rows: the worker in a "
        "network namespace behind a veth pair, with tokens)",
        "",
        "| Fault | How injected | What the system did | Detection (s) | Recovery (s) | Test |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        test = f"`{r.test}`" if r.test else "—"
        lines.append(
            f"| {r.fault} | {r.injected} | {r.behaviour} | {_seconds(r.detection_s)} "
            f"({r.detected}) | {_seconds(r.recovery_s)} ({r.recovered}) | {test} |"
        )
    for name, reason in skipped.items():
        lines.append(f"| {name} | — | {reason} | — | — | — |")
    lines.append("")
    if longest is not None:
        seconds, fault, what = longest
        lines.append(
            f"Longest detection: **{seconds:.2f} s** ({fault}: {what}), with a heartbeat timeout "
            f"of {HEARTBEAT_TIMEOUT:g} s (and a call timeout of {CALL_TIMEOUT:g} s in the "
            "hung-daemon row)."
        )
        for r in rows:
            if r.startup and r.detection_s is not None:
                lines.append(
                    f"Not counted there: {r.fault}, {r.detection_s:.2f} s ({r.detected}), the "
                    "new process's startup rather than a wait."
                )
        lines.append("")
    lines += [
        "A silent worker is declared lost between *timeout − interval* and *timeout + "
        "interval* after it fell silent: silence counts from its last heartbeat (up to one "
        "interval before the fault) and the coordinator looks every interval. A closed "
        "connection (a killed process) is seen at once. Recovery after a restart is mostly "
        "the new process importing torch; after a cut, it is the agent's closing timeout, "
        "TCP's retransmission backoff and the reconnection backoff (0.1 s doubling to 5 s, "
        "full jitter).",
        "",
    ]
    return "\n".join(lines)


def run(names: Sequence[str], scratch: Path) -> tuple[list[Outcome], dict[str, str], int]:
    """Run the scenarios ``names``, grouped by cluster kind; rows, skipped ones, failures."""
    rows: list[Outcome] = []
    skipped: dict[str, str] = {}
    failures = 0
    kinds = list(dict.fromkeys(SCENARIOS[name][0] for name in names))
    for kind in kinds:
        site: Site | None = None
        starts = 0
        with contextlib.ExitStack() as stack:
            for name in (n for n in names if SCENARIOS[n][0] == kind):
                t0 = time.monotonic()
                print(f"{name} ...", end=" ", flush=True)
                try:
                    if site is None:
                        starts += 1
                        site = KINDS[kind](scratch / f"{kind}-{starts}", stack)
                    outcome = SCENARIOS[name][1](site)
                except Skipped as exc:
                    skipped[name] = str(exc)
                    print(exc)
                    continue
                except Exception as exc:
                    failures += 1
                    print(f"FAILED: {type(exc).__name__}: {exc}")
                    stack.close()  # the next scenario of this kind gets a fresh cluster
                    site = None
                    continue
                rows.append(outcome)
                print(
                    f"detection {_seconds(outcome.detection_s)} s, recovery "
                    f"{_seconds(outcome.recovery_s)} s ({time.monotonic() - t0:.0f} s)"
                )
    return rows, skipped, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__)
    parser.add_argument("names", nargs="*", metavar="SCENARIO", help=f"of {list(SCENARIOS)}")
    parser.add_argument("--out", type=Path, default=DOC, help=f"default {DOC}")
    parser.add_argument(
        "--keep", type=Path, metavar="DIR", help="keep the clusters' state and logs in DIR"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {list(SCENARIOS)}")
    began = dt.datetime.now(dt.UTC)
    with contextlib.ExitStack() as stack:
        scratch = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        rows, skipped, failures = run(args.names or list(SCENARIOS), scratch)
    print(f"total {(dt.datetime.now(dt.UTC) - began).total_seconds():.0f} s")
    if failures:
        print(f"{failures} scenario(s) failed: {args.out} not written", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    given = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python -m benchmarks.faults", *given])
    args.out.write_text(render(rows, skipped, began, command))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
