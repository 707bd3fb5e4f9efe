"""``python -m benchmarks.gpu``: on the cpu every check runs and passes; a CUDA device that is
not there is said in one line and nothing is checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKS = (
    "graph.fit (baseline)",
    "Local vs graph.fit",
    "FedAvg vs FedAvg on cpu",
    "DataParallel(2, collective='torch') vs graph.fit",
    "DataParallel(2, collective='coordinator') vs graph.fit",
    "DataParallel(2, sharding='full') vs graph.fit",
    "ModelParallel(2) vs graph.fit",
    "DataParallel(2, collective='torch') step / torch step",
    "DataParallel(2, collective='coordinator') step / torch step",
)


def _run(*args: str, timeout: float, **extra_env: str) -> subprocess.CompletedProcess[str]:
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra_env}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_every_check_passes_on_the_cpu():
    # Unsandboxed, each job's daemon is forked in milliseconds rather than started anew.
    done = _run("--device", "cpu", "--quick", "--sandbox", "none", timeout=240)

    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for name in CHECKS:
        row = [line for line in lines if line.startswith(name)]
        assert len(row) == 1, (name, done.stdout)
        assert " ok " in row[0] and "FAIL" not in row[0], row[0]
    assert lines[-1] == "every check ok", done.stdout


def test_a_missing_cuda_device_is_said_and_nothing_is_checked():
    # No CUDA device visible to it, whatever this machine has.
    done = _run("--device", "cuda", timeout=60, CUDA_VISIBLE_DEVICES="")

    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    assert lines[0].startswith("no CUDA device here: ") and lines[0].endswith("; nothing checked")
