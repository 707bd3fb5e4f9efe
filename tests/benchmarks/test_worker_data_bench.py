"""benchmarks.worker_data: its files, page-cache helpers, probes and rows (no cluster)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from benchmarks import worker_data as wd
from benchmarks import worker_data_io as wdio
from engine.data.dataset_files import describe, open_dataset
from protocol.rules.batching import replica_batches


def test_the_npy_directory_and_the_npz_hold_the_same_rows(tmp_path):
    disk = wdio.write_worker_data(tmp_path / "w0", 600, 0, width=8)
    npz = wdio.write_npz(disk, tmp_path / "w0.npz")

    on_disk, in_memory = describe(disk), describe(npz)
    assert (on_disk.kind, in_memory.kind) == ("npy", "npz")
    assert on_disk.rows == in_memory.rows == 600
    assert on_disk.x == in_memory.x and on_disk.y == in_memory.y
    x, y = open_dataset(npz)
    assert np.array_equal(x, np.load(disk / "x.npy"))
    assert np.array_equal(y, np.load(disk / "y.npy"))
    assert x.dtype == np.float32 and y.dtype == np.int64
    assert y.min() >= 0 and y.max() < wdio.CLASSES
    other = wdio.write_worker_data(tmp_path / "w1", 600, 1, width=8)
    assert not np.array_equal(np.load(other / "x.npy"), x)


def test_rows_for_makes_the_gib_asked_and_at_least_a_batch():
    assert wdio.rows_for(4) == 262_144
    assert wdio.rows_for(0.5) * wdio.WIDTH * 4 == 2**29
    assert wdio.rows_for(1e-6) == wdio.BATCH


def test_a_file_read_through_is_cached_and_its_share_is_a_fraction(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    wdio.warm_cache([path])
    assert wdio.cached_share([path]) == 1.0
    wdio.drop_cache([path])
    share = wdio.cached_share([path])
    assert share is not None and 0.0 <= share <= 1.0


def test_the_probe_reads_the_jobs_first_slices_of_replica_0(tmp_path):
    disk = wdio.write_worker_data(tmp_path / "w0", 3 * wdio.BATCH, 0, width=4)
    for shuffle in (True, False):
        plan = wdio.plan_rows(3 * wdio.BATCH, shuffle, 2)
        expected = [
            s[0] for _, _, s in replica_batches([3 * wdio.BATCH] * 2, 1, wdio.BATCH, shuffle, 0)
        ]
        assert len(plan) == 2
        assert all(np.array_equal(p, e) for p, e in zip(plan, expected, strict=False))
        times = wdio.time_reads(disk, plan)
        assert len(times) == 2 and all(t >= 0 for t in times)


def test_this_process_has_a_peak_rss():
    status = wdio.proc_status(os.getpid())
    assert status["VmHWM"] >= status["VmRSS"] > 0
    assert wdio.proc_status(2**22 + 1) == {}


def _job(step_ms: float, peak_mb: float, **extra):
    daemons = {w: {"peak_mb": peak_mb, "read_mb": 10.0, "rchar_mb": 20.0} for w in wd.WORKERS}
    return {"step_s": step_ms / 1e3, "daemons": daemons, **extra}


def test_rows_hold_the_disk_step_to_1_2_x_memory_and_each_daemon_under_1_5_gb():
    results = {
        "gib": 4.0,
        "by_shuffle": {
            "on": {
                "memory": _job(100.0, 4400.0),
                "warm": _job(110.0, 600.0, rows_mb_s=170.0),
                "cold": _job(130.0, 1600.0, rows_mb_s=140.0),
                "probe_ms": {"warm": 5.0, "cold": 30.0},
            }
        },
    }
    out = wd.rows(results)
    assert len(out) == 6
    warm_step, warm_rss, warm_rate, cold_step, cold_rss, _ = out
    assert warm_step.ratio == pytest.approx(1.1) and warm_step.met
    assert cold_step.ratio == pytest.approx(1.3) and not cold_step.met
    assert warm_rss.met and not cold_rss.met
    assert warm_rate.target is None and warm_rate.ours == 170.0
