"""Data-parallel training of a 5.8M-parameter MLP on N = 2, 3, 4 workers, next to torch DDP.

``python -m benchmarks.data_parallel [--quick] [--steps S] [--rounds R]`` trains the MLP
784-2048-2048-10 (float32, 5.8M parameters, 23.3 MB of gradients;
:func:`benchmarks.allreduce.mlp`, seeded) with SGD (lr 0.01) and cross-entropy on random data of
the right shapes, 256 rows per replica, a global batch of 256 · N rows. The data is
:data:`EPOCH_STEPS` global batches, trained for as many epochs (``shuffle=False``) as make at
least ``steps + 2`` global steps, the first 2 being warm-up (``steps`` 40 by default: the torch
collective's chunks of steps have room to grow). ``--quick`` leaves out N = 4, the slowest on
2 cores; ``--steps`` and ``--rounds`` set the measured steps and the rounds.

- *ours, torch*: a :class:`somatize.cli.cluster.LocalCluster` (a real ``somatize-coordinator``, job
  threads 1, and max(N) real ``somatize-worker --threads 1``) runs
  ``TorchFilter(mlp, loss="cross_entropy", optimizer="sgd", lr=0.01, batch_size=256 · N,
  epochs=E, shuffle=False)`` with ``sz.DataParallel(N, collective="torch", checkpoint_every=0)``
  (no checkpoints: the anchor takes none; :mod:`benchmarks.checkpoints` measures them): the
  replicas' daemons form a gloo group and train with DistributedDataParallel themselves; the
  coordinator
  only sends each chunk's request and gets one progress event per chunk back;
- *ours, coordinator* (N = 2 only for the time): the same job with
  ``collective="coordinator"``, every step's gradients averaged by the coordinator (the star);
- *anchor*: ``torch.nn.parallel.DistributedDataParallel`` over gloo, N processes of 1 thread,
  256 rows each, the same model, data shapes, optimizer and number of steps;
- *context*: the same model trained in one process, 2 threads, batch 512.

**Per step.** Progress comes once per *chunk* of steps on the torch collective (``step``: global
steps done, ``chunk``: the steps the event covers), so intervals between events are not steps.
Every figure, ours and DDP's alike, is therefore a mean over the measured steps of one run:
(time of the last step's mark − time of the first mark at or after the warm-up) / (their
difference in steps); our marks are the coordinator's recorded times of the ``training``
progress events, DDP's rank 0's step ends. That span holds whole chunks (the gaps between them
too), does not depend on how the chunks were cut, and is the same measure for both sides; the
job's wall time from submit to end (with the upload, the staging of each replica's rows and the
read-back of the states) is reported beside it. Over the rounds the median of these means is
taken.

**Bytes per training step** through the coordinator, both collectives at every N: the
coordinator's ``somatize_received_bytes_total`` + ``somatize_sent_bytes_total`` (its
``/metrics``: every WebSocket message, from and to workers and the client) before the job and
after its terminal event, for the long job above and for a short one of the same data and 1
epoch (:data:`EPOCH_STEPS` steps; for the coordinator path at N = 3, 4 the long one is 2 epochs:
its bytes per step do not vary). The setup — uploading the data, staging each replica's rows,
reading back the states, the client's requests — is the same in both, so (long − short) /
(their difference in steps) is the traffic of training steps alone, progress events to the
client included; the workers' heartbeats of the extra seconds (some hundred bytes a second) are
in it too. The torch path's must not grow with the model: its target is under 1 % of one set of
gradients a step; the coordinator path's is printed next to 2 · N · the gradient bytes (N sets
up, N means down), its floor.

For the coordinator path at N = 2 our step is also broken down as before: each kind of
process's CPU time per step (``/proc``: coordinator, agents, their filter daemons), next to what
its bytes cost over bare ``websockets`` (2 clients each sending 23 MB up and getting 23 MB back
through one echo process), the averaging alone (``weighted_mean`` of 2 trees, in-process) and a
replica's compute alone (256 rows forward, backward and SGD step, 1 thread, one process).

Timed parts run :data:`ROUNDS` times, interleaved (for each N: our torch job, DDP; then the
coordinator job, one process, the parts), on one cluster; the byte runs, whose figures do not
depend on the machine's speed, once. Every process started here is killed at the end (also on
Ctrl-C); logs are printed on failure. On 2 cores the default run took 4.8 minutes (with another
0.8 core of load on the machine), ``--quick`` about 3; the print-out's last line says how long.
There a step of 256 rows per replica takes about a quarter of a second or more, so the torch
collective's chunks (which double while under half of
:data:`coordinator.strategies.chunks.CHUNK_SECONDS`) stay at a few steps;
on faster machines they grow, which the per-step measure above does not mind.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import somatize as sz
from benchmarks.allreduce import (
    EVENT_TIMEOUT,
    SEED,
    SIZES,
    WARMUP,
    _tree_cpu,
    cluster,
    cpu_snapshot,
    descendants,
    foreign_cores,
    gradient_bytes,
    intervals,
    mlp,
    ms,
    run_torch,
    time_websockets,
    time_weighted_mean,
)
from benchmarks.report import Row, Target
from benchmarks.roundtrip import Processes
from somatize.cli.cluster import LocalCluster

STEPS = 40
"""Measured global steps (after :data:`WARMUP`), at least; rounded up to whole epochs."""
EPOCH_STEPS = 4
"""Global steps in one epoch of the data (its rows: 256 · N · EPOCH_STEPS)."""
PER_REPLICA = 256
WORKERS = (2, 3, 4)
QUICK_WORKERS = (2, 3)
STAR_WORKERS = 2
"""The N the coordinator path is timed at (its bytes are measured at every N)."""
LR = 0.01
REPS = 10
ROUNDS = 1
COLLECTIVES = ("torch", "coordinator")
TORCH_TARGET = 1.1
STAR_TARGET = 1.5
TORCH_BYTES_SHARE = 0.01
"""The torch path's bytes per step must stay under this share of one set of gradients."""


def epochs_for(steps: int) -> int:
    """Epochs of :data:`EPOCH_STEPS` steps that make at least ``steps + WARMUP`` steps, and at
    least 2 (the short byte run is 1)."""
    return max(2, math.ceil((steps + WARMUP) / EPOCH_STEPS))


def per_step(marks: Sequence[tuple[int, float]], warmup: int = WARMUP) -> float:
    """Seconds per step from ``(steps done, time)`` marks in order: from the first mark at or
    after ``warmup`` steps (the first mark if none is before the last) to the last mark, divided
    by the steps between them."""
    last = marks[-1]
    first = next((m for m in marks if warmup <= m[0] < last[0]), marks[0])
    return (last[1] - first[1]) / (last[0] - first[0])


def coordinator_bytes(c: LocalCluster) -> dict[str, int]:
    """``received`` and ``sent``: the coordinator's byte counters (``GET /metrics``)."""
    url = f"http://127.0.0.1:{c.port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    found: dict[str, int] = {}
    for line in text.splitlines():
        for key in ("received", "sent"):
            name = f"somatize_{key}_bytes_total"
            if line.startswith(name + " "):
                found[key] = int(float(line.split()[1]))
    if set(found) != {"received", "sent"}:
        raise RuntimeError(f"/metrics has no byte counters:\n{text[:2000]}")
    return found


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:data:`EPOCH_STEPS` global batches of ``n`` replicas' rows, seeded."""
    rows = PER_REPLICA * n * EPOCH_STEPS
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(rows, SIZES[0], generator=g)
    y = torch.randint(0, SIZES[-1], (rows,), generator=g)
    return x, y


def run_job(
    c: LocalCluster,
    model: torch.nn.Module,
    n: int,
    collective: str,
    epochs: int,
    sharding: str = "none",
) -> dict[str, Any]:
    """Train ``model`` with ``sz.DataParallel(n, collective=collective, sharding=sharding)``
    for ``epochs`` epochs of :func:`data` on cluster ``c``.

    Returns ``{"collective", "workers", "marks", "chunks", "steps", "step_s", "wall_s",
    "to_first_step_s", "after_last_step_s", "bytes", "cpu_per_step_ms"}``: ``marks`` the
    ``(step, coordinator time)`` of every ``training`` progress event, ``chunks`` their
    ``chunk`` (1 each on the coordinator path), ``step_s`` :func:`per_step` of the marks,
    ``bytes`` the coordinator's ``received`` and ``sent`` bytes from before the submit to after
    the terminal event, and each kind of process's CPU time (coordinator, the placed workers'
    agents, their daemons) per step over the same span as ``step_s``.
    """
    x, y = data(n)
    graph = sz.Graph(
        [
            sz.TorchFilter(
                model,
                loss="cross_entropy",
                optimizer="sgd",
                lr=LR,
                batch_size=PER_REPLICA * n,
                epochs=epochs,
                shuffle=False,
                seed=SEED,
            ).named("mlp")
        ]
    )
    assert c.coordinator is not None
    total = EPOCH_STEPS * epochs
    marks: list[tuple[int, float]] = []
    chunks: list[int] = []
    cpu: dict[str, float] = {}
    cpu_steps: list[int] = []
    pids: dict[str, list[int]] = {}
    placed: list[str] = []
    before = coordinator_bytes(c)
    with sz.connect(c.url, timeout=60) as client:
        submitted = time.time()
        # No checkpoints (DDP, the anchor, takes none): the default saves one at every epoch's
        # end, which with these 4-step epochs would be a 23 MB state a few steps
        # (benchmarks.checkpoints measures what they cost).
        strategy = sz.DataParallel(n, collective=collective, checkpoint_every=0, sharding=sharding)
        job = client.submit(graph, x, y, strategy=strategy)
        end = None
        for event in job.events(timeout=EVENT_TIMEOUT):
            if event.event == "placed":
                placed = list(event.data.get("workers", []))
                if event.data.get("collective", collective) != collective:
                    raise RuntimeError(f"asked for {collective!r}, placed: {event.data}")
            if event.event == "progress" and event.data.get("phase") == "training":
                step = int(event.data["step"])
                marks.append((step, event.time))
                chunks.append(int(event.data.get("chunk", 1)))
                if (step >= WARMUP and not cpu_steps and step < total) or step == total:
                    if not pids:
                        agents = [c.workers[w].pid for w in placed or c.workers]
                        pids = {"coordinator": [c.coordinator.pid], "agents": agents}
                        pids["daemons"] = [d for agent in agents for d in descendants(agent)]
                    for kind, members in pids.items():
                        cpu[kind] = _tree_cpu(members) - cpu.get(kind, 0.0)
                    cpu_steps.append(step)
            end = event
        after = coordinator_bytes(c)
        finished = time.time()
    if end is None or end.event != "succeeded":
        raise RuntimeError(f"the {collective} job on {n} workers did not succeed: {end}")
    if not marks or marks[-1][0] != total:
        raise RuntimeError(f"expected progress up to step {total}, got {marks}")
    measured = cpu_steps[-1] - cpu_steps[0] if len(cpu_steps) == 2 else 0
    return {
        "collective": collective,
        "workers": n,
        "marks": marks,
        "chunks": chunks,
        "steps": total,
        "step_s": per_step(marks),
        "wall_s": finished - submitted,
        "to_first_step_s": marks[0][1] - submitted,
        "after_last_step_s": end.time - marks[-1][1],
        "bytes": {key: after[key] - before[key] for key in after},
        "cpu_per_step_ms": {k: v / measured * 1e3 for k, v in cpu.items()} if measured else {},
    }


def run_ddp(procs: Processes, n: int, total: int) -> float:
    """Seconds per step of DDP over gloo, ``n`` processes of 1 thread, ``total`` steps
    (:func:`per_step` of rank 0's step ends)."""
    times = run_torch(
        procs, "train", {"lr": LR, "steps": total, "threads": 1, "batch": PER_REPLICA}, n
    )
    return per_step(list(enumerate(times)))


def bytes_per_step(long: dict[str, Any], short: dict[str, Any]) -> dict[str, float]:
    """``received``, ``sent`` and ``total`` bytes per training step: (long − short) / (their
    difference in steps)."""
    steps = long["steps"] - short["steps"]
    out = {key: (long["bytes"][key] - short["bytes"][key]) / steps for key in ("received", "sent")}
    return out | {"total": out["received"] + out["sent"], "steps": steps}


def run(
    steps: int = STEPS,
    rounds: int = ROUNDS,
    workers: Sequence[int] = WORKERS,
    quick: bool = False,
) -> dict[str, Any]:
    """Time our torch collective next to DDP at each N of ``workers`` (without 4 when
    ``quick``), the coordinator path at N = 2 with its breakdown, and the bytes each collective
    moves through the coordinator per training step at each N (module docstring); the timed
    parts ``rounds`` times, interleaved.

    Returns:
        ``{"steps", "epochs", "total_steps", "rounds", "workers", "foreign_cores", "params",
        "grad_bytes", "seconds", "torch", "ddp", "ratio_torch_ddp", "star", "ratio_star_ddp",
        "single", "bytes", "jobs", "breakdown"}``: ``torch`` and ``ddp`` map N (as a string) to a
        :func:`benchmarks.allreduce.ms` summary of the rounds'
        per-step means, ``star`` the coordinator path's at N = 2;
        ``bytes`` maps collective → N → :func:`bytes_per_step`; ``jobs`` every job's
        :func:`run_job` result (without its marks) by collective and N; ``breakdown`` as
        before (``bytes_ws``, ``bytes_pipes``, and summaries of ``compute_256``,
        ``weighted_mean``, ``ws_2_clients``), plus the star job's CPU per step by kind.
    """
    ns = tuple(n for n in workers if not (quick and n > max(QUICK_WORKERS)))
    began = time.monotonic()
    model = mlp()
    nbytes = gradient_bytes(model)
    epochs = epochs_for(steps)
    total = epochs * EPOCH_STEPS
    seconds: dict[str, list[float]] = defaultdict(list)
    times: dict[str, list[float]] = defaultdict(list)
    jobs: dict[str, dict[str, list[dict[str, Any]]]] = {c: defaultdict(list) for c in COLLECTIVES}
    shorts: dict[str, dict[str, dict[str, Any]]] = {c: {} for c in COLLECTIVES}
    start = cpu_snapshot()
    names = tuple(f"w{i}" for i in range(max((*ns, STAR_WORKERS))))
    with (
        cluster(names) as c,
        tempfile.TemporaryDirectory(prefix="somatize-data-parallel-") as tmp,
        Processes(Path(tmp)) as procs,
    ):
        for r in range(rounds):
            for n in ns:
                key = str(n)
                jobs["torch"][key].append(run_job(c, model, n, "torch", epochs))
                seconds[f"torch-{n}"].append(jobs["torch"][key][-1]["step_s"])
                seconds[f"ddp-{n}"].append(run_ddp(procs, n, total))
            star = str(STAR_WORKERS)
            jobs["coordinator"][star].append(run_job(c, model, STAR_WORKERS, "coordinator", epochs))
            seconds["star"].append(jobs["coordinator"][star][-1]["step_s"])
            if str(STAR_WORKERS) not in {str(n) for n in ns}:
                seconds[f"ddp-{STAR_WORKERS}"].append(run_ddp(procs, STAR_WORKERS, total))
            train = {"lr": LR, "steps": total}
            single = run_torch(procs, "train", {**train, "threads": 2, "batch": 2 * PER_REPLICA})
            seconds["single"].append(per_step(list(enumerate(single))))
            compute = run_torch(procs, "train", {**train, "threads": 1, "batch": PER_REPLICA})
            times["compute_256"] += intervals(compute[1:])
            times["ws_2_clients"] += time_websockets(procs, nbytes, REPS)["ws_2_clients"]
            times["weighted_mean"] += time_weighted_mean(model, REPS)["weighted_mean"]
            if r == 0:  # the byte runs: the short job of each, and 2 epochs where none is timed
                for n in ns:
                    for collective in COLLECTIVES:
                        shorts[collective][str(n)] = run_job(c, model, n, collective, 1)
                        if not jobs[collective][str(n)]:
                            jobs[collective][str(n)].append(run_job(c, model, n, collective, 2))
    foreign = foreign_cores(start, cpu_snapshot())
    torch_s = {str(n): ms(seconds[f"torch-{n}"]) for n in ns}
    ddp_s = {str(n): ms(seconds[f"ddp-{n}"]) for n in {*ns, STAR_WORKERS}}
    star_s = ms(seconds["star"])
    star_n = str(STAR_WORKERS)
    star_job = jobs["coordinator"][star_n][0]
    results: dict[str, Any] = {
        "steps": total - WARMUP,
        "epochs": epochs,
        "total_steps": total,
        "rounds": rounds,
        "workers": list(ns),
        "foreign_cores": foreign,
        "params": sum(p.numel() for p in model.parameters()),
        "grad_bytes": nbytes,
        "torch": torch_s,
        "ddp": ddp_s,
        "ratio_torch_ddp": {k: v["p50_ms"] / ddp_s[k]["p50_ms"] for k, v in torch_s.items()},
        "star": star_s
        | {"wall_s": statistics.fmean(j["wall_s"] for j in jobs["coordinator"][star_n])},
        "ratio_star_ddp": star_s["p50_ms"] / ddp_s[star_n]["p50_ms"],
        "single": ms(seconds["single"]),
        "bytes": {
            collective: {
                key: bytes_per_step(runs[0], shorts[collective][key]) for key, runs in by_n.items()
            }
            for collective, by_n in jobs.items()
        },
        "jobs": {
            collective: {
                key: [{k: v for k, v in job.items() if k != "marks"} for job in runs]
                for key, runs in by_n.items()
            }
            for collective, by_n in jobs.items()
        },
        "breakdown": {
            "bytes_ws": 2 * STAR_WORKERS * nbytes,
            "bytes_pipes": 2 * STAR_WORKERS * nbytes,
            **{key: ms(times[key]) for key in ("compute_256", "ws_2_clients", "weighted_mean")},
            "cpu_per_step_ms": star_job["cpu_per_step_ms"],
        },
    }
    results["seconds"] = time.monotonic() - began
    return results


def rows(results: dict[str, Any]) -> list[Row]:
    """The suite's rows: our torch-collective step next to DDP's at each N, the coordinator
    path's at N = 2, and the bytes per training step through the coordinator."""
    out: list[Row] = []
    for key, ours in results["torch"].items():
        job = results["jobs"]["torch"][key][0]
        out.append(
            Row(
                bench="data-parallel",
                name=f"MLP step, collective=torch, {PER_REPLICA} rows x {key} workers",
                ours=ours["p50_ms"],
                unit="ms",
                anchor=results["ddp"][key]["p50_ms"],
                anchor_name=f"torch DDP over gloo, {key} processes",
                target=Target("<=", TORCH_TARGET, text=f"<= {TORCH_TARGET:g} x DDP"),
                note=f"chunks up to {max(job['chunks'])} steps, job {job['wall_s']:.0f} s",
            )
        )
    star = str(STAR_WORKERS)
    out.append(
        Row(
            bench="data-parallel",
            name=f"MLP step, collective=coordinator, {PER_REPLICA} rows x {star} workers",
            ours=results["star"]["p50_ms"],
            unit="ms",
            anchor=results["ddp"][star]["p50_ms"],
            anchor_name=f"torch DDP over gloo, {star} processes",
            target=Target("<=", STAR_TARGET, text=f"<= {STAR_TARGET:g} x DDP"),
            note=f"one process {results['single']['p50_ms']:.0f} ms",
        )
    )
    grad = results["grad_bytes"]
    for key, b in results["bytes"]["torch"].items():
        bound = TORCH_BYTES_SHARE * grad / 1e3
        out.append(
            Row(
                bench="data-parallel",
                name=f"bytes through the coordinator per step, collective=torch, {key} workers",
                ours=b["total"] / 1e3,
                unit="kB",
                target=Target(
                    "<",
                    bound,
                    on="ours",
                    text=f"< {TORCH_BYTES_SHARE:.0%} of the {grad / 1e6:.1f} MB of gradients",
                ),
                note=f"in {b['received'] / 1e3:.1f} kB, out {b['sent'] / 1e3:.1f} kB",
            )
        )
    for key, b in results["bytes"]["coordinator"].items():
        out.append(
            Row(
                bench="data-parallel",
                name=f"bytes through the coordinator per step, collective=coordinator, "
                f"{key} workers",
                ours=b["total"] / 1e6,
                unit="MB",
                anchor=2 * int(key) * grad / 1e6,
                anchor_name=f"2 x {key} x gradient bytes (floor)",
                note=f"in {b['received'] / 1e6:.1f} MB, out {b['sent'] / 1e6:.1f} MB",
            )
        )
    return out


def chunk_sizes(chunks: Sequence[int]) -> str:
    """``"1 step x 3, 2 steps x 20"``: how many events covered how many steps."""
    counts = Counter(chunks)
    return ", ".join(f"{k} step{'s' if k > 1 else ''} x {counts[k]}" for k in sorted(counts))


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.data_parallel",
        description="DataParallel (torch and coordinator collectives) next to torch DDP",
    )
    parser.add_argument("--quick", action="store_true", help="leave out N = 4 workers")
    parser.add_argument("--steps", type=int, default=STEPS, help="measured steps, at least")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    results = run(steps=args.steps, rounds=args.rounds, quick=args.quick)
    mb = results["grad_bytes"] / 1e6
    print(
        f"data-parallel SGD of the MLP {'-'.join(map(str, SIZES))} ({results['params']:,} float32 "
        f"parameters, {mb:.1f} MB of gradients), {PER_REPLICA} rows per replica, global batch "
        f"{PER_REPLICA} x N; {results['epochs']} epochs of {EPOCH_STEPS} steps, per-step means "
        f"over {results['steps']} steps after {WARMUP} warm-up, medians of "
        f"{results['rounds']} interleaved round(s)"
    )
    print(f"  {'':58} {'p50 ms':>8} {'min ms':>8} {'max ms':>8}")
    lines: list[tuple[str, dict[str, float]]] = []
    for key in results["torch"]:
        lines.append((f"ours: DataParallel({key}, collective='torch')", results["torch"][key]))
        lines.append(
            (f"anchor: torch DDP over gloo, {key} processes x 1 thread", results["ddp"][key])
        )
    star = str(STAR_WORKERS)
    lines.append((f"ours: DataParallel({star}, collective='coordinator')", results["star"]))
    lines.append(("context: one process, batch 512, 2 threads", results["single"]))
    for label, r in lines:
        print(f"  {label:58} {r['p50_ms']:8.1f} {r['min_ms']:8.1f} {r['max_ms']:8.1f}")
    for key, ratio in results["ratio_torch_ddp"].items():
        job = results["jobs"]["torch"][key][0]
        print(
            f"  torch / DDP at N = {key}: {ratio:.2f} x ({len(job['chunks'])} progress events, "
            f"chunks of {chunk_sizes(job['chunks'])}; job wall "
            f"{job['wall_s']:.1f} s for {job['steps']} steps, submit to first step "
            f"{job['to_first_step_s']:.1f} s)"
        )
    print(f"  coordinator / DDP at N = {star}: {results['ratio_star_ddp']:.2f} x")
    print("  bytes through the coordinator per training step ((long - short job) / steps):")
    for collective, by_n in results["bytes"].items():
        for key, b in by_n.items():
            print(
                f"    {collective:11} N = {key}: {b['total'] / 1e3:12,.1f} kB (in "
                f"{b['received'] / 1e3:,.1f}, out {b['sent'] / 1e3:,.1f}; over {b['steps']} steps)"
            )
    b = results["breakdown"]
    step = results["star"]["p50_ms"]
    cpu = b["cpu_per_step_ms"]
    print(f"  the coordinator path's step of {step:.0f} ms at N = {star}, seen from outside:")
    if cpu:
        print(
            f"    CPU per step: coordinator {cpu['coordinator']:.0f} ms, {star} agents "
            f"{cpu['agents']:.0f} ms, {star} daemons {cpu['daemons']:.0f} ms "
            f"(sum {sum(cpu.values()):.0f} ms of the {2 * step:.0f} ms 2 cores hold)"
        )
    compute = b["compute_256"]["p50_ms"]
    ws = b["ws_2_clients"]["p50_ms"]
    wm = b["weighted_mean"]["p50_ms"]
    print(f"    a replica's compute alone (256 rows fwd+bwd+SGD, 1 thread): {compute:.0f} ms")
    print(
        f"    those WebSocket bytes over bare websockets (2 clients echo {mb:.1f} MB through "
        f"one process): {ws:.0f} ms; averaging (weighted_mean of 2 trees): {wm:.0f} ms"
    )
    print(
        f"  other processes of the machine kept {results['foreign_cores']:.2f} cores busy "
        f"meanwhile; the whole run took {results['seconds']:.0f} s"
    )


if __name__ == "__main__":
    main()
