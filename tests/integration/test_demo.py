"""``somatize demo``, the README's first command, end to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import timeout_unit

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


def test_the_demo_trains_in_process_and_on_a_local_cluster_with_the_same_accuracy():
    marker = f"SOMATIZE_DEMO_TEST={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    script = Path(sys.executable).parent / "somatize"
    out = subprocess.run(
        [str(script), "demo", "--epochs", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300 * timeout_unit(),
    )
    assert out.returncode == 0, out.stderr + out.stdout
    local = re.search(r"in-process \(graph\.fit\)\s+([\d.]+)%", out.stdout)
    remote = re.search(r"Local, on one worker\s+([\d.]+)%", out.stdout)
    assert local and remote, out.stdout
    assert float(local.group(1)) > 80.0  # a real dataset, really learned
    assert local.group(1) == remote.group(1)  # the same engine on the same data: the same answer
    assert "somatize-worker --connect ws://COORDINATOR:8765" in out.stdout
    assert _marked(marker) == [], "the demo left processes behind"
