"""Issue 54: machines several people share — over a real coordinator and real workers.

* two clients with 8 short jobs each, submitted together on 2 workers, alternate: each holds
  40–60 % of the worker-time while both have jobs waiting, and the queue says why each waits;
* a job of higher priority gets a worker within the preemption bound while another client's
  long DataParallel job runs; the long job checkpoints, is queued again, resumes afterwards,
  and its final weights are the plain torch loop's (≤ 1e-6);
* 4 one-slot jobs run at once on a worker of 4 slots, each about as fast as alone;
* a 3-worker job starts within a bound while 1-worker jobs keep arriving;
* a job past its ``time_limit`` fails ``time_limit``; a priority over the client's ceiling is
  refused at submit.
"""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import somatize as sz
from tests.coordinator.strategies.data_parallel.test_data_parallel import (
    dataset,
    graph_for,
    reference_training,
)
from tests.integration.cluster import Cluster, cluster, wait_for
from tests.integration.faults.test_resume import _checkpointed_at, paced
from tests.utils import UNIT, Sleepy

pytestmark = pytest.mark.integration

X = np.zeros((4, 2), np.float32)
SLACK = 0.01
"""How far past its bound a share measured from naps may read: a nap's own jitter (a sleep
wakes microseconds late), not a job more or less."""


class Nap(sz.Filter):
    """A fit that waits ``seconds`` without using a core (as a job waiting on its GPU or its
    disk does), then returns when it ran."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def fit(self, x, y=None):
        began = time.time()
        time.sleep(self.seconds)
        return {"began": np.float64(began), "ended": np.float64(time.time())}

    def forward(self, x, state):
        return x


def _clients(tmp_path: Path, lines: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """A clients file of ``name → settings`` lines, and each client's token."""
    tokens = {name: secrets.token_urlsafe(16) for name in lines}
    path = tmp_path / "clients"
    path.write_text("".join(f"{n} {tokens[n]} {s}\n" for n, s in lines.items()))
    path.chmod(0o600)
    return path, tokens


def _cluster(tmp_path: Path, clients: Path, *coordinator_args: str) -> Cluster:
    c = Cluster(  # its own client token is the ``client`` admin's
        tmp_path / "state",
        worker_token=secrets.token_urlsafe(16),
        client_token=secrets.token_urlsafe(16),
    )
    c.start_coordinator(["--client-tokens-file", str(clients), *coordinator_args])
    return c


def test_two_clients_queues_alternate_on_two_workers(tmp_path):
    clients, tokens = _clients(tmp_path, {"alice": "", "bob": ""})
    c = _cluster(tmp_path, clients)
    try:
        graph = sz.Graph([Nap(0.4 * UNIT).named("nap")])
        with (
            sz.connect(c.url, token=tokens["alice"]) as alice,
            sz.connect(c.url, token=tokens["bob"]) as bob,
            c.client() as root,
        ):
            # The workers are busy with the admin's naps while both queues fill, and free once
            # they are full: whoever submitted first, they alternate. Each nap is its worker's
            # first job, whose start (the fork server's imports, seconds against a nap's
            # half-second) is charged to the admin, not to whichever of the two came first.
            warming = []
            for worker_id in ("w1", "w2"):
                c.start_worker(worker_id)
                warming.append(root.submit(sz.Graph([Nap(3 * UNIT).named("nap")]), X))
                wait_for(lambda: warming[-1].status()["state"] == "running", 60 * UNIT, "a nap")
            jobs = {"alice": [], "bob": []}
            for name, client in (("alice", alice), ("bob", bob)):  # all of alice's first
                for k in range(8):
                    jobs[name].append(client.submit(graph, X, name=f"{name}-{k}"))
            queue = root.queue()
            waiting = [r for r in queue["jobs"] if r["state"] == "queued"]
            assert len(waiting) == 16 and all(r["wait"]["reason"] for r in waiting)
            mine = bob.queue()["jobs"]  # bob sees his own, and no clients' table
            assert {r["summary"]["owner"] for r in mine} <= {"bob"} and "clients" not in (
                bob.queue()
            )
            for job in warming:
                job.result(timeout=60 * UNIT)
            ran = {
                name: [job.result(timeout=120 * UNIT).states["nap"] for job in js]
                for name, js in jobs.items()
            }
            shares = root.queue()["clients"]
    finally:
        c.close()
    spans = {n: [(float(s["began"]), float(s["ended"])) for s in r] for n, r in ran.items()}
    # while both had jobs waiting: until the first of them ran its last job
    window = (
        min(b for v in spans.values() for b, _ in v),
        min(max(e for _, e in v) for v in spans.values()),
    )
    held = {
        n: sum(max(0.0, min(e, window[1]) - max(b, window[0])) for b, e in v)
        for n, v in spans.items()
    }
    alice_part = held["alice"] / sum(held.values())
    # (first come, first served: 1.0; the spans are the naps alone, without each job's start
    # and finish, which the scheduler also counts: a ratio of 1:2 at worst, 0.38 seen under load,
    # and 1:2 itself seen on a quiet machine, to the naps' jitter: 0.3333268)
    assert 1 / 3 - SLACK <= alice_part <= 2 / 3 + SLACK, (alice_part, spans)
    # in the order they started, until either had started all eight, neither got four ahead
    # (first come, first served: eight; fair by worker-time, which counts more than the naps)
    starts = [name for _, name in sorted((b, n) for n, v in spans.items() for b, _ in v)]
    counts = {"alice": 0, "bob": 0}
    for name in starts:
        counts[name] += 1
        assert abs(counts["alice"] - counts["bob"]) <= 3, (starts, spans)
        if max(counts.values()) == len(spans[name]):
            break
    # bob's first job did not wait for alice's eight: it ran among her first
    assert min(b for b, _ in spans["bob"]) < sorted(b for b, _ in spans["alice"])[2]
    assert shares["alice"]["share"] == 1.0 and shares["alice"]["recent"] > 0


def test_a_priority_job_preempts_a_long_one_which_resumes_to_the_same_weights(tmp_path):
    clients, tokens = _clients(tmp_path, {"alice": "", "bob": "max_priority=1"})
    grace = 30 * UNIT
    c = _cluster(tmp_path, clients, "--preempt-grace", str(grace))
    x, y = dataset()
    epochs = 6
    graph = graph_for("sgd", epochs=epochs, shuffle=True, module=paced())
    try:
        c.start_worker("w1")
        c.start_worker("w2")
        with (
            sz.connect(c.url, token=tokens["alice"]) as alice,
            sz.connect(c.url, token=tokens["bob"]) as bob,
        ):
            long = alice.submit(graph, x, y, strategy=sz.DataParallel(2, checkpoint_every=4))
            _checkpointed_at(long, 4)
            with pytest.raises(sz.ClientError, match="ceiling of 0"):
                alice.submit(sz.Graph([Nap(0.1).named("nap")]), X, priority=1)
            asked = time.monotonic()
            urgent = bob.submit(sz.Graph([Nap(0.5).named("nap")]), X, priority=1)
            placed = next(e for e in urgent.events(timeout=120 * UNIT) if e.event == "placed")
            waited = time.monotonic() - asked
            urgent.result(timeout=60 * UNIT)
            fitted = long.result(timeout=180 * UNIT)
            events = [e.event for e in long.events()]
    finally:
        c.close()
    assert placed is not None and waited <= grace, waited
    assert events.index("preempting") < events.index("preempted") < events.index("resumed")
    assert events[-1] == "succeeded"
    expected = reference_training(x, y, "sgd", epochs=epochs, shuffle=True)
    for key, value in expected.items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-6)


def test_four_one_slot_jobs_run_at_once_on_a_worker_of_four_slots(tmp_path):
    nap = 2.0 * UNIT
    with cluster(tmp_path, {}) as c, c.client() as client:
        c.start_worker("big", args=["--slots", "4"])
        assert c.worker("big")["slots"] == 4
        graph = sz.Graph([Nap(nap).named("nap")])
        alone = client.submit(graph, X).result(timeout=60 * UNIT).states["nap"]
        jobs = [client.submit(graph, X, name=f"packed-{k}") for k in range(4)]
        states = [job.result(timeout=60 * UNIT).states["nap"] for job in jobs]
        records = [job.status() for job in jobs]
        with pytest.raises(sz.ClientError, match="no registered worker gives more than 4"):
            client.submit(graph, X, slots=5)
    alone_took = float(alone["ended"]) - float(alone["began"])
    spans = [(float(s["began"]), float(s["ended"])) for s in states]
    assert max(b for b, _ in spans) < min(e for _, e in spans)  # all four ran at once
    assert all(e - b <= 1.2 * alone_took for b, e in spans)
    assert all(r["workers"] == ["big"] for r in records)


def test_a_three_worker_job_starts_while_one_worker_jobs_keep_coming(tmp_path):
    clients, tokens = _clients(tmp_path, {"bob": "", "carol": ""})
    c = _cluster(tmp_path, clients)
    stop = threading.Event()
    try:
        for w in ("w1", "w2", "w3"):
            c.start_worker(w)
        with (
            sz.connect(c.url, token=tokens["bob"]) as bob,
            sz.connect(c.url, token=tokens["carol"]) as carol,
        ):
            small = sz.Graph([Nap(1.0 * UNIT).named("nap")])
            stream: list[sz.Job] = [bob.submit(small, X) for _ in range(4)]

            def keep_coming() -> None:  # one more whenever fewer than 4 wait
                while not stop.is_set():
                    if len(bob.queue()["jobs"]) < 7:
                        stream.append(bob.submit(small, X))
                    stop.wait(0.2)

            feeder = threading.Thread(target=keep_coming, daemon=True)
            feeder.start()
            time.sleep(1.5 * UNIT)  # bob's jobs hold every worker and more wait
            x, y = dataset()
            asked = time.monotonic()
            gang = carol.submit(graph_for("sgd", epochs=1), x, y, strategy=sz.DataParallel(3))
            wait_for(lambda: gang.status()["state"] != "queued", 30 * UNIT, "the gang to start")
            waited = time.monotonic() - asked
            stop.set()
            feeder.join(timeout=10)
            gang.result(timeout=60 * UNIT)
            ran = [j for j in stream if j.status()["state"] == "succeeded"]
    finally:
        stop.set()
        c.close()
    # the gang waited for the running ones to end (each 1 s), not for bob's stream to dry up
    # (which never happens while the feeder runs: wait_for above would time out at 30 s);
    # 6.2 s seen on a loaded 2-core CI run, placement and start of three daemons included
    assert waited <= 12 * UNIT, waited
    assert len(ran) >= 4


def test_a_job_past_its_time_limit_fails_time_limit(tmp_path):
    with cluster(tmp_path, {"w1": ()}) as c, c.client() as client:
        job = client.submit(sz.Graph([Sleepy().named("s")]), X, time_limit=2.0 * UNIT)
        with pytest.raises(sz.JobFailed) as failure:
            job.result(timeout=60 * UNIT)
        after = client.submit(sz.Graph([Nap(0.1).named("nap")]), X)
        after.result(timeout=60 * UNIT)  # the worker was freed
    assert failure.value.code == "time_limit" and "time_limit of" in failure.value.message
