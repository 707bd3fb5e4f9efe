"""Issue 14, row 8: a queued job's inputs wait on disk, not in the coordinator's memory.

A real coordinator with no worker: jobs of 8 MB each stay queued, their filters and data in
their submit messages' files, ``<state_dir>/jobs/<job id>.submit`` (private, like the store),
which the coordinator reads over a memory map; one cancelled while queued leaves no file; once
a worker comes the others run on their data read back, exactly.
"""

from __future__ import annotations

import stat

import numpy as np
import pytest

import somatize as sz
from tests.integration.cluster import cluster, wait_for
from tests.utils import UNIT, Center

pytestmark = pytest.mark.integration

ROWS = 1 << 17  # × 8 float64 columns: 8 MiB of x per job


def test_jobs_inputs_wait_in_their_submit_files_and_are_read_back_when_they_run(tmp_path):
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((ROWS, 8)) for _ in range(3)]
    with cluster(tmp_path, {}) as c, c.client(timeout=30 * UNIT) as client:
        jobs = [client.submit(sz.Graph([Center().named("c")]), x) for x in xs]
        kept = tmp_path / "state" / "jobs"
        files = {j.id: kept / f"{j.id}.submit" for j in jobs}
        for path in files.values():
            assert path.stat().st_size > xs[0].nbytes
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(kept.stat().st_mode) == 0o700
        jobs[2].cancel()
        assert jobs[2].wait(timeout=10 * UNIT).event == "cancelled"
        wait_for(lambda: not files[jobs[2].id].exists(), 10 * UNIT, "the cancelled job's file")

        c.start_worker("w0")
        for job, x in zip(jobs[:2], xs, strict=False):
            mean = job.states(timeout=60 * UNIT)["c"]["mean"]
            np.testing.assert_array_equal(mean, x.mean(0))  # the very rows, read back
        wait_for(lambda: not any(kept.iterdir()), 10 * UNIT, "the ended jobs' files to go")
