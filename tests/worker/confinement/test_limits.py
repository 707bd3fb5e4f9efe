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
from worker.confinement.cgroup import CgroupParent
from worker.confinement.limits import JobLimits, Usage, group_usage, over, usage_of

pytestmark = pytest.mark.integration
__all__ = ["no_process_left"]


class Forks:
    """Its fit starts ``n`` sleepers of its own and says their pids; with ``escape`` they
    leave the daemon's process group (a session of their own, as a daemonizing library's)."""

    def __init__(self, n: int, escape: bool = False) -> None:
        self.n = n
        self.escape = escape

    def fit(self, x, y=None):
        sleepers = [
            subprocess.Popen(["sleep", "600"], start_new_session=self.escape) for _ in range(self.n)
        ]
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


@pytest.mark.parametrize(
    ("escape", "job_cgroups"),
    [(False, False), (True, True)],
    ids=["its-process-group", "setsid-its-cgroup"],
)
def test_what_a_filter_forks_is_killed_with_its_job(escape: bool, job_cgroups: bool) -> None:
    """In its process group, it dies with the group; out of it by ``setsid``, the job's cgroup
    holds it — where the machine lets the agent make one (this one does, as root). Where it
    does not, the agent says so and that sleeper outlives the job: the documented limit."""
    stand_in = StandIn()

    async def main() -> None:
        options = {"worker_id": "w-forks", "spare": False, "job_cgroups": job_cgroups}
        async with running(stand_in, **options) as agent:
            channel = await stand_in.next_channel()
            held = agent._pool.cgroups is not None
            assert held == (job_cgroups and isinstance(CgroupParent.find(), CgroupParent))
            await open_job(channel, "j", forks=Forks(2, escape))
            result = await call(channel, "j", "fit", node_id="forks", x=[1.0])
            pids = result["states"]["forks"]["pids"]
            assert len(pids) == 2 and not any(gone(pid) for pid in pids)
            assert isinstance(await channel.request(CloseJob(job_id="j"), 10 * UNIT), Ack)
            for _ in range(int(5 * UNIT / 0.05)):
                if all(gone(pid) for pid in pids):
                    break
                await asyncio.sleep(0.05)
            survivors = [pid for pid in pids if not gone(pid)]
            for pid in survivors:
                os.kill(pid, signal.SIGKILL)
            assert survivors == ([] if held or not escape else pids), "a sleeper outlived its job"

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


def test_usage_of_counts_the_processes_given_and_skips_those_gone() -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        usage = usage_of([sleeper.pid, 2**22 + 1])  # a pid above pid_max: gone
        assert usage.procs == 1 and 0 < usage.rss_bytes < 64 << 20
    finally:
        sleeper.kill()
        sleeper.wait()


def test_without_a_cgroup_v2_the_agent_is_told_why(tmp_path) -> None:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("4:memory:/docker/1\n")
    (proc / "self" / "mountinfo").write_text(
        "30 23 0:26 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    )
    assert CgroupParent.find(proc) == "the machine has no cgroup v2 hierarchy"
    (proc / "self" / "cgroup").write_text("0::/agents\n")
    (proc / "self" / "mountinfo").write_text(
        f"31 23 0:27 / {tmp_path / 'cgroup2'} rw,relatime - cgroup2 cgroup2 rw\n"
    )
    found = CgroupParent.find(proc)  # its cgroup's directory is not there to write to
    assert isinstance(found, str) and f"cannot make cgroups under {tmp_path}" in found
