"""Issue 53's attacks that :mod:`benchmarks.attacks` makes: the trust boundaries where workers
really run — a job over its limits in its sandbox, a worker that could give job code none,
bytes a worker made reaching a client's unpickler or the coordinator's decoder, worker ids
crowding an honest worker's replies, another job reading a rendezvous, a forged log line.

Live rows run on the shared cluster (:class:`~benchmarks.attacks.harness.Site`) or start a
worker of their own beside it; rows marked *in process* drive the code a hostile worker's bytes
reach (the client's checkpoint reader, the coordinator's strategy over in-memory daemons) in
this process, as their tests do. Each asserts what the system must do, as its test does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import websockets
from torch.distributed.checkpoint.state_dict_saver import save

import somatize as sz
from benchmarks.attacks.harness import CAPS, WAIT, WS_OPTIONS, Attack, Memory, Site, pid_of, rss_kib
from benchmarks.attacks.scenarios import scenario
from benchmarks.faults.harness import until
from coordinator.errors import StrategyFailed
from protocol.asyncio.channel import Channel
from protocol.chunking import CHUNK_MAGIC
from protocol.messages import CHUNK_BYTES, Heartbeat, WorkerHello
from protocol.options.strategies import DataParallelOptions
from somatize.errors import ClientError, ClusterError
from somatize.remote.sharded_checkpoints import whole_states
from tests.coordinator.strategies.data_parallel.test_star_compression import (
    _Inflating,
    _NotFinite,
    run,
)
from tests.engine.data_parallel.test_dcp_metadata import dotted_call
from tests.integration.security.test_sandbox import Fills

FLOODS = 2
"""Worker ids flooding the coordinator with unasked messages (the attack's two)."""


@scenario
def job_over_its_limits(site: Site) -> Attack:
    c = site.cluster
    c.start_worker("w2", "limits", threads=1, args=["--max-job-memory", "700M"])
    c.start_worker("w3", "limits", threads=1, args=["--max-job-procs", "8"])
    x = np.zeros((2, 1), np.float32)
    took, said = [], []
    try:
        with site.client() as client:
            for worker, filler in (
                ("w2", Fills("/tmp", 600)),
                ("w2", Fills("/dev/shm", 600)),
                ("w3", Fills("/tmp", 1, sleepers=10)),
            ):
                started = time.perf_counter()
                job = client.submit(
                    sz.Graph([filler.named("fill")]), x, strategy=sz.Local(worker=worker)
                )
                try:
                    job.result(timeout=WAIT)
                except sz.JobFailed as exc:
                    if exc.code != "resource_limit":
                        raise
                    took.append(time.perf_counter() - started)
                    said.append(re.sub(r"^.*?: ", "", exc.message, count=1))
                    continue
                raise AssertionError(f"{filler!r} on {worker} was not stopped")
    finally:
        for worker in ("w2", "w3"):
            c.send_signal(c.workers.pop(worker), 15)
    return Attack(
        "Medium 1 (53)",
        "a sandboxed job over its memory and process limits",
        "on a worker with `--max-job-memory 700M` a job writes 600 MB to its private `/tmp`, "
        "then to `/dev/shm` (tmpfs, resident in no process); on one with `--max-job-procs 8` "
        "a job forks 10 sleepers (bubblewrap's own processes once started outside the cgroup)",
        "each job failed `resource_limit` naming the limit ("
        + "; ".join(f"“{s[:120]}”" for s in said)
        + "); the workers stayed up",
        took,
        "submit → `resource_limit`",
        "test_sandbox.py::test_a_bwrap_daemons_files_and_processes_count_against_its_jobs_limits",
    )


@scenario
def worker_without_a_sandbox(site: Site) -> Attack:
    c = site.cluster
    took = []
    for _ in range(3):
        started = time.perf_counter()
        try:
            c.start_worker("nobox", prefix=["env", "PATH=/nonexistent"], args=["--sandbox", "auto"])
        except ClusterError:
            took.append(time.perf_counter() - started)
            c.workers.pop("nobox", None)
            continue
        raise AssertionError("a worker without bubblewrap started under --sandbox auto")
    said = (c.logs / "worker-nobox.log").read_text(errors="replace")
    why = re.search(r"error: (no sandbox for job code works here[^\n]*)", said)
    if why is None:
        raise AssertionError(f"the refusal does not say why: {said[-500:]}")
    return Attack(
        "Medium 2 (53)",
        "a worker that can give job code no sandbox",
        "`somatize-worker --sandbox auto` started as root with bubblewrap off its `PATH` (and "
        "this machine's interpreter in root's home, where no other uid may run it)",
        f"it refused to start, saying why: “{why.group(1)[:300]}”",
        took,
        "start → exit 2",
        "test_sandbox.py::test_a_worker_without_bubblewrap_sandboxes_with_a_uid_or_refuses_"
        "to_start_saying_why",
    )


@scenario
def forged_checkpoint_metadata(site: Site) -> Attack:
    marker = Path(tempfile.mkdtemp(prefix="somatize-forged-")) / "ran"
    folder = marker.parent / "dcp"
    save({"0": torch.ones(4)}, checkpoint_id=folder, no_dist=True)
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    forged = dotted_call("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}")
    rest = {"states": {"mlp": {"weight": None}}, "split": [["states", "mlp", "weight"]]}
    took = []
    for _ in range(20):
        sent = files | {".metadata": forged}
        started = time.perf_counter()
        try:
            whole_states({"names": sorted(sent), "rest": rest, "plain": {}}, sent.__getitem__)
        except ClientError as exc:
            took.append(time.perf_counter() - started)
            said = str(exc)
            continue
        raise AssertionError("the forged .metadata was read")
    if marker.exists():
        raise AssertionError("the forged .metadata ran its command")
    return Attack(
        "High 2 (53)",
        "a worker's forged checkpoint runs code on the client (in process)",
        "replica 0's `.metadata` replaced by a protocol-4 pickle naming "
        "`torch.distributed.checkpoint.metadata` + `os.system` (a dotted name, which the old "
        "check admitted), read as `job.checkpoint()` reads a sharded checkpoint",
        f"refused, nothing ran: “{said[:200]}”; a resuming replica refuses it alike before "
        "its collective (test)",
        took,
        "read → `ClientError`",
        "test_dcp_metadata.py::test_a_dotted_name_under_an_allowed_module_runs_nothing; "
        "test_dcp_metadata.py::test_a_resuming_sharded_replica_refuses_a_forged_metadata_and_"
        "loads_a_genuine_one",
    )


@scenario
def hostile_gradients(site: Site) -> Attack:
    before = rss_kib(os.getpid())
    took, said = [], []
    for daemon, compression in ((_Inflating, "int8"), (_NotFinite, None), (_NotFinite, "int8")):
        _NotFinite.made = 0
        options = DataParallelOptions(workers=2, collective="coordinator", compression=compression)
        started = time.perf_counter()
        try:
            run(options, "sgd", daemon=daemon)
        except StrategyFailed as exc:
            took.append(time.perf_counter() - started)
            if exc.info.code != "aggregation_mismatch":
                raise
            said.append(str(exc))
            continue
        raise AssertionError(f"{daemon.__name__} ({compression}) was averaged")
    after = rss_kib(os.getpid())
    return Attack(
        "Medium 3 (53)",
        "a replica's hostile gradients (in process: the coordinator's strategy)",
        "over in-memory daemons (real engines), a replica adds 4M int8 values of a parameter "
        "the 163-value model lacks to its compressed gradients, consistent with their own "
        "layout; another puts a NaN in its plain, then its int8, gradients at step 3",
        "each job failed `aggregation_mismatch` naming the worker, the oversized tree from its "
        f"layout before anything was decoded (“{said[0][:160]}”; “{said[1][:120]}”)",
        took,
        "job → `aggregation_mismatch`",
        "test_star_compression.py::test_compressed_gradients_beyond_the_model_are_refused_"
        "before_they_are_decoded; test_star_compression.py::test_gradients_that_are_not_finite_"
        "fail_the_job_naming_the_worker",
        Memory("this process", before, after),
    )


async def _flood_as_workers(site: Site) -> list[Any]:
    """:data:`FLOODS` worker connections (the worker token, ids the coordinator gives) that
    each announce a 64 MiB unasked message, send 32 MiB of it, then stall, heartbeating."""
    held = []
    headers = {"Authorization": f"Bearer {site.worker_token}"}
    url = site.cluster.url
    for n in range(FLOODS):
        ws = await websockets.connect(f"{url}/worker", additional_headers=headers, **WS_OPTIONS)
        channel = Channel(ws, f"flood {n}")
        await channel.send(WorkerHello(capabilities=CAPS))
        async with asyncio.timeout(WAIT):
            assert (await channel.receive()).kind == "welcome"
        with contextlib.suppress(websockets.ConnectionClosed):
            for k in range(32):
                head = struct.pack("<8sQQQ", CHUNK_MAGIC, 7, k * CHUNK_BYTES, 64 << 20)
                await ws.send(head + bytes(CHUNK_BYTES))

        async def beat(channel: Channel = channel) -> None:
            with contextlib.suppress(Exception):
                while True:
                    await channel.send(Heartbeat(sent_at=time.time()))
                    await asyncio.sleep(1.0)

        held.append((ws, asyncio.ensure_future(beat())))
    return held


@scenario
def worker_ids_crowding_replies(site: Site) -> Attack:
    torch.manual_seed(0)
    net = sz.TorchFilter(torch.nn.Linear(2048, 2048), loss="mse", epochs=30, batch_size=8)
    x = np.random.default_rng(0).normal(size=(64, 2048)).astype(np.float32)
    before = rss_kib(pid_of(site.cluster.coordinator))
    with site.client() as client:
        job = client.submit(sz.Graph([net.named("net")]), x, x, strategy=sz.Local(worker="w0"))
        until(lambda: job.status()["state"] == "running", "the job to run")

        async def attack() -> float:
            held = await _flood_as_workers(site)
            try:
                started = time.perf_counter()
                fitted = await asyncio.to_thread(job.result, WAIT)
                if fitted.states["net"]["weight"].shape != (2048, 2048):
                    raise AssertionError("the job's states did not come back whole")
                return time.perf_counter() - started
            finally:
                for ws, beats in held:
                    beats.cancel()
                    await ws.close()

        waited = asyncio.run(attack())
    after = rss_kib(pid_of(site.cluster.coordinator))
    site.settle()
    return Attack(
        "Medium 5 (53)",
        "worker ids crowding an honest worker's replies",
        f"{FLOODS} new worker ids (the worker token, heartbeating) each announce a 64 MiB "
        "unasked chunked message and send what the coordinator takes of it, while a job on w0 "
        "trains a 16 MiB model whose states come back chunked",
        "the job succeeded, its states whole: what workers send unasked is held to a quarter "
        "of the pool, each id a quarter of that (the floods' first chunks were refused), and "
        "the replies the coordinator awaits have the rest",
        [],
        "",
        "test_fair_shares.py::test_worker_ids_sending_unasked_cannot_make_an_honest_workers_"
        "replies_busy",
        Memory("coordinator", before, after),
        [f"the job's result once the floods held: {waited:.2f} s"],
    )


@scenario
def rendezvous_snooped(site: Site) -> Attack:
    torch.manual_seed(0)
    net = sz.TorchFilter(torch.nn.Linear(256, 256), loss="mse", epochs=200, batch_size=8)
    x = np.random.default_rng(0).normal(size=(64, 256)).astype(np.float32)
    took = []
    with site.client() as client:
        strategy = sz.DataParallel(2, collective="torch", checkpoint_every=0)
        job = client.submit(sz.Graph([net.named("net")]), x, x, strategy=strategy)
        placed = next(e for e in job.events(timeout=WAIT) if e.event == "placed")
        where = re.search(r"at ([\d.]+):(\d+)", placed.data.get("collective_reason", ""))
        if where is None:
            raise AssertionError(f"the placement names no rendezvous: {placed.data}")
        host, port = where.group(1), int(where.group(2))
        for _ in range(5):
            started = time.perf_counter()
            snoop = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import sys, datetime, torch.distributed as d; "
                    f"s = d.TCPStore('{host}', {port}, None, False, "
                    "datetime.timedelta(seconds=3), False); print(s.list_keys())",
                ],
                capture_output=True,
                text=True,
                timeout=WAIT,
                check=False,
            )
            if snoop.returncode == 0:
                raise AssertionError(f"another process listed the keys: {snoop.stdout}")
            took.append(time.perf_counter() - started)
        fitted = job.result(timeout=WAIT)
    if not torch.isfinite(torch.as_tensor(fitted.states["net"]["weight"])).all():
        raise AssertionError("the job's weights are not finite")
    return Attack(
        "Medium 6 (53)",
        "another job reading and writing a job's rendezvous",
        "while a `DataParallel(2, collective='torch')` job trains, another process dials its "
        "store (the address its `placed` event names) with torch's own `TCPStore` client and "
        "lists its keys, as the attack did",
        "refused: the store asks every connection to prove the group's secret (HMAC-SHA256 of "
        "its nonce) before any key is read or written; the job succeeded",
        took,
        "a process's dial → refused (its torch import included)",
        "test_rendezvous_store.py::test_a_connection_without_the_secret_reads_and_writes_nothing",
    )


class Raises(sz.Filter):
    """Its fit raises ``text``: a filter error the coordinator logs."""

    def __init__(self, text: str) -> None:
        self.text = text

    def fit(self, x: Any, y: Any = None) -> Any:
        raise RuntimeError(self.text)

    def forward(self, x: Any, state: Any) -> Any:
        return x


@scenario
def forged_log_line(site: Site) -> Attack:
    c = site.cluster
    forged = "INFO coordinator.server.app: worker w9 connected"
    text = f"x\n2026-12-06 00:00:00,000 {forged}\x1b[2J"
    log = c.logs / "coordinator.log"
    with site.client() as client:
        job = client.submit(sz.Graph([Raises(text).named("f")]), np.zeros((2, 1)), name=text)
        with contextlib.suppress(sz.JobFailed):
            job.result(timeout=WAIT)
    site.settle()
    lines = log.read_text(errors="replace").splitlines()
    if any(line.endswith(forged) and " x" not in line for line in lines):
        raise AssertionError("the job's name wrote a line of its own into the coordinator's log")
    if any("\x1b" in line for line in lines):
        raise AssertionError("an escape sequence reached the coordinator's log")
    return Attack(
        "Low (53)",
        "a job name or error text forging log lines",
        "a job named `x⏎2026-12-06 … INFO … worker w9 connected ESC[2J` whose filter raises "
        "with that text, which the coordinator logs as the job's failure",
        "every record stays one line, its control characters written as `\\x..`; "
        "`somatize` prints what others wrote the same way",
        [],
        "",
        "test_log_lines.py::test_a_record_quoting_a_forged_line_and_escapes_stays_one_visible_line",
    )


class _Workers:
    """Where kept files are dropped (the coordinator's context, as the refusal sees it)."""

    def __init__(self) -> None:
        self.dropped: list[tuple[int, str]] = []

    async def drop_kept(self, replica: int, kept: str) -> None:
        self.dropped.append((replica, kept))


@scenario
def kept_files_flood(site: Site) -> Attack:
    from coordinator.strategies.data_parallel.checkpoints import Shards
    from coordinator.strategies.kept_on_worker import KeptLimit

    model = {"mlp": [[16, 6], [16], [3, 16], [3]]}  # 163 values: a 2.5 KB model
    said = [
        {"kept": "k0", "files": {f"__0_{k}.distcp": 43_000 for k in range(20_000)}},
        {"kept": "k1", "files": {"__1_0.distcp": 4096}},
    ]
    took = []
    for _ in range(20):
        workers = _Workers()
        started = time.perf_counter()
        try:
            asyncio.run(Shards.of(workers, said, {}, {}, KeptLimit.of(model, 2)))
        except StrategyFailed as exc:
            took.append(time.perf_counter() - started)
            if exc.info.code != "resource_limit" or len(workers.dropped) != 2:
                raise
            message = str(exc)
            continue
        raise AssertionError("20,000 kept files were taken for a checkpoint")
    return Attack(
        "Medium 4 (53)",
        "a replica keeping far more than a checkpoint of the model (in process)",
        "for a checkpoint of a 163-value model, replica 0 says it kept 20,000 files of 43 KB "
        "(860 MB, the attack's), as a sharded run's chunk reply names them",
        f"refused before a byte was read, and both workers told to drop their files: "
        f"“{message[:200]}”",
        took,
        "files named → `resource_limit`",
        "test_checkpoints.py::test_kept_files_beyond_what_a_checkpoint_of_the_model_can_be_"
        "are_refused_unread",
    )
