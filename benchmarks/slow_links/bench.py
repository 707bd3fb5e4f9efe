"""Workers far apart: DiLoCo and compressed gradients on links held to a rate and a delay, next
to their anchors in the same run.

``python -m benchmarks.slow_links [--rate 100mbit] [--delay 10ms] [--workers 2,4] [--quick]``
builds one network namespace per worker (:mod:`benchmarks.slow_links.links`: each namespace's
only link is held to ``--rate`` by HTB and delayed ``--delay`` each way by a delay line of its
own, this kernel having no ``sch_netem``; site to site crosses two links), needs root and fails,
never skips, without it. On the same model and data it trains:

- the anchors, plain torch over gloo, one process per rank in the sites
  (:mod:`benchmarks.slow_links.anchors`): ``DDP``, ``DDP + PowerSGD`` (rank 4, torch's
  ``powerSGD_hook``) and DiLoCo written by hand (Douillard et al. 2023: AdamW inner steps, an
  outer Nesterov SGD of lr 0.7, momentum 0.9);
- ours: a ``somatize-coordinator`` here and one ``somatize-worker --threads 1`` in each site,
  dialing the coordinator through its link, running ``sz.DiLoCo(N, sync_every=H)`` (also
  with its pseudo-gradients in int8, and in int8 every :data:`FREQUENT_SYNC` steps),
  ``sz.DataParallel(N, compression="powersgd:4")`` and, unless ``--quick``,
  ``sz.DataParallel(N)``; DataParallel with ``checkpoint_every=0``, as DiLoCo's default: the
  anchors save nothing (a DataParallel job's default checkpoint at each epoch's end sends the
  model and its AdamW state up the link, ~39 MB here).

The workload is :mod:`benchmarks.slow_links.char_lm`: a character-level transformer language model
(3.2 M parameters, 12.9 MB of fp32 gradients; context 64) on the Python standard library's sources,
AdamW (lr 3e-3), :data:`PER_REPLICA` windows a replica a step, epochs of :data:`EPOCH_STEPS` global
steps, the validation loss of :data:`VAL_ROWS` held-out windows at each epoch's end.

**What is compared.** Every clock runs without the evaluations (the anchors' rank 0 times its
own; ours are the gaps between an epoch's last training event and its validation row). DDP
trains :data:`BUDGET_EPOCHS` epochs (the sample budget) and its last validation loss is the
target. For every other run: the wall time from the start of training to the target — linearly
interpolated between the two epoch ends whose losses straddle it — and the global steps it took
(DiLoCo may use more samples than DDP: it trains up to :data:`DILOCO_EPOCHS` epochs). The
anchors' clocks start once their group is formed; ours at the first training event less its
steps at the pace of the rest (progress comes per chunk of steps; the set-up before — data
staged, group formed, DDP's first broadcast — is reported apart, with the job's wall time from
submit to end). The targets of issue 30: DiLoCo (ours) ≤ 0.25× DDP's time to DDP's loss; our
DataParallel with PowerSGD ≤ 1.1× DDP + PowerSGD over the budget.

**Unshaped.** On loopback (no namespaces, no shaping), the median over :data:`UNSHAPED_ROUNDS`
runs (each round in another order) of the per-step time over :data:`UNSHAPED_EPOCHS` epochs of
ours with ``compression`` ``None``, ``"fp16"``, ``"int8"`` and ``"powersgd:4"``, and of DiLoCo
(fp32 and int8), each against ``DataParallel`` uncompressed in the same run: none may cost more
than 1.1×; and DDP and DDP + PowerSGD on loopback too, for what torch's own hook costs there.

**Churn and streaming.** ``--churn [--link-bound]``: DiLoCo checkpointed, elastic through a
worker's loss and a newcomer, and streaming, against DDP and a DDP restarted from its
checkpoint (:mod:`benchmarks.slow_links.churn`).

Every process started here is stopped at the end, and the namespaces removed (also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np

import somatize as sz
from benchmarks.report import machine, now, with_section
from benchmarks.slow_links import char_lm
from benchmarks.slow_links.links import LinkShape, Sites
from somatize.cli.cluster import LocalCluster

PER_REPLICA = 8
"""Windows each replica trains a step (a global batch is N of these)."""
EPOCH_STEPS = 25
"""Global steps in one epoch of the data: validation at each end (DiLoCo syncs there too)."""
BUDGET_EPOCHS = 4
"""DDP's sample budget, in epochs (100 steps)."""
DILOCO_EPOCHS = 10
"""The most epochs DiLoCo trains to reach DDP's loss."""
SYNC_EVERY = 25
"""DiLoCo's H: inner steps between synchronisations."""
FREQUENT_SYNC = 10
"""The H of DiLoCo int8's second row: int8's syncs cost a quarter of the bytes, so it can
synchronise 2.5x as often for less than fp32's traffic."""
VAL_ROWS = 256
LR = 3e-3
SEED = 0
POWERSGD = "powersgd:4"
UNSHAPED_EPOCHS = 2
UNSHAPED_ROUNDS = 3
"""Each unshaped mode's runs: its median is reported (a 2-core machine drifts by ±10 %)."""
EVENT_TIMEOUT = 3600.0
DILOCO_TARGET = 0.25
POWERSGD_TARGET = 1.1
UNSHAPED_TARGET = 1.1
DOCUMENT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
WORKER_TOKEN, CLIENT_TOKEN = "slow-links-worker-token-0", "slow-links-client-token-0"


@dataclass(frozen=True)
class Curve:
    """A run's validation loss at each epoch's end: ``(global steps, seconds since training
    began, loss)``; and what its placement said (ours)."""

    method: str
    points: list[tuple[int, float, float]]
    said: dict[str, Any]

    @property
    def last(self) -> tuple[int, float, float]:
        return self.points[-1]

    def reaches(self, target: float) -> tuple[int, float] | None:
        """The steps and seconds at which the loss first reaches ``target`` (linear between
        the epoch ends that straddle it); ``None`` if it never does."""
        before = (0, 0.0, float("inf"))
        for point in self.points:
            if point[2] <= target:
                s0, t0, l0 = before
                s1, t1, l1 = point
                share = 1.0 if not np.isfinite(l0) else (l0 - target) / (l0 - l1)
                return round(s0 + share * (s1 - s0)), t0 + share * (t1 - t0)
            before = point
        return None


@dataclass(frozen=True)
class Workload:
    """The data every run trains on, for ``workers`` replicas: ``per_replica`` windows each a
    step, on a :class:`~benchmarks.slow_links.char_lm.CharLM` of ``size``."""

    workers: int
    epochs: int
    per_replica: int = PER_REPLICA
    size: char_lm.Size = char_lm.SIZE

    @property
    def batch(self) -> int:
        return self.per_replica * self.workers

    @property
    def rows(self) -> int:
        return EPOCH_STEPS * self.batch

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return char_lm.train_and_validation(self.rows, VAL_ROWS, SEED)

    def graph(self) -> sz.Graph:
        net = sz.TorchFilter(
            char_lm.model(SEED, self.size),
            loss="cross_entropy",
            optimizer="adamw",
            lr=LR,
            batch_size=self.batch,
            epochs=self.epochs,
            shuffle=True,
            seed=SEED,
        )
        return sz.Graph([net.named("lm")])


# -- the anchors ---------------------------------------------------------------------------------


def anchor(sites: Sites | None, method: str, work: Workload, directory: Path) -> Curve:
    """``method`` of :mod:`benchmarks.slow_links.anchors` on ``work``, rank ``i`` in site ``i``
    (on loopback with no ``sites``)."""
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"{method}-{work.workers}.jsonl"
    finish_anchor(start_anchor(sites, method, work, out), out)
    return anchor_curve(method, anchor_lines(out))


def start_anchor(
    sites: Sites | None, method: str, work: Workload, out: Path, more: Sequence[str] = ()
) -> list[subprocess.Popen[bytes]]:
    """The ranks of ``method`` on ``work``, started (rank 0 writing ``out``, rank ``r`` logging
    to ``<out's stem>-<r>.log`` beside it), with ``more`` arguments of
    :mod:`benchmarks.slow_links.anchors`; each rank in its site, or on loopback."""
    port = random.randint(20000, 40000)
    master = sites.address(0) if sites is not None else "127.0.0.1"
    size = work.size
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(work.workers):
            argv = [
                *(sites.prefix(rank) if sites is not None else []),
                sys.executable,
                "-m",
                "benchmarks.slow_links.anchors",
                *("--method", method, "--rank", str(rank), "--world", str(work.workers)),
                *("--master", f"{master}:{port}"),
                *("--ifname", sites.interface(rank) if sites is not None else "lo"),
                *("--rows", str(work.rows), "--val-rows", str(VAL_ROWS)),
                *("--batch", str(work.batch), "--epochs", str(work.epochs), "--lr", str(LR)),
                *("--sync-every", str(SYNC_EVERY), "--seed", str(SEED), "--threads", "1"),
                *("--d-model", str(size.d_model), "--layers", str(size.layers)),
                *("--heads", str(size.heads), "--ff", str(size.ff)),
                *("--out", str(out), *more),
            ]
            # The child keeps its own copy of the log's descriptor: ours closes at once.
            with open(out.parent / f"{out.stem}-{rank}.log", "wb") as log:
                procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
    except BaseException:
        stop_ranks(procs)
        raise
    return procs


def finish_anchor(procs: Sequence[subprocess.Popen[bytes]], out: Path) -> None:
    """Wait for the ranks writing ``out`` to end; every one still running is killed when one
    fails (or on Ctrl-C).

    Raises:
        RuntimeError: a rank failed (rank 0's log tail in the message).
    """
    try:
        for proc in procs:
            if proc.wait(timeout=EVENT_TIMEOUT) != 0:
                tail = (out.parent / f"{out.stem}-0.log").read_text()[-3000:]
                raise RuntimeError(f"the anchor writing {out.name} failed:\n{tail}")
    finally:
        stop_ranks(procs)


def stop_ranks(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Kill every rank still running, and reap them all."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


def anchor_lines(out: Path) -> list[dict[str, Any]]:
    """What an anchor's rank 0 wrote: its settings, then one object per epoch."""
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def anchor_curve(method: str, lines: Sequence[dict[str, Any]]) -> Curve:
    """The curve of an anchor's ``lines`` (:func:`anchor_lines`): each epoch's seconds less
    the evaluations before it (rank 0's, the others wait)."""
    head, epochs = lines[0], lines[1:]
    points, evaluating = [], 0.0
    for e in epochs:
        points.append((e["step"], e["seconds"] - evaluating, e["val_loss"]))
        evaluating += e["eval_seconds"]
    return Curve(method, points, dict(head))


# -- ours ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def our_cluster(sites: Sites | None, workers: int, directory: Path) -> Iterator[LocalCluster]:
    """A coordinator here and a worker in each site (or on loopback, with no ``sites``)."""
    host = "0.0.0.0" if sites is not None else "127.0.0.1"
    c = LocalCluster(
        directory / "state",
        host=host,
        job_threads=1,
        worker_token=WORKER_TOKEN,
        client_token=CLIENT_TOKEN,
    )
    try:
        c.start_coordinator()
        for i in range(workers):
            if sites is None:
                c.start_worker(f"w{i}", threads=1)
            else:
                start_in_site(c, sites, f"site{i}", i)
        yield c
    except BaseException:
        c.print_log_tails()
        raise
    finally:
        c.close()


def start_in_site(c: LocalCluster, sites: Sites, worker_id: str, i: int) -> None:
    """Worker ``worker_id`` (one thread) in site ``i``, dialing ``c``'s coordinator through
    the site's link; back once the coordinator lists it."""
    url = f"ws://{sites.gateway(i)}:{c.port}"
    c.start_worker(worker_id, threads=1, prefix=sites.prefix(i), connect=url)


def ours(c: LocalCluster, method: str, strategy: Any, work: Workload) -> Curve:
    """``strategy`` on ``work`` through cluster ``c``: its validation curve."""
    return our_curve(method, our_events(c, strategy, work))


def our_events(c: LocalCluster, strategy: Any, work: Workload) -> list[sz.JobEventInfo]:
    """The events of ``strategy`` on ``work``, validated at each epoch's end, through cluster
    ``c``, once the job succeeded."""
    x, y, val_x, val_y = work.arrays()
    with c.client(timeout=60) as client:
        job = client.submit(work.graph(), x, y, strategy=strategy, validation=(val_x, val_y))
        job.result(timeout=EVENT_TIMEOUT)
        return list(job.events(timeout=60))


def our_curve(method: str, events: Sequence[sz.JobEventInfo], began: float | None = None) -> Curve:
    """The validation curve of a job of ours from its ``events``, its clock from ``began``
    (Unix seconds; by default its first training event less its steps at the run's pace);
    what its placement said, with the job's ``wall`` time, its ``setup`` before training,
    ``began`` and ``pace`` (wall seconds per step between its first and last training
    events)."""
    first = next(k for k, e in enumerate(events) if _training(e))
    marks = [(e.data["step"], e.time) for e in events if _training(e)]
    (s0, t0), (s1, t1) = marks[0], marks[-1]
    pace = (t1 - t0) / (s1 - s0)
    if began is None:
        began = t0 - s0 * pace  # the first chunk's steps at the run's pace
    placed = dict(next(e.data for e in events if e.event == "placed"))  # (a copy: ours to add to)
    placed |= {"wall": events[-1].time - events[0].time, "setup": began - events[0].time}
    placed |= {"began": began, "pace": pace}
    points, evaluating, ended = [], 0.0, began
    for e in events[first:]:
        if _training(e):
            ended = e.time  # an epoch's last chunk ends here; its evaluation follows
        elif e.event == "progress" and e.data.get("phase") == "epoch":
            step = e.data["epoch"] * EPOCH_STEPS
            points.append((step, ended - began - evaluating, e.data["val_loss"]))
            evaluating += e.time - ended
    return Curve(method, points, placed)


def _training(event: sz.JobEventInfo) -> bool:
    return event.event == "progress" and event.data.get("phase") == "training"


def per_step(c: LocalCluster, strategy: Any, work: Workload) -> float:
    """Seconds per global step of ``strategy`` on ``work``: from its first training event to
    its last, over the steps between them."""
    x, y, _, _ = work.arrays()
    with c.client(timeout=60) as client:
        job = client.submit(work.graph(), x, y, strategy=strategy)
        job.result(timeout=EVENT_TIMEOUT)
        marks = [(e.data["step"], e.time) for e in job.events(timeout=60) if _training(e)]
    (s0, t0), (s1, t1) = marks[0], marks[-1]
    return float((t1 - t0) / (s1 - s0))


# -- the run -------------------------------------------------------------------------------------


def shaped(shape: LinkShape, workers: int, quick: bool, directory: Path) -> dict[str, Any]:
    """Every run on ``workers`` sites of ``shape``: the curves and the figures compared."""
    directory.mkdir(parents=True, exist_ok=True)
    budget = Workload(workers, BUDGET_EPOCHS)
    longer = Workload(workers, DILOCO_EPOCHS)
    curves: dict[str, Curve] = {}
    with Sites(workers, shape) as sites:
        curves["DDP"] = anchor(sites, "ddp", budget, directory)
        curves["DDP + PowerSGD"] = anchor(sites, "powersgd", budget, directory)
        curves["DiLoCo by hand"] = anchor(sites, "diloco", longer, directory)
        sites.ensure_running()
        with our_cluster(sites, workers, directory / f"ours-{workers}") as c:
            diloco = sz.DiLoCo(workers, sync_every=SYNC_EVERY)
            curves["ours: DiLoCo"] = ours(c, "ours: DiLoCo", diloco, longer)
            int8 = sz.DiLoCo(workers, sync_every=SYNC_EVERY, compression="int8")
            curves["ours: DiLoCo int8"] = ours(c, "ours: DiLoCo int8", int8, longer)
            often = sz.DiLoCo(workers, sync_every=FREQUENT_SYNC, compression="int8")
            name = f"ours: DiLoCo int8, H={FREQUENT_SYNC}"
            curves[name] = ours(c, name, often, longer)
            powersgd = sz.DataParallel(workers, compression=POWERSGD, checkpoint_every=0)
            curves["ours: DataParallel powersgd"] = ours(c, "powersgd", powersgd, budget)
            if not quick:
                plain = sz.DataParallel(workers, checkpoint_every=0)
                curves["ours: DataParallel"] = ours(c, "ours: DataParallel", plain, budget)
        sites.ensure_running()
    return {"workers": workers, "curves": curves}


def unshaped(workers: int, directory: Path) -> dict[str, float]:
    """Seconds per step on loopback of ours, uncompressed and in every mode."""
    work = Workload(workers, UNSHAPED_EPOCHS)
    modes: dict[str, Any] = {
        "DataParallel": sz.DataParallel(workers, checkpoint_every=0),
        "DataParallel fp16": sz.DataParallel(workers, compression="fp16", checkpoint_every=0),
        "DataParallel int8": sz.DataParallel(workers, compression="int8", checkpoint_every=0),
        f"DataParallel {POWERSGD}": sz.DataParallel(
            workers, compression=POWERSGD, checkpoint_every=0
        ),
        "DiLoCo": sz.DiLoCo(workers, sync_every=SYNC_EVERY),
        "DiLoCo int8": sz.DiLoCo(workers, sync_every=SYNC_EVERY, compression="int8"),
    }
    taken: dict[str, list[float]] = {name: [] for name in modes}
    taken |= {"anchor: DDP": [], "anchor: DDP + PowerSGD": []}
    with our_cluster(None, workers, directory / "unshaped") as c:
        for turn in range(UNSHAPED_ROUNDS):  # each round in another order: drift spreads evenly
            names = list(modes)
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                taken[name].append(per_step(c, modes[name], work))
    for _ in range(UNSHAPED_ROUNDS):
        for method, name in (("ddp", "anchor: DDP"), ("powersgd", "anchor: DDP + PowerSGD")):
            points = anchor(None, method, work, directory / "unshaped").points
            taken[name].append(points[-1][1] / points[-1][0])  # (no chunks to skip)
    return {name: float(np.median(seconds)) for name, seconds in taken.items()}


def report(shape: LinkShape, runs: Sequence[dict[str, Any]], flat: dict[str, float]) -> str:
    """The tables and the targets, in markdown."""
    lines = [f"### Links held to {shape.describe()} (site to site: both links)", ""]
    for run in runs:
        curves: dict[str, Curve] = run["curves"]
        ddp = curves["DDP"]
        target = ddp.last[2]
        n = run["workers"]
        lines += [
            f"**{n} workers.** DDP's validation loss after {ddp.last[0]} steps: {target:.4f}.",
            "",
            *table(curves, target, ddp.last[1]),
            "",
        ]
        for name, curve in curves.items():
            if not name.startswith("ours: DiLoCo"):
                continue
            reached = curve.reaches(target)
            share = reached[1] / ddp.last[1] if reached else float("inf")
            said = (
                f"**{share:.3f}×** DDP's time to DDP's loss"
                if reached
                else "DDP's loss **not reached** in its steps"
            )
            met = _verdict(share <= DILOCO_TARGET)
            label = name.removeprefix("ours: ")
            lines.append(f"- {label}: {said} (target ≤ {DILOCO_TARGET}: {met})")
        powersgd = curves["ours: DataParallel powersgd"].last[1] / curves["DDP + PowerSGD"].last[1]
        lines += [
            f"- DataParallel {POWERSGD}: **{powersgd:.3f}×** DDP + PowerSGD's time over "
            f"the budget (target ≤ {POWERSGD_TARGET}: {_verdict(powersgd <= POWERSGD_TARGET)})",
        ]
        for name, curve in curves.items():
            if "wall" in curve.said:
                said = curve.said
                lines.append(
                    f"- {name}: the job {said['wall']:.1f} s from submit to end, of which "
                    f"set-up {said['setup']:.1f} s; collective {said['collective']} "
                    f"({said['collective_reason']})"
                )
        lines.append("")
    if flat:
        base = flat["DataParallel"]
        lines += [
            f"**Unshaped** (loopback, 2 workers), seconds per step, the median of "
            f"{UNSHAPED_ROUNDS} runs each:",
            "",
            f"| ours | s / step | × DataParallel (target ≤ {UNSHAPED_TARGET}) |",
            "|---|---:|---:|",
        ]
        for name, seconds in flat.items():
            met = _verdict(seconds / base <= UNSHAPED_TARGET)
            lines.append(f"| {name} | {seconds:.3f} | {seconds / base:.3f} ({met}) |")
    return "\n".join(lines) + "\n"


def table(curves: dict[str, Curve], target: float, base: float) -> list[str]:
    """The markdown table of ``curves``: each one's end, and its time and steps to ``target``
    (× ``base`` seconds, DDP's)."""
    lines = [
        "| run | steps | seconds | val loss | time to DDP's loss | steps to it | × DDP |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, curve in curves.items():
        steps, seconds, loss = curve.last
        reached = curve.reaches(target)
        to = f"{reached[1]:.1f} s" if reached else "not reached"
        at = str(reached[0]) if reached else "-"
        ratio = f"{reached[1] / base:.3f}" if reached else "-"
        lines.append(f"| {name} | {steps} | {seconds:.1f} | {loss:.4f} | {to} | {at} | {ratio} |")
    return lines


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def _header(
    command: str,
    seconds: float,
    title: str = "Workers far apart",
    module: str = "bench",
    flags: str = "",
) -> str:
    m = machine()
    return "\n".join(
        [
            f"## {title}",
            "",
            f"Written by `python -m benchmarks.slow_links {flags}--write` (see "
            f"`benchmarks/slow_links/{module}.py` for what is compared and how); every anchor "
            "runs in the same run, on the same links.",
            "",
            f"- **date**: {now()}",
            f"- **machine**: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB RAM, "
            f"{m['kernel']}; torch {m['torch']}",
            f"- **command**: `{command}` ({seconds:.0f} s)",
            "",
            "",
        ]
    )


def _save(path: Path, runs: Sequence[dict[str, Any]]) -> None:
    """The runs so far, as JSON (the curves' points and what each placement said)."""
    saved = [
        {"workers": run["workers"]}
        | {name: {"points": c.points, "said": c.said} for name, c in run["curves"].items()}
        for run in runs
    ]
    path.write_text(json.dumps(saved, indent=1, default=str))


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.slow_links", description=__doc__)
    p.add_argument("--rate", default="100mbit", help="each site's link rate (tc units)")
    p.add_argument("--delay", default="10ms", help="one-way delay of each link (e.g. 10ms)")
    p.add_argument(
        "--workers",
        default=None,
        help="the numbers of workers, comma-separated (default 2,4); with --churn one (4)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="leave out our plain DataParallel; with --churn, fewer epochs (a smoke test)",
    )
    p.add_argument("--no-unshaped", action="store_true", help="leave out the loopback part")
    p.add_argument(
        "--churn",
        action="store_true",
        help="checkpoints, a worker lost and a newcomer, streaming (benchmarks.slow_links.churn)",
    )
    p.add_argument(
        "--link-bound",
        action="store_true",
        help="with --churn: a wider model, one window per replica a step (less compute a byte)",
    )
    p.add_argument("--write", action="store_true", help="into docs/benchmarks.md, its section")
    args = p.parse_args(argv)
    delay = args.delay.removesuffix("ms")
    shape = LinkShape(args.rate, float(delay) / 1000)
    cloudpickle.register_pickle_by_value(char_lm)  # the workers need not import benchmarks
    given = list(argv) if argv is not None else sys.argv[1:]
    if args.churn:
        # (imported here: the churn module builds on this one)
        from benchmarks.slow_links import churn

        if args.workers is not None and not args.workers.isdigit():
            p.error(f"--churn runs on one number of workers, not {args.workers!r}")
        workers = int(args.workers or churn.WORKERS)
        plan = churn.Plan(shape, workers, args.link_bound, args.quick)
        churn.main(plan, given, write=args.write)
        return
    if args.link_bound:
        p.error("--link-bound is a workload of --churn")
    started = time.monotonic()
    directory = Path(tempfile.mkdtemp(prefix="slow-links-"))
    print(f"logs: {directory}", flush=True)
    runs = []
    for n in (args.workers or "2,4").split(","):
        runs.append(shaped(shape, int(n), args.quick, directory / f"n{n}"))
        print(report(shape, runs[-1:], {}), flush=True)  # each as it comes: a later one may fail
        _save(directory / "runs.json", runs)
    flat = {} if args.no_unshaped else unshaped(2, directory)
    seconds = time.monotonic() - started
    command = shlex.join(["python", "-m", "benchmarks.slow_links", *given])
    written = _header(command, seconds) + report(shape, runs, flat)
    print(written)
    if args.write:
        DOCUMENT.write_text(with_section(DOCUMENT.read_text(), "slow_links", written))
        print(f"wrote its section of {DOCUMENT}")
