"""A job's filter daemon killed, or hung past the coordinator's ``--call-timeout``, on a live
cluster: the job fails with the daemon's error naming the worker, the worker itself stays
connected and idle, and its next job succeeds."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import somatize as sz
from tests.integration.cluster import Cluster, cluster, wait_for
from tests.utils import UNIT, Center

pytestmark = pytest.mark.integration

CALL_TIMEOUT = 3 * UNIT
"""The coordinator's ``--call-timeout``: what one command may take (the plain filters here take
milliseconds; a first torch training in a fresh daemon can take longer on a loaded machine)."""


class Marked(sz.Filter):
    """Writes its daemon's pid to ``path``, then computes for ``seconds``."""

    def __init__(self, path: Path, seconds: float) -> None:
        self.path = str(path)
        self.seconds = seconds

    def fit(self, x, y=None):
        Path(self.path).write_text(str(os.getpid()))
        time.sleep(self.seconds)
        return {}


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Cluster]:
    """One worker under a short call timeout, shared by the tests below (each leaves it idle)."""
    directory = tmp_path_factory.mktemp("daemon-faults")
    with cluster(directory, {"w1": ()}, call_timeout=CALL_TIMEOUT) as c:
        yield c


def _marked_job(client: sz.Client, path: Path, seconds: float) -> tuple[sz.Job, int]:
    """A job whose daemon is computing, and that daemon's pid."""
    job = client.submit(sz.Graph([Marked(path, seconds).named("marked")]), np.zeros((2, 2)))
    pid = wait_for(lambda: path.exists() and path.read_text(), 30 * UNIT, "the filter to start")
    return job, int(pid)


def _next_job_succeeds(c: Cluster, client: sz.Client) -> None:
    """The worker runs a job again (a plain filter: milliseconds, well inside the timeout)."""
    wait_for(lambda: c.worker_state("w1") == "idle", 15 * UNIT, "w1 idle again")
    x = np.random.default_rng(0).normal(size=(16, 3))
    fitted = client.submit(sz.Graph([Center().named("center")]), x).result(timeout=60 * UNIT)
    np.testing.assert_allclose(fitted.states["center"]["mean"], x.mean(0), rtol=0, atol=1e-12)
    record = c.worker("w1")
    assert record is not None and record["connections"] == 1  # never disconnected


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_a_daemon_killed_mid_job_fails_the_job_naming_worker_and_signal(live, tmp_path):
    with live.client() as client:
        job, pid = _marked_job(client, tmp_path / "pid", 60)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(sz.JobFailed) as failure:
            job.result(timeout=30 * UNIT)
        assert time.monotonic() - killed_at < 5 * UNIT  # the pipe's EOF, not a timeout
        assert failure.value.code == "daemon_crashed"
        assert "'w1'" in failure.value.message and "SIGKILL" in failure.value.message
        _next_job_succeeds(live, client)


def test_a_daemon_hung_past_the_call_timeout_is_killed_and_the_job_fails(live, tmp_path):
    with live.client() as client:
        job, pid = _marked_job(client, tmp_path / "pid", 3600)
        with pytest.raises(sz.JobFailed) as failure:
            job.result(timeout=CALL_TIMEOUT + 30 * UNIT)
        assert failure.value.code == "timeout"
        assert "'w1'" in failure.value.message
        assert f"within {CALL_TIMEOUT}s" in failure.value.message
        wait_for(lambda: _gone(pid), 10 * UNIT, "the hung daemon to be killed")
        _next_job_succeeds(live, client)
