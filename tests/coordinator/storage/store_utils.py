"""What the job store's tests share: a predictable clock, jobs brought to a state, a child
process with this repository importable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from coordinator.storage.store import JobRecord, JobState, JobStore

REPO = Path(__file__).resolve().parents[3]


class Clock:
    """A clock that moves one second per reading, so every time in a record is predictable."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def running_job(store: JobStore, **summary: Any) -> JobRecord:
    job = store.create("local", summary)
    return store.start(job.id, ["w1"])


def job_in_state(store: JobStore, state: JobState) -> JobRecord:
    """A job brought to ``state`` through the public API."""
    job = store.create("local", {"state": str(state)})
    if state is JobState.QUEUED:
        return job
    if state is JobState.CANCELLED:
        return store.cancel(job.id)
    job = store.start(job.id, ["w1"])
    if state is JobState.SUCCEEDED:
        return store.succeed(job.id, b"result of " + job.id.encode())
    if state is JobState.FAILED:
        return store.fail(job.id, "filter_error", "boom")
    return job


def run_child(code: str, *args: str) -> subprocess.Popen[str]:
    """Start ``python -c code args`` with this repository importable."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
