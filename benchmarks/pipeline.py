"""Pipeline-parallel training on 2 stage workers: activation throughput, micro-batching, and
the step next to ``torch.distributed.pipelining``.

``python -m benchmarks.pipeline [--quick]`` runs ``sz.ModelParallel`` jobs on a
:class:`somatize.cli.cluster.LocalCluster` (a real ``somatize-coordinator``, job threads 1, and 4
real ``somatize-worker --threads 1``: ``d0``, ``d1`` started with ``--peer-listen`` so their
stages exchange activations and gradients worker to worker, ``r0``, ``r1`` without, so the
coordinator relays them). Parts 1 and 2 run with ``transport="websocket"`` (every micro-batch's
action a call from the coordinator, one ``training`` progress event per global batch); per step:
the median interval between those events (their recorded times), without the first
:data:`WARMUP` steps.

1. *Activation throughput* (websocket): the MLP 16-4096 | 4096-10 (stage 0 ``Linear(16, 4096)``
   + ReLU, cheap but with a wide output; stage 1 ``Linear(4096, 10)``), cross-entropy, SGD, a
   global batch of :data:`ACT_BATCH` rows in 1 micro-batch: every step moves a 16.8 MB activation
   forward and its 16.8 MB gradient back. Bytes per step ÷ step time → MB/s, over direct peer
   links and over the relay, next to a bare ``websockets`` echo (no codec, one message) of the
   same activation up and back between this process and an echo process
   (:func:`benchmarks.allreduce.time_websockets`), and next to the same model trained in one
   process (1 thread), whose step is the compute the pipeline step holds too (so the step minus
   it is an upper bound on what the transfer cost).
2. *Micro-batches* (websocket, GPipe): the MLP 784-2048 | 2048-768-10 (stage 0
   ``Linear(784, 2048)`` + ReLU, stage 1 ``Linear(2048, 768)`` + ReLU + ``Linear(768, 10)``:
   balanced stages), cross-entropy, SGD (lr 0.01), a global batch of :data:`MLP_BATCH` rows cut
   into M = 1, 2, 4, 8 micro-batches, over direct links; next to the same model trained in one
   process (batch 512, 1 thread, step ends timed the same way), with GPipe's idealised bubble
   fraction ``(S - 1) / (M + S - 1)`` (:func:`coordinator.strategies.model_parallel.schedule.gpipe`)
   beside each M.
3. *Against torch* (the rows with a target): the same MLP, split the same way, batch, loss and
   SGD, at M = 2, 4, 8 (:data:`TORCH_MICRO_BATCHES`) for GPipe and 1F1B, ours with
   ``transport="torch"`` on ``d0``, ``d1`` (the stage daemons join a gloo group and run the
   schedule themselves, activations point-to-point; the coordinator sends one call per stage per
   chunk of global batches and emits one progress event per chunk, with ``step`` the global
   batches done and ``chunk`` how many the event covers), each job :data:`PIPE_STEPS` global
   batches so the chunks grow; the anchor is ``torch.distributed.pipelining``
   (``ScheduleGPipe`` / ``Schedule1F1B``) on gloo in 2 processes of 1 thread
   (:mod:`benchmarks.anchors.pipelining`), same M, stepping once per global batch. Per step,
   ours: each pair of consecutive progress events after warm-up (the first event at or past
   global batch :data:`PIPE_WARMUP`, then every later one) gives ``(time between the events) /
   (difference of their step)`` for each batch between them; the figure is the median of those
   per-batch durations pooled over the rounds (a median weighted by batches; the mean over the
   same span, training wall time / batches, is printed beside it). The anchor: the median
   interval between global batches' ends on rank 0, after the same :data:`PIPE_WARMUP` batches.
   The rows' ratio is ours / anchor, held to ``<= 1.1``. Both train the same rows (with
   learnable labels, :func:`benchmarks.anchors.pipelining.data`) from the same initial
   parameters: the anchor's loss must fall (checked), ours must have run on torch (its
   ``linked`` event says ``transport: torch``, checked), and the largest difference between the
   two runs' per-batch losses is printed.

Everything runs :data:`ROUNDS` times interleaved and the durations are pooled, so a slow spell
of the machine hits every figure alike; how many cores other processes kept busy meanwhile is
printed. ``--quick`` is 1 round of fewer steps (:data:`QUICK`). Every process started here is
killed at the end (also on Ctrl-C); logs are printed on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
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
from benchmarks.anchors import pipelining
from benchmarks.report import Row, Target
from benchmarks.roundtrip import Processes
from coordinator.strategies.model_parallel.schedule import gpipe, one_f_one_b
from somatize.cli.cluster import LocalCluster

ACT_SIZES = (16, 4096, 10)
ACT_BATCH = 1024
MLP_SIZES = (784, 2048, 768, 10)
"""Stage 0 ``Linear(784, 2048)`` + ReLU, stage 1 ``Linear(2048, 768)`` + ReLU + ``Linear(768, 10)``:
about 1.6M multiply-adds a row on each side, so the two stages are balanced and pipelining them
can gain up to ``(M + S - 1) / M`` of the ideal 2x (a stage doing all the work could not)."""
MLP_BATCH = 512
MICRO_BATCHES = (1, 2, 4, 8)
"""M of part 2 (websocket, GPipe)."""
TORCH_MICRO_BATCHES = (2, 4, 8)
"""M of part 3 (ours on torch next to ``torch.distributed.pipelining``)."""
SCHEDULES = {"gpipe": ("GPipe", gpipe), "1f1b": ("1F1B", one_f_one_b)}
"""Part 3's schedules: their names and builders (for the idealised bubble)."""
STAGES = 2
LR = 0.01
STEPS = 10
"""Measured steps per websocket job (after :data:`WARMUP`)."""
PIPE_STEPS = 48
"""Global batches of each part-3 job, ours and the anchor's: enough for ours' chunks to grow."""
PIPE_WARMUP = 3
"""Global batches of a part-3 job left out of its figure (ours: its first, smallest chunks)."""
REPS = 10
ROUNDS = 2
QUICK = {"steps": 3, "reps": 3, "rounds": 1, "pipe_steps": 16}
"""``run()`` arguments of ``--quick``."""
EVENT_TIMEOUT = 120.0
DIRECT = ("d0", "d1")
RELAY = ("r0", "r1")


@contextlib.contextmanager
def cluster() -> Iterator[LocalCluster]:
    """A :class:`LocalCluster` (job threads 1) with workers :data:`DIRECT` (peer links) and
    :data:`RELAY` (none), ``--threads 1`` each, idle. Logs' tails printed on a failure."""
    with LocalCluster(
        heartbeat_interval=1.0, heartbeat_timeout=30.0, job_threads=1, spare_daemons=False
    ) as c:
        try:
            c.start_coordinator()
            for worker in DIRECT:
                c.start_worker(worker, threads=1, peer_link=True)
            for worker in RELAY:
                c.start_worker(worker, threads=1, peer_link=False)
            yield c
        except Exception:
            c.print_log_tails()
            raise


def data(sizes: tuple[int, ...], batch: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the right shapes for ``steps`` global batches of ``batch``, with learnable labels
    (:func:`benchmarks.anchors.pipelining.data`: the anchor trains on the same)."""
    return pipelining.data(sizes, batch, steps, SEED)


def run_pipeline(
    c: LocalCluster,
    sizes: tuple[int, ...],
    batch: int,
    micro: int,
    workers: tuple[str, str],
    *,
    x: torch.Tensor,
    y: torch.Tensor,
    schedule: str = "gpipe",
    transport: str = "websocket",
) -> dict[str, Any]:
    """Train the MLP ``sizes`` (a - b | b - c) split in 2 stages on ``workers``, ``schedule``
    with ``micro`` micro-batches over ``transport``. Returns ``{"stamps", "events", "linked",
    "wall_s"}``: the times of the ``training`` events, those events as ``(time, step, chunk,
    losses)``, the ``linked`` event's data, the wall time from submit to the end."""
    model = mlp(sizes)
    head = torch.nn.Sequential(*list(model)[:2])  # the first Linear + ReLU
    tail = torch.nn.Sequential(*list(model)[2:])  # the rest
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
    strategy = sz.ModelParallel(parts, micro_batches=micro, schedule=schedule, transport=transport)
    stamps: list[float] = []
    events: list[tuple[float, int, int, list[float]]] = []
    linked: dict[str, Any] = {}
    with sz.connect(c.url, timeout=60) as client:
        submitted = time.time()
        job = client.submit(graph, x, y, strategy=strategy)
        end = None
        for event in job.events(timeout=EVENT_TIMEOUT):
            if event.event == "progress" and event.data.get("phase") == "training":
                stamps.append(event.time)
                d = event.data
                losses = [float(v) for v in d.get("losses", [d.get("loss", float("nan"))])]
                step = int(d.get("step", len(stamps)))
                events.append((event.time, step, int(d.get("chunk", 1)), losses))
            elif event.event == "progress" and event.data.get("phase") == "linked":
                linked = dict(event.data)
            end = event
        finished = time.time()
    if end is None or end.event != "succeeded":
        raise RuntimeError(f"the job did not succeed: {end}")
    return {"stamps": stamps, "events": events, "linked": linked, "wall_s": finished - submitted}


def chunk_steps(
    events: Sequence[tuple[float, int, int, list[float]]], warmup: int = PIPE_WARMUP
) -> tuple[list[float], float]:
    """Per-batch durations from chunked progress events: for each pair of consecutive events
    from the first at or past global batch ``warmup``, the time between them divided by the
    difference of their ``step``, once for each batch between them; and the mean over that span
    (its time / its batches). ``([], nan)`` when fewer than 2 events are past the warm-up."""
    kept = [e for e in events if e[1] >= warmup]
    per_batch: list[float] = []
    for (t0, s0, _, _), (t1, s1, _, _) in itertools.pairwise(kept):
        if s1 > s0:
            per_batch += [(t1 - t0) / (s1 - s0)] * (s1 - s0)
    if len(kept) < 2 or kept[-1][1] <= kept[0][1]:
        return per_batch, float("nan")
    return per_batch, (kept[-1][0] - kept[0][0]) / (kept[-1][1] - kept[0][1])


def falls(losses: Sequence[float], n: int = 5) -> bool:
    """Whether the mean of the last ``n`` losses is below that of the first ``n``."""
    n = max(1, min(n, len(losses) // 2))
    return len(losses) >= 2 and statistics.fmean(losses[-n:]) < statistics.fmean(losses[:n])


def run_against_torch(
    c: LocalCluster,
    procs: Processes,
    schedule: str,
    micro: int,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    steps: int,
    anchor_first: bool,
) -> dict[str, Any]:
    """Part 3 for one (schedule, M): our job with ``transport="torch"`` and the
    ``torch.distributed.pipelining`` anchor (``anchor_first``: in that order).

    Returns:
        ``{"ours", "ours_span", "anchor", "anchor_span", "chunks", "ours_losses",
        "anchor_losses", "linked", "wall_s"}``: per-batch durations (seconds) after
        :data:`PIPE_WARMUP`, each side's mean over its measured span, our events' chunk sizes,
        both runs' per-batch losses, our ``linked`` event and both wall times.

    Raises:
        RuntimeError: ours did not run on torch, or the anchor's loss did not fall.
    """

    def ours() -> dict[str, Any]:
        return run_pipeline(
            c, MLP_SIZES, MLP_BATCH, micro, DIRECT, x=x, y=y, schedule=schedule, transport="torch"
        )

    def anchor() -> dict[str, Any]:
        return pipelining.run_anchor(
            procs, MLP_SIZES, MLP_BATCH, micro, schedule, steps, seed=SEED, lr=LR
        )

    if anchor_first:
        theirs, job = anchor(), ours()
    else:
        job, theirs = ours(), anchor()
    if job["linked"].get("transport") != "torch":
        raise RuntimeError(f"ours did not run on torch: linked event {job['linked']}")
    if not falls(theirs["losses"]):
        raise RuntimeError(f"the anchor's loss did not fall: {theirs['losses']}")
    per_batch, span = chunk_steps(job["events"])
    ends = theirs["times"][1:]  # the end of every global batch (times[0] is the start)
    anchor_steps = intervals(ends, PIPE_WARMUP)
    anchor_span = (ends[-1] - ends[PIPE_WARMUP - 1]) / (len(ends) - PIPE_WARMUP)
    return {
        "ours": per_batch,
        "ours_span": span,
        "anchor": anchor_steps,
        "anchor_span": anchor_span,
        "chunks": [e[2] for e in job["events"]],
        "ours_losses": [v for e in job["events"] for v in e[3]],
        "anchor_losses": theirs["losses"],
        "linked": job["linked"],
        "wall_s": {"ours": job["wall_s"], "anchor": theirs["wall_s"]},
    }


def run(
    steps: int = STEPS, rounds: int = ROUNDS, reps: int = REPS, pipe_steps: int = PIPE_STEPS
) -> dict[str, Any]:
    """Measure the three parts (see the module docstring), ``rounds`` times interleaved.

    Returns:
        ``{"steps", "pipe_steps", "rounds", "foreign_cores", "seconds", "activation", "micro",
        "torch"}``. ``activation``: ``act_bytes`` (one activation), ``bytes_per_step``
        (activation forward + gradient back), ``direct``, ``relay``, ``single``, ``ws``
        (:func:`benchmarks.allreduce.ms` summaries; ``ws`` is the activation up and back over
        bare websockets), ``mb_s`` by path (bytes per step ÷ p50 step) and ``linked`` (each
        path's ``linked`` event). ``micro``: ``single`` (one process) and ``by_m``: for each M,
        ``step`` (summary), ``bubble``, ``vs_single`` (p50 ratio); ``speedup_8_vs_1``.
        ``torch``: by schedule then M, ``ours`` and ``anchor`` (summaries of the per-batch
        durations), ``ours_mean_ms`` and ``anchor_mean_ms`` (the rounds' mean over each
        measured span), ``ratio`` (p50 ours / p50 anchor), ``bubble``, ``chunks`` (our events'
        chunk sizes, last round), ``loss_diff`` (the largest per-batch loss difference between
        ours and the anchor, over the rounds), ``loss_first_last`` (the anchor's first and last
        loss), ``linked`` and ``wall_s`` (last round).
    """
    began = time.monotonic()
    total = steps + WARMUP
    act_x, act_y = data(ACT_SIZES, ACT_BATCH, total)
    mlp_x, mlp_y = data(MLP_SIZES, MLP_BATCH, total)
    pipe_x, pipe_y = data(MLP_SIZES, MLP_BATCH, pipe_steps)
    act_bytes = ACT_BATCH * ACT_SIZES[1] * 4
    times: dict[str, list[float]] = defaultdict(list)
    linked: dict[str, Any] = {}
    against: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    start = cpu_snapshot()
    with (
        cluster() as c,
        tempfile.TemporaryDirectory(prefix="somatize-pipeline-") as tmp,
        Processes(Path(tmp)) as procs,
    ):
        for r in range(rounds):
            for path, workers in (("direct", DIRECT), ("relay", RELAY)):
                job = run_pipeline(c, ACT_SIZES, ACT_BATCH, 1, workers, x=act_x, y=act_y)
                times[f"act_{path}"] += intervals(job["stamps"])
                linked[path] = job["linked"]
            single = {"sizes": list(ACT_SIZES), "threads": 1, "batch": ACT_BATCH}
            single |= {"steps": total, "lr": LR}
            times["act_single"] += intervals(run_torch(procs, "train", single)[1:])
            times["act_ws"] += time_websockets(procs, act_bytes, reps)["ws_1_client"]
            for m in MICRO_BATCHES:
                job = run_pipeline(c, MLP_SIZES, MLP_BATCH, m, DIRECT, x=mlp_x, y=mlp_y)
                times[f"mlp_m{m}"] += intervals(job["stamps"])
            single = {"sizes": list(MLP_SIZES), "threads": 1, "batch": MLP_BATCH}
            single |= {"steps": total, "lr": LR}
            times["mlp_single"] += intervals(run_torch(procs, "train", single)[1:])
            for k, (schedule, m) in enumerate(
                (s, m) for s in SCHEDULES for m in TORCH_MICRO_BATCHES
            ):
                pair = run_against_torch(
                    c,
                    procs,
                    schedule,
                    m,
                    pipe_x,
                    pipe_y,
                    steps=pipe_steps,
                    anchor_first=(k + r) % 2 == 1,
                )
                against[(schedule, m)].append(pair)
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
    by_m: dict[int, dict[str, Any]] = {}
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
    on_torch: dict[str, dict[int, dict[str, Any]]] = {s: {} for s in SCHEDULES}
    for (schedule, m), pairs in against.items():
        ours = ms([d for p in pairs for d in p["ours"]])
        anchor = ms([d for p in pairs for d in p["anchor"]])
        diff = max(
            abs(a - b)
            for p in pairs
            for a, b in zip(p["ours_losses"], p["anchor_losses"], strict=True)
        )
        last = pairs[-1]
        on_torch[schedule][m] = {
            "ours": ours,
            "anchor": anchor,
            "ours_mean_ms": statistics.fmean(p["ours_span"] for p in pairs) * 1e3,
            "anchor_mean_ms": statistics.fmean(p["anchor_span"] for p in pairs) * 1e3,
            "ratio": ours["p50_ms"] / anchor["p50_ms"],
            "bubble": SCHEDULES[schedule][1](STAGES, m).bubble_fraction(),
            "chunks": last["chunks"],
            "loss_diff": diff,
            "loss_first_last": (last["anchor_losses"][0], last["anchor_losses"][-1]),
            "linked": last["linked"],
            "wall_s": last["wall_s"],
        }
    return {
        "steps": steps,
        "pipe_steps": pipe_steps,
        "rounds": rounds,
        "foreign_cores": foreign,
        "seconds": time.monotonic() - began,
        "activation": activation,
        "micro": micro,
        "torch": on_torch,
    }


def rows(results: dict[str, Any]) -> list[Row]:
    """The suite's rows: ours on torch next to ``torch.distributed.pipelining`` for each
    schedule and M (target ``<= 1.1``), the websocket step for each M next to one process, the
    M=8 speed-up, and the activation throughput next to bare websockets."""
    out = [
        Row(
            bench="pipeline",
            name=f"2-stage MLP step, {SCHEDULES[schedule][0]}, M={m}, transport torch",
            ours=r["ours"]["p50_ms"],
            unit="ms",
            anchor=r["anchor"]["p50_ms"],
            anchor_name=f"torch.distributed.pipelining {SCHEDULES[schedule][0]}, gloo",
            target=Target("<=", 1.1),
            note=f"bubble {r['bubble']:.2f}",
        )
        for schedule, by_m in results["torch"].items()
        for m, r in by_m.items()
    ]
    micro = results["micro"]
    out += [
        Row(
            bench="pipeline",
            name=f"2-stage MLP step, GPipe, M={m}, websocket",
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
            name="speed-up of M=8 over M=1, websocket",
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


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pipeline",
        description="ModelParallel (websocket and torch) next to torch.distributed.pipelining",
    )
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    results = run(**(QUICK if args.quick else {}))
    a, mp = results["activation"], results["micro"]
    mb = a["act_bytes"] / 1e6
    print(
        f"pipeline (2 stages, 1 thread per worker): medians of {results['rounds']} "
        f"interleaved round(s)"
    )
    print(
        f"1. activation throughput (websocket, {results['steps']} steps after {WARMUP} warm-up): "
        f"MLP {ACT_SIZES[0]}-{ACT_SIZES[1]} | {ACT_SIZES[1]}-{ACT_SIZES[2]}, batch {ACT_BATCH}, "
        f"M=1: {mb:.1f} MB forward + {mb:.1f} MB back a step"
    )
    print(f"  {'':58} {'p50 ms':>8} {'min ms':>8} {'max ms':>8} {'MB/s':>8}")
    lines = (
        ("ours: direct peer links (d0 -> d1)", "direct"),
        ("ours: relayed through the coordinator (r0 -> r1)", "relay"),
        (f"bare websockets: {mb:.1f} MB up and back, 2 processes", "ws"),
        ("context: same model in one process, 1 thread (compute)", "single"),
    )
    for label, key in lines:
        r = a[key]
        rate = f"{a['mb_s'][key]:8.0f}" if key in a["mb_s"] else f"{'':8}"
        print(f"  {label:58} {r['p50_ms']:8.1f} {r['min_ms']:8.1f} {r['max_ms']:8.1f} {rate}")
    compute = a["single"]["p50_ms"]
    for key in ("direct", "relay"):
        rest = a[key]["p50_ms"] - compute
        mbs = a["bytes_per_step"] / 1e6 / (rest / 1e3) if rest > 0 else float("inf")
        print(
            f"  {key}: step minus one-process compute = {rest:.1f} ms -> {mbs:.0f} MB/s "
            f"(linked event: {a['linked'].get(key)})"
        )
    print(
        f"2. micro-batches (websocket, GPipe, {results['steps']} steps after {WARMUP} warm-up): "
        f"MLP {MLP_SIZES[0]}-{MLP_SIZES[1]} | {'-'.join(str(n) for n in MLP_SIZES[1:])}, "
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
        f"  {'context: one process, batch 512, 1 thread':40} {s['p50_ms']:8.1f} "
        f"{s['min_ms']:8.1f} {s['max_ms']:8.1f}"
    )
    print(f"  speed-up of M=8 over M=1: {mp['speedup_8_vs_1']:.2f} x")
    print(
        f"3. against torch.distributed.pipelining (gloo, 2 processes x 1 thread): the same model "
        f"and batch, {results['pipe_steps']} global batches a job, {PIPE_WARMUP} left out; ours "
        f"transport='torch' on d0, d1"
    )
    print(
        f"  {'':46} {'p50 ms':>8} {'min ms':>8} {'max ms':>8} {'mean ms':>8} {'ratio':>6} "
        f"{'bubble':>6}"
    )
    for schedule, by_m in results["torch"].items():
        name = SCHEDULES[schedule][0]
        for m, r in by_m.items():
            for who, label in (("ours", "ours"), ("anchor", "anchor: pipelining")):
                s = r[who]
                ratio = f"{r['ratio']:6.2f}" if who == "ours" else f"{'':6}"
                print(
                    f"  {f'{label}, {name}, M={m}':46} {s['p50_ms']:8.1f} {s['min_ms']:8.1f} "
                    f"{s['max_ms']:8.1f} {r[f'{who}_mean_ms']:8.1f} {ratio} {r['bubble']:6.2f}"
                )
            first, last = r["loss_first_last"]
            wall = r["wall_s"]
            print(
                f"    ours' progress events covered {r['chunks']} batches; loss {first:.3f} -> "
                f"{last:.3f} (anchor), largest |ours - anchor| {r['loss_diff']:.2g}; wall ours "
                f"{wall['ours']:.1f} s, anchor {wall['anchor']:.1f} s; linked "
                f"{r['linked'].get('transport')}"
            )
    print(
        f"  other processes of the machine kept {results['foreign_cores']:.2f} cores busy "
        f"meanwhile; the whole run took {results['seconds']:.0f} s"
    )


if __name__ == "__main__":
    main()
