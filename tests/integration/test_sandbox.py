"""Job code in its sandbox (issue 32's attacks as tests): a live worker with ``--sandbox``
runs a job whose filter tries what the attack did — read the agent's token file and identity
key and ``/proc/<agent>/``, leave its cgroup, plant a ``.pth`` file in the environment, leave
files in ``/tmp`` and ``/dev/shm``, outlive its job — and reports what it got.

With bubblewrap on the machine (``make test`` installs it) the worker runs ``--sandbox bwrap``
and every attempt fails; so it does under ``--sandbox uid`` where this machine allows it (a root
agent, an interpreter any uid may run), else the worker refuses to start, saying why; a worker
with no sandbox says so at start and in ``status``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import somatize as sz
from somatize.errors import ClusterError
from tests.integration.cluster import Cluster
from tests.utils import UNIT

pytestmark = pytest.mark.integration

MARK = "6173"
"""The seconds of the ``sleep`` a job leaves behind: how the test finds it afterwards."""


class Probe(sz.Filter):
    """A plain filter whose ``fit`` attempts each attack and reports each outcome."""

    def __init__(self, secrets: list[str], agent: int, stamp: str) -> None:
        self.secrets = secrets
        self.agent = agent
        self.stamp = stamp

    def fit(self, x: Any, y: Any = None) -> dict[str, Any]:
        import glob
        import site
        import subprocess

        def attempt(action: Any) -> str:
            try:
                return f"ok: {action()!r}"[:200]
            except Exception as exc:
                return f"refused: {type(exc).__name__}"

        def read(path: str) -> str:
            with open(path) as f:
                return f.read()

        def write(path: str) -> int:
            with open(path, "w") as f:
                return f.write("planted")

        report = {f"secret {k}": attempt(lambda p=p: read(p)) for k, p in enumerate(self.secrets)}
        report["agent /proc"] = attempt(lambda: read(f"/proc/{self.agent}/environ"))
        procs = glob.glob("/sys/fs/cgroup/cgroup.procs") + glob.glob(
            "/sys/fs/cgroup/*/cgroup.procs"
        )
        report["leave cgroup"] = attempt(lambda: write(procs[0]) if procs else 1 / 0)
        pth = os.path.join(site.getsitepackages()[0], f"planted-{self.stamp}.pth")
        report["plant .pth"] = attempt(lambda: write(pth))
        report["/tmp"] = attempt(lambda: write(f"/tmp/left-{self.stamp}"))
        report["/dev/shm"] = attempt(lambda: write(f"/dev/shm/left-{self.stamp}"))
        subprocess.Popen(["sleep", MARK], start_new_session=True)
        return {"report": np.frombuffer(json.dumps(report).encode(), dtype=np.uint8)}

    def forward(self, x: Any, state: dict[str, Any]) -> Any:
        return x


def _sleeping() -> list[int]:
    """Processes on this machine running the probe's ``sleep``."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[:2] == [b"sleep", MARK.encode()]:
                found.append(int(entry.name))
    return found


@pytest.mark.parametrize("level", ["bwrap", "uid", "none"])
def test_job_code_cannot_reach_the_agents_secrets_its_environment_or_outlive_its_job(
    tmp_path, level
):
    token = secrets.token_urlsafe(16)
    token_file = tmp_path / "worker-token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    identity = tmp_path / "identities" / "w0.key"  # where the cluster keeps w0's
    stamp = secrets.token_hex(4)
    cluster = Cluster(tmp_path / "state", worker_token=token)
    try:
        cluster.start_coordinator()
        argv = ["--token-file", str(token_file), "--sandbox", level]
        try:
            cluster.start_worker("w0", args=argv)
        except ClusterError:
            log = (cluster.logs / "worker-w0.log").read_text()
            # uid wants a root agent and an interpreter any uid may run: else refused at start,
            # saying which (this machine's python may live in root's home, say).
            assert level == "uid", log
            assert "--sandbox uid: " in log or "--sandbox uid needs the agent to run as root" in log
            return
        agent = cluster.workers["w0"].pid
        with sz.connect(cluster.url, timeout=30 * UNIT) as client:
            worker = next(w for w in client.status()["workers"] if w["id"] == "w0")
            assert worker["capabilities"]["sandbox"] == level
            probe = Probe([str(token_file), str(identity.resolve())], agent, stamp)
            graph = sz.Graph([probe.named("probe")])
            fitted = client.submit(graph, np.zeros((2, 1), np.float32)).result(120 * UNIT)
        report = json.loads(bytes(np.asarray(fitted.states["probe"]["report"])).decode())
        log = (cluster.logs / "worker-w0.log").read_text()
    finally:
        cluster.close()
    left = (Path(f"/tmp/left-{stamp}"), Path(f"/dev/shm/left-{stamp}"))
    if level == "none":  # nothing stops it: the worker said so, loudly, at start
        assert "NO SANDBOX for job code" in log
        assert report["secret 0"] == f"ok: {token!r}"
        for path in left:
            path.unlink(missing_ok=True)
        return
    assert f"job code runs sandboxed: {level}" in log
    # It may write /tmp and /dev/shm (its own under bwrap), and nothing of it stays there once
    # its job is gone.
    assert report.pop("/tmp") == report.pop("/dev/shm") == "ok: 7"
    assert not any(path.exists() for path in left)
    # Every attack refused (the secrets, if read at all, read as empty files).
    assert {k: v for k, v in report.items() if not v.startswith("refused") and v != "ok: ''"} == {}
    deadline = time.monotonic() + 10 * UNIT
    while _sleeping() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _sleeping() == []  # what it started went with its job


def test_sandboxed_daemons_train_data_parallel_on_their_own_data(tmp_path):
    """Under bubblewrap a daemon still reads its worker's dataset (in /tmp, bound over the
    private one), joins a gloo group over loopback and exchanges tensors through its shared
    memory: DataParallel on the torch collective over WorkerData trains as it does outside."""
    if not shutil.which("bwrap"):  # the machine has no sandbox: the test above says so
        pytest.fail("bubblewrap is not installed: make test installs it (make bubblewrap)")
    rng = np.random.default_rng(0)
    paths = {}
    for worker in ("w0", "w1"):
        x = rng.normal(size=(64, 4)).astype(np.float32)
        np.savez(tmp_path / f"{worker}.npz", x=x, y=(x.sum(1) > 0).astype(np.int64))
        paths[worker] = {"local": tmp_path / f"{worker}.npz"}

    def graph() -> sz.Graph:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        return sz.Graph([sz.TorchFilter(net, loss="cross_entropy", epochs=2, batch_size=16)])

    fits = {}
    for level in ("bwrap", "none"):
        cluster = Cluster(tmp_path / level / "state", sandbox=level)
        try:
            cluster.start_coordinator()
            for worker in ("w0", "w1"):
                cluster.start_worker(worker, data=paths[worker])
            with sz.connect(cluster.url, timeout=30 * UNIT) as client:
                strategy = sz.DataParallel(2, collective="torch")
                job = client.submit(graph(), sz.WorkerData("local"), strategy=strategy)
                fits[level] = job.result(180 * UNIT)
        finally:
            cluster.close()
    for key, value in fits["none"].states[next(iter(fits["none"].states))].items():
        sandboxed = fits["bwrap"].states[next(iter(fits["bwrap"].states))][key]
        np.testing.assert_array_equal(np.asarray(sandboxed), np.asarray(value))
