"""The faults of :mod:`benchmarks.faults` around checkpoints beyond DataParallel's: the
coordinator SIGKILLed mid-FedAvg and mid-ModelParallel (each resumed by the next one), a
pipeline stage's worker SIGKILLed with a spare held (failed over), the coordinator killed while
a checkpoint is being written (the one before is used) and the disk full under the checkpoints
(the job goes on, saying so). Each checks the job's result: against ``graph.fit`` where the
strategy equals it, against an undisturbed run of the same job (FedAvg)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import somatize as sz
from benchmarks.faults.harness import (
    ELASTIC_DELAY,
    ELASTIC_MATCH,
    WAIT,
    Outcome,
    Site,
    SlowLinear,
    all_idle,
    elastic_data,
    elastic_graph,
    event,
    largest_difference,
    until,
)
from benchmarks.faults.resume import came_back
from benchmarks.faults.scenarios import scenario
from somatize.cli.cluster import LocalCluster

ROUNDS = 8


def _pipeline_graph() -> sz.Graph:
    """A slowed 2-layer MLP in two TorchFilters (one a stage), Adam, 96 rows in batches of 16
    for 5 epochs: 30 global batches."""
    torch.manual_seed(0)
    head = sz.TorchFilter(
        torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh()), optimizer="adam", lr=0.01
    )
    tail = sz.TorchFilter(
        torch.nn.Sequential(SlowLinear(16, 16, ELASTIC_DELAY), torch.nn.Linear(16, 3)),
        loss="cross_entropy",
        optimizer="adam",
        lr=0.01,
        batch_size=16,
        epochs=5,
        seed=11,
    )
    return head.named("head") >> tail.named("tail")


def _pipeline(spares: int = 0) -> sz.ModelParallel:
    parts = [sz.Partition(["head"], worker="w1"), sz.Partition(["tail"], worker="w2")]
    return sz.ModelParallel(parts, micro_batches=2, checkpoint_every=5, spares=spares)


def _checkpointed(job: sz.Job, key: str, at: int) -> sz.JobEventInfo:
    for e in job.events(timeout=WAIT):
        if e.event == "checkpoint" and e.data[key] >= at:
            return e
        if e.terminal:
            break
    raise AssertionError(f"job {job.id} ended before its checkpoint at {key} {at}")


def _matches_graph_fit(states: dict[str, object], graph: sz.Graph) -> float:
    x, y = elastic_data()
    diff = largest_difference(states, graph.fit(x, y).states)
    if not diff <= ELASTIC_MATCH:
        raise AssertionError(f"the result differs from graph.fit by {diff:.3g}")
    return diff


def _federated() -> tuple[sz.Graph, sz.FedAvg]:
    torch.manual_seed(0)
    net = sz.TorchFilter(
        torch.nn.Sequential(SlowLinear(6, 16, ELASTIC_DELAY), torch.nn.Linear(16, 3)),
        loss="cross_entropy",
        batch_size=16,
        epochs=1,
        lr=0.05,
    )
    server = sz.FedAdam(lr=0.05, beta1=0.9, beta2=0.99, tau=1e-3)
    strategy = sz.FedAvg(ROUNDS, workers=2, min_workers=2, server=server, checkpoint_every=2)
    return sz.Graph([net.named("mlp")]), strategy


@scenario("loopback")
def coordinator_killed_mid_fedavg(site: Site) -> Outcome:
    c = site.cluster
    x, y = elastic_data()
    graph, strategy = _federated()
    with site.client() as client:
        job = client.submit(graph, x, y, strategy=strategy)
        saved = _checkpointed(job, "round", 4)
    c.stop_coordinator(signal.SIGKILL)
    restarted = time.time()
    c.start_coordinator()
    with site.client() as client:
        fitted = client.job(job.id, graph).result(timeout=WAIT)
        events = list(client.job(job.id).events(timeout=WAIT))
        until(lambda: all_idle(client), "every worker idle")
        again, same = _federated()
        undisturbed = client.submit(again, x, y, strategy=same).result(timeout=WAIT)
    resumed = event(events, "resumed")
    at = int(resumed.data["round"])
    after = events[events.index(resumed) + 1 :]
    first = next(e for e in after if e.event == "progress" and "round" in e.data)
    if at < 2 or first.data["round"] != at + 1:
        raise AssertionError(f"resumed at round {at}, went on at {first.data['round']}")
    diff = largest_difference(fitted.states, undisturbed.states)
    if not diff <= 1e-6:
        raise AssertionError(f"the resumed FedAvg differs from an undisturbed run by {diff:.3g}")
    return Outcome(
        "coordinator killed mid-FedAvg, resumed",
        f"SIGKILL to the coordinator after the checkpoint at round {saved.data['round']} of a "
        f"FedAvg({ROUNDS}, FedAdam, checkpoint_every=2) job on 2 workers; started again at once "
        "on the same `--state-dir`",
        f"the job was queued again and resumed from round {at} (the global model, FedAdam's "
        f"moments and the round); went on at round {at + 1}; the result equals an undisturbed "
        f"run of the same job (max abs diff {diff:.1e})",
        resumed.time - restarted,
        "restart → `resumed`",
        first.time - restarted,
        f"restart → round {at + 1} done",
        "test_resume.py::test_a_fedavg_job_with_a_server_optimizer_outlives_a_sigkilled_"
        "coordinator",
        startup=True,
    )


@scenario("loopback")
def coordinator_killed_mid_model_parallel(site: Site) -> Outcome:
    c = site.cluster
    x, y = elastic_data()
    with site.client() as client:
        job = client.submit(_pipeline_graph(), x, y, strategy=_pipeline())
        saved = _checkpointed(job, "step", 10)
    c.stop_coordinator(signal.SIGKILL)
    restarted = time.time()
    c.start_coordinator()
    with site.client() as client:
        run = came_back(client.job(job.id, _pipeline_graph()), _pipeline_graph())
        until(lambda: all_idle(client), "every worker idle")
    step = run.resumed.data["step"]
    return Outcome(
        "coordinator killed mid-ModelParallel, resumed",
        f"SIGKILL to the coordinator after the checkpoint at step {saved.data['step']} of a "
        "2-stage ModelParallel(checkpoint_every=5) job (30 global batches, Adam, torch "
        "transport); started again at once on the same `--state-dir`",
        f"the job was queued again and resumed from step {step} (every stage's model and "
        f"optimizer state), went on at step {step + 1}; result equals graph.fit (max abs diff "
        f"{run.diff:.1e})",
        run.resumed.time - restarted,
        "restart → `resumed`",
        run.first_step.time - restarted,
        f"restart → step {step + 1} done",
        "test_model_parallel_resume.py::test_a_pipeline_outlives_a_sigkilled_coordinator_and_"
        "equals_the_unsplit_model",
        startup=True,
    )


@scenario("loopback")
def pipeline_stage_failed_over(site: Site) -> Outcome:
    c = site.cluster
    x, y = elastic_data()
    with site.client() as client:
        job = client.submit(_pipeline_graph(), x, y, strategy=_pipeline(spares=1))
        saved = _checkpointed(job, "step", 10)
        killed = time.time()
        c.send_signal(c.workers["w2"], signal.SIGKILL)
        run = came_back(job, _pipeline_graph())
        events = list(job.events(timeout=WAIT))
        lost = event(events, "worker_lost", stage=1, worker="w2")
        event(events, "worker_replaced", stage=1, lost="w2", worker="w3")
        site.restart(client, "w2")  # left as found: three idle workers
    step = run.resumed.data["step"]
    return Outcome(
        "pipeline stage killed, failed over to a spare",
        f"SIGKILL to stage 1's worker w2 after the checkpoint at step {saved.data['step']} of a "
        "2-stage ModelParallel(spares=1, checkpoint_every=5) job on w1, w2 with w3 held",
        f"`worker_lost` (stage 1, w2), `worker_replaced` (w3); every stage loaded again and set "
        f"back to step {step}, went on at step {step + 1}; result equals graph.fit (max abs "
        f"diff {run.diff:.1e})",
        lost.time - killed,
        "kill → `worker_lost`",
        run.first_step.time - lost.time,
        f"`worker_lost` → step {step + 1} done",
        "test_model_parallel_resume.py::test_a_stage_whose_worker_is_sigkilled_moves_to_a_spare",
    )


def _wide_graph() -> sz.Graph:
    """elastic_graph's data through a wider MLP (4.3 MB of weights, 12.8 MB checkpointed with
    Adam's moments): its checkpoint takes long enough to write that a kill lands in one."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        SlowLinear(6, 1024, ELASTIC_DELAY), torch.nn.Tanh(), torch.nn.Linear(1024, 1024),
        torch.nn.Tanh(), torch.nn.Linear(1024, 3),
    )  # fmt: skip
    net = sz.TorchFilter(
        mlp, loss="cross_entropy", optimizer="adam", lr=0.01, batch_size=16, epochs=5, seed=11
    )
    return sz.Graph([net.named("mlp")])


@scenario("loopback")
def checkpoint_write_interrupted(site: Site) -> Outcome:
    c = site.cluster
    x, y = elastic_data()
    strategy = sz.DataParallel(2, collective="coordinator", checkpoint_every=2)
    with site.client() as client:
        job = client.submit(_wide_graph(), x, y, strategy=strategy)
    folder = c.state_dir / "checkpoints" / job.id
    caught = _kill_while_writing(c, folder)
    partial = caught.name
    complete = sorted(p.name for p in folder.glob("*.ckpt"))
    restarted = time.time()
    c.start_coordinator()
    with site.client() as client:
        fitted = client.job(job.id, _wide_graph()).result(timeout=WAIT)
        events = list(client.job(job.id).events(timeout=WAIT))
        until(lambda: all_idle(client), "every worker idle")
    resumed = event(events, "resumed")
    if f"{resumed.data['checkpoint']:08d}.ckpt" != complete[-1]:
        raise AssertionError(f"resumed from {resumed.data}, the newest whole one is {complete}")
    step = int(resumed.data["step"])
    first = event(events[events.index(resumed) :], "progress", step=step + 1)
    diff = _matches_graph_fit(fitted.states, _wide_graph())
    return Outcome(
        "coordinator killed while writing a checkpoint",
        f"SIGKILL to the coordinator while `{partial}` was being written (polled every ms) in a "
        "DataParallel(2, checkpoint_every=2) job of a 12.8 MB checkpoint",
        f"the torn write never became a checkpoint; the next coordinator resumed the job from "
        f"the one before ({complete[-1]}, step {resumed.data['step']}) and it succeeded; result "
        f"equals graph.fit (max abs diff {diff:.1e})",
        resumed.time - restarted,
        "restart → `resumed` from the one before",
        first.time - restarted,
        f"restart → step {step + 1} done",
        "test_checkpoints.py::test_a_write_that_never_finished_leaves_the_previous_checkpoint_"
        "standing",
        startup=True,
    )


def _kill_while_writing(c: LocalCluster, folder: Path, seconds: float = WAIT) -> Path:
    """SIGKILL the coordinator the moment a ``.partial`` checkpoint is seen in ``folder`` with
    a whole one beside it (the one a resumed run must go back to)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            names = [entry.name for entry in os.scandir(folder)]
            partial = [n for n in names if n.endswith(".partial")]
            if partial and any(n.endswith(".ckpt") for n in names):
                c.stop_coordinator(signal.SIGKILL)
                return folder / partial[0]
        time.sleep(0.001)
    raise AssertionError(f"no checkpoint write seen in {folder} within {seconds:.0f}s")


@contextlib.contextmanager
def _small_disk(folder: Path, size: str) -> Iterator[None]:
    """A tmpfs of ``size`` mounted over ``folder`` (root only), unmounted after."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@scenario("loopback")
def checkpoint_disk_full(site: Site) -> Outcome:
    if os.geteuid() != 0:
        raise AssertionError("needs root to mount a small tmpfs under the checkpoints")
    c = site.cluster
    x, y = elastic_data()
    strategy = sz.DataParallel(2, collective="coordinator", checkpoint_every=5)
    with _small_disk(c.state_dir / "checkpoints", "1m"), site.client() as client:
        began = time.time()
        job = client.submit(_wide_graph(), x, y, strategy=strategy)
        fitted = job.result(timeout=WAIT)
        events = list(job.events(timeout=WAIT))
        quick = client.submit(elastic_graph(), x, y, strategy=sz.Local()).result(timeout=WAIT)
    refused = [e for e in events if e.event == "checkpoint_failed"]
    if not refused or any("No space left" not in e.data["error"] for e in refused):
        raise AssertionError(f"expected checkpoint_failed events for ENOSPC: {refused}")
    if any(e.event == "checkpoint" for e in events):
        raise AssertionError("a checkpoint was written on a full disk")
    went_on = event(events[events.index(refused[0]) :], "progress")
    diff = _matches_graph_fit(fitted.states, _wide_graph())
    if not quick.states:
        raise AssertionError("the next job has no states")
    return Outcome(
        "the disk full while checkpointing",
        "the coordinator's `checkpoints/` on a 1 MiB tmpfs, a DataParallel(2, "
        "checkpoint_every=5) job whose checkpoints take 12.8 MB",
        f"each of its {len(refused)} checkpoints was a `checkpoint_failed` event ('No space "
        "left on device'), no torn file kept; training went on and the job succeeded (result "
        f"equals graph.fit, max abs diff {diff:.1e}); the next job ran as usual",
        refused[0].time - began,
        "submit → first `checkpoint_failed`",
        went_on.time - refused[0].time,
        f"`checkpoint_failed` → step {went_on.data['step']} done",
        "test_checkpoints.py::test_a_write_the_disk_refuses_keeps_the_checkpoints_before_it",
    )
