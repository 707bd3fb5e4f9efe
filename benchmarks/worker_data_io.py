"""The files, caches, probes and process readings of ``python -m benchmarks.worker_data``.

Writing a worker's rows (``x.npy``/``y.npy`` and the same rows as an ``.npz``), dropping or
warming their page cache and measuring how much of them is cached, timing a step's reads and
compute alone, and sampling the daemons' ``/proc`` while a job runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import shutil
import statistics
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.allreduce import cpu_snapshot, descendants, foreign_cores
from benchmarks.periodic import Periodic
from engine.data.npy_rows import NpyRows
from protocol.rules.batching import replica_batches

WIDTH = 4096
"""Features per row: 16 KiB of float32."""
HIDDEN = 256
CLASSES = 10
BATCH = 512
"""Rows per replica per step (8 MiB of ``x``)."""
LR = 0.01
SEED = 0
SAMPLE_S = 0.05
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
        self._periodic = Periodic(self._sample, SAMPLE_S, "daemon watcher")

    def __enter__(self) -> Watcher:
        self._periodic.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._periodic.__exit__(*exc)

    def _sample(self) -> None:
        for worker, agent in self.agents.items():
            for pid in descendants(agent):
                peak = proc_status(pid).get("VmHWM", 0)
                mine = self.peak_kib[worker]
                mine[pid] = max(mine.get(pid, 0), peak)
                if io := proc_io(pid):
                    self.io[worker][pid] = io

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


def wait_quiet(limit_s: float = 60.0, cores: float = 0.15, window_s: float = 0.5) -> float:
    """Wait until the other processes keep under ``cores`` cores busy for ``window_s`` (an
    agent starting the spare daemon a job will take next imports torch: over a second of
    CPU on each worker), at most ``limit_s``; the seconds waited."""
    began = time.monotonic()
    while time.monotonic() - began < limit_s:
        start = cpu_snapshot()
        time.sleep(window_s)
        if foreign_cores(start, cpu_snapshot()) < cores:
            break
    return time.monotonic() - began
