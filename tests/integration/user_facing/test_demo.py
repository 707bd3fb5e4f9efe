"""``somatize demo``, the README's first command, end to end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.utils import UNIT, interruptible

pytestmark = pytest.mark.integration


def _marked(marker: str) -> list[int]:
    """Pids of the processes whose environment carries ``marker`` (a demo's descendants)."""
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                pids.append(int(environ.parent.name))
        except OSError:
            continue  # gone, or not ours to read
    return pids


def test_the_demo_trains_every_strategy_on_a_local_cluster_next_to_graph_fit():
    marker = f"SOMATIZE_DEMO_TEST={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    script = Path(sys.executable).parent / "somatize"
    out = subprocess.run(
        [str(script), "demo", "--epochs", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300 * UNIT,
    )
    assert out.returncode == 0, out.stderr + out.stdout

    def held_out(label: str) -> float:
        found = re.search(re.escape(label) + r"\s+([\d.]+)%", out.stdout)
        assert found, f"no accuracy for {label!r} in:\n{out.stdout}"
        return float(found.group(1))

    reference = held_out("in-process (graph.fit)")
    assert reference > 80.0  # a real dataset, really learned
    # The same engine on the same batches: the same answer, within half a point.
    assert abs(held_out("DataParallel, 2 workers") - reference) <= 0.5
    assert abs(held_out("ModelParallel, 2 stages, M=4") - reference) <= 0.5
    assert held_out("FedAvg, 2 workers, 10 rounds") > 50.0
    assert "somatize-worker --connect ws://COORDINATOR:8765" in out.stdout
    assert "job code's sandbox on the workers: bwrap" in out.stdout  # root, bubblewrap: make test
    # Issue 18: every row has its time, the in-process one too; the closing hint's worker line
    # carries the tag examples/digits_job.py asks for, and says why small models run slower.
    for label in ("in-process (graph.fit)", "DataParallel, 2 workers", "FedAvg, 2 workers"):
        assert re.search(re.escape(label) + r".*\s[\d.]+%\s+[\d.]+ s$", out.stdout, re.M), label
    assert "--id box-1 --tag dp" in out.stdout and "examples/digits_job.py" in out.stdout
    assert "A model this small trains fastest in-process" in out.stdout
    assert _marked(marker) == [], "the demo left processes behind"


def test_ctrl_c_stops_the_demo_and_everything_it_started():
    marker = f"SOMATIZE_DEMO_TEST={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    script = Path(sys.executable).parent / "somatize"
    proc = subprocess.Popen(
        interruptible([str(script), "demo", "--epochs", "50"]),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # wait until the cluster runs a job
            if "DataParallel, 2 workers" in line:
                break
        time.sleep(1.0)
        assert len(_marked(marker)) > 3  # the coordinator, two agents and their daemons
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60 * UNIT)[0]
        assert proc.returncode == 130, rest
        assert "interrupted" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    deadline = time.monotonic() + 15 * UNIT
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _marked(marker) == [], "Ctrl-C left processes behind"
