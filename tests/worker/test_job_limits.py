"""Issue 14, row 7: a job's daemon is killed whole when the job closes, and held to
``--max-job-memory`` and ``--max-job-procs``.

A real in-process agent with real filter daemons, driven by the coordinator stand-in: a filter
that forks a long sleeper leaves nothing behind once its job closes; one that grows past the
memory limit, or forks past the process limit, fails its call with ``resource_limit`` naming
the limit, and the worker's next job runs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import torch

from protocol.errors import ErrorCode
from protocol.messages import Ack, CloseJob
from tests.utils import UNIT, Center
from tests.worker.standin import (
    StandIn,
    call,
    call_error,
    drive,
    gone,
    no_process_left,
    open_job,
    running,
)
from worker.job_limits import JobLimits, Usage, group_usage, over

pytestmark = pytest.mark.integration
__all__ = ["no_process_left"]


class Forks:
    """Its fit starts ``n`` sleepers of its own and says their pids."""

    def __init__(self, n: int) -> None:
        self.n = n

    def fit(self, x, y=None):
        sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(self.n)]
        time.sleep(1.0)  # long enough to be seen by the limit's watch
        return {"pids": [p.pid for p in sleepers]}

    def forward(self, x, state):
        return x


class Hog:
    """Its fit holds ``mib`` MiB, touched, for a while."""

    def __init__(self, mib: int) -> None:
        self.mib = mib

    def fit(self, x, y=None):
        held = np.ones(self.mib << 18, dtype=np.float32)  # 4 bytes each: mib MiB
        time.sleep(2.0)
        return {"sum": float(held[:10].sum())}

    def forward(self, x, state):
        return x


def test_what_a_filter_forks_is_killed_with_its_job() -> None:
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in, worker_id="w-forks", spare=False):
            channel = await stand_in.next_channel()
            await open_job(channel, "j", forks=Forks(2))
            result = await call(channel, "j", "fit", node_id="forks", x=[1.0])
            pids = result["states"]["forks"]["pids"]
            assert len(pids) == 2 and not any(gone(pid) for pid in pids)
            assert isinstance(await channel.request(CloseJob(job_id="j"), 10 * UNIT), Ack)
            for _ in range(int(5 * UNIT / 0.05)):
                if all(gone(pid) for pid in pids):
                    break
                await asyncio.sleep(0.05)
            assert all(gone(pid) for pid in pids), "a sleeper outlived its job"

    drive(main)


@pytest.mark.parametrize(
    ("limits", "filter_", "says"),
    [
        ({"max_job_memory": 400 << 20}, Hog(1024), "over --max-job-memory 400 MiB"),
        ({"max_job_procs": 3}, Forks(4), "over --max-job-procs 3"),
    ],
    ids=["memory", "procs"],
)
def test_a_job_over_its_limit_fails_resource_limit_and_the_next_one_runs(limits, filter_, says):
    stand_in = StandIn()

    async def main() -> None:
        async with running(stand_in, worker_id="w-limited", spare=False, **limits) as agent:
            channel = await stand_in.next_channel()
            await open_job(channel, "j", greedy=filter_, center=Center())
            pid = agent.jobs["j"].pid
            started = time.monotonic()
            error = await call_error(channel, "j", "fit", node_id="greedy", x=[1.0])
            assert error.code == ErrorCode.RESOURCE_LIMIT
            assert says in error.message and "killed" in error.message
            assert error.detail["worker_id"] == "w-limited" and error.detail["job_id"] == "j"
            assert time.monotonic() - started < 10 * UNIT
            assert pid is not None and gone(pid)
            await open_job(channel, "k", center=Center())
            fitted = await call(channel, "k", "fit", node_id="center", x=torch.ones(2, 2))
            torch.testing.assert_close(fitted["states"]["center"]["mean"], torch.ones(2))

    drive(main)


def test_group_usage_counts_the_processes_of_the_group_and_their_memory() -> None:
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        usage = group_usage(sleeper.pid)
        assert usage.procs == 1 and 0 < usage.rss_bytes < 64 << 20
        assert group_usage(os.getpgrp()).procs >= 1
    finally:
        os.kill(sleeper.pid, signal.SIGKILL)
        sleeper.wait()
    assert over(Usage(5 << 20, 1), JobLimits(memory_bytes=4 << 20)) is not None
    assert over(Usage(3 << 20, 2), JobLimits(memory_bytes=4 << 20, procs=2)) is None
    with pytest.raises(ValueError, match="must be positive"):
        JobLimits(procs=0)
