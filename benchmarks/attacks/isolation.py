"""Issue 32's attacks that :mod:`benchmarks.attacks` makes: clients who share workers reaching
for each other's jobs, and job code reaching for the worker.

- **trickled uploads**: a client announces two 2 GiB chunked messages and trickles their first
  MiB, as the attack did; another client's 8 MB submission and its running job's chunked states
  must go through (the reassembly budgets count bytes received, per client, and keep the
  workers' replies a pool of their own).
- **job code against the worker**: a job's filter, on a worker with its default ``--sandbox``
  (``auto``: bubblewrap here), tries to read the agent's identity key, its ``/proc`` and its
  environment, to leave its cgroup, plant a ``.pth`` file in the environment, leave files in
  ``/tmp`` and ``/dev/shm`` and a process behind; every attempt must fail or leave nothing.

The scenarios register themselves (:func:`~benchmarks.attacks.scenarios.scenario`) when this
module is imported, after those of :mod:`benchmarks.attacks.scenarios`; like them they leave the
shared cluster as they found it, both workers idle.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import websockets

import somatize as sz
from benchmarks.attacks.harness import WAIT, WS_OPTIONS, Attack, Memory, Site, pid_of, rss_kib
from benchmarks.attacks.scenarios import scenario
from benchmarks.faults.harness import until
from protocol.asyncio.channel import Channel
from protocol.chunking import CHUNK_MAGIC
from protocol.messages import CHUNK_BYTES, ClientHello, Status
from somatize.remote.connection import client_url
from tests.integration.security.test_sandbox import Probe, _sleeping

ANNOUNCED = 2 << 30
"""Bytes each trickled message announces (the attack's 2 GiB)."""
TRICKLED = 2
"""The attacker's connections, each holding one announced message."""
SUBMITTED = 8_000_000
"""Bytes of the other client's submission (its ``x``), sent in chunks."""


async def _trickle(site: Site) -> tuple[list[Any], list[float]]:
    """:data:`TRICKLED` connections with the client token, each announcing a message of
    :data:`ANNOUNCED` bytes and sending its first chunk only. Returns the open sockets (the
    caller closes them) and how long each took to be answered behind its chunk."""
    held, answered = [], []
    headers = {"Authorization": f"Bearer {site.client_token}"}
    for n in range(TRICKLED):
        ws = await websockets.connect(
            client_url(site.cluster.url), additional_headers=headers, **WS_OPTIONS
        )
        channel = Channel(ws, f"trickle {n}")
        await channel.send(ClientHello(name=f"trickle{n}"))
        async with asyncio.timeout(WAIT):
            assert (await channel.receive()).kind == "welcome"
        started = time.perf_counter()
        await ws.send(struct.pack("<8sQQQ", CHUNK_MAGIC, 7, 0, ANNOUNCED) + bytes(CHUNK_BYTES))
        await channel.send(Status())  # behind its chunk: once answered, the chunk is in
        async with asyncio.timeout(WAIT):
            reply = await channel.receive()
        if reply.kind != "result":
            raise AssertionError(f"the trickled chunk was refused: {reply}")
        answered.append(time.perf_counter() - started)
        held.append(ws)
    return held, answered


@scenario
def trickled_uploads(site: Site) -> Attack:
    c = site.cluster
    torch.manual_seed(0)
    net = sz.TorchFilter(torch.nn.Linear(512, 1024), loss="mse", epochs=60, batch_size=8)
    x = np.random.default_rng(0).normal(size=(64, 512)).astype(np.float32)
    big = np.zeros((SUBMITTED // 4, 1), np.float32)
    small = sz.Graph([sz.TorchFilter(torch.nn.Linear(1, 1), loss="mse", epochs=1).named("s")])
    with site.client() as client:
        # A model of 2 MiB of weights: its states come back from the worker chunked.
        job = client.submit(
            sz.Graph([net.named("net")]), x, np.zeros((64, 1024), np.float32), strategy=sz.Local()
        )
        until(lambda: job.status()["state"] == "running", "the job to run")
        before = rss_kib(pid_of(c.coordinator))  # (the job's start imported what it needs)

        async def attack() -> tuple[list[float], float]:
            held, answered = await _trickle(site)
            try:
                started = time.perf_counter()
                # Queued behind the running job: accepted is what matters, then cancelled.
                other = await asyncio.to_thread(client.submit, small, big, big, strategy=sz.Local())
                took = time.perf_counter() - started
                await asyncio.to_thread(other.cancel)
                return answered, took
            finally:
                for ws in held:
                    await ws.close()

        answered, submitted = asyncio.run(attack())
        after = rss_kib(pid_of(c.coordinator))
        fitted = job.result(timeout=WAIT)
    if fitted.states["net"]["weight"].shape != (1024, 512):
        raise AssertionError("the running job's states did not come back whole")
    site.settle()
    return Attack(
        "1 (32)",
        "one client's trickled uploads against another client's jobs",
        f"{TRICKLED} connections with the client token each announce a "
        f"{ANNOUNCED >> 30} GiB chunked message and send its first MiB only (the attack's), "
        f"while another client's job runs, whose 2 MiB of states come back chunked; the other "
        f"client then submits {SUBMITTED / 1e6:.0f} MB of rows, in chunks",
        "the other client's submission was taken and its running job succeeded, its states "
        "whole: the budgets count bytes received (the attacker holds 2 MiB, not 4 GiB), one "
        "client's chunked messages hold at most its share, and the workers' replies have a pool "
        "of their own",
        [],
        "",
        "test_fair_shares.py::test_a_client_filling_the_clients_pool_cannot_fail_another_"
        "clients_running_job",
        Memory("coordinator", before, after),
        [
            f"the other client's {SUBMITTED / 1e6:.0f} MB submit, the chunks held: "
            f"{1e3 * submitted:.0f} ms; each trickled chunk in: "
            + " / ".join(f"{1e3 * t:.1f} ms" for t in answered)
        ],
    )


@scenario
def job_code_against_the_worker(site: Site) -> Attack:
    c = site.cluster
    stamp = secrets.token_hex(4)
    identity = (c.logs.parent / "identities" / "w0.key").resolve()
    agent = pid_of(c.workers["w0"])
    root_only = Path(tempfile.mkdtemp(prefix="somatize-root-only-", dir="/var/tmp"))
    root_only.chmod(0o755)
    (root_only / "secret").write_text("only root reads this")
    (root_only / "secret").chmod(0o600)
    probe = Probe([str(identity)], agent, stamp, str(root_only / "secret"))
    with site.client() as client:
        level = next(w for w in client.status()["workers"] if w["id"] == "w0")["capabilities"][
            "sandbox"
        ]
        started = time.perf_counter()
        job = client.submit(
            sz.Graph([probe.named("probe")]),
            np.zeros((2, 1), np.float32),
            strategy=sz.Local(worker="w0"),
        )
        fitted = job.result(timeout=WAIT)
        took = time.perf_counter() - started
    report = json.loads(bytes(np.asarray(fitted.states["probe"]["report"])).decode())
    shutil.rmtree(root_only)
    site.settle()
    until(lambda: not _sleeping(), "the job's process to be gone with its job")
    left = [p for p in (Path(f"/tmp/left-{stamp}"), Path(f"/dev/shm/left-{stamp}")) if p.exists()]
    capabilities = report.pop("CapEff")
    own = ("/tmp", "/dev/shm")
    got = {k: v for k, v in report.items() if k not in own and v[:2] == "ok" and v != "ok: ''"}
    if level == "none" or got or left or capabilities != "0000000000000000":
        raise AssertionError(f"sandbox {level!r}: the job got {got}, left {left}")
    names = {"secret 0": "identity key", "agent /proc": "agent's environ"}
    refused = ", ".join(
        f"{names.get(k, k)}: {v.removeprefix('refused: ')}"
        for k, v in report.items()
        if k not in own
    )
    return Attack(
        "High 2–3 (32); High 1 (53)",
        "job code reaching for the worker, the machine and the next job (a root worker)",
        "a job's filter, on w0 (an agent running as root, as the image runs it) with its "
        "default `--sandbox auto`, reads the agent's identity key, a root-only file "
        "(`/var/tmp`, 0600) and `/proc/<agent>/environ`, unmounts the mask over the key "
        "(`umount2`), remounts `/` read-write, opens an `AF_PACKET` socket, makes a block "
        "device, writes every `cgroup.procs`, `memory.max` and `pids.max` it finds, plants a "
        "`.pth` file in the environment's site-packages, writes to `/tmp` and `/dev/shm` and "
        "leaves a `setsid sleep` running",
        f"under `{level}` it ran with `CapEff` {capabilities} and every read and write was "
        f"refused ({refused}); its own `/tmp` and `/dev/shm` files and its process were gone "
        "once its job ended",
        [],
        "",
        "test_sandbox.py::test_job_code_cannot_reach_the_agents_secrets_its_environment_or_"
        "outlive_its_job",
        None,
        [f"the probe job, submit → result: {took:.2f} s"],
    )
