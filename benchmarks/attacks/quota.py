"""The attack of issue 14, row 8, that :mod:`benchmarks.attacks` makes: big jobs waiting in the
queue, whose inputs the coordinator would hold in memory until a worker is free. A job's inputs
are its submit message's file (``<state_dir>/jobs/<job id>.submit``), read over a memory map.

The scenario registers itself (:func:`~benchmarks.attacks.scenarios.scenario`) when this module is
imported, after those of :mod:`benchmarks.attacks.scenarios`: its row comes after theirs. Like
them it leaves the shared cluster as it found it, both workers idle.
"""

from __future__ import annotations

import stat
import time
from pathlib import Path

import numpy as np

import somatize as sz
from benchmarks.attacks.harness import WAIT, WORKERS, Attack, Memory, Site, pid_of, rss_kib
from benchmarks.attacks.scenarios import scenario
from benchmarks.faults.harness import sleepy_job, until
from tests.utils import Center

QUEUED_JOBS = 2
COLUMNS = 64
QUEUED_BYTES = 300_000_000
"""Bytes of float32 ``x`` of each queued job."""
ROWS = QUEUED_BYTES // (4 * COLUMNS)
BUSY_SECONDS = 300.0
"""How long the jobs keeping both workers busy would compute (they are cancelled first)."""


def reset_peak(pid: int) -> bool:
    """Start the process's peak resident set again from its current one (``5`` written to
    ``/proc/PID/clear_refs``); whether it could be."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_kib(pid: int) -> int:
    """The process's peak resident set (``VmHWM`` of ``/proc/PID/status``), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmHWM for process {pid}")


def _mib(kib: int) -> str:
    return f"{kib / 1024:.1f} MiB"


@scenario
def queued_inputs(site: Site) -> Attack:
    c = site.cluster
    submits_dir = c.state_dir / "jobs"
    x = np.ones((ROWS, COLUMNS), np.float32)  # the same array for both: this process's memory
    queued_mb = QUEUED_JOBS * x.nbytes / 1e6
    with site.client() as client:
        busy = [sleepy_job(client, worker, BUSY_SECONDS) for worker in WORKERS]
        until(lambda: all(c.worker_state(w) not in ("idle", None) for w in WORKERS), "both busy")
        pid = pid_of(c.coordinator)
        since = "the submits" if reset_peak(pid) else "the coordinator started"
        before = rss_kib(pid)
        graph = sz.Graph([Center().named("c")])
        submits: list[float] = []
        jobs: list[sz.Job] = []
        for _ in range(QUEUED_JOBS):
            started = time.perf_counter()
            jobs.append(client.submit(graph, x))
            submits.append(time.perf_counter() - started)
        files = [submits_dir / f"{job.id}.submit" for job in jobs]
        until(lambda: all(f.exists() for f in files), "both queued jobs' submits kept")
        time.sleep(1.0)  # anything the submits left behind is freed, or stays, by now
        after, peak = rss_kib(pid), peak_kib(pid)
        sizes = [f.stat().st_size for f in files]
        modes = {stat.S_IMODE(f.stat().st_mode) for f in files}
        states = [job.status()["state"] for job in jobs]
        if any(state != "queued" for state in states):
            raise AssertionError(f"the big jobs did not wait in the queue: {states}")
        # The queued jobs first: cancelling a busy one first would let a queued one start.
        ends = []
        for job in [*jobs, *busy]:
            job.cancel()
            ends.append(job.wait(timeout=WAIT).event)
            if job in jobs:
                file = files[jobs.index(job)]
                until(lambda file=file: not file.exists(), f"job {job.id}'s file removed")
        until(lambda: all(c.worker_state(w) == "idle" for w in WORKERS), "w0 and w1 idle")
        cancelled = rss_kib(pid)
    if any(end != "cancelled" for end in ends):
        raise AssertionError(f"the jobs did not end cancelled: {ends}")
    if modes != {0o600}:
        raise AssertionError(f"the submit files have modes {sorted(map(oct, modes))}, not 0600")
    if min(sizes) < x.nbytes:
        raise AssertionError(f"a submit file of {min(sizes)} bytes holds less than x's {x.nbytes}")
    growth = (after - before) * 1024
    if growth >= 0.25 * QUEUED_JOBS * x.nbytes:
        raise AssertionError(
            f"the coordinator's RSS grew {growth / 1e6:.0f} MB for {queued_mb:.0f} MB of queued "
            "inputs: they are held in memory"
        )
    return Attack(
        "8",
        "big jobs waiting in the queue",
        f"w0 and w1 each running a `Local` job whose filter sleeps ({BUSY_SECONDS:.0f} s); "
        f"meanwhile {QUEUED_JOBS} submits of a `Center` job on {x.nbytes / 1e6:.0f} MB of "
        f"float32 x each ({ROWS:,} × {COLUMNS}), which no idle worker can take; then all four "
        "cancelled, the queued ones first",
        "both jobs queued, their pickled filters and data in their submit message's file, "
        "`<state_dir>/jobs/<job id>.submit` (`0600`), written before the submit was answered "
        "and read over a memory map, not held in the coordinator's memory (its pages are read "
        "as the job sends them); cancelled while queued, each job's file was removed; both "
        "workers idle again",
        [],
        "",
        "test_queued_inputs.py::test_jobs_inputs_wait_in_their_submit_files_and_are_read_back_"
        "when_they_run",
        Memory("coordinator", before, after),
        [
            f"queued {queued_mb:.0f} MB of x; coordinator RSS {growth / 1e6:+.1f} MB "
            f"({100 * growth / (QUEUED_JOBS * x.nbytes):.1f}% of it), "
            f"{_mib(cancelled)} after the cancels",
            f"submit files {', '.join(f'{s / 1e6:.1f} MB' for s in sizes)}",
            f"coordinator peak RSS (`VmHWM`) since {since}: {_mib(peak)}, "
            f"{(peak - before) / 1024:+.1f} MiB: one submit's message while it is received "
            "and kept, the pages of the unnamed file it lands in (`<state_dir>/incoming`), "
            "which the resident set counts",
            f"each submit answered in {', '.join(f'{s:.1f}' for s in submits)} s (this "
            "process's upload included)",
        ],
    )
