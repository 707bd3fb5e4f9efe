"""Pipeline-parallel training on 2 stage workers: activation throughput, and GPipe micro-batching.

``python -m benchmarks.pipeline`` runs ``sz.ModelParallel`` jobs (GPipe) on a
:class:`somatize.cluster.LocalCluster` (a real ``somatize-coordinator``, job threads 1, and 4
real ``somatize-worker --threads 1``: ``d0``, ``d1`` started with ``--peer-listen`` so their
stages exchange activations and gradients worker to worker, ``r0``, ``r1`` without, so the
coordinator relays them). Per step: the median interval between the coordinator's ``training``
progress events (their recorded times), without the first :data:`WARMUP` steps.

1. *Activation throughput*: the MLP 16-4096 | 4096-10 (stage 0 ``Linear(16, 4096)`` + ReLU,
   cheap but with a wide output; stage 1 ``Linear(4096, 10)``), cross-entropy, SGD, a global
   batch of :data:`ACT_BATCH` rows in 1 micro-batch: every step moves a 16.8 MB activation
   forward and its 16.8 MB gradient back. Bytes per step ÷ step time → MB/s, over direct peer
   links and over the relay, next to a bare ``websockets`` echo (no codec, one message) of the
   same activation up and back between this process and an echo process
   (:func:`benchmarks.allreduce.time_websockets`), and next to the same model trained in one
   process (1 thread), whose step is the compute the pipeline step holds too (so the step minus
   it is an upper bound on what the transfer cost).
2. *Micro-batches*: the MLP 784-2048 | 2048-768-10 (stage 0 ``Linear(784, 2048)`` + ReLU,
   stage 1 ``Linear(2048, 768)`` + ReLU + ``Linear(768, 10)``: balanced stages), cross-entropy,
   SGD (lr 0.01), a global batch of :data:`MLP_BATCH` rows cut into M = 1, 2, 4, 8
   micro-batches, over direct links; next to the same model trained in one process (batch 512,
   1 thread, step ends timed the same way), with GPipe's idealised bubble fraction
   ``(S - 1) / (M + S - 1)`` (:func:`coordinator.strategies.schedule.gpipe`)
   beside each M.

Everything runs :data:`ROUNDS` times interleaved and the durations are pooled, so a slow spell
of the machine hits every figure alike; how many cores other processes kept busy meanwhile is
printed. Every process started here is killed at the end (also on Ctrl-C); logs are printed on
failure.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import somatize as sz
from benchmarks.allreduce import (
    SEED,
    WARMUP,
    cpu_snapshot,
    foreign_cores,
    intervals,
    mlp,
    ms,
    run_torch,
    time_websockets,
)
from benchmarks.report import Row, Target
from benchmarks.roundtrip import Processes
from coordinator.strategies.schedule import gpipe
from somatize.cluster import LocalCluster

ACT_SIZES = (16, 4096, 10)
ACT_BATCH = 1024
MLP_SIZES = (784, 2048, 768, 10)
"""Stage 0 ``Linear(784, 2048)`` + ReLU, stage 1 ``Linear(2048, 768)`` + ReLU + ``Linear(768, 10)``:
about 1.6M multiply-adds a row on each side, so the two stages are balanced and pipelining them
can gain up to ``(M + S - 1) / M`` of the ideal 2x (a stage doing all the work could not)."""
MLP_BATCH = 512
MICRO_BATCHES = (1, 2, 4, 8)
STAGES = 2
LR = 0.01
STEPS = 10
"""Measured steps per job (after :data:`WARMUP`)."""
REPS = 10
ROUNDS = 2
EVENT_TIMEOUT = 120.0
DIRECT = ("d0", "d1")
RELAY = ("r0", "r1")


@contextlib.contextmanager
def cluster() -> Iterator[LocalCluster]:
    """A :class:`LocalCluster` (job threads 1) with workers :data:`DIRECT` (peer links) and
    :data:`RELAY` (none), ``--threads 1`` each, idle. Logs' tails printed on a failure."""
    with LocalCluster(heartbeat_interval=1.0, heartbeat_timeout=30.0, job_threads=1) as c:
        try:
            c.start_coordinator()
            for worker in DIRECT:
                c.start_worker(worker, threads=1, peer_link=True)
            for worker in RELAY:
                c.start_worker(worker, threads=1, peer_link=False)
            yield c
        except Exception:
            for log in sorted(c.logs.glob("*.log")):
                lines = log.read_text(errors="replace").splitlines()[-30:]
                print(f"--- tail of {log.name} ---", *lines, sep="\n", file=sys.stderr)
            raise


def data(sizes: tuple[int, ...], batch: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows of the right shapes for ``steps`` global batches of ``batch``."""
    g = torch.Generator().manual_seed(SEED)
    rows = batch * steps
    return torch.randn(rows, sizes[0], generator=g), torch.randint(
        0, sizes[-1], (rows,), generator=g
    )


def run_pipeline(
    c: LocalCluster,
    sizes: tuple[int, ...],
    batch: int,
    micro: int,
    workers: tuple[str, str],
    x: torch.Tensor,
    y: torch.Tensor,
) -> dict[str, Any]:
    """Train the MLP ``sizes`` (a - b | b - c) split in 2 stages on ``workers``, GPipe with
    ``micro`` micro-batches. Returns ``{"stamps", "linked", "wall_s"}``: the times of the
    ``training`` events, the ``linked`` event's data, the wall time from submit to the end."""
    model = mlp(sizes)
    head = torch.nn.Sequential(*model[:2])  # the first Linear + ReLU
    tail = torch.nn.Sequential(*model[2:])  # the rest
    graph = sz.TorchFilter(head, optimizer="sgd", lr=LR).named("s0") >> sz.TorchFilter(
        tail,
        loss="cross_entropy",
        optimizer="sgd",
        lr=LR,
        batch_size=batch,
        epochs=1,
        shuffle=False,
        seed=SEED,
    ).named("s1")
    parts = [sz.Partition(["s0"], worker=workers[0]), sz.Partition(["s1"], worker=workers[1])]
    strategy = sz.ModelParallel(parts, micro_batches=micro, schedule="gpipe")
    stamps: list[float] = []
    linked: dict[str, Any] = {}
    with sz.connect(c.url, timeout=60) as client:
        submitted = time.time()
        job = client.submit(graph, x, y, strategy=strategy)
        end = None
        for event in job.events(timeout=EVENT_TIMEOUT):
            if event.event == "progress" and event.data.get("phase") == "training":
                stamps.append(event.time)
            elif event.event == "progress" and event.data.get("phase") == "linked":
                linked = dict(event.data)
            end = event
        finished = time.time()
    if end is None or end.event != "succeeded":
        raise RuntimeError(f"the job did not succeed: {end}")
    return {"stamps": stamps, "linked": linked, "wall_s": finished - submitted}


def run(steps: int = STEPS, rounds: int = ROUNDS, reps: int = REPS) -> dict[str, Any]:
    """Measure both parts (see the module docstring), ``rounds`` times interleaved.

    Returns:
        ``{"steps", "rounds", "foreign_cores", "activation", "micro"}``. ``activation``:
        ``act_bytes`` (one activation), ``bytes_per_step`` (activation forward + gradient back),
        ``direct``, ``relay``, ``single``, ``ws`` (:func:`benchmarks.allreduce.ms` summaries; ``ws``
        is the activation up and back over bare websockets), ``mb_s`` by path (bytes per step ÷
        p50 step) and ``linked`` (each path's ``linked`` event). ``micro``: ``single`` (one
        process) and ``by_m``: for each M, ``step`` (summary), ``bubble``, ``vs_single``
        (p50 ratio); ``speedup_8_vs_1``.
    """
    total = steps + WARMUP
    act_x, act_y = data(ACT_SIZES, ACT_BATCH, total)
    mlp_x, mlp_y = data(MLP_SIZES, MLP_BATCH, total)
    act_bytes = ACT_BATCH * ACT_SIZES[1] * 4
    times: dict[str, list[float]] = defaultdict(list)
    linked: dict[str, Any] = {}
    start = cpu_snapshot()
    with (
        cluster() as c,
        tempfile.TemporaryDirectory(prefix="somatize-pipeline-") as tmp,
        Processes(Path(tmp)) as procs,
    ):
        for _ in range(rounds):
            for path, workers in (("direct", DIRECT), ("relay", RELAY)):
                job = run_pipeline(c, ACT_SIZES, ACT_BATCH, 1, workers, act_x, act_y)
                times[f"act_{path}"] += intervals(job["stamps"])
                linked[path] = job["linked"]
            single = {"sizes": list(ACT_SIZES), "threads": 1, "batch": ACT_BATCH}
            single |= {"steps": total, "lr": LR}
            times["act_single"] += intervals(run_torch(procs, "train", single)[1:])
            times["act_ws"] += time_websockets(procs, act_bytes, reps)["ws_1_client"]
            for m in MICRO_BATCHES:
                job = run_pipeline(c, MLP_SIZES, MLP_BATCH, m, DIRECT, mlp_x, mlp_y)
                times[f"mlp_m{m}"] += intervals(job["stamps"])
            single = {"sizes": list(MLP_SIZES), "threads": 1, "batch": MLP_BATCH}
            single |= {"steps": total, "lr": LR}
            times["mlp_single"] += intervals(run_torch(procs, "train", single)[1:])
    foreign = foreign_cores(start, cpu_snapshot())
    per_step = 2 * act_bytes
    activation: dict[str, Any] = {
        "act_bytes": act_bytes,
        "bytes_per_step": per_step,
        **{key: ms(times[f"act_{key}"]) for key in ("direct", "relay", "single", "ws")},
        "linked": linked,
    }
    activation["mb_s"] = {
        key: per_step / 1e6 / (activation[key]["p50_ms"] / 1e3) for key in ("direct", "relay", "ws")
    }
    single_p50 = ms(times["mlp_single"])["p50_ms"]
    by_m = {}
    for m in MICRO_BATCHES:
        step = ms(times[f"mlp_m{m}"])
        by_m[m] = {
            "step": step,
            "bubble": gpipe(STAGES, m).bubble_fraction(),
            "vs_single": step["p50_ms"] / single_p50,
        }
    micro = {
        "single": ms(times["mlp_single"]),
        "by_m": by_m,
        "speedup_8_vs_1": by_m[1]["step"]["p50_ms"] / by_m[8]["step"]["p50_ms"],
    }
    return {
        "steps": steps,
        "rounds": rounds,
        "foreign_cores": foreign,
        "activation": activation,
        "micro": micro,
    }


def rows(results: dict[str, Any]) -> list[Row]:
    """The suite's rows: the step for each M next to one process, the M=8 speed-up, and the
    activation throughput next to bare websockets."""
    micro = results["micro"]
    out = [
        Row(
            bench="pipeline",
            name=f"2-stage MLP step, M={m}",
            ours=r["step"]["p50_ms"],
            unit="ms",
            anchor=micro["single"]["p50_ms"],
            anchor_name="same model, one process",
            note=f"GPipe bubble {r['bubble']:.2f}",
        )
        for m, r in micro["by_m"].items()
    ]
    out.append(
        Row(
            bench="pipeline",
            name="speed-up of M=8 over M=1",
            ours=micro["speedup_8_vs_1"],
            unit="x",
            target=Target(">=", 1.4, on="ours", text=">= 1.4 x faster"),
        )
    )
    act = results["activation"]
    for path in ("direct", "relay"):
        out.append(
            Row(
                bench="pipeline",
                name=f"activations + gradients, {path}",
                ours=act["mb_s"][path],
                unit="MB/s",
                anchor=act["mb_s"]["ws"],
                anchor_name="bare websockets up and back",
            )
        )
    return out


def main() -> None:
    results = run()
    a, mp = results["activation"], results["micro"]
    mb = a["act_bytes"] / 1e6
    print(
        f"pipeline (GPipe, 2 stages, 1 thread per worker): medians of {results['rounds']} "
        f"interleaved rounds of {results['steps']} steps after {WARMUP} warm-up"
    )
    print(
        f"1. activation throughput: MLP {ACT_SIZES[0]}-{ACT_SIZES[1]} | {ACT_SIZES[1]}-"
        f"{ACT_SIZES[2]}, batch {ACT_BATCH}, M=1: {mb:.1f} MB forward + {mb:.1f} MB back a step"
    )
    print(f"  {'':58} {'p50 ms':>8} {'min ms':>8} {'max ms':>8} {'MB/s':>8}")
    rows = (
        ("ours: direct peer links (d0 -> d1)", "direct"),
        ("ours: relayed through the coordinator (r0 -> r1)", "relay"),
        (f"bare websockets: {mb:.1f} MB up and back, 2 processes", "ws"),
        ("context: same model in one process, 1 thread (compute)", "single"),
    )
    for label, key in rows:
        r = a[key]
        rate = f"{a['mb_s'][key]:8.0f}" if key in a["mb_s"] else f"{'':8}"
        print(f"  {label:58} {r['p50_ms']:8.1f} {r['min_ms']:8.1f} {r['max_ms']:8.1f} {rate}")
    compute = a["single"]["p50_ms"]
    for key in ("direct", "relay"):
        rest = a[key]["p50_ms"] - compute
        rate = a["bytes_per_step"] / 1e6 / (rest / 1e3) if rest > 0 else float("inf")
        print(
            f"  {key}: step minus one-process compute = {rest:.1f} ms -> {rate:.0f} MB/s "
            f"(linked event: {a['linked'].get(key)})"
        )
    print(
        f"2. micro-batches: MLP {MLP_SIZES[0]}-{MLP_SIZES[1]} | "
        f"{'-'.join(str(n) for n in MLP_SIZES[1:])}, "
        f"batch {MLP_BATCH}, SGD, direct links"
    )
    print(f"  {'':40} {'p50 ms':>8} {'min ms':>8} {'max ms':>8} {'bubble':>7} {'/1proc':>7}")
    for m, r in mp["by_m"].items():
        s = r["step"]
        print(
            f"  {f'ours: M={m}':40} {s['p50_ms']:8.1f} {s['min_ms']:8.1f} {s['max_ms']:8.1f} "
            f"{r['bubble']:7.2f} {r['vs_single']:7.2f}"
        )
    s = mp["single"]
    print(
        f"  {'anchor: one process, batch 512, 1 thread':40} {s['p50_ms']:8.1f} {s['min_ms']:8.1f} "
        f"{s['max_ms']:8.1f}"
    )
    print(f"  speed-up of M=8 over M=1: {mp['speedup_8_vs_1']:.2f} x")
    print(
        f"  other processes of the machine kept {results['foreign_cores']:.2f} cores busy meanwhile"
    )


if __name__ == "__main__":
    main()
