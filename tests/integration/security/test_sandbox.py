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
import signal
import site
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import somatize as sz
from somatize.errors import ClientError, ClusterError
from tests.integration.cluster import Cluster
from tests.utils import UNIT

pytestmark = pytest.mark.integration

MARK = "6173"
"""The seconds of the ``sleep`` a job leaves behind: how the test finds it afterwards."""


class Probe(sz.Filter):
    """A plain filter whose ``fit`` attempts each attack and reports each outcome."""

    def __init__(self, secrets: list[str], agent: int, stamp: str, root_only: str) -> None:
        self.secrets = secrets
        self.agent = agent
        self.stamp = stamp
        self.root_only = root_only

    def fit(self, x: Any, y: Any = None) -> dict[str, Any]:
        import ctypes
        import glob
        import site
        import socket
        import stat
        import subprocess

        libc = ctypes.CDLL(None, use_errno=True)

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

        def called(result: int) -> int:
            if result != 0:
                raise OSError(ctypes.get_errno(), "refused")
            return result

        def write_any(paths: list[str]) -> str:
            written = []
            for path in paths:
                try:
                    with open(path, "w") as f:
                        f.write("0\n")
                    written.append(path)
                except OSError:
                    pass
            if not written:
                raise PermissionError(f"none of {len(paths)}")
            return ", ".join(written)

        report = {f"secret {k}": attempt(lambda p=p: read(p)) for k, p in enumerate(self.secrets)}
        report["root-only file"] = attempt(lambda: read(self.root_only))
        report["agent /proc"] = attempt(lambda: read(f"/proc/{self.agent}/environ"))
        with open("/proc/self/status") as status:
            report["CapEff"] = next(
                line.split()[1] for line in status if line.startswith("CapEff:")
            )
        # The masks over the secrets: a detached unmount (umount2 MNT_DETACH) would show them.
        report["unmount a mask"] = attempt(
            lambda: called(libc.umount2(self.secrets[0].encode(), 2))
        )
        ms_remount, ms_bind = 32, 4096  # remount / read-write (MS_RDONLY cleared)
        report["remount /"] = attempt(
            lambda: called(libc.mount(b"none", b"/", None, ms_remount | ms_bind, None))
        )
        report["raw socket"] = attempt(
            lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW).close()
        )
        report["block device"] = attempt(
            lambda: os.mknod(f"/tmp/block-{self.stamp}", stat.S_IFBLK | 0o600, os.makedev(7, 0))
        )
        controls = sorted(
            glob.glob("/sys/fs/cgroup/**/cgroup.procs", recursive=True)
            + glob.glob("/sys/fs/cgroup/**/memory.max", recursive=True)
            + glob.glob("/sys/fs/cgroup/**/pids.max", recursive=True)
        )[:200]
        report["write a cgroup"] = attempt(lambda: write_any(controls))
        pth = os.path.join(site.getsitepackages()[0], f"planted-{self.stamp}.pth")
        report["plant .pth"] = attempt(lambda: write(pth))
        report["/tmp"] = attempt(lambda: write(f"/tmp/left-{self.stamp}"))
        report["/dev/shm"] = attempt(lambda: write(f"/dev/shm/left-{self.stamp}"))
        subprocess.Popen(["sleep", MARK], start_new_session=True)
        return {"report": np.frombuffer(json.dumps(report).encode(), dtype=np.uint8)}

    def forward(self, x: Any, state: dict[str, Any]) -> Any:
        return x


@pytest.fixture
def root_only(tmp_path_factory) -> Any:
    """A file only its owner may read, where any uid can reach its folder (not under the
    test's own ``/tmp`` folder, which a sandbox hides anyway): what other workers' keys and
    the coordinator's files are to a root agent's job."""
    folder = Path(tempfile.mkdtemp(prefix="somatize-root-only-", dir="/var/tmp"))
    folder.chmod(0o755)
    secret = folder / "secret"
    secret.write_text("only root reads this")
    secret.chmod(0o600)
    yield secret
    shutil.rmtree(folder)


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
    tmp_path, level, root_only
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
            assert "--sandbox uid: " in log
            return
        agent = cluster.workers["w0"].pid
        with sz.connect(cluster.url, timeout=30 * UNIT) as client:
            worker = next(w for w in client.status()["workers"] if w["id"] == "w0")
            assert worker["capabilities"]["sandbox"] == level
            probe = Probe([str(token_file), str(identity.resolve())], agent, stamp, str(root_only))
            graph = sz.Graph([probe.named("probe")])
            fitted = client.submit(graph, np.zeros((2, 1), np.float32)).result(120 * UNIT)
        report = json.loads(bytes(np.asarray(fitted.states["probe"]["report"])).decode())
        log = (cluster.logs / "worker-w0.log").read_text()
    finally:
        cluster.close()
    left = (Path(f"/tmp/left-{stamp}"), Path(f"/dev/shm/left-{stamp}"))
    if level == "none":  # nothing stops it: the worker said so, loudly, at start
        assert "NO SANDBOX for job code (--sandbox none)" in log
        assert report["secret 0"] == f"ok: {token!r}"
        planted = Path(site.getsitepackages()[0], f"planted-{stamp}.pth")  # it wrote that too
        for path in (*left, Path(f"/tmp/block-{stamp}"), planted):
            path.unlink(missing_ok=True)
        for pid in _sleeping():  # it left its cgroup too (wrote itself into another): gone now
            os.kill(pid, signal.SIGKILL)
        return
    assert f"job code runs sandboxed: {level}" in log
    # It may write /tmp and /dev/shm (its own under bwrap), and nothing of it stays there once
    # its job is gone.
    assert report.pop("/tmp") == report.pop("/dev/shm") == "ok: 7"
    assert not any(path.exists() for path in left)
    # No capability, as a root agent's job too (issue 53: it kept 000001fffeffffff).
    assert report.pop("CapEff") == "0000000000000000"
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


class Fills(sz.Filter):
    """Its fit writes ``mib`` MiB to a file in ``folder`` (its private tmpfs under bubblewrap)
    and forks ``sleepers`` processes, holds them a while, then says how it went."""

    def __init__(self, folder: str, mib: int, sleepers: int = 0) -> None:
        self.folder, self.mib, self.sleepers = folder, mib, sleepers

    def fit(self, x: Any, y: Any = None) -> dict[str, Any]:
        import subprocess

        block = b"\xa5" * (1 << 20)
        with open(os.path.join(self.folder, "fill"), "wb") as f:
            for _ in range(self.mib):
                f.write(block)
        held = [subprocess.Popen(["sleep", "30"]) for _ in range(self.sleepers)]
        time.sleep(3.0)  # long enough for the limits' watch to see it
        for process in held:
            process.kill()
        return {"wrote": np.array(self.mib)}

    def forward(self, x: Any, state: dict[str, Any]) -> Any:
        return x


def test_a_bwrap_daemons_files_and_processes_count_against_its_jobs_limits(tmp_path):
    """Issue 53, Medium 1: a bubblewrap daemon is in its job's cgroup before it runs anything
    of the job's (its processes all counted: a job ran 24 under 16), and what it writes to its
    private /tmp and /dev/shm counts as its memory (a job held 1.76 GB under 1 GiB). Each over
    its limit fails resource_limit, naming it; the next job on the worker runs."""
    cluster = Cluster(tmp_path / "state", sandbox="bwrap")
    x = np.zeros((2, 1), np.float32)
    try:
        cluster.start_coordinator()
        # Apart: a daemon forking 10 processes may count its pages in each, for a moment.
        cluster.start_worker("memory", args=["--max-job-memory", "700M"])
        cluster.start_worker("procs", args=["--max-job-procs", "8"])
        with sz.connect(cluster.url, timeout=30 * UNIT) as client:
            for worker, filler, said in (
                ("memory", Fills("/tmp", 600), r"in its /tmp and /dev/shm, over --max-job-memory"),
                ("memory", Fills("/dev/shm", 600), r"in its /tmp and /dev/shm, over --max-job-"),
                ("procs", Fills("/tmp", 1, sleepers=10), r"processes, over --max-job-procs 8"),
            ):
                strategy = sz.Local(worker=worker)
                job = client.submit(sz.Graph([filler.named("fill")]), x, strategy=strategy)
                with pytest.raises(sz.JobFailed, match=said) as failed:
                    job.result(120 * UNIT)
                assert failed.value.code == "resource_limit"
            done = client.submit(
                sz.Graph([Fills("/tmp", 8).named("fill")]), x, strategy=sz.Local(worker="memory")
            )
            assert int(np.asarray(done.result(120 * UNIT).states["fill"]["wrote"])) == 8
    finally:
        cluster.close()


def test_a_worker_without_bubblewrap_sandboxes_with_a_uid_or_refuses_to_start_saying_why(
    tmp_path, capsys
):
    """Issue 53, Medium 2: ``--sandbox auto`` never falls back to no sandbox in silence. Here
    bubblewrap is taken off the worker's PATH: a root agent whose interpreter others may run
    sandboxes with ``uid``; elsewhere (this machine's python lives in root's home) the worker
    refuses to start, naming what each level lacked and the way to run unsandboxed. A
    LocalCluster of one's own then runs its workers ``--sandbox none``, and says so."""
    cluster = Cluster(tmp_path / "state", sandbox="auto")
    no_bwrap = ["env", "PATH=/nonexistent"]
    try:
        cluster.start_coordinator()
        try:
            cluster.start_worker("w0", prefix=no_bwrap, args=["--sandbox", "auto"])
        except ClusterError:
            log = (cluster.logs / "worker-w0.log").read_text()
            assert "no sandbox for job code works here (bwrap: bubblewrap is not installed" in log
            assert "uid: " in log and "give --sandbox none to run job code" in log
            cluster.start_worker("w1", prefix=no_bwrap)  # the cluster's own auto
            assert "this cluster's workers run job code as your user" in capsys.readouterr().err
            worker = cluster.worker("w1")
            assert worker is not None and worker["capabilities"]["sandbox"] == "none"
            return
        worker = cluster.worker("w0")
        assert worker is not None and worker["capabilities"]["sandbox"] == "uid"
    finally:
        cluster.close()


class WhereAmI(sz.Filter):
    """Its fit says the uid its daemon runs as, and its niceness."""

    def fit(self, x: Any, y: Any = None) -> dict[str, Any]:
        with open("/proc/self/status") as status:
            uid = next(int(line.split()[1]) for line in status if line.startswith("Uid:"))
        return {"uid": np.array(uid), "nice": np.array(os.nice(0))}

    def forward(self, x: Any, state: dict[str, Any]) -> Any:
        return x


def test_a_job_or_a_coordinator_can_require_the_sandbox(tmp_path):
    """Issue 53, Medium 2: ``sandbox="required"`` places a job only on a sandboxed worker (and
    is refused at submit where none is), and ``--require-sandbox`` refuses a worker that would
    run job code unsandboxed, saying why, while a sandboxed one registers."""
    x = np.zeros((2, 1), np.float32)
    cluster = Cluster(tmp_path / "state")
    try:
        cluster.start_coordinator()
        cluster.start_worker("open", args=["--sandbox", "none"])
        with sz.connect(cluster.url, timeout=30 * UNIT) as client:
            graph = sz.Graph([WhereAmI().named("where")])
            with pytest.raises(ClientError, match="sandbox='required', and no worker runs"):
                client.submit(graph, x, sandbox="required")
            with pytest.raises(ValueError, match="sandbox must be one of 'any', 'required'"):
                client.submit(graph, x, sandbox="yes")  # type: ignore[arg-type]
            cluster.start_worker("boxed", args=["--sandbox", "bwrap"])
            for _ in range(2):  # whichever is idle first, the job goes to the sandboxed one
                fitted = client.submit(graph, x, sandbox="required").result(120 * UNIT)
                assert int(np.asarray(fitted.states["where"]["uid"])) >= 61000
                # (started nice as a spare, at the default priority once a job's)
                assert int(np.asarray(fitted.states["where"]["nice"])) == 0
    finally:
        cluster.close()
    strict = Cluster(tmp_path / "strict")
    try:
        strict.start_coordinator(["--require-sandbox"])
        with pytest.raises(ClusterError):
            strict.start_worker("open", args=["--sandbox", "none"])
        log = (strict.logs / "worker-open.log").read_text()
        assert "runs job code sandboxed only (--require-sandbox)" in log
        assert "with 'none': start it with --sandbox auto, bwrap or uid" in log
        strict.start_worker("boxed", args=["--sandbox", "bwrap"])
    finally:
        strict.close()


class Dials(sz.Filter):
    """Its fit tries to open a TCP connection to ``port`` on loopback and says how it went."""

    def __init__(self, port: int) -> None:
        self.port = port

    def fit(self, x: Any, y: Any = None) -> dict[str, Any]:
        import socket

        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=5).close()
            said = "connected"
        except OSError as exc:
            said = f"refused: {type(exc).__name__}"
        return {"said": np.frombuffer(said.encode(), dtype=np.uint8)}

    def forward(self, x: Any, state: dict[str, Any]) -> Any:
        return x


def test_a_worker_without_job_network_keeps_job_code_off_the_network(tmp_path):
    """``--job-network off``: a bwrap daemon has a loopback of its own (it cannot reach the
    coordinator, or anything else), the worker says so, and a job that needs the torch
    collective is refused at submit rather than placed where it cannot join its group."""
    x = np.zeros((4, 1), np.float32)
    cluster = Cluster(tmp_path / "state", sandbox="bwrap")
    try:
        cluster.start_coordinator()
        cluster.start_worker("w0", args=["--job-network", "off"])
        with sz.connect(cluster.url, timeout=30 * UNIT) as client:
            worker = next(w for w in client.status()["workers"] if w["id"] == "w0")
            assert worker["capabilities"]["network"] is False
            fitted = client.submit(sz.Graph([Dials(cluster.port).named("dial")]), x).result(
                120 * UNIT
            )
            said = bytes(np.asarray(fitted.states["dial"]["said"])).decode()
            assert said.startswith("refused"), said
            net = sz.TorchFilter(torch.nn.Linear(1, 1), loss="mse", epochs=1)
            with pytest.raises(ClientError, match=r"without network .*--job-network off"):
                client.submit(
                    sz.Graph([net]), x, x, strategy=sz.DataParallel(1, collective="torch")
                )
    finally:
        cluster.close()
