"""DataParallel(2) over worker-local rows read from disk, next to the same rows held in memory.

``python -m benchmarks.worker_data [--gib G] [--shuffle both|on|off] [--rounds R]
[--collective auto|torch|coordinator] [--json PATH]`` writes, for each of two
workers, ``G`` GiB (default :data:`GIB`, 4) of float32 rows of :data:`WIDTH` features (16 KiB a
row; 262,144 rows at 4 GiB) with int64 labels, twice: as a directory of ``x.npy``/``y.npy`` and
as an uncompressed ``.npz`` holding the same two ``.npy`` files (byte for byte). One
:class:`somatize.cli.cluster.LocalCluster` (a real coordinator, two real ``somatize-worker
--threads 1 --spare-daemon off``, job threads 1) serves both on each worker: ``--data disk=DIR
--data mem=NPZ``. No spare daemon: one would start, importing torch, as each job starts, and take
its first seconds' CPU from it (the anchor's staging hid that, the disk jobs' did not); each job
starts once the machine is quiet (:func:`benchmarks.worker_data_io.wait_quiet`).
Per shuffle setting, one epoch of ``sz.DataParallel(2, collective=C)`` (``--collective``,
default ``auto``: torch where the workers can) over
``sz.WorkerData(...)`` trains the MLP ``WIDTH``-256-10 (SGD, lr 0.01, cross-entropy,
``batch_size`` :data:`BATCH` rows *per replica*, ``seed`` 0), three times:

- *anchor, memory*: ``WorkerData("mem")``: each daemon reads its ``.npz`` whole when the job
  stages it (:mod:`engine.data.dataset_files`) and every step takes its rows from that array;
- *ours, disk, warm*: ``WorkerData("disk")`` with the files read through once just before
  (the page cache holds them: its share is printed), each step reading its rows with ``pread``
  (:class:`engine.data.npy_rows.NpyRows`), nothing else held;
- *ours, disk, cold*: the same after ``fsync`` and ``posix_fadvise(DONTNEED)`` on both files
  (no root needed; the share still cached is printed): the epoch reads them from storage.

**Step time** is :func:`benchmarks.data_parallel.per_step` of the ``training`` progress events
(the coordinator's times, one per chunk of steps): the mean over the epoch after 2 warm-up steps,
the ratio ours / anchor computed in the same run. The wall time from submit to the first
progress event (the daemons' start and the staging: the whole ``.npz`` read for the anchor) is
reported beside it. **Peak RSS**: a thread reads every process below each agent (its filter
daemons) from ``/proc`` every 50 ms while a job runs and keeps each one's ``VmHWM``; the figure
is each worker's largest (a new daemon serves each job, so a peak never carries over). The
agents' own ``VmHWM`` is printed too: describing an ``.npz`` at startup reads it whole.
**Read throughput** of a disk job: the rows it trained on (``x`` and ``y``, both replicas) per
second of training; the bytes its daemons read from storage (``read_bytes`` of
``/proc/PID/io``: also what else they read from storage, their libraries when not cached) are
printed beside it.

Context, in this process (1 torch thread): one step's read alone — the first
:data:`PROBE_STEPS` steps of replica 0's plan (:func:`protocol.rules.batching.replica_batches`) read
with ``NpyRows``, warm and cold — and one replica's compute alone (512 rows forward, backward,
SGD step). The disk path reads the next step's rows in a thread of the daemon while a step trains
(:mod:`engine.data.read_ahead`), what the page cache holds at once and every other run of rows asked
for at once (:mod:`engine.data.row_reads`): a read longer than a step, or one competing for the only
cores (a cold random 16 KiB read costs about 40 µs of kernel CPU on the project's VM), shows in
the ratio.

Targets (issue 15): disk step ≤ :data:`RATIO_TARGET` × memory step, each daemon's peak RSS on
the disk path < :data:`RSS_TARGET_MB` MB. Everything written lives in a temporary directory
removed at the end; every process is stopped. With ``--rounds R`` the three jobs run ``R`` times,
interleaved, and the medians are taken. On 2 cores ``--gib 0.5`` takes about a minute; the default
4 GiB writes 16 GiB (50 s) and takes about six minutes a round of both shuffle settings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import somatize as sz
from benchmarks.allreduce import cpu_snapshot, foreign_cores
from benchmarks.data_parallel import per_step
from benchmarks.report import Row, Target
from benchmarks.worker_data_io import (
    BATCH,
    LR,
    SEED,
    WIDTH,
    Watcher,
    cached_share,
    drop_cache,
    model,
    plan_rows,
    proc_status,
    pytest_running,
    rows_for,
    time_compute,
    time_reads,
    wait_quiet,
    warm_cache,
    write_npz,
    write_worker_data,
)
from somatize.cli.cluster import LocalCluster

GIB = 4.0
"""GiB of ``x`` rows per worker."""
WORKERS = ("w0", "w1")
SHUFFLES = {"both": (True, False), "on": (True,), "off": (False,)}
PROBE_STEPS = 16
"""Steps read alone, in this process, for the read-per-step context."""
EVENT_TIMEOUT = 600.0
RATIO_TARGET = 1.2
RSS_TARGET_MB = 1500.0


@contextlib.contextmanager
def cluster(datasets: dict[str, dict[str, Path]]) -> Iterator[tuple[LocalCluster, dict[str, Any]]]:
    """A :class:`LocalCluster` (job threads 1) with a worker per entry of ``datasets``
    (``--threads 1``), and each agent's startup: seconds and ``VmHWM``/``VmRSS`` once up."""
    with LocalCluster(
        heartbeat_interval=1.0, heartbeat_timeout=30.0, job_threads=1, startup=900.0
    ) as c:
        try:
            c.start_coordinator()
            startup: dict[str, Any] = {}
            for worker, data in datasets.items():
                began = time.monotonic()
                # No spare daemon: one would start (importing torch) as each job starts, and
                # take CPU from its first seconds; every job here starts its own, off the clock.
                c.start_worker(worker, threads=1, data=data, args=("--spare-daemon", "off"))
                status = proc_status(c.workers[worker].pid)
                startup[worker] = {
                    "seconds": time.monotonic() - began,
                    "peak_mb": status.get("VmHWM", 0) * 1024 / 1e6,
                    "rss_mb": status.get("VmRSS", 0) * 1024 / 1e6,
                }
            yield c, startup
        except Exception:
            c.print_log_tails()
            raise


def run_job(
    c: LocalCluster, dataset: str, shuffle: bool, width: int, collective: str = "auto"
) -> dict[str, Any]:
    """One epoch of ``DataParallel(2, collective=collective)`` over ``WorkerData(dataset)``.

    Returns ``{"dataset", "shuffle", "collective", "steps", "step_s", "wall_s",
    "to_first_step_s", "train_s", "daemons", "agents_peak_mb", "pytest"}``: ``step_s``
    :func:`benchmarks.data_parallel.per_step` of the training marks, ``train_s`` from the first
    to the last mark, ``daemons`` :meth:`Watcher.summary`.
    """
    net = sz.TorchFilter(
        model(width),
        loss="cross_entropy",
        optimizer="sgd",
        lr=LR,
        batch_size=BATCH,
        epochs=1,
        shuffle=shuffle,
        seed=SEED,
    )
    marks: list[tuple[int, float]] = []
    chosen = None
    pytest_seen = pytest_running()
    agents = {w: p.pid for w, p in c.workers.items()}
    quiet_s = wait_quiet()  # nothing of the job before still busy
    with Watcher(agents) as watcher, sz.connect(c.url, timeout=60) as client:
        submitted = time.time()
        job = client.submit(
            sz.Graph([net.named("mlp")]),
            sz.WorkerData(dataset),
            strategy=sz.DataParallel(2, collective=collective),
        )
        end = None
        for event in job.events(timeout=EVENT_TIMEOUT):
            if event.event == "placed":
                chosen = event.data.get("collective", collective)
            if event.event == "progress" and event.data.get("phase") == "training":
                marks.append((int(event.data["step"]), event.time))
            end = event
        finished = time.time()
    pytest_seen = pytest_seen or pytest_running()
    if end is None or end.event != "succeeded":
        raise RuntimeError(f"the job over {dataset!r} did not succeed: {end}")
    if len(marks) < 2:
        raise RuntimeError(f"too few progress events to time steps: {marks}")
    return {
        "dataset": dataset,
        "shuffle": shuffle,
        "collective": chosen,
        "steps": marks[-1][0],
        "events": len(marks),
        "step_s": per_step(marks),
        "wall_s": finished - submitted,
        "to_first_step_s": marks[0][1] - submitted,
        "train_s": marks[-1][1] - marks[0][1],
        "daemons": watcher.summary(),
        "agents_peak_mb": {
            w: proc_status(p).get("VmHWM", 0) * 1024 / 1e6 for w, p in agents.items()
        },
        "pytest": pytest_seen,
        "quiet_wait_s": quiet_s,
    }


def merge(jobs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One figure for the rounds of a kind of job: the median ``step_s`` (each round's in
    ``step_s_all``), each worker's largest daemon peak and the mean bytes read; the rest is the
    first round's."""
    first = jobs[0]
    daemons = {
        w: {
            "peak_mb": max(j["daemons"][w]["peak_mb"] for j in jobs),
            "read_mb": statistics.fmean(j["daemons"][w]["read_mb"] for j in jobs),
            "rchar_mb": statistics.fmean(j["daemons"][w]["rchar_mb"] for j in jobs),
        }
        for w in first["daemons"]
    }
    return first | {
        "step_s": statistics.median(j["step_s"] for j in jobs),
        "step_s_all": [j["step_s"] for j in jobs],
        "to_first_step_s": statistics.median(j["to_first_step_s"] for j in jobs),
        "daemons": daemons,
        "pytest": any(j["pytest"] for j in jobs),
    }


def run(
    gib: float = GIB,
    shuffles: Sequence[bool] = (True, False),
    width: int = WIDTH,
    collective: str = "auto",
    rounds: int = 1,
    tmp: Path | None = None,
) -> dict[str, Any]:
    """Write the data, then for each of ``shuffles``, ``rounds`` times: the memory job, the warm
    disk job and the cold disk job, with the read-alone probes (module docstring).

    Returns:
        ``{"gib", "rows", "width", "row_bytes", "batch", "collective", "rounds", "write_s",
        "startup", "compute_ms", "foreign_cores", "seconds", "by_shuffle"}``: ``by_shuffle``
        maps ``"on"``/``"off"`` to ``{"memory", "warm", "cold"}`` (:func:`merge` of the rounds'
        :func:`run_job` results, the disk ones with ``cached_share`` before the job,
        ``rows_mb_s`` and ``ratio`` to the memory step) and ``probe_ms`` (``warm``, ``cold``:
        median read of a step in this process).
    """
    began = time.monotonic()
    rows = rows_for(gib, width)
    row_bytes = width * 4 + 8
    start = cpu_snapshot()
    results: dict[str, Any] = {
        "gib": rows * width * 4 / 2**30,
        "rows": rows,
        "width": width,
        "row_bytes": row_bytes,
        "batch": BATCH,
        "collective": collective,
        "rounds": rounds,
        "compute_ms": time_compute(width) * 1e3,
        "by_shuffle": {},
    }
    with tempfile.TemporaryDirectory(prefix="somatize-worker-data-", dir=tmp) as scratch:
        base = Path(scratch)
        t = time.monotonic()
        datasets: dict[str, dict[str, Path]] = {}
        for i, worker in enumerate(WORKERS):
            disk = write_worker_data(base / worker, rows, i, width)
            datasets[worker] = {"disk": disk, "mem": write_npz(disk, base / f"{worker}.npz")}
        files = [d["disk"] / name for d in datasets.values() for name in ("x.npy", "y.npy")]
        npzs = [d["mem"] for d in datasets.values()]
        drop_cache([*files, *npzs])  # written back: what follows reads them as it says
        results["write_s"] = time.monotonic() - t
        with cluster(datasets) as (c, startup):
            results["startup"] = startup
            drop_cache(npzs)  # the agents read them whole to describe them
            for shuffle in shuffles:
                plan = plan_rows(rows, shuffle, PROBE_STEPS)
                jobs: dict[str, list[dict[str, Any]]] = {"memory": [], "warm": [], "cold": []}
                probes: dict[str, list[float]] = {"warm": [], "cold": []}
                for _ in range(rounds):
                    jobs["memory"].append(run_job(c, "mem", shuffle, width, collective))
                    drop_cache(npzs)
                    warm_cache(files)
                    probes["warm"] += time_reads(datasets[WORKERS[0]]["disk"], plan)
                    share = cached_share(files)
                    job = run_job(c, "disk", shuffle, width, collective)
                    jobs["warm"].append(job | {"cached_share": share})
                    drop_cache(files)
                    probes["cold"] += time_reads(datasets[WORKERS[0]]["disk"], plan)
                    drop_cache(files)
                    share = cached_share(files)
                    job = run_job(c, "disk", shuffle, width, collective)
                    jobs["cold"].append(job | {"cached_share": share})
                    drop_cache(files)
                by = {kind: merge(runs) for kind, runs in jobs.items()}
                for kind in ("warm", "cold"):
                    by[kind]["ratio"] = by[kind]["step_s"] / by["memory"]["step_s"]
                    by[kind]["rows_mb_s"] = (
                        len(WORKERS) * BATCH * row_bytes / by[kind]["step_s"] / 1e6
                    )
                by["probe_ms"] = {k: statistics.median(v) * 1e3 for k, v in probes.items()}
                results["by_shuffle"]["on" if shuffle else "off"] = by
    results["foreign_cores"] = foreign_cores(start, cpu_snapshot())
    results["seconds"] = time.monotonic() - began
    return results


def storage_mb(job: dict[str, Any]) -> float:
    """MB a job's daemons read from storage (``read_bytes``), both workers."""
    return float(sum(d["read_mb"] for d in job["daemons"].values()))


def rows(results: dict[str, Any]) -> list[Row]:
    """The suite's rows: per shuffle setting and cache state, the disk step next to the memory
    step; each disk daemon's peak RSS; the disk path's read throughput."""
    out: list[Row] = []
    gib = results["gib"]
    for key, by in results["by_shuffle"].items():
        mem = by["memory"]
        for cache in ("warm", "cold"):
            job = by[cache]
            what = f"DataParallel(2) step over {gib:.3g} GiB/worker on disk, shuffle {key}, {cache}"
            out.append(
                Row(
                    bench="worker-data",
                    name=what,
                    ours=job["step_s"] * 1e3,
                    unit="ms",
                    anchor=mem["step_s"] * 1e3,
                    anchor_name="same rows held in memory (.npz)",
                    target=Target("<=", RATIO_TARGET, text=f"<= {RATIO_TARGET:g} x memory"),
                    note=f"read alone {by['probe_ms'][cache]:.1f} ms/step",
                )
            )
            out.append(
                Row(
                    bench="worker-data",
                    name=f"peak RSS of a daemon on disk rows, shuffle {key}, {cache}",
                    ours=max(d["peak_mb"] for d in job["daemons"].values()),
                    unit="MB",
                    anchor=max(d["peak_mb"] for d in mem["daemons"].values()),
                    anchor_name="daemon holding the .npz",
                    target=Target("<", RSS_TARGET_MB, on="ours", text=f"< {RSS_TARGET_MB:g} MB"),
                )
            )
            out.append(
                Row(
                    bench="worker-data",
                    name=f"rows read per second of training, shuffle {key}, {cache}",
                    ours=job["rows_mb_s"],
                    unit="MB/s",
                    note=f"from storage {storage_mb(job):,.0f} MB",
                )
            )
    return out


# -- print-out -------------------------------------------------------------------------------


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def report(results: dict[str, Any]) -> None:
    r = results
    mib = BATCH * r["width"] * 4 / 2**20
    print(
        f"worker data: DataParallel(2, collective={r['collective']}), 2 workers x "
        f"{r['gib']:.3g} GiB "
        f"({r['rows']:,} rows of {r['width']} float32 + int64 label), batch {BATCH} rows per "
        f"replica ({mib:.0f} MiB), 1 epoch, medians of {r['rounds']} round(s); files written in "
        f"{r['write_s']:.0f} s"
    )
    for worker, s in r["startup"].items():
        print(
            f"  agent {worker}: up in {s['seconds']:.1f} s, VmHWM {s['peak_mb']:,.0f} MB, "
            f"VmRSS {s['rss_mb']:,.0f} MB (its datasets described at start)"
        )
    header = (
        f"  {'':34} {'step ms':>8} {'x mem':>6} {'1st step s':>10} {'cached':>7} "
        f"{'peak RSS w0/w1 MB':>18} {'rows MB/s':>9} {'storage MB':>10}"
    )
    for key, by in r["by_shuffle"].items():
        mem = by["memory"]
        print(
            f" shuffle {key} (collective {mem['collective']}, {mem['steps']} steps, "
            f"{mem['events']} progress events)"
        )
        print(header)
        for label, job in (
            ("anchor: memory (.npz held whole)", mem),
            ("ours: disk x.npy, warm cache", by["warm"]),
            ("ours: disk x.npy, cold cache", by["cold"]),
        ):
            peaks = "/".join(f"{d['peak_mb']:,.0f}" for d in job["daemons"].values())
            ratio = f"{job['ratio']:.3f}" if "ratio" in job else ""
            rate = f"{job['rows_mb_s']:,.0f}" if "rows_mb_s" in job else ""
            read = storage_mb(job)
            each = job.get("step_s_all", [])
            print(
                f"  {label:34} {job['step_s'] * 1e3:8.1f} {ratio:>6} "
                f"{job['to_first_step_s']:10.1f} {_share(job.get('cached_share')):>7} "
                f"{peaks:>18} {rate:>9} {read:10,.0f}"
                + (f"  rounds {', '.join(f'{s * 1e3:.1f}' for s in each)}" if len(each) > 1 else "")
                + ("  (pytest ran meanwhile)" if job["pytest"] else "")
            )
        p = by["probe_ms"]
        print(
            f"  context: a step's rows read alone (NpyRows, {BATCH} rows of x and y, this "
            f"process): warm {p['warm']:.1f} ms, cold {p['cold']:.1f} ms; compute alone "
            f"(fwd+bwd+SGD, 1 thread) {r['compute_ms']:.1f} ms"
        )
    print(" targets:")
    for row in rows(r):
        if row.target is None:
            continue
        value = row.ratio if row.target.on == "ratio" else row.ours
        shown = f"{value:.3f} x" if row.target.on == "ratio" else f"{value:,.0f} MB"
        print(f"  {row.name}: {shown}, {row.target.describe()}: {'met' if row.met else 'MISSED'}")
    print(
        f" other processes kept {r['foreign_cores']:.2f} cores busy meanwhile; the whole run "
        f"took {r['seconds']:.0f} s"
    )


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.worker_data",
        description="DataParallel(2) over worker-local rows on disk vs the same rows in memory",
    )
    parser.add_argument("--gib", type=float, default=GIB, help="GiB of rows per worker")
    parser.add_argument(
        "--shuffle",
        choices=sorted(SHUFFLES),
        default="both",
        help="shuffled epochs, in order, or both",
    )
    parser.add_argument("--width", type=int, default=WIDTH, help="float32 features per row")
    parser.add_argument(
        "--collective",
        choices=("auto", "torch", "coordinator"),
        default="auto",
        help="DataParallel's collective (default auto: torch where the workers can)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="interleaved rounds of the three jobs (medians)"
    )
    parser.add_argument(
        "--tmp", type=Path, default=None, help="where to write the data (default: the system's)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results there")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    results = run(
        gib=args.gib,
        shuffles=SHUFFLES[args.shuffle],
        width=args.width,
        collective=args.collective,
        rounds=args.rounds,
        tmp=args.tmp,
    )
    report(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
