"""The gradient all-reduce of a 5.8M-parameter MLP alone: ours, its parts, next to gloo.

``python -m benchmarks.allreduce`` averages the gradients of the MLP 784-2048-2048-10 (6 float32
tensors, 5.8M parameters, 23.3 MB) of 2 contributors, measured piece by piece and end to end:

- *ours, end to end*: a real ``somatize-coordinator`` and 2 real ``somatize-worker`` processes
  (:class:`somatize.cli.cluster.LocalCluster`, ``--threads 1``, job threads 1) run a
  ``sz.DataParallel(2)`` job of that MLP with a global batch of 2 rows (1 per replica), so the
  compute is almost nothing but every step still moves the full gradients: with
  ``collective="coordinator"`` each replica's 23 MB go daemon → agent → coordinator, are
  averaged there, and the 23 MB mean goes back to both replicas, which step their SGD; with
  ``collective="torch"`` DDP all-reduces them between the daemons over gloo. Per step: between
  two of the coordinator's ``training`` progress events after 2 warm-up steps, the time over
  the steps between them (one event a step through the coordinator, one a chunk of steps on
  the torch collective). Nothing is
  subtracted; the replica's own compute for 1 row (forward, backward, SGD step, 1 thread,
  measured alone in a subprocess) is printed for context;
- *its averaging*: :func:`coordinator.strategies.aggregate.weighted_mean` of two such gradient
  trees in this process (the maths alone), next to torch's ``(a + b) / 2`` of the same tensors;
- *bare transport*: a bare ``websockets`` echo server on uvloop (no codec, no chunking, one
  23 MB message) and a client in this process on uvloop: 23 MB up and back, by 1 client, and by
  2 clients at once (the shape of a step: 2 replicas through one process);
- *anchor*: ``torch.distributed.all_reduce`` over gloo between 2 processes (1 thread each) of the
  same 6 tensors, one call per tensor, divided by 2 (a mean), each repetition after a barrier.

Figures are medians in ms over :data:`REPS` repetitions after warm-up, in :data:`ROUNDS`
interleaved rounds (our job, the averaging, the compute, the transport, gloo), pooled, so that a
slow spell of the machine hits every figure alike; how many cores other processes kept busy
meanwhile is printed too. Everything runs on loopback on this machine's cores. Every process
started here is killed at the end (also on Ctrl-C); the cluster's logs are printed if the run
fails. :mod:`benchmarks.data_parallel` reuses the helpers (the model, the torch scripts, the job
runner, the transport anchor).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import uvloop
from websockets.asyncio.client import connect

import somatize as sz
from benchmarks.report import Row, Target
from benchmarks.roundtrip import Processes, cpu_seconds, free_port, port_open
from coordinator.strategies.aggregate import weighted_mean
from somatize.cli.cluster import LocalCluster
from worker.confinement.procfs import descendants

SIZES = (784, 2048, 2048, 10)
"""The MLP's layer widths: Linear 784→2048, ReLU, Linear 2048→2048, ReLU, Linear 2048→10."""
SEED = 0
REPS = 20
WARMUP = 2
ROUNDS = 2
STEPS = 20
"""Measured steps of the all-reduce job (after :data:`WARMUP`)."""
WORKERS = ("w0", "w1")
RUN_TIMEOUT = 180.0
EVENT_TIMEOUT = 120.0

TORCH_SCRIPT = """
import json, os, sys, time
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
import torch
import torch.distributed as dist
import torch.nn.functional as F

MODE, ARGS, OUT = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
torch.set_num_threads(ARGS["threads"])
torch.manual_seed(ARGS["seed"])
sizes = ARGS["sizes"]
layers = []
for a, b in zip(sizes[:-1], sizes[1:]):
    layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers[:-1])
rank, world = ARGS.get("rank", 0), ARGS.get("world", 1)
if world > 1:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{ARGS['port']}", rank=rank, world_size=world
    )
times = []
if MODE == "allreduce":
    g = torch.Generator().manual_seed(ARGS["seed"] + 1 + rank)
    tensors = [torch.randn(p.shape, generator=g) for p in model.parameters()]
    for _ in range(ARGS["warmup"] + ARGS["reps"]):
        dist.barrier()
        start = time.perf_counter()
        for t in tensors:
            dist.all_reduce(t)
            t.div_(world)
        times.append(time.perf_counter() - start)
else:  # "train": plain, or DistributedDataParallel (FSDP2 with "fsdp") when world > 1;
    # the end time of every step
    if world > 1 and ARGS.get("fsdp"):
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        fully_shard(model)
    elif world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=ARGS["lr"])
    g = torch.Generator().manual_seed(ARGS["seed"] + 1 + rank)
    batch, steps = ARGS["batch"], ARGS["steps"]
    x = torch.randn(batch * steps, sizes[0], generator=g)
    y = torch.randint(0, sizes[-1], (batch * steps,), generator=g)
    if world > 1:
        dist.barrier()
    times.append(time.perf_counter())
    for step in range(steps):
        rows = slice(step * batch, (step + 1) * batch)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
        times.append(time.perf_counter())
if world > 1:
    dist.barrier()
    dist.destroy_process_group()
if rank == 0:
    with open(OUT, "w") as f:
        json.dump({"times": times}, f)
"""
"""Run as ``python -c TORCH_SCRIPT MODE JSON_ARGS OUT``: ``train`` (one process, or DDP over gloo
when ``world`` > 1; FSDP2, each layer a unit, with ``"fsdp": true``) writes the end time of
every step (after a start time); ``allreduce`` writes the duration of every repetition. Only
rank 0 writes ``OUT``."""

WS_ECHO = """
import asyncio, sys
import uvloop
from websockets.asyncio.server import serve

async def echo(ws):
    async for message in ws:
        await ws.send(message)

async def main():
    async with serve(echo, "127.0.0.1", int(sys.argv[1]), compression=None, max_size=None):
        await asyncio.Future()

uvloop.run(main())
"""
"""A bare ``websockets`` echo server on uvloop without a message size limit:
``python -c WS_ECHO PORT``."""


# -- shared helpers ----------------------------------------------------------------------------


def mlp(sizes: tuple[int, ...] = SIZES, seed: int = SEED) -> torch.nn.Sequential:
    """The benchmark's MLP (as :data:`TORCH_SCRIPT` builds it), seeded."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of one full set of the model's gradients (float32, as its parameters)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def ms(times: list[float]) -> dict[str, float]:
    """``n``, ``p50_ms``, ``min_ms``, ``max_ms`` of durations in seconds."""
    return {
        "n": len(times),
        "p50_ms": statistics.median(times) * 1e3,
        "min_ms": min(times) * 1e3,
        "max_ms": max(times) * 1e3,
    }


def intervals(stamps: list[float], warmup: int = WARMUP) -> list[float]:
    """The durations of steps ``warmup + 1``..n from the end times of steps 1..n (each step's
    end minus the previous step's end)."""
    return [b - a for a, b in zip(stamps[warmup - 1 :], stamps[warmup:], strict=False)]


def per_step(marks: list[tuple[float, int]], warmup: int = WARMUP) -> list[float]:
    """Step durations from ``(time, steps done)`` of progress events that may each cover
    several steps (the torch collective's chunks): between two events after the warm-up, the
    time over the steps between them, once per step."""
    kept = [(t, s) for t, s in marks if s >= warmup]
    out: list[float] = []
    for (t0, s0), (t1, s1) in itertools.pairwise(kept):
        if s1 > s0:
            out += [(t1 - t0) / (s1 - s0)] * (s1 - s0)
    return out


def wait_all(procs: Processes, names: list[str], deadline: float, limit: float) -> None:
    """Wait for the processes ``names`` to exit by ``deadline`` (``time.monotonic()``, ``limit``
    seconds after they started).

    Raises:
        TimeoutError: one is still running at the deadline.
        RuntimeError: one exited with a non-zero status (its log's tail in the message).
    """
    for name in names:
        proc = procs.procs[name]
        try:
            code = proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{name} did not finish in {limit:.0f} s") from None
        procs.stopped.add(name)
        if code != 0:
            raise RuntimeError(f"{name} exited with {code}:\n{procs.tail(name)}")


def run_torch(
    procs: Processes,
    mode: str,
    args: dict[str, Any],
    world: int = 1,
    env: Mapping[str, str] | None = None,
) -> list[float]:
    """Run :data:`TORCH_SCRIPT` in ``world`` processes (ranks), ``env`` set for them, and
    return rank 0's ``times``."""
    out = procs.directory / f"{mode}-{free_port()}.json"
    port = free_port()
    names = []
    for rank in range(world):
        name = f"{mode}-rank{rank}-{port}"
        spec = {"sizes": list(SIZES), "seed": SEED, **args, "rank": rank, "world": world}
        spec["port"] = port
        argv = [sys.executable, "-c", TORCH_SCRIPT, mode, json.dumps(spec), str(out)]
        procs.spawn(name, argv, env)
        names.append(name)
    wait_all(procs, names, time.monotonic() + RUN_TIMEOUT, RUN_TIMEOUT)
    times: list[float] = json.loads(out.read_text())["times"]
    return times


def cpu_snapshot() -> tuple[float, float, float]:
    """``(monotonic time, CPU seconds the whole machine spent busy, CPU seconds of this process
    and its reaped children)``, for :func:`foreign_cores`."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields[:3]) + sum(fields[5:8])  # user nice system, irq softirq steal
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), own


def foreign_cores(start: tuple[float, float, float], end: tuple[float, float, float]) -> float:
    """How many cores other processes kept busy on average between two :func:`cpu_snapshot`
    results (every process this one started must have been reaped by ``end``): the noise."""
    wall = end[0] - start[0]
    return max(0.0, ((end[1] - start[1]) - (end[2] - start[2])) / wall) if wall > 0 else 0.0


def _tree_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


@contextlib.contextmanager
def cluster(workers: tuple[str, ...] = WORKERS) -> Iterator[LocalCluster]:
    """A :class:`LocalCluster` (job threads 1) with ``workers`` (``--threads 1``), idle.

    Heartbeats every second, lost after 30 s: a step that keeps both cores busy must not make a
    replica look lost. On a failure (not Ctrl-C) the tail of every log is printed first.
    """
    with LocalCluster(
        heartbeat_interval=1.0, heartbeat_timeout=30.0, job_threads=1, spare_daemons=False
    ) as c:
        try:
            c.start_coordinator()
            for worker in workers:
                c.start_worker(worker, threads=1)
            yield c
        except Exception:
            c.print_log_tails()
            raise


def run_job(
    c: LocalCluster,
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    *,
    on_training: Callable[[dict[str, list[int]]], None] | None = None,
    collective: str = "coordinator",
) -> dict[str, Any]:
    """Train ``model`` on ``x, y`` with ``sz.DataParallel(len(c.workers), collective=...)`` on
    cluster ``c``.

    Returns ``{"stamps", "marks", "steps", "wall_s", "to_first_step_s", "after_last_step_s",
    "cpu_per_step_ms": {"coordinator", "agents", "daemons"}}``: the coordinator's times of the
    ``training`` events, with the steps done at each (``marks``: one event a step through the
    coordinator, one a chunk of steps on the torch collective), the job's wall time from submit
    to its terminal event, the time from submit to the first step's event and from the last
    step's event to the end, and each kind of process's CPU time per step between the ends of
    the warm-up and of the last step. ``on_training`` is called with the pids by kind once the
    warm-up is over.
    """
    graph = sz.Graph(
        [
            sz.TorchFilter(
                model,
                loss="cross_entropy",
                optimizer="sgd",
                lr=0.01,
                batch_size=batch_size,
                epochs=1,
                shuffle=False,
                seed=SEED,
            ).named("mlp")
        ]
    )
    assert c.coordinator is not None
    agents = [proc.pid for proc in c.workers.values()]
    marks: list[tuple[float, int]] = []
    cpu: dict[str, float] = {}
    pids: dict[str, list[int]] = {}
    warm: int | None = None  # the steps done at the first event after the warm-up
    # No checkpoints: gloo's all_reduce, the anchor, takes none (benchmarks.checkpoints).
    strategy = sz.DataParallel(len(c.workers), collective=collective, checkpoint_every=0)
    with sz.connect(c.url, timeout=60) as client:
        submitted = time.time()
        job = client.submit(graph, x, y, strategy=strategy)
        end = None
        for event in job.events(timeout=EVENT_TIMEOUT):
            if event.event == "placed" and event.data.get("collective") != collective:
                raise RuntimeError(f"asked for {collective!r}, placed: {event.data}")
            if event.event == "progress" and event.data.get("phase") == "training":
                step = int(event.data.get("step", len(marks) + 1))
                marks.append((event.time, step))
                if (warm is None and step >= WARMUP) or step == int(event.data["steps"]):
                    if not pids:
                        daemons = [d for agent in agents for d in descendants(agent)]
                        pids = {"coordinator": [c.coordinator.pid], "agents": agents}
                        pids["daemons"] = daemons
                    for kind, members in pids.items():
                        cpu[kind] = _tree_cpu(members) - cpu.get(kind, 0.0)
                    if warm is None:
                        warm = step
                        if on_training is not None:
                            on_training(pids)
            end = event
        finished = time.time()
    if end is None or end.event != "succeeded":
        raise RuntimeError(f"the job did not succeed: {end}")
    measured = max(1, marks[-1][1] - (warm or 0))
    return {
        "stamps": [t for t, _ in marks],
        "marks": marks,
        "steps": marks[-1][1],
        "wall_s": finished - submitted,
        "to_first_step_s": marks[0][0] - submitted,
        "after_last_step_s": end.time - marks[-1][0],
        "cpu_per_step_ms": {k: v / measured * 1e3 for k, v in cpu.items()},
    }


def merge_jobs(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """The :func:`run_job` results of several jobs as one: ``step`` (an :func:`ms` summary of
    every job's step durations, without each job's warm-up), ``jobs``, ``steps`` (per job), the
    mean ``wall_s``, ``to_first_step_s``, ``after_last_step_s`` and ``cpu_per_step_ms``."""
    merged: dict[str, Any] = {
        "step": ms([d for job in jobs for d in per_step(job["marks"])]),
        "jobs": len(jobs),
        "steps": jobs[0]["steps"],
    }
    for key in ("wall_s", "to_first_step_s", "after_last_step_s"):
        merged[key] = statistics.fmean(job[key] for job in jobs)
    merged["cpu_per_step_ms"] = {
        kind: statistics.fmean(job["cpu_per_step_ms"][kind] for job in jobs)
        for kind in jobs[0]["cpu_per_step_ms"]
    }
    return merged


def time_weighted_mean(model: torch.nn.Module, reps: int = REPS) -> dict[str, list[float]]:
    """Durations of ``weighted_mean`` of two gradient trees of ``model`` (weights 1 and 1), and
    of torch's ``(a + b) / 2`` of the same tensors, in this process (``reps`` after warm-up)."""
    g = torch.Generator().manual_seed(SEED)
    trees = [
        {"mlp": {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}}
        for _ in range(2)
    ]
    contributions = [(f"w{i}", 1, tree) for i, tree in enumerate(trees)]

    def torch_mean() -> dict[str, torch.Tensor]:
        a, b = (t["mlp"] for t in trees)
        return {n: torch.add(a[n], b[n]).div_(2) for n in a}

    results: dict[str, list[float]] = {}
    calls = (("weighted_mean", lambda: weighted_mean(contributions)), ("torch_mean", torch_mean))
    for key, call in calls:
        times = []
        for i in range(WARMUP + reps):
            start = time.perf_counter()
            call()
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
        results[key] = times
    mean = weighted_mean(contributions)["mlp"]
    expected = torch_mean()
    for name, value in expected.items():
        np.testing.assert_allclose(mean[name].numpy(), value.numpy(), rtol=1e-6, atol=1e-7)
    return results


async def _echo(url: str, payload: bytes, clients: int, reps: int) -> list[float]:
    async with contextlib.AsyncExitStack() as stack:
        conns = [
            await stack.enter_async_context(connect(url, compression=None, max_size=None))
            for _ in range(clients)
        ]

        async def one(ws: Any) -> None:
            await ws.send(payload)
            back = await ws.recv(decode=False)
            if len(back) != len(payload):
                raise RuntimeError("the echo came back different")

        times = []
        for i in range(WARMUP + reps):
            start = time.perf_counter()
            await asyncio.gather(*(one(ws) for ws in conns))
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
        return times


def time_websockets(procs: Processes, nbytes: int, reps: int = REPS) -> dict[str, list[float]]:
    """Durations of ``nbytes`` up and back through a bare ``websockets`` echo server, by 1
    client (``ws_1_client``) and by 2 clients at once (``ws_2_clients``)."""
    port = free_port()
    procs.spawn(f"ws-echo-{port}", [sys.executable, "-c", WS_ECHO, str(port)])
    procs.wait_for(lambda: port_open(port), 30, f"the echo server on port {port}")
    payload = np.random.default_rng(SEED).bytes(nbytes)
    url = f"ws://127.0.0.1:{port}"
    results = {
        "ws_1_client": uvloop.run(_echo(url, payload, 1, reps)),
        "ws_2_clients": uvloop.run(_echo(url, payload, 2, reps)),
    }
    procs.stop(f"ws-echo-{port}")
    return results


# -- the benchmark -----------------------------------------------------------------------------


def run(steps: int = STEPS, reps: int = REPS, rounds: int = ROUNDS) -> dict[str, Any]:
    """Measure the all-reduce of the MLP's gradients, ours end to end (a job of ``steps`` steps
    after warm-up) and its parts, next to bare ``websockets`` and gloo (``reps`` repetitions
    each), in ``rounds`` interleaved rounds: a slow spell of the machine hits every path alike.

    Returns:
        ``{"params", "tensors", "grad_bytes", "rounds", "foreign_cores", "ours", "compute_1row",
        "weighted_mean", "torch_mean", "ws_1_client", "ws_2_clients", "gloo", "ratios"}``: each
        timing an :func:`ms` summary (``n``, ``p50_ms``, ``min_ms``, ``max_ms``) pooled over the
        rounds; ``ours`` is :func:`merge_jobs` of the rounds' jobs; ``ratios`` of the p50s, ours
        end to end over each other figure.
    """
    model = mlp()
    nbytes = gradient_bytes(model)
    results: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters()),
        "tensors": len(list(model.parameters())),
        "grad_bytes": nbytes,
        "rounds": rounds,
    }
    g = torch.Generator().manual_seed(SEED)
    rows = 2 * (steps + WARMUP)
    x = torch.randn(rows, SIZES[0], generator=g)
    y = torch.randint(0, SIZES[-1], (rows,), generator=g)
    times: dict[str, list[float]] = defaultdict(list)
    jobs: dict[str, list[dict[str, Any]]] = {"torch": [], "coordinator": []}
    start = cpu_snapshot()
    with (
        cluster() as c,
        tempfile.TemporaryDirectory(prefix="somatize-allreduce-") as tmp,
        Processes(Path(tmp)) as procs,
    ):
        for _ in range(rounds):
            for collective, done in jobs.items():
                done.append(run_job(c, model, x, y, batch_size=2, collective=collective))
            for key, values in time_weighted_mean(model, reps).items():
                times[key] += values
            one_row = {"threads": 1, "batch": 1, "steps": reps + WARMUP, "lr": 0.01}
            times["compute_1row"] += intervals(run_torch(procs, "train", one_row)[1:])
            for key, values in time_websockets(procs, nbytes, reps).items():
                times[key] += values
            gloo = {"threads": 1, "reps": reps, "warmup": WARMUP}
            times["gloo"] += run_torch(procs, "allreduce", gloo, 2)[WARMUP:]
    results["foreign_cores"] = foreign_cores(start, cpu_snapshot())
    results |= {key: ms(values) for key, values in times.items()}
    results["ours"] = merge_jobs(jobs["coordinator"])
    results["ours_torch"] = merge_jobs(jobs["torch"])
    p50 = results["ours"]["step"]["p50_ms"]
    results["ratios"] = {
        key: p50 / results[key]["p50_ms"]
        for key in ("weighted_mean", "ws_1_client", "ws_2_clients", "gloo")
    }
    results["ratios"]["torch_gloo"] = (
        results["ours_torch"]["step"]["p50_ms"] / (results["gloo"]["p50_ms"])
    )
    return results


def rows(results: dict[str, Any]) -> list[Row]:
    """The suite's rows: our all-reduce step, on each collective, next to gloo's ``all_reduce``
    of the same tensors."""
    mb = results["grad_bytes"] / 1e6
    torch_step = results["ours_torch"]["step"]["p50_ms"]
    compute = results["compute_1row"]["p50_ms"]
    return [
        Row(
            bench="all-reduce",
            name=f"all-reduce of {mb:.1f} MB gradients alone, collective=torch: DataParallel(2) "
            "step, 1 row/replica, minus that row's compute measured alone",
            ours=torch_step - compute,
            unit="ms",
            anchor=results["gloo"]["p50_ms"],
            anchor_name="gloo all_reduce, 2 processes",
            target=Target("<=", 1.1, text="<= 1.1 x gloo"),
            note=f"step {torch_step:.1f} ms (DDP's buckets), compute {compute:.1f} ms",
        ),
        Row(
            bench="all-reduce",
            name=f"DataParallel(2) step of {mb:.1f} MB gradients, 1 row/replica, "
            "collective=coordinator",
            ours=results["ours"]["step"]["p50_ms"],
            unit="ms",
            anchor=results["gloo"]["p50_ms"],
            anchor_name="gloo all_reduce, 2 processes",
            target=Target("<=", 1.5, text="<= 1.5 x gloo"),
            note=f"bare ws 2 clients {results['ws_2_clients']['p50_ms']:.0f} ms",
        ),
    ]


def main() -> None:
    results = run()
    mb = results["grad_bytes"] / 1e6
    ours = results["ours"]
    print(
        f"all-reduce of the MLP {'-'.join(map(str, SIZES))}'s gradients: {results['params']:,} "
        f"float32 parameters in {results['tensors']} tensors, {mb:.1f} MB, 2 contributors; "
        f"medians of {results['rounds']} interleaved rounds (ours: {ours['step']['n']} steps "
        f"after {WARMUP} warm-up per job; others: {results['gloo']['n']} repetitions)"
    )
    print(f"  {'':60} {'p50 ms':>8} {'min ms':>8} {'max ms':>8}   ours/this")
    rows = (
        ("ours: DataParallel(2) step, 1 row/replica, coordinator", "ours", False),
        ("ours: DataParallel(2) step, 1 row/replica, collective=torch", "ours_torch", False),
        ("  its averaging: weighted_mean of 2 trees, in-process", "weighted_mean", True),
        ("  for context: torch (a + b) / 2 of the same tensors", "torch_mean", False),
        ("  for context: a replica's compute, 1 row fwd+bwd+SGD", "compute_1row", False),
        (f"bare websockets: {mb:.0f} MB up and back, 1 client", "ws_1_client", True),
        (f"bare websockets: {mb:.0f} MB up and back, 2 clients at once", "ws_2_clients", True),
        ("anchor: gloo all_reduce, 2 processes, 6 tensors, mean", "gloo", True),
    )
    for label, key, ratio in rows:
        r = results[key]["step"] if key.startswith("ours") else results[key]
        line = f"  {label:60} {r['p50_ms']:8.1f} {r['min_ms']:8.1f} {r['max_ms']:8.1f}"
        if ratio:
            line += f"   {results['ratios'][key]:6.1f} x"
        print(line)
    cpu = ours["cpu_per_step_ms"]
    print(
        f"  ours, CPU per step: coordinator {cpu['coordinator']:.0f} ms, 2 agents "
        f"{cpu['agents']:.0f} ms, 2 daemons {cpu['daemons']:.0f} ms; job wall "
        f"{ours['wall_s']:.1f} s for {ours['steps']} steps"
    )
    print(
        f"  other processes of the machine kept {results['foreign_cores']:.2f} cores busy meanwhile"
    )


if __name__ == "__main__":
    main()
