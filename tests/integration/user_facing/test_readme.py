"""The README's walk from the demo to one's own model, run as written (issue 18, item 10).

Its code blocks are taken from the README itself, in order: ``my_model.py`` and ``my_job.py``
are written as files, the shell lines start the coordinator and the two workers it says (on a
port the coordinator picks instead of 8765, with ``HOME`` in the test's directory for the
workers' identity keys)
and submit the job, and each Python block runs as a script in that directory. What each prints
is checked against what the README says it shows.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import somatize as sz
from somatize.cli.cluster import wait_for
from tests.utils import UNIT, said_port, stop_groups

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
SECTION = "## From the demo to your own model"


def walkthrough() -> list[tuple[str, str]]:
    """The section's code blocks, ``(language, code)``, in order."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.DOTALL)


def test_the_walkthrough_has_what_it_promises():
    languages = [language for language, _ in walkthrough()]
    assert languages == ["python", "python", "sh", "python", "sh", "python", "python"]


@contextlib.contextmanager
def started(lines: list[str], cwd: Path, env: dict[str, str]) -> Iterator[int]:
    """The README's background commands (``... &``): the first, the coordinator, on a port of
    its own choosing (``0`` for 8765, read from what it prints), the others told that port;
    stopped at the end. Yields the port."""
    procs: list[subprocess.Popen[bytes]] = []
    port = 0
    try:
        for i, line in enumerate(lines):
            argv = shlex.split(line.replace("127.0.0.1:8765", f"127.0.0.1:{port}").rstrip(" &"))
            argv[0] = str(BIN / argv[0])
            log = cwd / f"process-{i}.log"
            with log.open("ab") as out:
                procs.append(
                    subprocess.Popen(
                        argv,
                        cwd=cwd,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            if i == 0:
                port = said_port(procs[0], log)
        yield port
    finally:
        stop_groups(*procs)


@pytest.mark.timeout(int(400 * UNIT))  # three trainings in-process, two jobs, one cluster
def test_the_walkthrough_runs_as_written(tmp_path):
    (model, in_process, cluster, job, submit, load, client) = (c for _, c in walkthrough())
    (tmp_path / "my_model.py").write_text(model)
    (tmp_path / "my_job.py").write_text(job)
    env = {
        **os.environ,
        "HOME": str(tmp_path),  # the workers' identity keys go under it
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "COLUMNS": "200",
    }
    env.pop("SOMATIZE_TOKEN", None)
    env.pop("SOMATIZE_COORDINATOR", None)

    def python(code: str, seconds: float = 120) -> str:
        if "SOMATIZE_COORDINATOR" in env:
            code = code.replace("ws://127.0.0.1:8765", env["SOMATIZE_COORDINATOR"])
        ran = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=seconds * UNIT,
            check=False,
        )
        assert ran.returncode == 0, ran.stdout + ran.stderr
        return ran.stdout

    said = python(in_process)
    accuracy = float(re.search(r"held-out accuracy ([\d.]+)", said).group(1))
    assert accuracy > 0.9, said
    assert (tmp_path / "model.pt").is_file()

    with started(cluster.strip().splitlines(), tmp_path, env) as port:
        env["SOMATIZE_COORDINATOR"] = f"ws://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                with sz.connect(env["SOMATIZE_COORDINATOR"], timeout=5) as c:
                    states = {w["id"]: w["state"] for w in c.status()["workers"]}
            except sz.ConnectionFailed:
                return False
            return states == {"box-1": "idle", "box-2": "idle"}

        wait_for(ready, 90 * UNIT, "the README's coordinator and workers")
        (tmp_path / "model.pt").unlink()
        (command,) = [line.split("#")[0] for line in submit.strip().splitlines()]
        argv = shlex.split(command)
        argv[0] = str(BIN / argv[0])
        submitted = subprocess.run(
            argv,
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=180 * UNIT,
            check=False,
        )
        assert submitted.returncode == 0, submitted.stderr
        assert "succeeded in" in submitted.stderr and "(epoch mean)" in submitted.stderr
        assert "saved the states of 2 nodes to model.pt" in submitted.stderr
        loaded = float(re.search(r"held-out accuracy ([\d.]+)", python(load)).group(1))
        # DataParallel trains what graph.fit trains: the same held-out accuracy.
        assert loaded == pytest.approx(accuracy, abs=0.01)
        difference = python(client, seconds=180)
        assert float(difference.split()[-1]) < 1e-4, difference
