"""The faults of :mod:`benchmarks.faults` that a job comes through by going back to its last
checkpoint: the coordinator SIGKILLed mid-DataParallel (resumed by the next one), and a replica's
worker SIGKILLed under ``max_restarts=1`` (restarted on the workers left). Each checks the
result against an in-process ``graph.fit`` of the same graph and data."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any

import somatize as sz
from benchmarks.faults.harness import (
    ELASTIC_MATCH,
    WAIT,
    Outcome,
    Site,
    all_idle,
    elastic_data,
    elastic_graph,
    event,
    largest_difference,
    until,
)
from benchmarks.faults.scenarios import scenario

CHECKPOINT_EVERY = 5
"""Steps between the checkpoints of these jobs (of :func:`elastic_graph`'s 30)."""


def checkpointed_job(client: sz.Client, **options: Any) -> tuple[sz.Job, sz.JobEventInfo]:
    """A DataParallel(2) job of :func:`elastic_graph` (``options`` added) once it has saved its
    checkpoint at step 10; that event."""
    x, y = elastic_data()
    strategy = sz.DataParallel(2, checkpoint_every=CHECKPOINT_EVERY, **options)
    job = client.submit(elastic_graph(), x, y, strategy=strategy)
    for e in job.events(timeout=WAIT):
        if e.event == "checkpoint" and e.data["step"] >= 2 * CHECKPOINT_EVERY:
            return job, e
        if e.event in ("succeeded", "failed", "cancelled"):
            break
    raise AssertionError(f"job {job.id} ended before its checkpoint at step 10")


@dataclass
class Resumed:
    """How a job came back from its checkpoint: its events, checked."""

    resumed: sz.JobEventInfo
    first_step: sz.JobEventInfo
    """The first progress event after ``resumed``: the first step done anew."""
    diff: float


def came_back(job: sz.Job, graph: sz.Graph | None = None) -> Resumed:
    """Check the job succeeded, resumed from a checkpoint past the start, went on from the step
    after it and ended equal to ``graph.fit`` (of :func:`elastic_graph` unless ``graph``)."""
    fitted = job.result(timeout=WAIT)
    events = list(job.events(timeout=WAIT))
    resumed = event(events, "resumed")
    at = int(resumed.data["step"])
    if at < CHECKPOINT_EVERY:
        raise AssertionError(f"resumed from step {at}: not from a checkpoint")
    after = events[events.index(resumed) + 1 :]
    first_step = next(e for e in after if e.event == "progress" and "step" in e.data)
    if first_step.data["step"] != at + 1:
        raise AssertionError(f"resumed at step {at}, went on at {first_step.data['step']}")
    x, y = elastic_data()
    reference = (graph if graph is not None else elastic_graph()).fit(x, y)
    diff = largest_difference(fitted.states, reference.states)
    if not diff <= ELASTIC_MATCH:
        raise AssertionError(f"the resumed result differs from graph.fit by {diff:.3g}")
    return Resumed(resumed, first_step, diff)


@scenario("loopback")
def coordinator_killed_mid_data_parallel(site: Site) -> Outcome:
    c = site.cluster
    with site.client() as client:
        job, saved = checkpointed_job(client)
    c.stop_coordinator(signal.SIGKILL)
    restarted = time.time()
    c.start_coordinator()
    healthy = time.time()
    with site.client() as client:
        run = came_back(client.job(job.id, elastic_graph()))
        until(lambda: all_idle(client), "every worker idle")
    step = run.resumed.data["step"]
    return Outcome(
        "coordinator killed mid-DataParallel, resumed",
        f"SIGKILL to the coordinator after the checkpoint at step {saved.data['step']} of a "
        f"DataParallel(2, checkpoint_every={CHECKPOINT_EVERY}) job (30 steps, Adam); started "
        "again at once on the same `--state-dir`",
        f"the new coordinator (/healthz {healthy - restarted:.2f} s after its start) queued the "
        f"job again by itself; placed once its workers reconnected, it resumed from step "
        f"{step} (`resumed`) and went on at step {step + 1}; the client followed it again by "
        f"its id; result equals graph.fit (max abs diff {run.diff:.1e})",
        run.resumed.time - restarted,
        "restart → `resumed`",
        run.first_step.time - restarted,
        f"restart → step {step + 1} done",
        "test_resume.py::test_a_data_parallel_job_outlives_a_sigkilled_coordinator_and_equals_"
        "an_undisturbed_run",
        startup=True,
    )


@scenario("loopback")
def replica_killed_with_max_restarts(site: Site) -> Outcome:
    c = site.cluster
    with site.client() as client:
        job, saved = checkpointed_job(client, collective="coordinator", max_restarts=1)
        survivor, victim = job.status()["workers"]
        (spare,) = set(c.workers) - {survivor, victim}
        killed = time.time()
        c.send_signal(c.workers[victim], signal.SIGKILL)
        run = came_back(job)
        events = list(job.events(timeout=WAIT))
        restarting = event(events, "restarting", code="worker_lost", attempt=1)
        placed = [e for e in events if e.event == "placed"][-1]
        if sorted(placed.data["workers"]) != sorted([survivor, spare]):
            raise AssertionError(f"restarted on {placed.data['workers']}, not {survivor}, {spare}")
        site.restart(client, victim)  # left as found: three idle workers
    step = run.resumed.data["step"]
    return Outcome(
        "replica killed mid-training, max_restarts=1",
        f"SIGKILL to {victim}'s agent (and daemons) after the checkpoint at step "
        f"{saved.data['step']} of a DataParallel(2, max_restarts=1, checkpoint_every="
        f"{CHECKPOINT_EVERY}) job on {survivor}, {victim}, {spare} idle",
        f"`restarting` (attempt 1 of 1, `worker_lost` for {victim}); queued again at the head, "
        f"placed on {survivor} and {spare}, resumed from step {step} and went on at step "
        f"{step + 1}; job succeeded; result equals graph.fit (max abs diff {run.diff:.1e})",
        restarting.time - killed,
        "kill → `restarting`",
        run.first_step.time - restarting.time,
        f"`restarting` → step {step + 1} done",
        "test_restarts.py::test_a_replica_sigkilled_restarts_the_job_from_its_checkpoint_on_a_"
        "spare_worker",
    )
