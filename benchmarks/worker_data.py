"""DataParallel(2) over worker-local rows read from disk, next to the same rows held in memory.

``python -m benchmarks.worker_data [--gib G] [--shuffle both|on|off] [--rounds R]
[--collective auto|torch|coordinator] [--json PATH]`` writes, for each of two
workers, ``G`` GiB (default :data:`GIB`, 4) of float32 rows of :data:`WIDTH` features (16 KiB a
row; 262,144 rows at 4 GiB) with int64 labels, twice: as a directory of ``x.npy``/``y.npy`` and
as an uncompressed ``.npz`` holding the same two ``.npy`` files (byte for byte). One
:class:`somatize.cluster.LocalCluster` (a real coordinator, two real ``somatize-worker
--threads 1``, job threads 1) serves both on each worker: ``--data disk=DIR --data mem=NPZ``.
Per shuffle setting, one epoch of ``sz.DataParallel(2, collective=C)`` (``--collective``,
default ``auto``: torch where the workers can) over
``sz.WorkerData(...)`` trains the MLP ``WIDTH``-256-10 (SGD, lr 0.01, cross-entropy,
``batch_size`` :data:`BATCH` rows *per replica*, ``seed`` 0), three times:

- *anchor, memory*: ``WorkerData("mem")``: each daemon reads its ``.npz`` whole when the job
  stages it (:mod:`worker.dataset_files`) and every step takes its rows from that array;
- *ours, disk, warm*: ``WorkerData("disk")`` with the files read through once just before
  (the page cache holds them: its share is printed), each step reading its rows with ``pread``
  (:class:`worker.npy_rows.NpyRows`), nothing else held;
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
:data:`PROBE_STEPS` steps of replica 0's plan (:func:`protocol.batching.replica_batches`) read
with ``NpyRows``, warm and cold — and one replica's compute alone (512 rows forward, backward,
SGD step). The disk path reads a step's rows synchronously, between two steps, in the daemon's
one thread: the ratio's excess over 1 is about read / (compute + all-reduce).

Targets (issue 15): disk step ≤ :data:`RATIO_TARGET` × memory step, each daemon's peak RSS on
the disk path < :data:`RSS_TARGET_MB` MB. Everything written lives in a temporary directory
removed at the end; every process is stopped. With ``--rounds R`` the three jobs run ``R`` times,
interleaved, and the medians are taken. On 2 cores ``--gib 0.5`` takes about a minute; the default
4 GiB writes 16 GiB (50 s) and takes about six minutes a round of both shuffle settings.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import somatize as sz
from benchmarks.allreduce import cpu_snapshot, descendants, foreign_cores
from benchmarks.data_parallel import per_step
from benchmarks.report import Row, Target
from protocol.batching import replica_batches
from somatize.cluster import LocalCluster
from worker.npy_rows import NpyRows

GIB = 4.0
"""GiB of ``x`` rows per worker."""
WIDTH = 4096
"""Features per row: 16 KiB of float32."""
HIDDEN = 256
CLASSES = 10
BATCH = 512
"""Rows per replica per step (8 MiB of ``x``)."""
LR = 0.01
SEED = 0
WORKERS = ("w0", "w1")
SHUFFLES = {"both": (True, False), "on": (True,), "off": (False,)}
PROBE_STEPS = 16
"""Steps read alone, in this process, for the read-per-step context."""
SAMPLE_S = 0.05
EVENT_TIMEOUT = 600.0
RATIO_TARGET = 1.2
RSS_TARGET_MB = 1500.0
CHUNK = 1 << 24
"""Bytes written or read at a time while preparing the files."""


# -- the data --------------------------------------------------------------------------------


def rows_for(gib: float, width: int = WIDTH) -> int:
    """Rows of ``width`` float32 that make ``gib`` GiB (at least one batch)."""
    return max(BATCH, int(gib * 2**30) // (width * 4))


def write_worker_data(directory: Path, rows: int, worker: int, width: int = WIDTH) -> Path:
    """``directory/x.npy`` (``rows`` × ``width`` float32) and ``y.npy`` (int64 labels in
    ``[0, CLASSES)``), a cheap deterministic fill that differs by ``worker``; returns
    ``directory``."""
    directory.mkdir(parents=True)
    shape = (rows, width)
    x = np.lib.format.open_memmap(directory / "x.npy", mode="w+", dtype=np.float32, shape=shape)
    pattern = np.cos(np.arange(width, dtype=np.float32) / 97.0 + worker)
    step = max(1, CHUNK // (width * 4))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        scale = ((np.arange(lo, hi) % 251) / 125.0 - 1.0).astype(np.float32)
        np.multiply(scale[:, None], pattern[None, :], out=x[lo:hi])
    x.flush()
    del x
    np.save(directory / "y.npy", ((np.arange(rows) % 251) * CLASSES // 251).astype(np.int64))
    return directory


def write_npz(npy_dir: Path, path: Path) -> Path:
    """An uncompressed ``.npz`` holding ``npy_dir``'s ``x.npy`` and ``y.npy`` as they are (which is
    what ``np.savez`` writes), copied a chunk at a time; returns ``path``."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as npz:
        for name in ("x.npy", "y.npy"):
            with (npy_dir / name).open("rb") as src, npz.open(name, "w", force_zip64=True) as dst:
                shutil.copyfileobj(src, dst, CHUNK)
    return path


def drop_cache(paths: Sequence[Path]) -> None:
    """Write ``paths`` back and ask the kernel to drop their cached pages (no root needed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(paths: Sequence[Path]) -> None:
    """Read ``paths`` through once, so that the page cache holds them."""
    buffer = bytearray(CHUNK)
    for path in paths:
        with path.open("rb", buffering=0) as file:
            while file.readinto(buffer):
                pass


def _libc() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def cached_share(paths: Sequence[Path]) -> float | None:
    """The share of ``paths``' pages in the page cache (``mincore`` of an untouched map), or
    ``None`` where it cannot be read."""
    try:
        libc = _libc()
    except (OSError, AttributeError, TypeError):
        return None
    page = mmap.PAGESIZE
    resident = total = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                pages = (size + page - 1) // page
                vector = (ctypes.c_ubyte * pages)()
                if libc.mincore(address, size, vector) != 0:
                    return None
                resident += int(np.count_nonzero(np.ctypeslib.as_array(vector) & 1))
                total += pages
            finally:
                libc.munmap(address, size)
        finally:
            os.close(fd)
    return resident / total if total else None


# -- the model and the context figures -------------------------------------------------------


def model(width: int = WIDTH, seed: int = SEED) -> torch.nn.Sequential:
    """The MLP ``width``-256-10, seeded."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(width, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)
    )


def plan_rows(rows: int, shuffle: bool, steps: int) -> list[np.ndarray[Any, Any]]:
    """Replica 0's row indices of the first ``steps`` steps of the job's epoch."""
    out = []
    for _, step, slices in replica_batches([rows, rows], 1, BATCH, shuffle, SEED):
        if step >= steps:
            break
        out.append(np.asarray(slices[0]))
    return out


def time_reads(directory: Path, plan: Sequence[np.ndarray[Any, Any]]) -> list[float]:
    """Seconds each step of ``plan`` takes to read its ``x`` and ``y`` rows with ``NpyRows``."""
    x, y = NpyRows(directory / "x.npy"), NpyRows(directory / "y.npy")
    times = []
    for index in plan:
        began = time.perf_counter()
        x.rows(index)
        y.rows(index)
        times.append(time.perf_counter() - began)
    return times


def time_compute(width: int, steps: int = 12) -> float:
    """Median seconds of one replica's step alone: forward, backward and SGD of :data:`BATCH`
    rows, 1 torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = model(width)
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        xb = torch.randn(BATCH, width)
        yb = torch.randint(0, CLASSES, (BATCH,))
        times = []
        for _ in range(steps + 2):
            began = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xb), yb).backward()
            opt.step()
            times.append(time.perf_counter() - began)
        return statistics.median(times[2:])
    finally:
        torch.set_num_threads(threads)


# -- processes -------------------------------------------------------------------------------


def proc_status(pid: int) -> dict[str, int]:
    """``VmHWM`` and ``VmRSS`` (KiB) of ``pid``; empty when it is gone (or a zombie)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key = line.split(":", 1)[0]
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(line.split()[1])
    return out


def proc_io(pid: int) -> dict[str, int]:
    """``read_bytes`` (from storage) and ``rchar`` (every read call) of ``pid``, if readable."""
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return {}
    pairs = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k: int(v) for k, v in pairs if k in ("read_bytes", "rchar")}


def pytest_running() -> bool:
    """Whether some process of this machine runs pytest (a full test run skews the figures)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if b"pytest" in (entry / "cmdline").read_bytes():
                    return True
    return False


class Watcher:
    """Samples every process below each agent while a job runs: peak ``VmHWM`` and last
    ``/proc/PID/io`` per pid, grouped by worker."""

    def __init__(self, agents: dict[str, int]) -> None:
        self.agents = agents
        self.peak_kib: dict[str, dict[int, int]] = {w: {} for w in agents}
        self.io: dict[str, dict[int, dict[str, int]]] = {w: {} for w in agents}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            for worker, agent in self.agents.items():
                for pid in descendants(agent):
                    peak = proc_status(pid).get("VmHWM", 0)
                    mine = self.peak_kib[worker]
                    mine[pid] = max(mine.get(pid, 0), peak)
                    if io := proc_io(pid):
                        self.io[worker][pid] = io
            if self._stop.wait(SAMPLE_S):
                return

    def summary(self) -> dict[str, dict[str, float]]:
        """Per worker: ``peak_mb`` (its largest daemon's ``VmHWM``), ``read_mb`` and
        ``rchar_mb`` (summed over its daemons)."""
        out = {}
        for worker in self.agents:
            ios = self.io[worker].values()
            out[worker] = {
                "peak_mb": max(self.peak_kib[worker].values(), default=0) * 1024 / 1e6,
                "read_mb": sum(io.get("read_bytes", 0) for io in ios) / 1e6,
                "rchar_mb": sum(io.get("rchar", 0) for io in ios) / 1e6,
            }
        return out


# -- the jobs --------------------------------------------------------------------------------


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
                c.start_worker(worker, threads=1, data=data)
                status = proc_status(c.workers[worker].pid)
                startup[worker] = {
                    "seconds": time.monotonic() - began,
                    "peak_mb": status.get("VmHWM", 0) * 1024 / 1e6,
                    "rss_mb": status.get("VmRSS", 0) * 1024 / 1e6,
                }
            yield c, startup
        except Exception:
            for log in sorted(c.logs.glob("*.log")):
                lines = log.read_text(errors="replace").splitlines()[-30:]
                print(f"--- tail of {log.name} ---", *lines, sep="\n", file=sys.stderr)
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
