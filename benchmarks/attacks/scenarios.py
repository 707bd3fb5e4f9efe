"""The attacks :mod:`benchmarks.attacks` makes (issue 14). Each scenario is one function of a
:class:`~benchmarks.attacks.harness.Site` returning its row (an
:class:`~benchmarks.attacks.harness.Attack`), registered by :func:`scenario`; like its test (named
in the row) it asserts what the system must do, and fails the run otherwise. A scenario leaves
the shared cluster as it found it: a killed worker restarted, both workers idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import selectors
import signal
import socket
import statistics
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import websockets

import somatize as sz
from benchmarks.attacks.harness import (
    ATTEMPTS,
    CAPS,
    HEALTH_POLL,
    WAIT,
    WORKERS,
    WS_OPTIONS,
    Attack,
    Memory,
    Site,
    exact,
    nan_gradients,
    pid_of,
    pipeline_job,
    polled,
    refused,
    rss_kib,
    spread,
    timed_refusals,
)
from benchmarks.faults.harness import until
from coordinator.server.config import (
    HANDSHAKE_TIMEOUT,
    MAX_PENDING_CONNECTIONS,
    MAX_PENDING_PER_ADDRESS,
)
from protocol.asyncio.channel import Channel
from protocol.asyncio.handshake import send_hello
from protocol.codec import encode, encode_frame, frame_nbytes
from protocol.errors import ErrorCode, RemoteError
from protocol.filters import dump_filter
from protocol.messages import (
    MAX_GRAPH_NODES,
    Ack,
    Deliver,
    GraphSpec,
    Links,
    PeerHello,
    Submit,
    Welcome,
    WorkerHello,
)
from protocol.parsing import dump
from protocol.security.identity_proof import CHALLENGE_HEADER, prove, public_key
from somatize.remote.client import graph_info
from somatize.remote.connection import client_url, dial, handshake
from tests.utils import Center
from tests.worker.standin import drive, open_job, presented
from tests.worker.test_peer import RelayStandIn, two_agents
from worker.peer import MAILBOX_JOB_ENTRIES

FLOOD_BYTES = 64 << 10
"""Bytes of each delivery of the mailbox flood."""
IDLE_SOCKETS = 100
BIG_NODES = 50_000

SCENARIOS: dict[str, Callable[[Site], Attack]] = {}
"""The scenarios by name, in the order of the table."""


def scenario(fn: Callable[[Site], Attack]) -> Callable[[Site], Attack]:
    """Register a scenario under its function's name."""
    SCENARIOS[fn.__name__] = fn
    return fn


@scenario
def forged_peer_hello(site: Site) -> Attack:
    c = site.cluster
    address = c.peer_addresses["w1"]

    async def forge(job_id: str) -> list[float]:
        async def attempt(n: int) -> Any:
            async with websockets.connect(f"{address}/peer", **WS_OPTIONS) as ws:
                channel = Channel(ws, "outsider")
                reader = asyncio.ensure_future(channel.run())
                guess = secrets.token_urlsafe(32) if n % 2 else ""
                hello = PeerHello(worker_id="w0", job_id=job_id, secret=guess)
                try:
                    answer = await channel.request(hello, WAIT)
                except RemoteError:
                    async with asyncio.timeout(WAIT):
                        await reader  # the agent closes the link
                    raise
                await channel.close()
                return answer

        words = f"no open job {job_id!r} here for which it holds that credential"
        return await timed_refusals(attempt, lambda e: refused(e, ErrorCode.UNAUTHORIZED, words))

    with site.client() as client:
        job = pipeline_job(client)
        before = rss_kib(pid_of(c.workers["w1"]))
        took = asyncio.run(forge(job.id))
        after = rss_kib(pid_of(c.workers["w1"]))
        diff = exact(job)
        linked = [e.data for e in job.events() if e.data.get("phase") == "linked"]
    if not linked or not linked[0].get("direct"):
        raise AssertionError(f"the stages did not link directly: {linked}")
    return Attack(
        "1",
        "forged peer hello",
        f"{ATTEMPTS} dials of w1's `/peer`, each a `peer_hello` naming the running "
        'ModelParallel job (w0 → w1, `transport="websocket"`, peer links) as w0, with no '
        "secret or a guessed 32-byte one",
        'each refused `unauthorized` ("no open job … here for which it holds that '
        'credential"), '
        "the link closed by the agent; the job went on over its own direct link and succeeded "
        f"equal to the unsplit model trained in one process (max abs diff {diff:.1e})",
        took,
        "dial → `unauthorized`, link closed",
        "test_peer_attacks.py::test_forged_peer_hellos_are_refused_while_a_pipeline_trains_"
        "exactly; test_peer_auth.py::test_a_peer_hello_without_the_jobs_secret_is_refused_and_"
        "the_link_closed",
        Memory("w1's agent", before, after),
    )


@scenario
def forged_relay(site: Site) -> Attack:
    c = site.cluster
    token = site.worker_token

    async def forge(job_id: str) -> list[float]:
        headers = {"Authorization": f"Bearer {token}"}
        url = f"{c.url}/worker"
        async with websockets.connect(url, additional_headers=headers, **WS_OPTIONS) as ws:
            channel = Channel(ws, "rogue worker")
            hello = WorkerHello(id=channel.next_id(), worker_id="rogue", capabilities=CAPS)
            await send_hello(channel, hello, Welcome, WAIT, first=True)
            reader = asyncio.ensure_future(channel.run())
            payload = nan_gradients()

            async def attempt(n: int) -> Any:
                to = WORKERS[n % 2]
                forged = Deliver(job_id=job_id, to=to, key="grad/1/0", payload=payload)
                return await channel.request(forged, WAIT)

            check = "is not on job", job_id
            took = await timed_refusals(
                attempt, lambda e: refused(e, ErrorCode.BAD_REQUEST, *check)
            )
            await channel.close()
            await reader
        return took

    with site.client() as client:
        job = pipeline_job(client)
        before = rss_kib(pid_of(c.coordinator))
        took = asyncio.run(forge(job.id))
        after = rss_kib(pid_of(c.coordinator))
        diff = exact(job)
    return Attack(
        "1/2",
        "forged relay",
        "a process holding the worker token registers as a new worker `rogue` on `/worker` and "
        f"sends {ATTEMPTS} `deliver`s of NaN gradients for the running ModelParallel job, to "
        "w1 and w0 in turn",
        'each refused `bad_request` ("… is not on job …"): the coordinator relays only between '
        f"workers of the same job; the job succeeded exactly (max abs diff {diff:.1e})",
        took,
        "`deliver` → `bad_request`",
        "test_peer_attacks.py::test_a_worker_on_no_job_cannot_have_the_coordinator_relay_to_"
        "the_jobs_workers",
        Memory("coordinator", before, after),
    )


@contextlib.asynccontextmanager
async def peer_link(address: str, worker_id: str, job_id: str) -> AsyncIterator[Channel]:
    """A link to the ``/peer`` at ``address`` as ``worker_id``, for ``job_id`` with its
    credential (as a peer of the job has it); closed on exit."""
    async with websockets.connect(f"{address}/peer", **WS_OPTIONS) as ws:
        channel = Channel(ws, f"{worker_id}'s link for {job_id}")
        reader = asyncio.ensure_future(channel.run())
        try:
            hello = PeerHello(worker_id=worker_id, job_id=job_id, secret=presented(worker_id))
            if not isinstance(await channel.request(hello, WAIT), Ack):
                raise AssertionError(f"{worker_id}, a peer of {job_id}, was not let in")
            yield channel
        finally:
            await channel.close()
            await reader


@dataclass
class Flood:
    """What the mailbox flood saw: this process's RSS before and after, the entries held at the
    end, and the seconds of the refusals beyond the share and of the second deliveries."""

    before_kib: int = 0
    after_kib: int = 0
    held: int = 0
    full: list[float] = field(default_factory=list)
    twice: list[float] = field(default_factory=list)


@scenario
def mailbox_flood(site: Site) -> Attack:
    """In this process: two real agents (real filter daemons) and a stand-in coordinator."""
    flood = Flood()
    payload = encode_frame(torch.zeros(FLOOD_BYTES // 4))

    def deliver(job_id: str, n: int) -> Deliver:
        return Deliver(job_id=job_id, to="B", key=f"act/{n}/0", payload=payload)

    async def main() -> None:
        async with (
            two_agents(RelayStandIn()) as (_, _, b_agent, b),
            contextlib.AsyncExitStack() as links,
        ):
            address = b_agent.peer_address
            assert address is not None
            for job_id in ("greedy", "fair"):
                await open_job(b, job_id, center=Center())
                expects = Links(job_id=job_id, peers={"A": None}, expects={"A": "act/"})
                await b.request(expects, WAIT)
            greedy = await links.enter_async_context(peer_link(address, "A", "greedy"))
            flood.before_kib = rss_kib(os.getpid())
            for n in range(MAILBOX_JOB_ENTRIES):
                await greedy.request(deliver("greedy", n), WAIT)
            full = f"{MAILBOX_JOB_ENTRIES} deliveries of job 'greedy'"
            flood.full = await timed_refusals(
                lambda n: greedy.request(deliver("greedy", MAILBOX_JOB_ENTRIES + n), WAIT),
                lambda e: refused(e, ErrorCode.BUSY, full),
            )
            flood.twice = await timed_refusals(
                lambda n: greedy.request(deliver("greedy", n), WAIT),
                lambda e: refused(e, ErrorCode.BAD_REQUEST, "delivered already"),
            )
            fair = await links.enter_async_context(peer_link(address, "A", "fair"))
            await fair.request(deliver("fair", 0), WAIT)  # the other job has its share
            flood.held = len(b_agent.mailbox)
            flood.after_kib = rss_kib(os.getpid())

    drive(main, seconds=2 * WAIT)
    if flood.held != MAILBOX_JOB_ENTRIES + 1:
        raise AssertionError(f"the mailbox holds {flood.held}, not the share and one")
    held_mib = MAILBOX_JOB_ENTRIES * FLOOD_BYTES / (1 << 20)
    return Attack(
        "2",
        "mailbox flood by an authenticated peer",
        f"in-process agents A and B (real daemons, a stand-in coordinator): A, with job "
        f"`greedy`'s secret, delivers {MAILBOX_JOB_ENTRIES} distinct keys of "
        f"{FLOOD_BYTES >> 10} KiB to B, then {ATTEMPTS} more, then {ATTEMPTS} keys again",
        f"the per-job share (`MAILBOX_JOB_ENTRIES` = {MAILBOX_JOB_ENTRIES}) held, each one "
        "beyond it refused `busy`; each second delivery to a held key refused `bad_request` "
        '("delivered already"); job `fair` still delivered on its own link',
        flood.full + flood.twice,
        "`deliver` → `busy` or `bad_request`",
        "test_peer_auth.py::test_one_job_cannot_fill_the_mailbox_for_the_others; "
        "test_peer_auth.py::test_an_authenticated_link_takes_only_its_job_the_expected_keys_"
        "and_each_key_once",
        Memory("this process (both agents)", flood.before_kib, flood.after_kib),
        [
            f"over the share: {spread(flood.full)}; twice: {spread(flood.twice)}",
            f"held {held_mib:.0f} MiB: the share counts deliveries, not bytes",
        ],
    )


class Environment(sz.Filter):
    """Its state is the environment of the filter daemon it runs in."""

    def fit(self, x: Any, y: Any = None) -> Any:
        return {"env": dict(os.environ)}


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


@scenario
def filter_reads_the_environment(site: Site) -> Attack:
    c = site.cluster
    token = site.worker_token
    agent = environ(pid_of(c.workers["w0"]))
    if agent.get("SOMATIZE_WORKER_TOKEN") != token:
        raise AssertionError("w0's agent does not hold the worker token: the row shows nothing")
    with site.client() as client:
        graph = sz.Graph([Environment().named("env")])
        job = client.submit(graph, np.zeros((2, 1)), strategy=sz.Local("w0"))
        env: dict[str, str] = job.result(timeout=WAIT).states["env"]["env"]
    leaked = [k for k in ("SOMATIZE_WORKER_TOKEN", "SOMATIZE_TOKEN") if k in env]
    if leaked or any(t in str(env) for t in (site.worker_token, site.client_token)):
        raise AssertionError(f"the filter read a token: {leaked}")
    return Attack(
        "3",
        "a filter reads the daemon environment",
        "a plain `sz.Filter` whose fit returns `dict(os.environ)`, run on w0, whose "
        "agent was started with `SOMATIZE_WORKER_TOKEN` in its environment",
        f"no token, nor its value, reached the filter: its daemon got an allow-listed "
        f"environment of {len(env)} variables (`{'`, `'.join(sorted(env))}`), the agent's "
        f"{len(agent)}",
        [],
        "",
        "test_secrets.py::test_a_filter_sees_no_token_and_only_the_allowed_environment",
    )


@scenario
def impersonated_worker(site: Site) -> Attack:
    c = site.cluster
    token = site.worker_token
    connections = (c.worker("w1") or {})["connections"]

    async def impersonate() -> list[float]:
        async def attempt(n: int) -> Any:
            headers = {"Authorization": f"Bearer {token}"}
            url = f"{c.url}/worker"
            async with websockets.connect(url, additional_headers=headers, **WS_OPTIONS) as ws:
                proven = {}
                if n % 2:  # a key of its own, proven for this connection's challenge
                    key, issued = secrets.token_urlsafe(32), ws.response.headers[CHALLENGE_HEADER]
                    proven = {"public_key": public_key(key), "proof": prove(key, issued, "w1")}
                hello = WorkerHello(id=1, worker_id="w1", capabilities=CAPS, **proven)
                return await send_hello(Channel(ws, "impostor"), hello, Welcome, WAIT, first=True)

        words = "worker id 'w1' is enrolled with another identity key", "--forget-worker w1"
        return await timed_refusals(attempt, lambda e: refused(e, ErrorCode.UNAUTHORIZED, *words))

    victim = c.workers["w1"]
    c.send_signal(victim, signal.SIGKILL)
    victim.wait(timeout=WAIT)
    until(lambda: c.worker_state("w1") != "idle", "w1 seen gone")
    before = rss_kib(pid_of(c.coordinator))
    took = asyncio.run(impersonate())
    after = rss_kib(pid_of(c.coordinator))
    restarted = time.monotonic()
    c.start_worker("w1", threads=1, peer_link=True)  # the same machine: its identity file
    back = time.monotonic() - restarted
    now = (c.worker("w1") or {}).get("connections")
    if now != connections + 1:
        raise AssertionError(f"w1 has {now} connections, not {connections + 1}: was one taken?")
    return Attack(
        "3",
        "impersonation of an enrolled worker id",
        f"w1 SIGKILLed; {ATTEMPTS} hellos as `w1` on `/worker` with the worker token, proving "
        "no identity key or one of its own (signing the connection's challenge)",
        "each refused `unauthorized` (\"worker id 'w1' is enrolled with another identity key\", "
        "naming `--forget-worker w1`); the real w1 restarted with its identity file registered "
        "again under its id (its connection count up by one: no impostor got in)",
        took,
        "dial → `unauthorized`",
        "test_identity.py::test_an_enrolled_worker_id_is_refused_to_anyone_without_its_key",
        Memory("coordinator", before, after),
        [f"restart → w1 registered: {back:.2f} s"],
    )


def _connect_and_status(site: Site) -> float:
    started = time.perf_counter()
    with site.client() as client:
        client.status()
    return time.perf_counter() - started


def _closed(socks: list[socket.socket], opened: list[float]) -> list[float]:
    """Seconds from each socket's connect to the coordinator closing it."""
    closed: dict[int, float] = {}
    with selectors.DefaultSelector() as selector:
        for n, sock in enumerate(socks):
            selector.register(sock, selectors.EVENT_READ, n)
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT + WAIT
        while len(closed) < len(socks) and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=1.0):
                with contextlib.suppress(ConnectionResetError):
                    if key.fileobj.recv(4096):  # type: ignore[union-attr]
                        continue  # an HTTP error page: the close follows
                closed[key.data] = time.monotonic() - opened[key.data]
                selector.unregister(key.fileobj)
    if len(closed) < len(socks):
        raise AssertionError(f"{len(socks) - len(closed)} idle sockets were never closed")
    return [closed[n] for n in range(len(socks))]


def _hello_from(site: Site, address: str) -> float:
    """Seconds for a client with the token, from ``address``, to connect and be welcomed."""

    async def hello() -> None:
        url = client_url(site.cluster.url)
        started = time.perf_counter()
        async with websockets.connect(
            url,
            additional_headers={"Authorization": f"Bearer {site.client_token}"},
            local_addr=(address, 0),
            open_timeout=WAIT,
        ) as ws:
            await handshake(Channel(ws, f"client from {address}"), url, WAIT)
        took.append(time.perf_counter() - started)

    took: list[float] = []
    asyncio.run(hello())
    return took[0]


ATTACKER = "127.0.0.2"
"""The address the idle sockets come from (loopback: the other valid client's is 127.0.0.1)."""


@scenario
def idle_sockets(site: Site) -> Attack:
    c = site.cluster
    alone = [_connect_and_status(site) for _ in range(5)]
    before = rss_kib(pid_of(c.coordinator))
    socks, opened = [], []
    try:
        for _ in range(IDLE_SOCKETS):  # TCP only: not a byte sent, no token shown
            opened.append(time.monotonic())
            socks.append(
                socket.create_connection((c.host, c.port), WAIT, source_address=(ATTACKER, 0))
            )
        time.sleep(0.1)  # accepted by the server
        held = [_connect_and_status(site) for _ in range(5)]
        neighbour = [_hello_from(site, ATTACKER) for _ in range(5)]
        if not c.healthy():
            raise AssertionError("/healthz failed while the idle sockets were held")
        after = rss_kib(pid_of(c.coordinator))
        closes = _closed(socks, opened)
        at_accept = sum(1 for t in closes if t < 1.0)
    finally:
        for sock in socks:
            sock.close()
    if max(closes) > HANDSHAKE_TIMEOUT + 2.0:
        raise AssertionError(f"an idle socket was held {max(closes):.1f} s")
    return Attack(
        "4 (14), 2 (32)",
        "pre-auth lockout by idle sockets, from another address and from the same one",
        f"{IDLE_SOCKETS} TCP connections from {ATTACKER} to the coordinator's port, not a byte "
        f"sent (more than its {MAX_PENDING_CONNECTIONS} pending upgrades); meanwhile a client "
        "with the token connects from 127.0.0.1 and asks for status, 5 times, and another "
        f"connects from {ATTACKER} itself (a NAT's neighbour) and is welcomed, 5 times",
        "both valid clients connected every time (idle sockets show no token, so they do not "
        "count against the pending limit, and one behind the same address takes the place of "
        "the oldest idle one); `/healthz` answered; beyond its share of "
        f"{MAX_PENDING_PER_ADDRESS} pending sockets each new socket of the address displaced "
        f"its oldest idle one, closed within a second of its accept ({at_accept} of them), the "
        f"others were closed by the handshake timeout ({HANDSHAKE_TIMEOUT:g} s from their "
        "accept)",
        closes,
        "connect → closed by the coordinator",
        "test_limits.py::test_idle_sockets_lock_nobody_out_and_silent_upgrades_beyond_the_"
        "limit_get_503",
        Memory("coordinator", before, after),
        [
            f"valid connect + status with the sockets held: {spread(held)} "
            f"(alone: {spread(alone)}); from {ATTACKER}, connect + welcome: "
            f"{spread(neighbour)}",
        ],
    )


def _big_submit() -> tuple[Submit, int]:
    """A ModelParallel submit of :data:`BIG_NODES` plain nodes whose second partition names one
    more, and its pickled filters' bytes (built without validation: this side would refuse it)."""
    nodes = [f"n{i}" for i in range(BIG_NODES)]
    g = sz.Graph([sz.Filter().named(n) for n in nodes])
    half = BIG_NODES // 2
    strategy = sz.ModelParallel(
        [
            sz.Partition(nodes[:half], worker="w0"),
            sz.Partition([*nodes[half:], "ghost"], worker="w1"),
        ]
    )
    filters = {n: dump_filter(f) for n, f in g.items()}
    spec = GraphSpec.model_construct(node_ids=nodes, filters=filters, nodes=graph_info(g))
    x = np.zeros((4, 1), np.float32)
    message = Submit.model_construct(graph=spec, x=x, strategy=strategy.spec())
    return message, sum(map(len, filters.values()))


@scenario
def big_submit(site: Site) -> Attack:
    c = site.cluster
    message, nbytes = _big_submit()
    started = time.perf_counter()
    frame = frame_nbytes(encode(dump(message)))  # what each attempt also does here
    encoding = time.perf_counter() - started
    words = ("graph.node_ids", f"at most {MAX_GRAPH_NODES} items", f"not {BIG_NODES}")
    messages: list[str] = []
    rss: list[int] = []  # the coordinator's, before each attempt

    def check(exc: RemoteError) -> None:
        refused(exc, ErrorCode.BAD_REQUEST, *words)
        messages.append(exc.info.message)

    async def attempt(channel: Channel) -> Any:
        rss.append(rss_kib(pid_of(c.coordinator)))
        return await channel.request(message, WAIT)

    async def submit() -> list[float]:
        ws = await dial(client_url(c.url), site.client_token, None, WAIT)
        channel = Channel(ws, "big submitter")
        await handshake(channel, c.url, WAIT)
        reader = asyncio.ensure_future(channel.run())
        took = await timed_refusals(lambda n: attempt(channel), check)
        await channel.close()
        await reader
        return took

    health = f"http://{c.host}:{c.port}/healthz"
    with site.client() as client:
        jobs = client.jobs()
        idle, _ = polled(health, lambda: time.sleep(1.0))
        busy, took = polled(health, lambda: asyncio.run(submit()))
        after = rss_kib(pid_of(c.coordinator))
        if client.jobs() != jobs:
            raise AssertionError("a refused submit left a job behind")
    if not busy or max(busy) == float("inf"):
        raise AssertionError(f"/healthz failed while the submits were checked: {busy}")
    longest = max(messages, key=len)
    if len(longest) >= 300:
        raise AssertionError(f"a refusal of {len(longest)} characters: {longest}")
    return Attack(
        "5",
        "big submit",
        f"{ATTEMPTS} `submit`s, one after the other (raw, with the client token), of a "
        f"ModelParallel job of {BIG_NODES:,} plain `sz.Filter` nodes ({nbytes / 1e6:.1f} MB "
        f"pickled, a {frame / 1e6:.1f} MB message) in two partitions, the second naming one "
        f"node more (`ghost`); `GET /healthz` every {1e3 * HEALTH_POLL:.0f} ms meanwhile",
        "each refused `bad_request` by the message's validation (more than the "
        f"{MAX_GRAPH_NODES} nodes a graph may have), no job made, the message naming the field "
        f"and the count; `/healthz` answered throughout (the message is decoded and validated "
        "off the event loop; the graph's own checks, linear, too: see the test)",
        took,
        "`submit` → `bad_request`",
        "test_jobs.py::test_a_huge_graph_is_checked_off_the_loop_and_refused_in_a_line",
        Memory("coordinator", rss[0], after),
        [
            f"`/healthz` max {1e3 * max(busy):.0f} ms, median "
            f"{1e3 * statistics.median(busy):.0f} ms over {len(busy)} polls (idle: max "
            f"{1e3 * max(idle):.0f} ms)",
            f"coordinator RSS after the 1st refusal {rss[1] / 1024:.1f} MiB, after the "
            f"{ATTEMPTS - 1}th {rss[-1] / 1024:.1f} MiB",
            f"of each time to refuse, ~{1e3 * encoding:.0f} ms is this process encoding the "
            "message",
            f"the refusal, {len(longest)} characters: `{longest}`",
        ],
    )
