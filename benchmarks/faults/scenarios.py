"""The faults :mod:`benchmarks.faults` injects. Each scenario is one function of a :class:`Site`
returning its row (an :class:`Outcome`), registered by :func:`scenario` with the kind of cluster
it runs on."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import numpy as np
import torch

import somatize as sz
from benchmarks.faults.harness import (
    BLIP,
    CALL_TIMEOUT,
    KINDS,
    WAIT,
    Outcome,
    Site,
    Sleepy,
    SlowLinear,
    agent_gave_up,
    all_idle,
    back,
    came_through,
    elastic_job,
    failed,
    progressed,
    quick_job,
    sleepy_job,
    state,
    until,
    workers_of,
)
from tests.utils import Center

SCENARIOS: dict[str, tuple[str, Callable[[Site], Outcome]]] = {}
"""The scenarios by name: the kind of cluster each runs on (a key of :data:`KINDS`) and its
function, in the order of the table."""


def scenario(kind: str) -> Callable[[Callable[[Site], Outcome]], Callable[[Site], Outcome]]:
    """Register a scenario run on a cluster of ``kind`` (a key of :data:`KINDS`)."""
    if kind not in KINDS:
        raise ValueError(f"no cluster kind {kind!r}; the kinds are {list(KINDS)}")

    def register(fn: Callable[[Site], Outcome]) -> Callable[[Site], Outcome]:
        SCENARIOS[fn.__name__] = (kind, fn)
        return fn

    return register


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
def elastic_replica_replaced(site: Site) -> Outcome:
    c = site.cluster
    with site.client() as client:
        job, (survivor, victim) = elastic_job(client)
        (spare,) = set(c.workers) - {survivor, victim}
        killed = time.time()
        c.send_signal(c.workers[victim], signal.SIGKILL)
        run = came_through(job, victim, spare, survivor)
        until(lambda: state(client, survivor) == "idle", f"{survivor} freed")
        site.restart(client, victim)  # left as found: three idle workers
    step = run.lost.data["step"]
    return Outcome(
        "replica killed mid-training, elastic, a spare idle",
        f"SIGKILL to {victim}'s agent (and daemons) after step 3 of an elastic DataParallel(2) "
        f"job ({run.steps} steps, Adam, the coordinator's collective) on 3 workers: "
        f"{survivor}, {victim} and idle {spare}",
        f"`worker_lost` for {victim} at step {step}; replaced {victim} by {spare}, restored it "
        f"from {survivor} (model and optimizer state; `worker_restored` "
        f"{run.restored.time - run.lost.time:.2f} s after the loss), resumed step {step}; job "
        f"succeeded, each step done once; result equals graph.fit (max abs diff "
        f"{run.diff:.1e})",
        run.lost.time - killed,
        "kill → `worker_lost`",
        run.resumed.time - run.lost.time,
        f"`worker_lost` → failed step {step} done",
        "test_data_parallel_live.py::test_elastic_replaces_a_killed_replica_with_a_spare_and_"
        "restarts_a_crashed_daemon",
    )


@scenario("loopback")
def elastic_replica_reconnected(site: Site) -> Outcome:
    c = site.cluster
    with site.client() as client:
        hold = sleepy_job(client, "w3", seconds=WAIT)  # no spare: only the lost worker can come
        job, (survivor, victim) = elastic_job(client)
        before = workers_of(client)[victim]["connections"]
        killed = time.time()
        c.send_signal(c.workers[victim], signal.SIGKILL)
        c.workers[victim].wait(timeout=WAIT)
        until(lambda: state(client, victim) == "lost", f"{victim} lost")
        restarted = time.time()
        c.start_worker(victim, threads=1, data=site.data.get(victim))
        connected = time.time()  # start_worker returns once the coordinator lists it
        run = came_through(job, victim, victim, survivor)
        hold.cancel()
        until(lambda: all_idle(client), "every worker idle")
        if workers_of(client)[victim]["connections"] != before + 1:
            raise AssertionError(f"{victim} did not come back as the same record")
    step = run.lost.data["step"]
    return Outcome(
        "replica killed mid-training, elastic, no spare",
        f"w3 held by a Local job; SIGKILL to {victim}'s agent (and daemons) after step 3 of "
        f"the same elastic DataParallel(2) job on {survivor}, {victim}; {victim} started again "
        f"under its id once listed lost ({restarted - killed:.2f} s after the kill)",
        f"`worker_lost` for {victim} at step {step}; the job waited for a worker; {victim} "
        f"reconnected {connected - restarted:.2f} s after the restart (a new process importing "
        f"torch), was given back to the job, waited for its new filter daemon to start and "
        f"was restored from "
        f"{survivor} (`worker_restored` {run.restored.time - restarted:.2f} s after the "
        f"restart), resumed step {step}; job succeeded, each step done once; result equals "
        f"graph.fit (max abs diff {run.diff:.1e})",
        run.lost.time - killed,
        "kill → `worker_lost`",
        run.resumed.time - restarted,
        f"restart → failed step {step} done",
        "test_data_parallel_live.py::test_elastic_takes_back_the_lost_worker_before_a_queued_job_"
        "then_fails_when_none_comes",
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
        again = client.job(running.id)
        requeued = next(e for e in again.events(timeout=WAIT) if "requeued" in e.data)
        after = client.job(done.id).states(timeout=WAIT)["c"]["mean"]
        np.testing.assert_array_equal(after, before)
        until(lambda: again.status()["state"] == "running", "the running job to run again")
        again.cancel()  # a Local job starts over: this one would sleep its minute again
        # A new process: a new registry, where each returning worker is on its first connection.
        back_at = until(lambda: all(back(client, w, 1) for w in c.workers), "every worker back")
        quick_job(client, "w1")
    return Outcome(
        "coordinator killed and restarted",
        "SIGKILL to the coordinator during a Local job, started again at once on the same state",
        "finished job's result intact (equal); the running job queued again at startup "
        "(`queued`, `requeued`) and run again once w1 was back (a Local job starts over; "
        "cancelled then); all 3 agents reconnected by themselves under their ids; the new "
        f"process answered /healthz {healthy - restarted:.2f} s after it was started "
        "(importing torch is most of it)",
        requeued.time - restarted,
        "restart → running job queued again",
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
