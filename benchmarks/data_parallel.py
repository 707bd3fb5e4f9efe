"""Data-parallel training of a 5.8M-parameter MLP on 2 workers, next to torch DDP over gloo.

``python -m benchmarks.data_parallel`` trains the MLP 784-2048-2048-10 (float32, 5.8M
parameters; :func:`benchmarks.allreduce.mlp`, seeded) with SGD (lr 0.01) and cross-entropy on
random data of the right shapes: a global batch of 512 rows, 256 per worker, 2 workers, for
``steps + 2`` steps (512 · (steps + 2) rows, in order), the first 2 steps being warm-up:

- *ours*: a :class:`somatize.cluster.LocalCluster` (a real ``somatize-coordinator``, job threads
  1, and 2 real ``somatize-worker --threads 1``) runs
  ``TorchFilter(mlp, loss="cross_entropy", optimizer="sgd", lr=0.01, batch_size=512, epochs=1,
  shuffle=False)`` with ``sz.DataParallel(2)``. Per step: the median interval between the
  coordinator's ``training`` progress events (their recorded times), without the first 2 steps;
  plus the job's wall time from submit to its end (with the upload, the staging of each
  replica's rows and the final read-back of the states);
- *anchor*: ``torch.nn.parallel.DistributedDataParallel`` over gloo, 2 processes of 1 thread,
  256 rows each, the same model, data shapes, optimizer and number of steps; per step: the median
  interval between rank 0's step ends, without the first 2;
- *context*: the same model trained in one process, 2 threads, batch 512.

Our step is then broken down with what can be seen without changing the product: each kind of
process's CPU time per step (``/proc``: coordinator, the 2 agents, their filter daemons), the
bytes a step moves (2 × 23 MB of gradients up and 2 × 23 MB of means down, over WebSockets, and
the same again over the agent ↔ daemon pipes), measured in this run next to what those bytes
cost over bare ``websockets`` (2 clients each sending 23 MB up and getting 23 MB back through one
echo process), the averaging alone (``weighted_mean`` of 2 trees, in-process) and a replica's
compute alone (256 rows forward, backward and SGD step, 1 thread, one process).

All of it is done :data:`ROUNDS` times, interleaved (our job, DDP, one process, the parts), on
one cluster, and the medians pooled: a slow spell of the machine hits every figure alike. Every
process started here is killed at the end (also on Ctrl-C); logs are printed on failure.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.allreduce import (
    SEED,
    SIZES,
    WARMUP,
    cluster,
    cpu_snapshot,
    foreign_cores,
    gradient_bytes,
    intervals,
    merge_jobs,
    mlp,
    ms,
    run_job,
    run_torch,
    time_websockets,
    time_weighted_mean,
)
from benchmarks.report import Row, Target
from benchmarks.roundtrip import Processes

STEPS = 20
GLOBAL_BATCH = 512
WORKERS = 2
LR = 0.01
REPS = 10
ROUNDS = 2


def run(steps: int = STEPS, rounds: int = ROUNDS) -> dict[str, Any]:
    """Train for ``steps`` measured steps (after :data:`WARMUP`) ours, with DDP and in one
    process, then time the parts of our step; all of it ``rounds`` times, interleaved, so that
    a slow spell of the machine hits every figure alike.

    Returns:
        ``{"steps", "rounds", "foreign_cores", "params", "grad_bytes", "ours", "ddp", "single",
        "ratio_ours_ddp", "breakdown"}``: ``foreign_cores`` is how many cores other processes of
        the machine kept busy meanwhile (:func:`benchmarks.allreduce.foreign_cores`); ``ours`` is
        :func:`benchmarks.allreduce.merge_jobs` of the rounds' jobs (``step``, ``wall_s``,
        ``to_first_step_s``, ``after_last_step_s``, ``cpu_per_step_ms`` by kind of process);
        ``ddp`` and ``single`` are :func:`benchmarks.allreduce.ms` summaries of their step
        durations. ``breakdown``: ``bytes_ws`` and ``bytes_pipes`` per step, and summaries of
        ``compute_256`` (a replica's compute alone), ``weighted_mean`` and ``ws_2_clients``
        (:func:`benchmarks.allreduce.time_websockets`).
    """
    model = mlp()
    nbytes = gradient_bytes(model)
    total = steps + WARMUP
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(GLOBAL_BATCH * total, SIZES[0], generator=g)
    y = torch.randint(0, SIZES[-1], (GLOBAL_BATCH * total,), generator=g)
    per_rank = GLOBAL_BATCH // WORKERS
    train = {"lr": LR, "steps": total}
    times: dict[str, list[float]] = defaultdict(list)
    jobs = []
    start = cpu_snapshot()
    with (
        cluster() as c,
        tempfile.TemporaryDirectory(prefix="somatize-data-parallel-") as tmp,
        Processes(Path(tmp)) as procs,
    ):
        for _ in range(rounds):
            jobs.append(run_job(c, model, x, y, batch_size=GLOBAL_BATCH))
            ddp = run_torch(procs, "train", {**train, "threads": 1, "batch": per_rank}, WORKERS)
            times["ddp"] += intervals(ddp[1:])
            single = run_torch(procs, "train", {**train, "threads": 2, "batch": GLOBAL_BATCH})
            times["single"] += intervals(single[1:])
            compute = run_torch(procs, "train", {**train, "threads": 1, "batch": per_rank})
            times["compute_256"] += intervals(compute[1:])
            times["ws_2_clients"] += time_websockets(procs, nbytes, REPS)["ws_2_clients"]
            times["weighted_mean"] += time_weighted_mean(model, REPS)["weighted_mean"]
    foreign = foreign_cores(start, cpu_snapshot())
    ours = merge_jobs(jobs)
    results: dict[str, Any] = {
        "steps": steps,
        "rounds": rounds,
        "foreign_cores": foreign,
        "params": sum(p.numel() for p in model.parameters()),
        "grad_bytes": nbytes,
        "ours": ours,
        "ddp": ms(times["ddp"]),
        "single": ms(times["single"]),
        "ratio_ours_ddp": ours["step"]["p50_ms"] / ms(times["ddp"])["p50_ms"],
        "breakdown": {
            "bytes_ws": 2 * WORKERS * nbytes,
            "bytes_pipes": 2 * WORKERS * nbytes,
            **{key: ms(times[key]) for key in ("compute_256", "ws_2_clients", "weighted_mean")},
        },
    }
    return results


def rows(results: dict[str, Any]) -> list[Row]:
    """The suite's row: our data-parallel step next to DDP's."""
    return [
        Row(
            bench="data-parallel",
            name=f"MLP step, {GLOBAL_BATCH // WORKERS} rows x {WORKERS} workers",
            ours=results["ours"]["step"]["p50_ms"],
            unit="ms",
            anchor=results["ddp"]["p50_ms"],
            anchor_name="torch DDP over gloo, 2 processes",
            target=Target("<=", 1.3, text="<= 1.3 x DDP"),
            note=f"one process {results['single']['p50_ms']:.0f} ms",
        )
    ]


def main() -> None:
    results = run()
    ours, b = results["ours"], results["breakdown"]
    mb = results["grad_bytes"] / 1e6
    print(
        f"data-parallel SGD of the MLP {'-'.join(map(str, SIZES))} ({results['params']:,} float32 "
        f"parameters, {mb:.1f} MB of gradients), global batch {GLOBAL_BATCH} = {WORKERS} x "
        f"{GLOBAL_BATCH // WORKERS}; step medians of {results['rounds']} interleaved rounds of "
        f"{results['steps']} steps after {WARMUP} warm-up"
    )
    print(f"  {'':58} {'p50 ms':>8} {'min ms':>8} {'max ms':>8}")
    rows = (
        ("ours: DataParallel(2), 2 workers x 1 thread", ours["step"]),
        ("anchor: torch DDP over gloo, 2 processes x 1 thread", results["ddp"]),
        ("context: one process, batch 512, 2 threads", results["single"]),
    )
    for label, r in rows:
        print(f"  {label:58} {r['p50_ms']:8.1f} {r['min_ms']:8.1f} {r['max_ms']:8.1f}")
    print(f"  ours / DDP: {results['ratio_ours_ddp']:.2f} x")
    print(
        f"  other processes of the machine kept {results['foreign_cores']:.2f} cores busy meanwhile"
    )
    print(
        f"  ours, whole job (mean of {ours['jobs']}): {ours['wall_s']:.1f} s wall for "
        f"{ours['steps']} steps (submit to first step {ours['to_first_step_s']:.1f} s, "
        f"last step to end {ours['after_last_step_s']:.1f} s)"
    )
    step = ours["step"]["p50_ms"]
    cpu = ours["cpu_per_step_ms"]
    print(f"  our step of {step:.0f} ms, where it can be seen from outside:")
    print(
        f"    CPU per step: coordinator {cpu['coordinator']:.0f} ms, 2 agents "
        f"{cpu['agents']:.0f} ms, 2 daemons {cpu['daemons']:.0f} ms "
        f"(sum {sum(cpu.values()):.0f} ms of the {2 * step:.0f} ms 2 cores hold)"
    )
    compute = b["compute_256"]["p50_ms"]
    ws = b["ws_2_clients"]["p50_ms"]
    wm = b["weighted_mean"]["p50_ms"]
    print(f"    a replica's compute alone (256 rows fwd+bwd+SGD, 1 thread): {compute:.0f} ms")
    print(
        f"    bytes per step: {b['bytes_ws'] / 1e6:.0f} MB over WebSockets (2 x {mb:.1f} MB up, "
        f"2 x {mb:.1f} MB down) + {b['bytes_pipes'] / 1e6:.0f} MB over agent-daemon pipes"
    )
    print(
        f"    those WebSocket bytes over bare websockets (2 clients echo {mb:.1f} MB through "
        f"one process): {ws:.0f} ms"
    )
    print(f"    averaging (weighted_mean of 2 trees, in-process): {wm:.0f} ms")
    rest = step - compute - ws - wm
    print(
        f"    compute + bare transfer + averaging, one after the other: {compute + ws + wm:.0f} "
        f"ms; the other {rest:.0f} ms: pipes, codec, chunking, SGD apply, scheduling"
    )


if __name__ == "__main__":
    main()
